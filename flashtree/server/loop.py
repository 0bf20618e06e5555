"""The engine thread: the only code that touches the LLMEngine while the server runs.

HTTP handlers never call the engine. They put commands on a thread-safe inbox and get
answers back on asyncio objects through `loop.call_soon_threadsafe`. The thread drains the
inbox between rounds, so requests join (add) and leave (abort) only at round boundaries,
which is where the engine's continuous batching expects them. When there is no work the
thread sleeps on the inbox instead of spinning.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from flashtree.engine import LLMEngine, Request, RequestGroup, TokenLogprob
from flashtree.errors import FlashtreeError
from flashtree.sampling import SamplingParams
from flashtree.server.metrics import ServerMetrics

log = logging.getLogger("flashtree.server")


class EngineStopped(RuntimeError):
    """The engine thread is not running (shutting down, or it died); HTTP 503."""


class EngineFailed(RuntimeError):
    """A round, or the serving loop itself, raised; the requests in it were aborted. HTTP 500."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"the engine failed while decoding this request ({type(error).__name__}: {error}); "
                         "it was aborted, and the server log has the traceback")


@dataclass
class Update:
    """One sample's progress after a round. `text` is cumulative (the engine's trimmed text), of
    which the last `held` characters could still become a stop string; token_ids and logprobs
    are the sample's own lists, which the engine only appends to: read them up to
    completion_tokens."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    error: BaseException | None = None
    index: int = 0  # which sample of the request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sample 0 of a request that asked for them
    held: int = 0


class RequestStream:
    """The asyncio side of one request: an admission future, then each sample's latest Update,
    and once every sample has finished, which samples to return (`chosen`).

    Updates carry cumulative text, so only the newest per sample matters: a slow reader gets
    the rounds it missed merged into one larger delta, and memory stays bounded however far
    it falls behind.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.loop = asyncio.get_running_loop()
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.admitted: asyncio.Future[None] = self.loop.create_future()
        self.latest: dict[int, Update] = {}
        self.fresh: set[int] = set()
        self.chosen: list[int] | None = None  # sample indices to return, in order (best_of: best first)
        self.changed = asyncio.Event()
        self.finished = False

    async def next_updates(self) -> list[Update]:
        """The samples' Updates not yet returned, by index (waits for the next round if none)."""
        while not self.fresh:
            await self.changed.wait()
            self.changed.clear()
        out = [self.latest[i] for i in sorted(self.fresh)]
        self.fresh.clear()
        return out

    async def wait_done(self) -> None:
        """Until every sample finished (chosen is set) or one failed."""
        while self.chosen is None and not any(u.error is not None for u in self.latest.values()):
            await self.changed.wait()
            self.changed.clear()

    def _set_latest(self, update: Update) -> None:  # runs on the event loop
        self.latest[update.index] = update
        self.fresh.add(update.index)
        self.changed.set()

    def _set_chosen(self, chosen: list[int]) -> None:
        self.chosen = chosen
        self.changed.set()

    # Called on the engine thread; everything crosses over with call_soon_threadsafe.
    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    def _admit(self) -> None:
        self._post(_set_result, self.admitted, None)

    def _reject(self, error: BaseException) -> None:
        self._post(_set_exception, self.admitted, error)

    def _update(self, update: Update) -> None:
        self._post(self._set_latest, update)

    def _choose(self, chosen: list[int]) -> None:
        self._post(self._set_chosen, chosen)


