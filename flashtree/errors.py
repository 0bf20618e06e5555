"""One error type for bad input, so the CLI and server can show a one-line message."""


class FlashtreeError(ValueError):
    """Bad input or configuration. The message says what was wrong and how to fix it."""
