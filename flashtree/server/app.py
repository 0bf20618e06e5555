"""The FastAPI app: OpenAI-compatible completions and chat over one engine thread.

Handlers validate, refuse absurd sizes at once (a cheap count of characters and messages),
tokenize in a small worker pool, and hand token ids to the EngineLoop; they then only wait
on asyncio objects. So neither the event loop nor the engine thread ever waits on a
tokenizer or a chat template, and many clients can stream while one thread batches their
trees.
"""

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flashtree import __version__
from flashtree.config import DEMO_TARGET
from flashtree.engine import LLMEngine
from flashtree.server.errors import APIError, install_error_handlers
from flashtree.server.limits import BodyLimit, check_seconds
from flashtree.server.loop import EngineLoop, RequestStream
from flashtree.server.metrics import ServerMetrics
from flashtree.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelCard, ModelList, SamplingFields,
                                       bounded, new_id)
from flashtree.server.responses import ChatShape, CompletionShape, Shape, events, final_choices, usage
from flashtree.server.sse import SSEResponse

# Far above any prompt that fits a context; refuses (413) bodies that would only burn memory.
MAX_BODY_BYTES = 8 << 20
TOKENIZER_THREADS = min(4, os.cpu_count() or 1)
ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in
          [(400, "invalid request (the message names the field and the limit)"), (404, "unknown model"),
           (408, "the request body did not arrive in time"), (413, "the request body is over 8 MiB"),
           (429, "the waiting queue is full; retry later"), (431, "the request head is over 16 KiB"),
           (503, "the server is shutting down")]}


def default_model_name(target: str) -> str:
    path = Path(target)
    if path.resolve() == DEMO_TARGET.resolve():
        return "flashtree-demo"
    return path.name if path.is_dir() else target


class ClientGone(Exception):
    """The client hung up before a non-streamed answer was ready."""


# No `from __future__ import annotations` here: FastAPI must see the handlers' body types,
# which are classes built inside build_app, as objects rather than names.


def build_app(engine: LLMEngine, model_name: str | None = None, registry: CollectorRegistry | None = None,
              read_timeout: float = 30.0) -> FastAPI:
    """An app that owns `engine` through its own engine thread, started and stopped by the lifespan.

    read_timeout: seconds a client gets to send a request body (408 after that)."""
    check_seconds("read_timeout", read_timeout, zero_ok=False)
    metrics = ServerMetrics(registry)
    loop = EngineLoop(engine, metrics)
    pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="flashtree-tokenize")
    name = model_name or default_model_name(engine.config.target)
    max_len = engine.config.max_model_len
    created = int(time.time())
    CompletionBody, ChatBody = bounded(CompletionRequest, max_len), bounded(ChatCompletionRequest, max_len)
    engine.check_size(0)  # computes the size bound now (a vocabulary scan), not on the first request

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        # uvicorn has drained (or timed out) the HTTP requests by now; abort what remains.
        await asyncio.to_thread(loop.stop)
        pool.shutdown(wait=False, cancel_futures=True)

    # redirect_slashes off: Starlette builds those redirects from the client's Host header.
    app = FastAPI(title="flashtree", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible server: lossless DFlash/DDTree speculative decoding")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, timeout=read_timeout)
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
        params = body.sampling_params(max_tokens)
        if params.num_samples > engine.config.max_batch:
            field = "best_of" if params.best_of else "n"
            raise APIError(400, f"{field}={params.num_samples} samples are decoded together, but this server "
                           f"decodes at most {engine.config.max_batch} requests at once (--max-batch)", field,
                           "integer_above_max_value")
        return params

    async def tokenize(encode, *args) -> list[int]:
        """Token ids from the worker pool, refused there if they cannot fit the context."""

        def work() -> list[int]:
            ids = encode(*args)
            engine.check_length(ids)
            return ids

        return await asyncio.get_running_loop().run_in_executor(pool, work)

    async def final(stream: RequestStream, request: Request) -> None:
        """Wait until every sample of a non-streamed request finished; aborts the request if
        the client hangs up first, raises a sample's error."""

        async def hung_up() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result, watch = asyncio.ensure_future(stream.wait_done()), asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not result.done():
                result.cancel()
                loop.cancel(stream)
        if not result.done() or result.cancelled():
            raise ClientGone()
        for update in stream.latest.values():
            if update.error is not None:
                raise update.error

    async def run(request: Request, body: SamplingFields, ids: list[int], params, shape: Shape):
        stream = await loop.submit(shape.id, ids, params)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            # on_close is a no-op once the request finished; otherwise the client left mid-stream.
            return SSEResponse(events(stream, shape, len(ids), include), on_close=lambda: loop.cancel(stream))
        try:
            await final(stream, request)
        except ClientGone:
            return Response(status_code=499)
        choices, updates = final_choices(stream, shape)
        return shape.response(choices, usage(len(ids), updates))

    def shape_args(params) -> dict:
        return {"n": params.n, "logprobs": params.logprobs, "pieces": engine.token_pieces}

    # ---- endpoints -----------------------------------------------------------------------------

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionBody, request: Request):
        params = sampling(body, 16)
        if isinstance(body.prompt, str):
            engine.check_size(len(body.prompt))
        ids = await tokenize(engine.encode, body.prompt)
        shape = CompletionShape(new_id("cmpl"), int(time.time()), name, **shape_args(params))
        if body.echo:
            shape.echo_text = body.prompt if isinstance(body.prompt, str) else \
                await asyncio.get_running_loop().run_in_executor(pool, engine.decode, ids)
            shape.echo_ids = ids
        return await run(request, body, ids, params, shape)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatBody, request: Request):
        params = sampling(body, max_len)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        engine.check_size(sum(len(m["content"]) for m in messages))
        ids = await tokenize(engine.encode_chat, messages, body.parse_special_tokens)
        return await run(request, body, ids, params, ChatShape(new_id("chatcmpl"), int(time.time()), name,
                                                               **shape_args(params)))

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

