"""Train a DFlash drafter for a target: the recipe of the DFlash paper, on CPU or under torchrun.

With `selector`, the drafter is a DFlash2 (models/dflash2.py): block-local convolutions in every
layer and a candidate selector, learnt jointly with the rest; the selector's loss is taken on
the true previous token (teacher forcing, see blocks.block_loss).

Per step, every sequence draws fresh random anchors among its response tokens (up to
`max_anchors`), and all its blocks run in one drafter forward (see blocks.py). The loss is
the slot-weighted CE of blocks.block_loss. The target's embedding and LM head are borrowed
and frozen, as at inference. AdamW, linear warmup then cosine, grad clip, gradient
accumulation. Under torchrun each rank takes its own slice of every global batch (DDP;
gloo on CPU, nccl on CUDA). A checkpoint holds the optimizer, schedule, data position and
step, so a resumed run continues where it stopped; the output directory is always a
z-lab-format drafter that `flashtree.LLM` loads.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DFlashArgs, DFlashDrafter, default_target_layer_ids
from flashtree.models.dflash2 import DFlash2Args, DFlash2Drafter, save_drafter
from flashtree.train.blocks import BlockDrafter, block_labels, block_loss, block_prev_tokens, block_tokens, \
    init_drafter_weights, make_batch, slot_weights
from flashtree.train.features import FeatureShards, SequenceRows, target_features


@dataclass
class RunConfig:
    """What every training run is given, a drafter's or an MTP head's."""

    out: str  # the trained model's directory + checkpoint.pt + train_log.csv
    data: str | None = None  # feature shard directory (offline mode)
    sequences: str | None = None  # regenerated JSONL: online mode, features computed on the fly
    target: str | None = None  # None = the shards' target, or the embedded demo target
    intermediate_size: int | None = None  # None = the target's
    init_from_target: bool = False  # start the layers from the target's last layers
    batch_size: int = 4  # sequences per micro-batch and rank
    steps: int | None = None  # optimizer steps; else epochs (drafters); else minutes (calibrated once)
    minutes: float | None = None
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    max_len: int = 2048
    device: str | None = None
    dtype: str | None = None  # target dtype; training runs in fp32 weights (+bf16 autocast on CUDA)
    save_dtype: str = "float32"
    threads: int | None = None
    log_every: int = 10
    save_every: int = 200
    resume: bool = True
    stop_after: int | None = None  # stop (with a checkpoint) after this many steps this run: tests simulate a kill
    plot: str | None = None  # loss-curve PNG (default OUT/loss.png)


@dataclass
class TrainConfig(RunConfig):
    """A DFlash (or, with selector, DFlash2) drafter's run; `out` is a z-lab-format drafter."""

    block_size: int = 16
    num_layers: int = 1
    layer_ids: list[int] | None = None  # online mode only (offline reads the manifest's)
    mask_token_id: int | None = None  # None = the tokenizer's mask token / <|mask|>
    gamma: float | None = None  # None = 7 * B / 16
    max_anchors: int = 512
    grad_accum: int = 1
    epochs: float | None = None
    min_lr_ratio: float = 0.0
    backend: str = "auto"  # flex (CUDA), split (CPU), dense (reference)
    selector: bool = False  # train a DFlash2 drafter (convolutions + candidate selector)
    selector_rank: int = 32
    selector_top_k: int = 16
    conv_kernel_size: int = 4
    conv_group_size: int | None = None  # None = min(32, hidden size)


# Settings that do not change what a run computes: a resume may differ in these.
RESUMABLE = ("out", "resume", "threads", "log_every", "save_every", "stop_after", "plot")


# ---------------------------------------------------------------------------- distributed


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device | None) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK; gloo on CPU, nccl on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    elif device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local}")  # one GPU per rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), world, local), device


# ---------------------------------------------------------------------------- data order


