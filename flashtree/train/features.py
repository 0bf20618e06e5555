"""Target features for drafter training: offline shards, or on the fly (online mode).

The drafter reads the outputs of a few target blocks (`target_layer_ids`). Offline mode runs
the target once over every sequence and writes safetensors shards, so training epochs cost
only the drafter. Each shard is written to a temp file and moved into place with
`os.replace`, then the manifest is rewritten the same way: a run killed at any instant leaves
only whole shards, and the rerun recomputes exactly the missing ones. Shards hold flat
token rows (no padding): `input_ids`, `loss_mask`, `features` and `offsets`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.train.data import TokenSequence, read_sequences

FORMAT = "flashtree-features/1"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@torch.no_grad()
def target_features(target, seqs: list[list[int]], layer_ids: list[int], device: torch.device) -> list[Tensor]:
    """Features [len, n_layers * hidden] of each sequence, from one padded causal forward.

    Right padding is safe: attention is causal, so no real token sees a pad.
    """
    n = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), n, dtype=torch.long)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = torch.tensor(s)
    tokens = tokens.to(device)
    cache = target.new_cache(len(seqs), n)
    out = target(tokens, ForwardContext.prefill(cache, list(range(len(seqs))), n), tuple(layer_ids), last_only=True)
    return [out.features[r, : len(s)] for r, s in enumerate(seqs)]


def resolve_layer_ids(target, layer_ids: list[int] | None, num_draft_layers: int) -> list[int]:
    from flashtree.models.dflash import default_target_layer_ids

    ids = list(layer_ids) if layer_ids else default_target_layer_ids(target.num_layers, num_draft_layers)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise FlashtreeError(f"target_layer_ids {ids} do not fit a target with {target.num_layers} layers")
    return ids


@dataclass
class ExtractConfig:
    data: str  # regenerated JSONL (prompt_ids + response_ids) or input_ids + loss_mask rows
    out: str  # shard directory
    target: str | None = None  # None = the embedded demo target
    layer_ids: list[int] | None = None  # None = the DFlash default for num_draft_layers
    num_draft_layers: int = 1
    shard_size: int = 256  # sequences per shard
    batch_size: int = 8  # sequences per target forward
    max_len: int = 2048  # longer sequences are cut
    store_dtype: str = "bfloat16"
    device: str | None = None
    dtype: str | None = None  # the target's compute dtype
    stop_after: int | None = None  # write at most this many shards this run (tests simulate a kill)


def fingerprint(seqs: list[TokenSequence]) -> str:
    """Hash of the exact inputs, so a resume never mixes shards of different data."""
    h = hashlib.sha256()
    for s in seqs:
        h.update(json.dumps([s.id, s.input_ids, s.loss_mask]).encode())
    return h.hexdigest()[:16]


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_bytes(seqs: list[TokenSequence], feats: list[Tensor], dtype: torch.dtype) -> bytes:
    from safetensors.torch import save

    lengths = [len(s.input_ids) for s in seqs]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in seqs for m in s.loss_mask], dtype=torch.uint8),
        "features": torch.cat([f.to("cpu", dtype) for f in feats]).contiguous(),
        "offsets": offsets,
    }
    return save(tensors, metadata={"ids": json.dumps([s.id for s in seqs])})


def extract(cfg: ExtractConfig, target=None) -> dict:
    """Write (or finish writing) the feature shards of `cfg.data`; returns the manifest."""
    from flashtree.config import DEMO_TARGET
    from flashtree.models.loader import load_target, parse_dtype

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.store_dtype not in STORE_DTYPES:
        raise FlashtreeError(f"store dtype must be one of {', '.join(STORE_DTYPES)}")
    target_path = str(cfg.target or DEMO_TARGET)
    if target is None:
        target = load_target(target_path, parse_dtype(cfg.dtype, device), device)
    layer_ids = resolve_layer_ids(target, cfg.layer_ids, cfg.num_draft_layers)
    seqs = [TokenSequence(s.id, s.input_ids[: cfg.max_len], s.loss_mask[: cfg.max_len])
            for s in read_sequences(cfg.data) if s.input_ids]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "format": FORMAT, "target": target_path, "layer_ids": layer_ids,
        "hidden_size": target.args.hidden_size, "feature_dim": len(layer_ids) * target.args.hidden_size,
        "num_target_layers": target.num_layers, "vocab_size": target.vocab_size,
        "store_dtype": cfg.store_dtype, "shard_size": cfg.shard_size, "max_len": cfg.max_len,
        "num_sequences": len(seqs), "data_fingerprint": fingerprint(seqs),
    }
    manifest = load_manifest(out)
    if manifest is not None:
        old = {k: manifest.get(k) for k in settings if k != "target"}
        new = {k: v for k, v in settings.items() if k != "target"}
        if old != new:
            diff = sorted(k for k in new if old[k] != new[k])
            raise FlashtreeError(f"{out} holds shards made with other settings ({', '.join(diff)}); "
                                 "use a fresh --out directory or delete it")
    shards = {s["file"]: s for s in (manifest or {}).get("shards", []) if (out / s["file"]).is_file()}
    n_shards = (len(seqs) + cfg.shard_size - 1) // cfg.shard_size
    dtype = STORE_DTYPES[cfg.store_dtype]
    written, tokens, t0 = 0, 0, time.perf_counter()
    bar = tqdm(total=n_shards, initial=len(shards), desc="extract", unit="shard")
    for k in range(n_shards):
        name = f"shard-{k:05d}.safetensors"
        if name in shards:
            continue
        if cfg.stop_after is not None and written >= cfg.stop_after:
            break
        part = seqs[k * cfg.shard_size : (k + 1) * cfg.shard_size]
        feats: list[Tensor | None] = [None] * len(part)
        order = sorted(range(len(part)), key=lambda i: len(part[i].input_ids))  # similar lengths per batch
        for b in range(0, len(order), cfg.batch_size):
            idx = order[b : b + cfg.batch_size]
            for i, f in zip(idx, target_features(target, [part[i].input_ids for i in idx], layer_ids, device)):
                feats[i] = f
        write_atomic(out / name, shard_bytes(part, feats, dtype))
        n_tok = sum(len(s.input_ids) for s in part)
        shards[name] = {"file": name, "sequences": len(part), "tokens": n_tok}
        save_manifest(out, settings, shards, n_shards)
        written, tokens = written + 1, tokens + n_tok
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    manifest = save_manifest(out, settings, shards, n_shards)
    seconds = time.perf_counter() - t0
    if written:
        print(f"extract: {written} shards, {tokens} tokens in {seconds:.1f}s ({tokens / seconds:.0f} tok/s)", flush=True)
    return manifest


def load_manifest(out: Path) -> dict | None:
    path = out / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def save_manifest(out: Path, settings: dict, shards: dict, n_shards: int) -> dict:
    """Rewrite manifest.json atomically; `complete` once every shard exists."""
    manifest = {**settings, "shards": [shards[k] for k in sorted(shards)], "complete": len(shards) == n_shards}
    write_atomic(out / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


@dataclass
class FeatureRow:
    """One sequence as training reads it."""

    input_ids: Tensor  # [T] long
    loss_mask: Tensor  # [T] bool
    features: Tensor | None  # [T, F], None in online mode (the trainer computes them)


class FeatureShards:
    """Random access to the sequences of a finished shard directory (a few shards cached)."""

    def __init__(self, path: str | os.PathLike, cached: int = 2) -> None:
        self.path = Path(path)
        manifest = load_manifest(self.path)
        if manifest is None or manifest.get("format") != FORMAT:
            raise FlashtreeError(f"{self.path} has no feature manifest; run `flashtree train extract` first")
        if not manifest["complete"]:
            raise FlashtreeError(f"{self.path} is incomplete; rerun `flashtree train extract` to finish it")
        self.manifest = manifest
        self.index = [(k, i) for k, s in enumerate(manifest["shards"]) for i in range(s["sequences"])]
        self.cached = cached
        self._cache: OrderedDict[int, dict[str, Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    def shard(self, k: int) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        if k not in self._cache:
            self._cache[k] = load_file(str(self.path / self.manifest["shards"][k]["file"]))
            while len(self._cache) > self.cached:
                self._cache.popitem(last=False)
        self._cache.move_to_end(k)
        return self._cache[k]

    def __getitem__(self, n: int) -> FeatureRow:
        k, i = self.index[n]
        s = self.shard(k)
        a, b = int(s["offsets"][i]), int(s["offsets"][i + 1])
        return FeatureRow(s["input_ids"][a:b].long(), s["loss_mask"][a:b].bool(), s["features"][a:b])


class SequenceRows:
    """Online mode: token rows only; the trainer runs the target for their features."""

    def __init__(self, path: str | os.PathLike, max_len: int = 2048) -> None:
        self.seqs = [s for s in read_sequences(path) if s.input_ids]
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, n: int) -> FeatureRow:
        s = self.seqs[n]
        return FeatureRow(torch.tensor(s.input_ids[: self.max_len]),
                          torch.tensor(s.loss_mask[: self.max_len], dtype=torch.bool), None)
