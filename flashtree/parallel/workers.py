"""The tensor-parallel worker processes, started by flashtree itself (no torchrun), as vLLM does.

The user's process is rank 0: it owns the scheduler, the tokenizer and (in `flashtree serve`)
the HTTP server, and it starts ranks 1..N-1 once per process, reused by every
tensor-parallel engine it builds. A worker is a fresh `python -m flashtree.parallel.worker`
that is told its rank, the rendezvous port and its control socket on the command line; it
never imports the user's script (multiprocessing's spawn re-imports `__main__`, which fails
for code read from stdin or run without a main guard). Each worker builds the same LLMEngine
on its slice of the target and then mirrors rank 0's runner:

- control: each engine call on rank 0 (a runner method with its arguments: slots, bonus tokens,
  request parameters, small pickled objects) goes first to every worker over its own socket.
  A socket, not a collective: an idle server's workers can wait for hours without a collective
  timing out, and a worker sees EOF and exits when rank 0 goes away;
- data: the collectives inside the sharded forward (flashtree.parallel.shard), NCCL on CUDA,
  gloo on the CPU. Every rank then holds the same full logits, builds the same tree, walks it
  with the same counter-based sampling noise and commits the same nodes, so no result is sent
  back. With FLASHTREE_TP_CHECK=1 each worker also returns a digest of every call's result and
  its cache lengths, and rank 0 raises if they differ from its own (a debugging aid);
- failure: a watchdog thread in rank 0 waits on each worker process. When a worker
  dies, rank 0's next (or current) call raises FlashtreeError "tensor-parallel worker 1 exited
  with code ...; see its log above" (the worker's traceback is on the shared stderr); an NCCL
  collective that would wait for the dead rank forever is aborted, gloo's fails by itself.
  Collectives time out after FLASHTREE_TP_TIMEOUT seconds (default 600) if a rank hangs alive.
"""

from __future__ import annotations

import atexit
import collections
import copy
import datetime
import hashlib
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from flashtree.errors import FlashtreeError
from flashtree.parallel.group import TensorParallel

log = logging.getLogger(__name__)

TIMEOUT = float(os.environ.get("FLASHTREE_TP_TIMEOUT", "600"))


def rank_devices(device: str | None, world: int) -> list[torch.device]:
    """Rank r's device: cuda:(k + r) from --device cuda:k (cuda = cuda:0), or the CPU for all."""
    base = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if base.type == "cpu":
        return [base] * world
    if base.type != "cuda":
        raise FlashtreeError(f"tensor parallelism runs on cuda or cpu devices, not {base.type}")
    first, count = base.index or 0, torch.cuda.device_count()
    if first + world > count:
        raise FlashtreeError(f"tensor_parallel_size={world} from cuda:{first} needs {first + world} GPUs; "
                             f"this machine has {count}")
    return [torch.device("cuda", first + r) for r in range(world)]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def digest(result, runner) -> str:
    """What every rank must agree on after a call: its result without timings (floats), and the
    committed lengths of the caches."""

    def strip(x):
        if isinstance(x, float):
            return None
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        return x

    caches = (getattr(runner, "cache", None), getattr(runner, "draft_cache", None))
    lengths = [getattr(c, "lengths", None) for c in caches]
    return hashlib.sha256(pickle.dumps((strip(result), lengths))).hexdigest()