class Loader:
    """Deterministic global batches: a seeded order per epoch, each rank taking its slice.

    Offline data is ordered shard by shard (shuffled shards, shuffled rows inside) so a rank
    reads one shard at a time. The position is part of the checkpoint.
    """

    def __init__(self, dataset, batch_size: int, dd: Dist, seed: int) -> None:
        self.dataset, self.batch_size, self.dd, self.seed = dataset, batch_size, dd, seed
        self.epoch, self.pos = 0, 0
        self.order = self._order(0)

    def _order(self, epoch: int) -> list[int]:
        rng = random.Random(self.seed * 1000 + epoch)
        index = getattr(self.dataset, "index", None)
        if index is None:
            order = list(range(len(self.dataset)))
            rng.shuffle(order)
            return order
        groups: dict[int, list[int]] = {}
        for n, (k, _) in enumerate(index):
            groups.setdefault(k, []).append(n)
        keys = list(groups)
        rng.shuffle(keys)
        out = []
        for k in keys:
            rows = groups[k]
            rng.shuffle(rows)
            out += rows
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self.order = self._order(self.epoch)

    def next(self) -> list:
        """This rank's rows of the next global batch (batch_size per rank)."""
        need = self.batch_size * self.dd.world
        picked = []
        while len(picked) < need:
            if self.pos >= len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = self._order(self.epoch)
            take = self.order[self.pos : self.pos + need - len(picked)]
            picked += take
            self.pos += len(take)
        return [self.dataset[i] for i in picked[self.dd.rank :: self.dd.world]]

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.pos / max(1, len(self.order))


# ---------------------------------------------------------------------------- setup


def resolve_mask_token(target, given: int | None) -> int:
    if given is not None:
        return given
    from flashtree.engine.llm_engine import load_tokenizer

    tok = load_tokenizer(target.source_dir)
    if tok is not None:
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        mid = tok.convert_tokens_to_ids("<|mask|>")
        if isinstance(mid, int) and mid != getattr(tok, "unk_token_id", None) and mid >= 0:
            return mid
    raise FlashtreeError("the target tokenizer has no mask token; pass --mask-token-id with an id the "
                         "target never generates (z-lab Qwen3 drafters use a reserved id)")


def build_drafter(target, cfg: TrainConfig, layer_ids: list[int]) -> DFlashDrafter:
    """A drafter shaped like the target's layers (its hidden size is the target's by design)."""
    ta = target.args
    shape = dict(
        hidden_size=ta.hidden_size, intermediate_size=cfg.intermediate_size or ta.intermediate_size,
        num_layers=cfg.num_layers, num_heads=ta.num_heads, num_kv_heads=ta.num_kv_heads, head_dim=ta.head_dim,
        rms_norm_eps=ta.rms_norm_eps, block_size=cfg.block_size, target_layer_ids=list(layer_ids),
        mask_token_id=resolve_mask_token(target, cfg.mask_token_id), num_target_layers=target.num_layers,
        vocab_size=target.vocab_size, rope=dict(ta.rope), layer_types=["full_attention"] * cfg.num_layers,
    )
    if cfg.selector:
        args = DFlash2Args(**shape, selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
                           conv_kernel_size=cfg.conv_kernel_size,
                           conv_group_size=cfg.conv_group_size or min(32, ta.hidden_size))
        args.check()
    else:
        args = DFlashArgs(**shape)
    with torch.device("cpu"):
        drafter = (DFlash2Drafter(args) if cfg.selector else DFlashDrafter(args)).float()
    init_drafter_weights(drafter, seed=cfg.seed)
    if cfg.init_from_target:
        copy_target_layers(drafter, target)
    return drafter


def copy_target_layers(drafter: DFlashDrafter, target) -> None:
    """Start draft layer i from target layer N - L + i (same shapes): a warm start for small data."""
    n, k = target.num_layers, len(drafter.layers)
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            src = dict(target.layers[n - k + i].state_dict())
            for name, p in layer.state_dict().items():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name].float())


