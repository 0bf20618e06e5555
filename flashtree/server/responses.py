"""Engine updates to OpenAI bodies: one response, or a stream of chunks.

A stream is: [an opening chunk (chat: the assistant role)], text chunks, one chunk with the
finish_reason, then, only with stream_options.include_usage, one chunk with `choices: []`
and the usage, then `[DONE]`. No other chunk carries usage, so clients that add up usage
over a stream (LangChain's ChatOpenAI(stream_usage=True)) count it once, as with OpenAI.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from flashtree.server.loop import EngineStopped, RequestStream, Update
from flashtree.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionResponse,
                                       Usage)
from flashtree.server.sse import DONE, safe_end, sse


def usage(prompt_tokens: int, update: Update) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=update.completion_tokens,
                 total_tokens=prompt_tokens + update.completion_tokens)


@dataclass
class CompletionShape:
    id: str
    created: int
    model: str

    def _body(self, choices: list, use: Usage | None = None) -> CompletionResponse:
        extra = {} if use is None else {"usage": use}
        return CompletionResponse(id=self.id, object="text_completion", created=self.created, model=self.model,
                                  choices=choices, **extra)

    def opening(self) -> BaseModel | None:
        return None

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel:
        return self._body([CompletionChoice(index=0, text=text, finish_reason=finish_reason, logprobs=None)])

    def usage_chunk(self, use: Usage) -> BaseModel:
        return self._body([], use)

    def response(self, update: Update, use: Usage) -> BaseModel:
        return self._body([CompletionChoice(index=0, text=update.text, finish_reason=update.finish_reason,
                                            logprobs=None)], use)


@dataclass
class ChatShape:
    id: str
    created: int
    model: str

    def _chunk(self, choices: list, use: Usage | None = None) -> ChatCompletionChunk:
        extra = {} if use is None else {"usage": use}
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                                   choices=choices, **extra)

    def opening(self) -> BaseModel | None:  # OpenAI's first chunk announces the role
        return self._chunk([ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""),
                                            finish_reason=None, logprobs=None)])

    def chunk(self, text: str, finish_reason: str | None) -> BaseModel:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return self._chunk([ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=None)])

    def usage_chunk(self, use: Usage) -> BaseModel:
        return self._chunk([], use)

    def response(self, update: Update, use: Usage) -> BaseModel:
        message = AssistantMessage(role="assistant", content=update.text)
        return ChatCompletionResponse(id=self.id, object="chat.completion", created=self.created, model=self.model,
                                      choices=[ChatChoice(index=0, message=message, finish_reason=update.finish_reason,
                                                          logprobs=None)], usage=use)


Shape = CompletionShape | ChatShape


def chunk_line(body: BaseModel) -> str:
    return sse(body.model_dump(mode="json", exclude_unset=True))


async def events(stream: RequestStream, shape: Shape, prompt_tokens: int, include_usage: bool):
    """The SSE lines of one streamed request."""
    stops = stream.params.stop
    sent = ""
    if (opening := shape.opening()) is not None:
        yield chunk_line(opening)
    while True:
        update = await stream.next_update()
        if update.error is not None:
            code = "shutting_down" if isinstance(update.error, EngineStopped) else "engine_error"
            yield sse({"error": {"message": str(update.error), "type": "server_error", "param": None, "code": code}})
            yield DONE
            return
        done = update.finish_reason is not None
        text = update.text if done else update.text[: safe_end(update.text, stops)]
        delta = text[len(sent):] if text.startswith(sent) else ""
        sent += delta
        if delta and not done:
            yield chunk_line(shape.chunk(delta, None))
        if done:
            yield chunk_line(shape.chunk(delta, update.finish_reason))
            if include_usage:
                yield chunk_line(shape.usage_chunk(usage(prompt_tokens, update)))
            yield DONE
            return
