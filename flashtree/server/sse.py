"""Server-sent events: framing, and a response that notices hang-ups.

A stream withholds the text that could still grow into a stop string (the engine cuts the
text before a stop string only once the whole of it has appeared, possibly a round later,
and a stream cannot take back what it sent); the engine's stop matcher says how much that
is (`Request.held_back`, flashtree/engine/stops.py), so a stream never scans its text.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always listens for http.disconnect while it streams.

    Starlette skips the listener for ASGI spec >= 2.4 and relies on the next send failing,
    but a request still waiting for a slot sends nothing, so its hang-up would go unnoticed
    and it would keep its place in the queue. `on_close` runs however the response ends
    (finished, hung up, cancelled at shutdown), even if the body iterator never started.
    """

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()
            await self.body_iterator.aclose()