def lr_factor(step: int, total: int, warmup: float, min_ratio: float) -> float:
    """Linear warmup over `warmup` of the steps, then cosine down to min_ratio."""
    w = max(1, int(round(warmup * total)))
    if step < w:
        return (step + 1) / w
    progress = min(1.0, (step - w) / max(1, total - w))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class Run:
    """What a training run starts from (open_run)."""

    dd: Dist
    device: torch.device
    out: Path
    dataset: FeatureShards | SequenceRows
    target: nn.Module  # frozen


def open_run(cfg) -> Run:
    """Threads, ranks, the output directory, the data (feature shards, or sequences whose
    features the target computes batch by batch) and the frozen target, for a drafter's or an
    MTP head's training config."""
    from flashtree.config import DEMO_TARGET
    from flashtree.models.loader import load_target, parse_dtype

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dd, device = init_distributed(torch.device(cfg.device) if cfg.device else None)
    if (cfg.data is None) == (cfg.sequences is None):
        raise FlashtreeError("give exactly one of --data (feature shards) or --sequences (online mode)")
    out = Path(cfg.out)
    if dd.main:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target_path = cfg.target
    if cfg.data is not None:
        dataset = FeatureShards(cfg.data)
        target_path = target_path or dataset.manifest["target"]
    else:
        dataset = SequenceRows(cfg.sequences, cfg.max_len)
    if len(dataset) == 0:
        raise FlashtreeError("no training sequences")
    target = load_target(target_path or DEMO_TARGET, parse_dtype(cfg.dtype, device), device)
    for p in target.parameters():
        p.requires_grad_(False)
    return Run(dd, device, out, dataset, target)


def adamw(module: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norms and biases are not decayed)."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def resumable(path: Path, cfg, device: torch.device) -> dict | None:
    """The checkpoint to continue from, if there is one and resuming is on; refused when it was
    trained with settings that change what the run computes."""
    if not cfg.resume or not path.is_file():
        return None
    ck = torch.load(path, map_location=device, weights_only=False)
    changed = changed_settings(ck.get("config", {}), asdict(cfg))
    if changed:
        raise FlashtreeError(f"{path} was trained with other settings ({'; '.join(changed)}); rerun with "
                             "the same ones to resume, or start over with a fresh --out or --no-resume")
    return ck


def checkpoint_due(cfg, step: int, total: int | None, start_step: int, checkpoint) -> bool:
    """Checkpoint every save_every steps and at the end; True when a stop_after run stops here
    (after its checkpoint: tests simulate a kill this way)."""
    stop = cfg.stop_after is not None and step - start_step >= cfg.stop_after and step < total
    if stop or step % cfg.save_every == 0 or step == total:
        checkpoint()
    return stop


def write_summary(cfg, out: Path, step: int, seconds: float, loader: Loader, rows: list[dict], title: str,
                  **extra) -> dict:
    """The run's summary (train_args.json) and its loss curve (default OUT/loss.png)."""
    last = rows[-1] if rows else {}
    summary = {"steps": step, "train_seconds": round(seconds, 1), "sequences": len(loader.dataset),
               "epochs": round(loader.epochs_done, 3), "world_size": loader.dd.world, **extra,
               "final_loss": last.get("loss"), "final_tau_estimate": last.get("tau_estimate"),
               "torch": torch.__version__, "python": sys.version.split()[0], "config": asdict(cfg)}
    (out / "train_args.json").write_text(json.dumps(summary, indent=2) + "\n")
    if rows:
        plot_loss(rows, Path(cfg.plot) if cfg.plot else out / "loss.png", title)
    return summary


def calibrated_steps(step: int, elapsed: float, budget_s: float, dd: Dist) -> int:
    """A --minutes run's step count, from its first 10 steps' pace (every rank stops at rank 0's)."""
    total = max(step + 1, int(budget_s / (elapsed / 10)))
    if dd.world > 1:
        t = torch.tensor([total])
        dist.broadcast(t, 0)
        total = int(t)
    if dd.main:
        print(f"calibrated: {elapsed / 10:.2f}s/step -> {total} steps", flush=True)
    return total


