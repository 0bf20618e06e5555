"""uvicorn on a free loopback port in a daemon thread: for tests and in-process benchmarks."""

from __future__ import annotations

import threading
import time

from flashtree.server.graceful import BACKSTOP_S, GracefulServer


class BackgroundServer:
    """`with BackgroundServer(app) as url:` serves `app` at url until the block ends.

    uvicorn skips signal handlers off the main thread, so stopping goes through
    `should_exit`, which runs the same graceful shutdown (and the app's lifespan) as SIGTERM:
    running requests get `grace` seconds to finish, then they are aborted.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, grace: float = 5.0, **config) -> None:
        """`config`: more GracefulServer/uvicorn settings, e.g. read_timeout or timeout_keep_alive."""
        self.server = GracefulServer(app, grace, host=host, port=port, log_level="warning", lifespan="on", **config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.server.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.server.grace + BACKSTOP_S + 10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