def update_of(req: Request, error: BaseException | None = None, reason: str | None = None) -> Update:
    """A sample's Update now (on the engine thread)."""
    if reason is None and req.finished:
        reason = req.finish_reason
    return Update(req.text, len(req.output_ids), reason, error, req.index, req.output_ids, req.logprobs,
                  req.prompt_logprobs, req.held_back)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, tuple[RequestGroup, RequestStream]] = {}
        self.thread = threading.Thread(target=self._run, name="flashtree-engine", daemon=True)
        self.stopping = False
        self.deadline: float | None = None  # engine thread: abort what still runs after this

    # ---- called from the event loop --------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a tokenized request; returns once the engine accepted it (or raises its refusal).

        Prompts arrive as token ids: tokenizing runs in the server's worker pool, never on
        the engine thread, so a huge prompt cannot stall the rounds of running requests."""
        if not self.alive:
            raise EngineStopped("the server is shutting down")
        stream = RequestStream(request_id, prompt_ids, params)
        self.inbox.put(("add", stream))
        try:
            await stream.admitted
        except asyncio.CancelledError:  # client left before admission: the add is queued, undo it
            self.cancel(stream)
            raise
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Abort a request whose client went away; a no-op once it has finished.

        The inbox is FIFO, so an abort always lands after its own add."""
        if not stream.finished:
            self.inbox.put(("abort", stream.request_id))

    def drain(self, grace: float) -> None:
        """Shutdown, first step: refuse new requests (503); abort those still running after `grace` s.

        Aborted requests end with an error (a 503, or an error event on a stream) rather than
        having their HTTP tasks cancelled, so clients learn why and nothing logs a traceback."""
        self.stopping = True
        self.inbox.put(("deadline", time.monotonic() + grace))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and join the thread (uvicorn drained HTTP first)."""
        self.stopping = True
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as e:  # a bug in this loop: fail every waiter rather than leave it hanging
            log.exception("the engine thread died")
            self.stopping = True
            for group, stream in list(self.streams.values()):
                for req in group.samples:
                    stream._update(update_of(req, EngineFailed(e), "abort"))
            self._reject_queued(EngineStopped("the engine thread died; see the server log"))

    def _serve(self) -> None:
        engine = self.engine
        shut_down = EngineStopped("the server shut down before this request finished")
        while True:
            block = not engine.has_unfinished
            if not self._apply_commands(block):
                break
            if self.deadline is not None and time.monotonic() >= self.deadline and self.streams:
                self._abort_all(shut_down)
            self.metrics.observe_queue(engine)
            if not engine.has_unfinished:
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug or device error: fail the batch, keep serving
                log.exception("engine step failed; aborting %d requests", len(self.streams))
                self._abort_all(EngineFailed(e))
                continue
            self.metrics.observe_round(engine, outputs)
            for out in outputs:
                self._deliver(out.request)
            self.metrics.observe_queue(engine)
        self._abort_all(shut_down)
        self._reject_queued(shut_down)
        self.metrics.observe_queue(engine)

    def _reject_queued(self, error: BaseException) -> None:
        """Refuse adds still in the inbox (they raced with the stop), so no handler waits forever."""
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg._reject(error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        while True:
            try:
                kind, arg = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "deadline":
                self.deadline = arg
            elif kind == "abort" and arg in self.streams:
                group, _ = self.streams[arg]
                self.engine.abort(group)
                self._deliver(group.samples[0])

    def _add(self, stream: RequestStream) -> None:
        if self.stopping:
            stream._reject(EngineStopped("the server is shutting down"))
            return
        try:
            group = self.engine.add_group(stream.prompt_ids, stream.params, stream.request_id)
        except FlashtreeError as e:  # QueueFull (or a bad prompt): the handler maps it to 429/400
            stream._reject(e)
            return
        except Exception as e:  # a bug; still only this request's
            log.exception("add_group failed")
            stream._reject(e)
            return
        self.streams[group.request_id] = (group, stream)
        self.metrics.prompt_tokens.inc(len(stream.prompt_ids))
        stream._admit()

    def _deliver(self, req: Request, error: BaseException | None = None) -> None:
        """Post a sample's Update; once its whole group finished, every sample's last one and
        the samples to return."""
        group = req.group
        entry = self.streams.get(group.request_id)
        if entry is None:
            return
        stream = entry[1]
        done = group.finished
        for sample in group.samples if done else [req]:
            stream._update(update_of(sample, error))
        if done:
            del self.streams[group.request_id]
            stream.finished = True
            first = group.samples[0]
            self.metrics.finished(first, "error" if error is not None else first.finish_reason)
            stream._choose([s.index for s in group.choices()])

    def _abort_all(self, error: BaseException) -> None:
        # Every request the engine holds was added by _add, which records it in self.streams.
        for group, _ in list(self.streams.values()):
            self.engine.abort(group)
            self._deliver(group.samples[0], error)