def export(drafter: DFlashDrafter, out: Path, dtype: str) -> None:
    """Write the z-lab drafter dir (config.json + model.safetensors) in `dtype`."""
    from flashtree.models.loader import parse_dtype

    d = parse_dtype(dtype, torch.device("cpu"))
    copy = type(drafter)(drafter.args)
    copy.load_state_dict(drafter.state_dict())
    save_drafter(copy.to(d), out)


# ---------------------------------------------------------------------------- training


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) a drafter into `cfg.out`; returns the run summary (rank 0)."""
    run = open_run(cfg)
    dd, device, out, dataset, target = run.dd, run.device, run.out, run.dataset, run.target
    if cfg.data is None:
        layer_ids = cfg.layer_ids or default_target_layer_ids(target.num_layers, cfg.num_layers)
    else:
        layer_ids = dataset.layer_ids
        if cfg.layer_ids and list(cfg.layer_ids) != layer_ids:
            raise FlashtreeError(f"the shards hold features of layers {layer_ids}, not {cfg.layer_ids}")

    drafter = build_drafter(target, cfg, layer_ids).to(device)
    model = BlockDrafter(drafter, cfg.backend)
    ddp = model
    if dd.world > 1:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = adamw(drafter, cfg)
    loader = Loader(dataset, cfg.batch_size, dd, cfg.seed)
    per_step = cfg.batch_size * cfg.grad_accum * dd.world
    total = cfg.steps or (math.ceil(cfg.epochs * len(dataset) / per_step) if cfg.epochs else None)
    if total is None and not cfg.minutes:
        total = math.ceil(len(dataset) / per_step)  # one epoch
    weights = slot_weights(cfg.block_size, cfg.gamma).to(device)
    step, log_rows = 0, []

    ckpt_path = out / "checkpoint.pt"
    ck = resumable(ckpt_path, cfg, device)
    if ck is not None:
        if ck["args"] != asdict(drafter.args):
            raise FlashtreeError(f"{ckpt_path} is for another drafter shape; use a fresh --out or --no-resume")
        drafter.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["optim"])
        loader.load(ck["loader"])
        step, total, log_rows = ck["step"], ck["total"], ck.get("log", [])
        if total is not None and step >= total:
            if dd.main:
                print(f"{ckpt_path} already holds all {total} steps; nothing to train", flush=True)
            summary = out / "train_args.json"
            return json.loads(summary.read_text()) if summary.is_file() else {"steps": step}
        if dd.main:
            print(f"resumed from {ckpt_path} at step {step}/{total}", flush=True)

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    t0, seen_tokens, window = time.perf_counter(), 0, []
    budget_s = cfg.minutes * 60 if total is None else None
    start_step = step

    def checkpoint() -> None:
        if not dd.main:
            return
        save_atomic({"step": step, "total": total, "drafter": drafter.state_dict(), "optim": opt.state_dict(),
                     "loader": loader.state(), "args": asdict(drafter.args), "config": asdict(cfg), "log": log_rows},
                    ckpt_path)
        export(drafter, out, cfg.save_dtype)
        write_log(out / "train_log.csv", log_rows)

    if dd.main and (total is None or step < total):
        print(LOG_LEGEND + ("; DFlash2: loss = unary CE + selector CE, tau~ of the selector's chain"
                            if cfg.selector else ""), flush=True)
    while total is None or step < total:
        # Before a --minutes run is calibrated (10 steps), stay low in the warmup.
        lr = cfg.lr * (lr_factor(step, total, cfg.warmup, cfg.min_lr_ratio) if total else (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr
        # loss sum, micro-batches, labels, blocks, accept, 1/accept, unary loss sum, selector loss sum
        stats = torch.zeros(8, dtype=torch.float64)
        for micro in range(cfg.grad_accum):
            rows = loader.next()
            gen = torch.Generator().manual_seed(hash((cfg.seed, step, micro, dd.rank)) & 0x7FFFFFFF)
            batch = make_batch(rows, cfg.max_anchors, gen)
            if batch.features is None:  # online: run the target for this batch
                feats = target_features(target, [r.input_ids.tolist() for r in rows], layer_ids, device)
                batch.features = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
            batch = batch.to(device)
            labels = block_labels(batch, cfg.block_size)
            tokens = block_tokens(batch.input_ids, batch.anchors, cfg.block_size, drafter.args.mask_token_id)
            prev = block_prev_tokens(batch.input_ids, batch.anchors, cfg.block_size) if cfg.selector else None
            sync = ddp.no_sync() if dd.world > 1 and micro < cfg.grad_accum - 1 else nullcontext()
            with sync, autocast:
                noise = target.embed_tokens(tokens).float()
                hidden = ddp(batch.features, noise, batch.anchors)
                res = block_loss(hidden, labels, target.lm_head, weights, drafter, prev)
                (res.loss / cfg.grad_accum).backward()
            stats += torch.tensor([res.loss.item(), 1, res.tokens, res.blocks, res.accept_sum, res.inv_accept_sum,
                                   res.unary_loss, res.selector_loss], dtype=torch.float64)
            seen_tokens += res.tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if dd.world > 1:
            dist.all_reduce(stats)
        elapsed = time.perf_counter() - t0
        window.append(stats)
        if total is None and step - start_step == 10:
            total = calibrated_steps(step, elapsed, budget_s, dd)
        if step % cfg.log_every == 0 or step == total:
            w = torch.stack(window).sum(0)
            row = {"step": step, "lr": lr, "loss": float(w[0] / w[1]), "accept_mean": float(w[4] / w[3].clamp(min=1)),
                   "tau_estimate": float(w[3] / w[5].clamp(min=1e-9)),
                   "grad_norm": float(grad_norm), "epoch": round(loader.epochs_done, 3),
                   "labels_per_s": seen_tokens * dd.world / max(elapsed, 1e-9), "elapsed_s": elapsed}
            if cfg.selector:
                row |= {"unary_loss": float(w[6] / w[1]), "selector_loss": float(w[7] / w[1])}
            log_rows.append(row)
            window = []
            if dd.main:
                print(f"step {step}/{total} loss {row['loss']:.4f} tau~{row['tau_estimate']:.2f} lr {lr:.2e} "
                      f"|g| {row['grad_norm']:.2f} ep {row['epoch']:.2f} {row['labels_per_s']:.0f} labels/s "
                      f"{elapsed:.0f}s", flush=True)
        if checkpoint_due(cfg, step, total, start_step, checkpoint):
            return {"steps": step, "stopped": True}
    summary = {}
    if dd.main:
        checkpoint()
        summary = write_summary(cfg, out, step, time.perf_counter() - t0, loader, log_rows, "DFlash drafter training",
                                layer_ids=layer_ids)
    if dd.world > 1:
        dist.barrier()
    return summary


LOG_LEGEND = ("log: loss = slot-weighted cross-entropy of the steps since the last line; tau~ = teacher-forced "
              "chain acceptance (1 + leading run of top-1 hits per block, harmonic mean over blocks: tokens per "
              "round, an optimistic preview of `train eval`)")


def changed_settings(old: dict, new: dict) -> list[str]:
    """'name: old -> new' for every setting that changes what the run computes (see RESUMABLE)."""
    keys = sorted((set(old) | set(new)) - set(RESUMABLE))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def write_log(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def plot_loss(rows: list[dict], png: Path, title: str = "DFlash drafter training") -> None:
    """Loss and the in-training chain-acceptance estimate, per logged step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], lw=1, color="C0", label="weighted CE")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("slot-weighted cross-entropy (log)", color="C0")
    ax.set_yscale("log")  # the first steps start far above the rest
    ax2 = ax.twinx()
    ax2.plot(steps, [r["tau_estimate"] for r in rows], lw=1, color="C1", label="train tau estimate")
    ax2.set_ylabel("tau estimate (teacher-forced, harmonic)", color="C1")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
