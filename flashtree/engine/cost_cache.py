"""Where budget="auto"'s cost tables live between runs: one JSON file per (checkpoints, device,
dtype, threads, torch, selector), measured again when any of them changes or the file is damaged,
and the start-up lookup that reads it or measures fresh tables (cost_model.measure).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from flashtree.engine.cost_model import DEFAULT_SECONDS, FORMAT, CostModel, measure

# On the CPU, tables timed while this process had its core less than this share of the wall time were
# timed against another job's load: used for this run, never cached (a busy first start once priced a
# chain round at batch 1 at 18 ms against its 7, for every later start).
QUIET = 0.8


def quiet(device: torch.device, cpu_seconds: float, wall_seconds: float) -> bool:
    """Whether timings taken over `wall_seconds` may be cached: off the CPU always; on it, only if the
    process had its core for QUIET of that time (else they priced another job's load)."""
    return device.type != "cpu" or cpu_seconds >= QUIET * wall_seconds


def cache_dir(setting: str | None) -> Path | None:
    """EngineConfig.cost_cache: a directory, "off" (no disk cache), or None: $FLASHTREE_CACHE_DIR,
    else $XDG_CACHE_HOME/flashtree, else ~/.cache/flashtree."""
    if setting == "off":
        return None
    if setting or os.environ.get("FLASHTREE_CACHE_DIR"):
        return Path(setting or os.environ["FLASHTREE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashtree"


def _files(module) -> list[list]:
    """(name, size, mtime_ns) of a checkpoint's config and weights: changes when it is replaced."""
    if getattr(module, "source_dir", None) is None:
        return []
    src = Path(module.source_dir)
    files = [f for f in sorted(src.glob("*.safetensors")) + [src / "config.json"] if f.is_file()]
    return [[str(src.resolve())]] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(target, drafter, device: torch.device, dtype: torch.dtype, selector: bool = False) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"format": FORMAT, "target": _files(target), "drafter": _files(drafter), "device": f"{device} {name}",
            "dtype": str(dtype), "threads": torch.get_num_threads(), "torch": torch.__version__, "selector": selector,
            "compiled": getattr(target, "compiled", None) is not None, "packed": target.lm_head.packed}


def cache_path(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return directory / "costs" / f"{digest}.json"


def load(path: Path | None, key: dict) -> CostModel | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        return CostModel.from_dict(data) if data.get("key") == key and data.get("format") == FORMAT else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or a damaged or foreign file: measured over


def save(path: Path | None, key: dict, model: CostModel) -> None:
    """Write atomically (several engines may start at once); an unwritable cache is not an error."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**model.as_dict(), "key": key}))
        os.replace(tmp, path)
    except OSError:
        pass


def startup(target, drafter, passes: tuple[Callable, Callable], cache, draft_cache, max_rows: int, max_window: int,
            max_budget: int, cache_setting: str | None, seconds: float = DEFAULT_SECONDS, selector: bool = False
            ) -> tuple[CostModel, Path | None, dict]:
    """The cached tables when they cover this engine, else a fresh measurement: saved, unless the CPU was
    busy with other work while it ran (then the path is None, and nothing this run learns is saved)."""
    key = cache_key(target, drafter, cache.device, target.embed_tokens.weight.dtype, selector)
    directory = cache_dir(cache_setting)
    path = cache_path(directory, key) if directory is not None else None
    model = load(path, key)
    if model is not None:
        c = model.coverage
        if c["rows"] >= max_rows and c["window"] >= max_window and c["budget"] >= max_budget:
            return model, path, key
        # Measure at least what the cache covered, so engines do not take turns.
        max_rows = min(max(max_rows, c["rows"]), cache.k.shape[1])
        max_window = min(max(max_window, c["window"]), cache.max_len - 2)
        max_budget = max(max_budget, c["budget"])
    where = f"; cached in {path.parent}" if path is not None else ""
    loud = getattr(getattr(target, "tp", None), "rank", 0) == 0  # under tensor parallelism, rank 0 alone prints
    if loud:
        print(f"flashtree: measuring round costs for budget='auto' (once per model, device, dtype and "
              f"threads{where})...", end="", file=sys.stderr, flush=True)
    wall, cpu = time.perf_counter(), time.process_time()
    model = measure(target, drafter, passes, cache, draft_cache, max_rows, max_window, max_budget, seconds)
    busy = not quiet(cache.device, time.process_time() - cpu, time.perf_counter() - wall)
    if loud:
        note = "; the CPU was busy with other work, so not cached (measured again next start)" if busy else ""
        print(f" {model.seconds:.1f} s{note}", file=sys.stderr, flush=True)
    if busy:
        return model, None, key
    save(path, key, model)
    return model, path, key
