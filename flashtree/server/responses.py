"""Engine updates to OpenAI bodies: one response, or a stream of chunks.

A stream is: [opening chunks (chat: the assistant role, one per choice)], text chunks (each
with its tokens' logprobs when asked), one chunk per choice with its finish_reason, then,
only with stream_options.include_usage, one chunk with `choices: []` and the usage, then
`[DONE]`. No other chunk carries usage, so clients that add up usage over a stream
(LangChain's ChatOpenAI(stream_usage=True)) count it once, as with OpenAI.

Logprobs are -inf for a token the request's top-k/top-p filtered out; JSON has no -inf, so
such values are sent as -9999.0 (as vLLM does). A streamed chunk carries the logprobs of the
tokens committed since the previous chunk, which may run a little ahead of its text (text
that could still become a stop string, or half a character, is held back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from flashtree.engine import TokenLogprob
from flashtree.server.loop import EngineStopped, RequestStream, Update
from flashtree.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob,
                                       CompletionChoice, CompletionLogprobs, CompletionResponse, TopLogprob, Usage)
from flashtree.server.sse import DONE, sse

LOGPROB_FLOOR = -9999.0
Pieces = Callable[[list[int]], list[tuple[str, bytes]]]  # token ids -> (text, bytes) each (engine.token_pieces)


def usage(prompt_tokens: int, updates: list[Update]) -> Usage:
    completion = sum(u.completion_tokens for u in updates)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def finite(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


@dataclass
class Choice:
    """What a choice shows: echo prefix (completions) + the sample's text, and the logprob
    entries of echoed prompt tokens + output tokens (None entries: an echoed first token)."""

    echo_text: str = ""
    echo_ids: list[int] = field(default_factory=list)  # echoed prompt tokens (with logprobs)

    def text(self, update: Update) -> str:
        return self.echo_text + update.text

    def entries(self, update: Update, logprobs: bool, start: int = 0) -> list[tuple[int, TokenLogprob | None]]:
        """The entries from index `start` on (a stream asks only for those it has not sent)."""
        if not logprobs:
            return []
        out: list[tuple[int, TokenLogprob | None]] = []
        echoed = len(self.echo_ids)
        if start < echoed:
            prompt = update.prompt_logprobs or [None]
            out += [(self.echo_ids[i], prompt[i] if i < len(prompt) else None) for i in range(start, echoed)]
        n = update.completion_tokens
        out += [(lp.token, lp) for lp in (update.logprobs or [])[max(0, start - echoed):n]]
        return out


@dataclass
class CompletionShape:
    id: str
    created: int
    model: str
    n: int = 1
    logprobs: int | None = None  # alternatives per token, or None (no logprobs)
    echo_text: str | None = None  # the prompt, echoed
    echo_ids: list[int] = field(default_factory=list)
    pieces: Pieces | None = None

    def choice_view(self) -> Choice:
        if self.echo_text is None:
            return Choice()
        return Choice(self.echo_text, self.echo_ids if self.logprobs is not None else [])

    def _body(self, choices: list, use: Usage | None = None) -> CompletionResponse:
        extra = {} if use is None else {"usage": use}
        return CompletionResponse(id=self.id, object="text_completion", created=self.created, model=self.model,
                                  choices=choices, **extra)

    def openings(self) -> list[BaseModel]:
        return []

    def chunk(self, index: int, text: str, finish_reason: str | None, entries: list, offset: int) -> BaseModel:
        lp = self._logprobs(entries, offset) if self.logprobs is not None else None
        return self._body([CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=lp)])

    def usage_chunk(self, use: Usage) -> BaseModel:
        return self._body([], use)

    def response(self, choices: list[tuple[str, str, list]], use: Usage) -> BaseModel:
        """choices: (text, finish_reason, logprob entries) per returned choice."""
        return self._body([CompletionChoice(index=i, text=text, finish_reason=reason,
                                            logprobs=self._logprobs(entries, 0) if self.logprobs is not None else None)
                           for i, (text, reason, entries) in enumerate(choices)], use)

    def _logprobs(self, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> CompletionLogprobs:
        """Token texts, logprobs, the k best (and the chosen token) per token, text offsets from `offset`."""
        ids = [t for t, _ in entries] + [i for _, lp in entries if lp is not None for i, _ in lp.top]
        text = dict(zip(ids, (p[0] for p in self.pieces(ids))))
        tokens, values, tops, offsets = [], [], [], []
        for token, lp in entries:
            tokens.append(text[token])
            offsets.append(offset)
            offset += len(text[token])
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(finite(lp.logprob))
            top = {text[i]: finite(v) for i, v in lp.top}
            top.setdefault(text[token], finite(lp.logprob))
            tops.append(top)
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


@dataclass
class ChatShape:
    id: str
    created: int
    model: str
    n: int = 1
    logprobs: int | None = None
    pieces: Pieces | None = None

    def choice_view(self) -> Choice:
        return Choice()

    def _chunk(self, choices: list, use: Usage | None = None) -> ChatCompletionChunk:
        extra = {} if use is None else {"usage": use}
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                                   choices=choices, **extra)

    def openings(self) -> list[BaseModel]:  # OpenAI's first chunk of each choice announces the role
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""),
                                             finish_reason=None, logprobs=None)]) for i in range(self.n)]

    def chunk(self, index: int, text: str, finish_reason: str | None, entries: list, offset: int) -> BaseModel:
        delta = ChatDelta(content=text) if text else ChatDelta()
        lp = self._logprobs(entries) if self.logprobs is not None and entries else None
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=lp)])

    def usage_chunk(self, use: Usage) -> BaseModel:
        return self._chunk([], use)

    def response(self, choices: list[tuple[str, str, list]], use: Usage) -> BaseModel:
        return ChatCompletionResponse(
            id=self.id, object="chat.completion", created=self.created, model=self.model, usage=use,
            choices=[ChatChoice(index=i, message=AssistantMessage(role="assistant", content=text), finish_reason=reason,
                                logprobs=self._logprobs(entries) if self.logprobs is not None else None)
                     for i, (text, reason, entries) in enumerate(choices)])

    def _logprobs(self, entries: list[tuple[int, TokenLogprob | None]]) -> ChatLogprobs:
        ids = [t for t, _ in entries] + [i for _, lp in entries for i, _ in lp.top]
        piece = dict(zip(ids, self.pieces(ids)))

        def top(token: int, value: float) -> TopLogprob:
            text, raw = piece[token]
            return TopLogprob(token=text, logprob=finite(value), bytes=list(raw))

        content = [ChatTokenLogprob(**top(t, lp.logprob).model_dump(),
                                    top_logprobs=[top(i, v) for i, v in lp.top[: self.logprobs]])
                   for t, lp in entries]
        return ChatLogprobs(content=content)


Shape = CompletionShape | ChatShape


def chunk_line(body: BaseModel) -> str:
    return sse(body.model_dump(mode="json", exclude_unset=True))


def final_choices(stream: RequestStream, shape: Shape) -> tuple[list[tuple[str, str, list]], list[Update]]:
    """The returned choices of a finished request: (text, finish_reason, logprob entries) each."""
    view = shape.choice_view()
    updates = [stream.latest[i] for i in stream.chosen]
    return [(view.text(u), u.finish_reason, view.entries(u, shape.logprobs is not None)) for u in updates], updates


async def events(stream: RequestStream, shape: Shape, prompt_tokens: int, include_usage: bool):
    """The SSE lines of one streamed request (n choices; best_of > n is refused for streams).

    Each event costs what it sends: the text past what was sent, up to the characters the
    engine holds back for stop strings, and the logprob entries past those sent."""
    view = shape.choice_view()
    sent_chars = [0] * shape.n  # of the sample's own text (the echo goes with the first chunk)
    echoed = [not view.echo_text] * shape.n
    sent_entries = [0] * shape.n
    offsets = [0] * shape.n
    done: dict[int, Update] = {}
    for opening in shape.openings():
        yield chunk_line(opening)
    while len(done) < shape.n:
        for update in await stream.next_updates():
            if update.error is not None:
                code = "shutting_down" if isinstance(update.error, EngineStopped) else "engine_error"
                yield sse({"error": {"message": str(update.error), "type": "server_error", "param": None,
                                     "code": code}})
                yield DONE
                return
            i = update.index
            if i in done:
                continue
            finished = update.finish_reason is not None
            end = len(update.text) if finished else len(update.text) - update.held
            delta = update.text[sent_chars[i]:end]
            sent_chars[i] = max(sent_chars[i], end)
            if not echoed[i]:
                delta, echoed[i] = view.echo_text + delta, True
            entries = view.entries(update, shape.logprobs is not None, sent_entries[i])
            sent_entries[i] += len(entries)
            if delta or entries or finished:
                yield chunk_line(shape.chunk(i, delta, update.finish_reason, entries, offsets[i]))
                if entries and isinstance(shape, CompletionShape):
                    offsets[i] += sum(len(p[0]) for p in shape.pieces([t for t, _ in entries]))
            if finished:
                done[i] = update
    if include_usage:
        yield chunk_line(shape.usage_chunk(usage(prompt_tokens, list(done.values()))))
    yield DONE
