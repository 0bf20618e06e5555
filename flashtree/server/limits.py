"""Bounds on what one client can make the server hold: body size and read time.

Without them a client could keep a connection (and its buffers) open for ever by sending
nothing, or half a request, and a body too large got a plain-text 413 that OpenAI clients
cannot parse. Here:

- `BodyLimit` (ASGI middleware) reads the whole body before the app sees it. A body
  declared or found to be over `max_bytes` gets a 413, one that has not fully arrived after
  `timeout` seconds a 408; both are OpenAI error objects, and the connection is closed.
- `TimedH11Protocol` (uvicorn's h11 protocol) closes a connection whose request head
  (request line and headers) has not arrived `read_timeout` seconds after it opened or
  after its previous response; uvicorn alone waits for ever before the first request.
  Idle keep-alive connections are closed by uvicorn's own `timeout_keep_alive`.
- The same protocol answers a request head over MAX_HEADER_BYTES with a 431, however it
  arrives (h11's own bound only applies to a head still incomplete in its buffer, so a large
  head in one write went through), and a request h11 cannot parse (a garbage request line,
  a bad Content-Length) with a 400; both as OpenAI error objects, where uvicorn sends plain
  text, and both close the connection.
"""

from __future__ import annotations

import asyncio
import http
import re

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from flashtree.errors import FlashtreeError
from flashtree.server.cli import bad_seconds
from flashtree.server.errors import error_response

MAX_HEADER_BYTES = 16 << 10  # request line + headers; a 431 beyond it
BLANK_LINE = re.compile(b"\n\r?\n")  # the end of a request head, as h11 finds it
HEAD_TOO_LARGE = (431, f"the request head (request line and headers) is over {MAX_HEADER_BYTES >> 10} KiB",
                  "headers_too_large")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.refuse(scope, receive, send, 413)
            return
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await self.refuse(scope, receive, send, 408)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its request was complete: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self.refuse(scope, receive, send, 413)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for http.disconnect, as the app expects

        await self.app(scope, replay, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send, status: int) -> None:
        if status == 413:
            message = (f"the request body is over {self.max_bytes >> 20} MiB; prompts that fit a context are "
                       "far smaller")
            code = "body_too_large"
        else:
            message = f"the request body did not arrive within {self.timeout:g} s"
            code = "request_timeout"
        response = error_response(status, message, None, code, headers={"connection": "close"})
        await response(scope, receive, send)


def check_seconds(name: str, value: float, zero_ok: bool) -> None:
    if (why := bad_seconds(value, zero_ok)) is not None:
        raise FlashtreeError(f"{name}: {why}")


def head_too_large(buffered: bytes, limit: int) -> bool:
    """Whether the request head that `buffered` starts with is, or will be, over `limit` bytes."""
    return len(buffered) > limit and BLANK_LINE.search(buffered, 0, limit) is None


class TimedH11Protocol(H11Protocol):
    read_timeout: float = 30.0  # set per server by `timed_h11(seconds)`

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm(self.cycle)

    def _arm(self, cycle) -> None:
        """Close the connection if, `read_timeout` s from now, no request head arrived after `cycle`."""
        self.loop.call_later(self.read_timeout, self._head_deadline, cycle)

    def _head_deadline(self, cycle) -> None:
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and head_too_large(self.conn.trailing_data[0] + data, MAX_HEADER_BYTES):
            self._refuse(*HEAD_TOO_LARGE)
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (or a pipelined head h11 found too long)."""
        if head_too_large(self.conn.trailing_data[0], MAX_HEADER_BYTES):
            self._refuse(*HEAD_TOO_LARGE)
        else:
            self._refuse(400, "malformed HTTP request: the request line, a header or the body framing could not be "
                         "parsed", "invalid_http_request")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """An OpenAI error object, then close: written directly, as h11 may be past answering."""
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # an answer is under way: nothing sensible can follow it
            return
        response = error_response(status, message, None, code, headers={"connection": "close"})
        head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
        head += [name + b": " + value for name, value in response.raw_headers]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + response.body)
        self.transport.close()


def timed_h11(read_timeout: float) -> type[H11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": read_timeout})