class Cluster:
    """Rank 0's side: the workers, their control pipes, the process group and the watchdog."""

    def __init__(self, world: int, devices: list[torch.device]) -> None:
        self.world, self.devices = world, devices
        self.backend = backend_for(devices[0])
        self.check_results = os.environ.get("FLASHTREE_TP_CHECK") == "1"
        self.ids = itertools.count()
        self.drops: collections.deque[int] = collections.deque()  # engines garbage-collected on rank 0
        self.closing = False
        self.procs: list[subprocess.Popen] = []
        self.pipes: list[Channel] = []
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=TIMEOUT))
        threads = torch.get_num_threads()
        for rank in range(1, world):
            mine, theirs = socket.socketpair()
            self.procs.append(start_worker(rank, world, store.port, theirs.fileno(), devices[rank], threads,
                                           self.check_results))
            theirs.close()
            self.pipes.append(Channel(mine.detach()))
        for rank in range(1, world):
            threading.Thread(target=self._watch, args=(rank,), name=f"flashtree-tp{rank}-watchdog", daemon=True).start()
        for rank in range(1, world):  # imports done: the group's rendezvous cannot wait on a dead one
            self.receive(rank, "ready")
        dist.init_process_group(self.backend, store=store, rank=0, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT), device_id=self._device_id())
        self.store = store
        atexit.register(self.close)

    def _device_id(self):
        return self.devices[0] if self.backend == "nccl" else None

    # ---- liveness --------------------------------------------------------------------------

    def _watch(self, rank: int) -> None:
        proc = self.procs[rank - 1]
        proc.wait()
        if self.closing:
            return
        log.error("tensor-parallel worker %d exited with code %s", rank, proc.returncode)
        if self.backend == "nccl":  # NCCL would wait for the dead rank until the timeout
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # already torn down
                pass

    @property
    def dead(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def check(self, grace: float = 0.0) -> None:
        """Raise the one-line error if a worker is gone (waiting up to `grace` seconds for a dying
        one's exit code: a collective can fail a moment before its peer is reaped)."""
        if self.closing:
            raise FlashtreeError("the tensor-parallel workers were shut down; start a new process")
        deadline = time.monotonic() + grace
        while True:
            for rank, p in enumerate(self.procs, 1):
                if p.poll() is not None:
                    raise FlashtreeError(f"tensor-parallel worker {rank} exited with code {p.returncode}; "
                                         "see its log above")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    # ---- control ---------------------------------------------------------------------------

    def send(self, message: tuple) -> None:
        """The same message to every worker (after any pending engine drops)."""
        self.check()
        try:
            while self.drops:
                eid = self.drops.popleft()
                for pipe in self.pipes:
                    pipe.send(("drop", eid))
            for pipe in self.pipes:
                pipe.send(message)
        except OSError:  # a broken pipe: its worker died
            self.check(grace=5.0)
            raise

    def receive(self, rank: int, kind: str):
        """The next reply from worker `rank` (of the expected kind), watching that it stays alive."""
        pipe = self.pipes[rank - 1]
        deadline = time.monotonic() + TIMEOUT
        while not pipe.poll(0.1):
            self.check()
            if time.monotonic() > deadline:
                raise FlashtreeError(f"tensor-parallel worker {rank} did not answer within {TIMEOUT:.0f} s "
                                     "(FLASHTREE_TP_TIMEOUT)")
        try:
            reply = pipe.recv()
        except EOFError:
            self.check(grace=5.0)
            raise
        if reply[0] != kind:
            raise RuntimeError(f"tensor-parallel worker {rank} answered {reply[0]!r}, expected {kind!r}")
        return reply[1:]

    def drop(self, engine_id: int) -> None:
        """An engine on rank 0 was garbage-collected: its mirrors go with the next message."""
        self.drops.append(engine_id)

    def close(self) -> None:
        """Stop the workers and leave the process group (at exit, or before a restart)."""
        if self.closing:
            return
        self.closing = True
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait()
        for pipe in self.pipes:
            pipe.close()
        try:
            dist.destroy_process_group()
        except Exception:  # a dead peer can leave the group unable to shut down cleanly
            pass


class Channel:
    """One end of a control socket, carrying whole pickled messages. Plain pickle, not
    multiprocessing's: that one would send tensors as shared-memory handles, which only a
    process multiprocessing itself started can open."""

    def __init__(self, fd: int) -> None:
        self.conn = Connection(fd)

    def send(self, message) -> None:
        self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def start_worker(rank: int, world: int, port: int, fd: int, device: torch.device, threads: int,
                 check: bool) -> subprocess.Popen:
    """`python -m flashtree.parallel.worker` for one rank, importing this same flashtree (its
    package root goes first on PYTHONPATH; -P keeps the working directory off sys.path). Its
    warnings would repeat rank 0's, which runs the same code: only rank 0 prints them."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               TRANSFORMERS_VERBOSITY="error")
    isolate = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *isolate, "-W", "ignore", "-m", "flashtree.parallel.worker", "--rank", str(rank),
           "--world", str(world),
           "--port", str(port), "--fd", str(fd), "--device", str(device), "--threads", str(threads)]
    return subprocess.Popen(cmd + (["--check"] if check else []), env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL)


_cluster: Cluster | None = None


def cluster_for(world: int, device: str | None) -> Cluster:
    """This process's workers: started by the first tensor-parallel engine, shared by the rest."""
    global _cluster
    devices = rank_devices(device, world)
    if _cluster is not None and (_cluster.closing or _cluster.dead):  # after a crash, start afresh
        _cluster.close()
        _cluster = None
    if _cluster is None:
        _cluster = Cluster(world, devices)
    elif (_cluster.world, _cluster.devices) != (world, devices):
        raise FlashtreeError(f"this process already runs tensor_parallel_size={_cluster.world} on "
                             f"{_cluster.devices[0]}; every engine in one process must use the same")
    _cluster.check()
    return _cluster


@dataclass
class EngineLink:
    """How one LLMEngine takes part in tensor parallelism: its rank's group and its id; on rank 0
    also the cluster its runner calls go to."""

    group: TensorParallel
    engine_id: int
    cluster: Cluster | None = None  # rank 0 only

    @property
    def device(self) -> torch.device:
        return self.group.device

    def attach(self, runner):
        """Every rank takes rank 0's start-up measurements (budget="auto" times the target: timed
        on each rank they would differ, and so would the rounds' plans), frozen so that no rank's
        own timings move them; rank 0 gets back a runner whose every method call the workers mirror."""
        policy = getattr(runner, "policy", None)
        box = [policy.cost if policy is not None else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        if policy is not None:
            policy.cost = box[0]
            policy.cost.frozen = True
        if self.cluster is None:
            return runner
        from flashtree.parallel.mirror import MirroredRunner

        return MirroredRunner(runner, self)

    def run(self, fn, args: tuple, kwargs: dict) -> None:
        """Rank 0: have every worker run fn(its engine, *args, **kwargs) (see LLMEngine.on_every_rank)."""
        self.cluster.send(("run", self.engine_id, fn, args, kwargs))


@contextmanager
def open_engine(engine, config, share_weights):
    """Rank 0 builds `engine` inside this block while every worker builds its own from the same
    config; the block ends when all of them have. A worker's FlashtreeError (the same one rank 0
    would meet) is raised here; any other failure of a worker ends it (see `check`)."""
    cluster = cluster_for(config.tensor_parallel_size, config.device)
    link = EngineLink(TensorParallel(0, cluster.world, cluster.devices[0]), next(cluster.ids), cluster)
    share = getattr(share_weights, "tp", None)
    if share_weights is not None and share is None:
        raise FlashtreeError("share_weights needs an engine with the same tensor_parallel_size")
    if share is not None and share.cluster is not cluster:
        raise FlashtreeError("share_weights' engine ran on tensor-parallel workers that have since exited; "
                             "build it again")
    cluster.send(("open", link.engine_id, copy.deepcopy(config), share.engine_id if share else None))
    try:
        yield link
    except BaseException:
        _collect(cluster, link.engine_id, failed=True)
        raise
    _collect(cluster, link.engine_id, failed=False)
    weakref.finalize(engine, cluster.drop, link.engine_id)


def _collect(cluster: Cluster, engine_id: int, failed: bool) -> None:
    errors = {rank: cluster.receive(rank, "opened")[0] for rank in range(1, cluster.world)}
    if failed or any(errors.values()):
        cluster.drop(engine_id)  # the workers that did build it let it go
    if not failed:
        for rank, error in errors.items():
            if error:
                raise FlashtreeError(f"tensor-parallel worker {rank}: {error}")


# ---- the worker process ------------------------------------------------------------------------


def worker_main(rank: int, world: int, port: int, pipe: Channel, device: torch.device, threads: int,
                check: bool) -> None:
    """Ranks 1..N-1: build the engines rank 0 builds and run every call it sends, until it stops
    or goes away. An exception other than FlashtreeError (which rank 0 meets too) ends the
    process with its traceback on stderr, and rank 0 reports the exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; we follow its exit
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from flashtree.engine.llm_engine import LLMEngine

    timeout = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    pipe.send(("ready",))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    tp = TensorParallel(rank, world, device)
    engines: dict[int, LLMEngine] = {}
    while True:
        try:
            kind, eid, *rest = pipe.recv()
        except EOFError:  # rank 0 is gone
            break
        if kind == "stop":
            break
        if kind == "drop":
            engines.pop(eid, None)
        elif kind == "open":
            config, share = rest
            try:
                engines[eid] = LLMEngine(config, share_weights=engines.get(share), tp=EngineLink(tp, eid))
                pipe.send(("opened", None))
            except FlashtreeError as e:
                pipe.send(("opened", str(e)))
        elif kind == "call":
            name, args, kwargs = rest
            runner = engines[eid].runner
            try:
                result = getattr(runner, name)(*args, **kwargs)
            except FlashtreeError:  # rank 0 raised the same; it answers its caller
                continue
            if check:
                pipe.send(("digest", digest(result, runner)))
        elif kind == "run":
            fn, args, kwargs = rest
            try:
                fn(engines[eid], *args, **kwargs)
            except FlashtreeError:  # as for "call"
                continue
    engines.clear()
    dist.destroy_process_group()
