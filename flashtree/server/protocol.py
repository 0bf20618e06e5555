"""OpenAI request and response bodies, validated strictly.

Strict types (no "1" for 1, no true for 1), no NaN/Infinity, and `extra="forbid"`, so a
misspelled or unsupported field is a 400 that names it rather than a silently ignored knob.
OpenAI fields that the engine cannot honour are accepted only at their neutral value
(penalties 0, no tools, no suffix) so that clients which send defaults still work.
"""

from __future__ import annotations

import uuid
from typing import Annotated, ClassVar, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from flashtree.sampling import MAX_LOGPROBS, MAX_STOP_CHARS, SamplingParams

INT64 = 2**63
MAX_STOP = 16
MAX_SAMPLES = 128  # n and best_of (the engine also needs that many free cache slots at once)

# OpenAI fields the engine cannot honour -> the values that mean "off". A request may send
# them at those values (many clients send defaults); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _integral(value):
    """JSON has one number type: 3.0 is a valid JSON Schema integer, 3.5 and "3" are not."""
    return int(value) if type(value) is float and value.is_integer() else value


def _unicode(value: str) -> str:
    """JSON can smuggle lone UTF-16 surrogates ("\\ud800") that no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone UTF-16 surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
# Bounds go before the validator and inside the Annotated, so the JSON schema states them as
# minimum/maximum within each union arm (the fuzz test generates requests from that schema).
TokenCount = Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(_integral)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=-INT64, lt=INT64), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1, le=1_000_000), BeforeValidator(_integral)]
Samples = Annotated[int, Field(ge=1, le=MAX_SAMPLES), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def drop_neutral(data):
    """Remove unsupported OpenAI fields sent at their "off" value; refuse any other value."""
    if not isinstance(data, dict):
        return data
    for key, neutral in UNSUPPORTED.items():
        if key in data:
            value = data[key]
            if not any(value == v and type(value) is type(v) for v in neutral):
                allowed = " or ".join("null" if v is None else repr(v) for v in neutral)
                raise PydanticCustomError("unsupported", "{field}={value} is not supported by this server "
                                          "(allowed: {allowed})", {"field": key, "value": repr(value)[:40],
                                                                    "allowed": allowed})
    return {k: v for k, v in data.items() if k not in UNSUPPORTED}


def field_error(field: str, message: str) -> PydanticCustomError:
    """A refusal that names its field (for checks that span fields, in model validators)."""
    return PydanticCustomError("field_error", "{field}: {message}", {"field": field, "message": message})


class StreamOptions(Strict):
    include_usage: bool = False


Stop = Annotated[Text, Field(min_length=1)]


class SamplingFields(Strict):
    """Fields both endpoints share; everything here maps onto SamplingParams."""

    model: str | None = Field(None, description="the served model name (see /v1/models); optional")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TopK = Field(0, description="0 or -1 = off (extension)")
    max_tokens: TokenCount | None = Field(None, description="capped by the context left after the prompt")
    stop: Stop | list[Stop] | None = Field(None, description=f"up to {MAX_STOP} stop strings, {MAX_STOP_CHARS} "
                                           "characters in all")
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="keep generating past EOS (extension)")

    _neutral = model_validator(mode="before")(drop_neutral)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        chars = len(v) if isinstance(v, str) else sum(map(len, v or []))
        if chars > MAX_STOP_CHARS:
            raise ValueError(f"the stop strings have {chars} characters in all; at most {MAX_STOP_CHARS} are allowed")
        return v

    n: Samples = Field(1, description="choices to return; they share the prompt's prefill")

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "only allowed when stream is true (as in OpenAI's API)")
        return self

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens, stop=stop, seed=self.seed, ignore_eos=self.ignore_eos,
                              n=self.n, **self.extra_params())

    def extra_params(self) -> dict:
        return {}


class ContextBound(Strict):
    """`context` (set per server by `bounded`): the tokens a prompt must stay under. Lists that
    cannot fit (token ids, chat messages) are refused before their items are validated, which
    for a few hundred thousand items would hold the event loop for seconds."""

    context: ClassVar[int | None] = None


def too_long(what: str, n: int, limit: int, fix: str) -> PydanticCustomError:
    return PydanticCustomError("context_length_exceeded", "the prompt has {n} {what} but the context holds {limit} "
                               "tokens (prompt + output); {fix}", {"n": n, "what": what, "limit": limit, "fix": fix})


M = TypeVar("M", bound=ContextBound)


def bounded(model: type[M], context: int) -> type[M]:
    """`model` for a server whose context holds `context` tokens."""
    return type(model.__name__, (model,), {"__module__": model.__module__, "__doc__": model.__doc__,
                                           "context": context})


class CompletionRequest(SamplingFields, ContextBound):
    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] = Field(
        ..., description="one prompt: text, or a list of token ids (batched prompts are not supported)")
    max_tokens: TokenCount | None = Field(16, description="OpenAI's default is 16")
    best_of: Samples | None = Field(None, description="samples drawn (>= n); the n with the highest cumulative "
                                    "logprob are returned; not with stream")
    logprobs: TopLogprobs | None = Field(None, description=f"logprobs of each token and this many alternatives "
                                         f"(0..{MAX_LOGPROBS})")
    echo: bool = Field(False, description="return the prompt before the completion (with logprobs: the prompt's "
                       "too, the first token's null)")

    @model_validator(mode="after")
    def _samples(self):
        if self.best_of is not None and self.best_of < self.n:
            raise field_error("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise field_error("best_of", "a value above n cannot be streamed: the best samples are known "
                              "only at the end")
        return self

    def extra_params(self) -> dict:
        return {"best_of": self.best_of, "logprobs": self.logprobs,
                "prompt_logprobs": self.logprobs if self.echo else None}

    @model_validator(mode="before")
    @classmethod
    def _fits(cls, data):
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if cls.context and isinstance(prompt, list) and prompt and isinstance(prompt[0], int) \
                and len(prompt) >= cls.context:
            raise too_long("tokens", len(prompt), cls.context, "shorten the prompt")
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        """OpenAI also takes a batch of prompts; one in a list is fine, more is a clear 400."""
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise PydanticCustomError("unsupported", "{field}: a batch of {n} prompts is not supported; send one "
                                          "prompt per request (they are batched server-side)",
                                          {"field": "prompt", "n": len(v)})
            return v[0]
        return v


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields, ContextBound):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: TokenCount | None = Field(None, description="newer name for max_tokens")
    parse_special_tokens: bool = Field(False, description="extension: special-token strings in message content "
                                       "(e.g. <|im_start|>) become control tokens; by default they are plain text")
    logprobs: bool | None = Field(None, description="return each output token's logprob")
    top_logprobs: TopLogprobs | None = Field(None, description=f"with logprobs: this many alternatives per token "
                                             f"(0..{MAX_LOGPROBS})")

    def extra_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @model_validator(mode="before")
    @classmethod
    def _fits(cls, data):
        messages = data.get("messages") if isinstance(data, dict) else None
        if cls.context and isinstance(messages, list) and len(messages) >= cls.context:
            raise too_long("messages", len(messages), cls.context, "each message takes at least one token: "
                           "send fewer messages")
        return data

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        return self


# ---- responses ---------------------------------------------------------------------------------
# Streamed chunks are these same models dumped with exclude_unset: a field a chunk does not
# set (usage on all but the include_usage chunk, the role on all but the first chat delta) is
# left out, as in OpenAI's streams.

FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: per token its text, logprob, alternatives and text offset."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None only for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]  # the k best and the chosen token (so up to k + 1)
    text_offset: list[int]  # where each token starts in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completion, and also each chunk of a streamed one (as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashtree"
    max_model_len: int
    method: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
