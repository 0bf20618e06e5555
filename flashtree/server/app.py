"""The FastAPI app: OpenAI-compatible completions and chat over one engine thread.

Handlers validate, turn the body into SamplingParams, and hand the request to the
EngineLoop; they then only wait on asyncio objects, so the event loop never blocks on a
model forward and many clients can stream while one thread batches their trees.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flashtree import __version__
from flashtree.config import DEMO_TARGET
from flashtree.engine import LLMEngine
from flashtree.server.errors import APIError, install_error_handlers
from flashtree.server.loop import EngineLoop, EngineStopped, RequestStream, Update
from flashtree.server.metrics import ServerMetrics
from flashtree.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelCard, ModelList, SamplingFields,
                                       new_id)
from flashtree.server.sse import DONE, SSEResponse, safe_end, sse

# Far above any prompt that fits a context; refuses (413) bodies that would only burn memory.
# FastAPI >= 0.13x enforces it; older versions accept any size.
MAX_BODY_BYTES = 8 << 20
ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in
          [(400, "invalid request (the message names the field and the limit)"), (404, "unknown model"),
           (429, "the waiting queue is full; retry later"), (503, "the server is shutting down")]}


def default_model_name(target: str) -> str:
    path = Path(target)
    if path.resolve() == DEMO_TARGET.resolve():
        return "flashtree-demo"
    return path.name if path.is_dir() else target


class ClientGone(Exception):
    """The client hung up before a non-streamed answer was ready."""


def build_app(engine: LLMEngine, model_name: str | None = None, registry: CollectorRegistry | None = None) -> FastAPI:
    """An app that owns `engine` through its own engine thread, started and stopped by the lifespan."""
    metrics = ServerMetrics(registry)
    loop = EngineLoop(engine, metrics)
    name = model_name or default_model_name(engine.config.target)
    max_len = engine.config.max_model_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        # uvicorn has drained (or timed out) the HTTP requests by now; abort what remains.
        await asyncio.to_thread(loop.stop)

    limit = {"max_body_size": MAX_BODY_BYTES} if "max_body_size" in inspect.signature(FastAPI).parameters else {}
    app = FastAPI(title="flashtree", version=__version__, lifespan=lifespan, **limit,
                  description="OpenAI-compatible server: lossless DFlash/DDTree speculative decoding")
    app.state.engine_loop = loop
    app.state.metrics = metrics
    install_error_handlers(app, lambda code: metrics.requests.labels("rejected" if code == 429 else "invalid").inc())

    def sampling(body: SamplingFields, default_max: int):
        if body.model is not None and body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {name!r}", "model",
                           "model_not_found")
        max_tokens = default_max if body.max_tokens is None else body.max_tokens
        if max_tokens > max_len:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the context length ({max_len} tokens, prompt "
                           "included); output also stops when prompt + output reach it", "max_tokens",
                           "context_length_exceeded")
        return body.sampling_params(max_tokens)

    async def final(stream: RequestStream, request: Request) -> Update:
        """The last Update of a non-streamed request; aborts it if the client hangs up first."""

        async def last() -> Update:
            while True:
                update = await stream.next_update()
                if update.finish_reason is not None or update.error is not None:
                    return update

        async def hung_up() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result, watch = asyncio.ensure_future(last()), asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not result.done():
                result.cancel()
                loop.cancel(stream)
        if not result.done() or result.cancelled():
            raise ClientGone()
        update = result.result()
        if update.error is not None:
            raise update.error
        return update

    def usage(prompt_tokens: int, update: Update) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": update.completion_tokens,
                "total_tokens": prompt_tokens + update.completion_tokens}

    async def events(stream: RequestStream, prompt_tokens: int, chunk, include_usage: bool):
        """SSE lines for one request; `chunk(delta_text | None, finish_reason, usage)` shapes them."""
        stops = stream.params.stop
        sent = ""
        if (first := chunk(None, None, None)) is not None:
            yield sse(first)
        while True:
            update = await stream.next_update()
            if update.error is not None:
                code = "shutting_down" if isinstance(update.error, EngineStopped) else "engine_error"
                yield sse({"error": {"message": str(update.error), "type": "server_error", "param": None,
                                     "code": code}})
                yield DONE
                return
            done = update.finish_reason is not None
            text = update.text if done else update.text[: safe_end(update.text, stops)]
            delta = text[len(sent):] if text.startswith(sent) else ""
            sent += delta
            if delta and not done:
                yield sse(chunk(delta, None, None))
            if done:
                yield sse(chunk(delta, update.finish_reason, usage(prompt_tokens, update)))
                if include_usage:
                    yield sse({**chunk("", None, usage(prompt_tokens, update)), "choices": []})
                yield DONE
                return

    async def run(request: Request, body: SamplingFields, prompt, params, request_id: str, chunk, respond):
        stream = await loop.submit(request_id, prompt, params)
        prompt_tokens = stream.admitted.result()
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            # on_close is a no-op once the request finished; otherwise the client left mid-stream.
            return SSEResponse(events(stream, prompt_tokens, chunk, include), on_close=lambda: loop.cancel(stream))
        try:
            update = await final(stream, request)
        except ClientGone:
            return Response(status_code=499)
        return respond(update, usage(prompt_tokens, update))

    # ---- endpoints -----------------------------------------------------------------------------

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        params = sampling(body, 16)
        rid, now = new_id("cmpl"), int(time.time())

        def chunk(delta, reason, use):
            if delta is None:
                return None
            return {"id": rid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}],
                    **({"usage": use} if use else {})}

        def respond(update: Update, use: dict):
            return {"id": rid, "object": "text_completion", "created": now, "model": name, "usage": use,
                    "choices": [{"index": 0, "text": update.text, "finish_reason": update.finish_reason,
                                 "logprobs": None}]}

        return await run(request, body, body.prompt, params, rid, chunk, respond)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        params = sampling(body, max_len)
        prompt = render_chat(engine.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
        rid, now = new_id("chatcmpl"), int(time.time())

        def chunk(delta, reason, use):
            if delta is None:  # the opening chunk announces the role, as OpenAI's does
                choice_delta = {"role": "assistant", "content": ""}
            else:
                choice_delta = {"content": delta} if delta else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": name,
                    "choices": [{"index": 0, "delta": choice_delta, "finish_reason": reason, "logprobs": None}],
                    **({"usage": use} if use else {})}

        def respond(update: Update, use: dict):
            return {"id": rid, "object": "chat.completion", "created": now, "model": name, "usage": use,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": update.text},
                                 "finish_reason": update.finish_reason, "logprobs": None}]}

        return await run(request, body, prompt, params, rid, chunk, respond)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        card = ModelCard(id=name, created=created, max_model_len=max_len, method=engine.config.method)
        return ModelList(data=[card])

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    schema = app.openapi

    def openapi() -> dict:
        """FastAPI's schema, minus its default 422: validation errors here are OpenAI-style 400s."""
        if app.openapi_schema is None:
            for path in schema()["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
        return app.openapi_schema

    app.openapi = openapi
    return app


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text for a chat, through the checkpoint's own chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                       "messages", "no_chat_template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's raise_exception (e.g. bad role order) or a template bug
        raise APIError(400, f"the chat template rejected these messages: {e}", "messages", "invalid_messages")
