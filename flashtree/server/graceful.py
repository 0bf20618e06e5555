"""uvicorn with a shutdown that ends engine requests instead of cancelling their HTTP tasks.

On SIGTERM (or `should_exit`) uvicorn stops accepting connections and waits for open ones;
past its timeout it cancels their tasks, which cuts streams without a word and logs a
traceback per request. Here the engine thread gets the grace period instead: it refuses
new requests at once (503), lets running ones finish for `grace` seconds, then aborts the
rest with an error the client sees (a 503, or an error event before `[DONE]`). uvicorn's
own timeout stays as a backstop a few seconds later. A second SIGTERM or Ctrl-C stops
waiting and exits at once.

The connection limits (read deadlines, header size, keep-alive) are set here too; see
flashtree/server/limits.py.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

from flashtree.server.limits import MAX_HEADER_BYTES, check_seconds, timed_h11

BACKSTOP_S = 10.0
KEEP_ALIVE_S = 5  # idle keep-alive connections are closed after this


class GracefulServer(uvicorn.Server):
    def __init__(self, app, grace: float = 30.0, read_timeout: float = 30.0,
                 on_ready: Callable[[str], None] | None = None, **config) -> None:
        check_seconds("grace", grace, zero_ok=True)
        check_seconds("read_timeout", read_timeout, zero_ok=False)
        config.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
        # ws="none": an Upgrade request is plain HTTP to the app (a JSON 404/405), not a WebSocket
        # handshake that uvicorn would refuse with a bare 403.
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace + BACKSTOP_S, http=timed_h11(read_timeout),
                                        h11_max_incomplete_event_size=MAX_HEADER_BYTES, ws="none", **config))
        self.engine_loop = app.state.engine_loop
        self.grace = grace
        self.on_ready = on_ready

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready(self.url)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # the second signal: stop waiting for anything
            self.force_exit = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.drain(self.grace)
        await super().shutdown(sockets)
