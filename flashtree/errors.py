"""One error type for bad input, so the CLI and server can show a one-line message.

The subclasses let the server pick an HTTP status and an OpenAI error code without
reading the message; everywhere else they are plain FlashtreeErrors.
"""


class FlashtreeError(ValueError):
    """Bad input or configuration. The message says what was wrong and how to fix it."""


class QueueFull(FlashtreeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class PromptTooLong(FlashtreeError):
    """The prompt cannot fit the context (HTTP 400, code context_length_exceeded)."""


class ChatTemplateError(FlashtreeError):
    """No chat template, or the template refused the messages (HTTP 400, code invalid_messages)."""
