"""uvicorn with a shutdown that ends engine requests instead of cancelling their HTTP tasks.

On SIGTERM (or `should_exit`) uvicorn stops accepting connections and waits for open ones;
past its timeout it cancels their tasks, which cuts streams without a word and logs a
traceback per request. Here the engine thread gets the grace period instead: it refuses
new requests at once (503), lets running ones finish for `grace` seconds, then aborts the
rest with an error the client sees (a 503, or an error event before `[DONE]`). uvicorn's
own timeout stays as a backstop a few seconds later.
"""

from __future__ import annotations

import uvicorn

BACKSTOP_S = 10.0


class GracefulServer(uvicorn.Server):
    def __init__(self, app, grace: float = 30.0, **config) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace + BACKSTOP_S, **config))
        self.engine_loop = app.state.engine_loop
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.drain(self.grace)
        await super().shutdown(sockets)
