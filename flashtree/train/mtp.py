"""Train an MTP head for a target (`flashtree train train --mtp`), from the same extracted features
the DFlash recipes use.

Entry t of a sequence reads [norm(embed(x[t+1])); norm(h[t])], where h[t] is the target's final
hidden state (its last block's output, which the features hold, through the target's own final
norm), and predicts x[t+2]. With `depth` > 1 the head is trained the way it drafts: step s
(s = 2..depth) reads the head's own step s-1 output at the same entry and the token x[t+s], sits
at position t+s-1, and predicts x[t+s+1]. It attends to step 1's K/V of entries 0..t (the true
context the engine's head cache holds) and to its own chain's earlier steps at entry t (the
draft rows the engine writes after it), as flashtree/engine/mtp_draft.py runs it. Labels are
response tokens only. The embedding and LM head are the target's, frozen. AdamW, warmup then
cosine, gradient clipping, resumable checkpoints; the output directory is a head that
`flashtree.LLM(method="mtp", mtp_head=...)` loads.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.mask import additive
from flashtree.models.mtp import MTPHead, build_head, save_head
from flashtree.train.features import target_features
from flashtree.train.trainer import Loader, RunConfig, adamw, calibrated_steps, checkpoint_due, lr_factor, open_run, \
    resumable, save_atomic, write_log, write_summary


@dataclass
class MTPTrainConfig(RunConfig):
    """An MTP head's run; `out` is a head directory (config.json + model.safetensors)."""

    depth: int = 3  # recursive steps trained (the head drafts num_speculative_tokens of them)
    step_decay: float = 0.8  # step s weighs step_decay ** (s - 1): a later step counts only if earlier ones hit


class StepKV:
    """The K/V a recursive step attends, kept as a list so autograd sees every step's own tensors
    (the engine's cache buffer would be overwritten in place between steps)."""

    def __init__(self) -> None:
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def write(self, layer: int, ctx: ForwardContext, k: Tensor, v: Tensor) -> None:
        self.k.append(k)
        self.v.append(v)

    def read(self, layer: int, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        return torch.cat(self.k, 1).transpose(1, 2), torch.cat(self.v, 1).transpose(1, 2)


def step_mask(n: int, step: int, device: torch.device) -> Tensor:
    """[n, step * n]: entry t of step `step` sees step 1's entries 0..t and, of every later step
    so far (itself included), entry t alone."""
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * (step - 1)
    return torch.cat(blocks, dim=1)


def step_context(kv: StepKV, n: int, step: int, rows: int, device: torch.device, dtype: torch.dtype
                 ) -> ForwardContext:
    """Step `step` over entries 0..n-1 of `rows` sequences: positions t + step - 1."""
    pos = (torch.arange(n, device=device) + step - 1).expand(rows, n)
    mask = step_mask(n, step, device)[None, None].expand(rows, 1, n, step * n)
    return ForwardContext(kv, None, positions=pos, rows=pos, parents=pos - 1, depths=pos, key_len=step * n,
                          attn_bias=additive(mask, dtype), is_chain=False)


def step_inputs(ids: Tensor, loss_mask: Tensor, step: int, depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per entry t (t = 0..T-2) of step `step`: the token it reads (x[t+step]), its label
    (x[t+step+1]) and whether the label counts (a response token inside the sequence)."""
    n = ids.shape[1] - 1
    ids_p, mask_p = F.pad(ids, (0, depth + 1)), F.pad(loss_mask, (0, depth + 1))
    return ids_p[:, step : step + n], ids_p[:, step + 1 : step + 1 + n], mask_p[:, step + 1 : step + 1 + n]


def step_outputs(head: MTPHead, embed, ids: Tensor, hidden: Tensor, depth: int) -> list[Tensor]:
    """The head's output [B, T-1, d] at every entry for steps 1..depth (see the module docstring):
    step 1 reads the target's hidden states, each later step the previous step's output."""
    rows, n = ids.shape[0], ids.shape[1] - 1
    ids_p = F.pad(ids, (0, depth + 1))
    kv, prev, outs = StepKV(), hidden[:, :n], []
    for s in range(1, depth + 1):
        with torch.no_grad():
            embeds = embed(ids_p[:, s : s + n])  # x[t+s], as step_inputs gives it
        prev = head(embeds, prev, step_context(kv, n, s, rows, ids.device, hidden.dtype))
        outs.append(prev)
    return outs


@dataclass
class StepStats:
    loss: Tensor  # the weighted loss to minimise
    labels: list[int]  # per step: labelled entries
    hits: list[int]  # per step: top-1 hits
    ce: list[float]  # per step: summed cross-entropy
    runs: float  # summed leading runs of hits over step 1's labelled entries
    entries: int  # step 1's labelled entries


def head_loss(head: MTPHead, embed, lm_head, ids: Tensor, loss_mask: Tensor, hidden: Tensor, depth: int,
              decay: float) -> StepStats:
    """Recursive next-next-token loss on a padded batch: ids/loss_mask [B, T], hidden [B, T, d] (the
    target's normed final hidden states); step s weighs decay ** (s - 1)."""
    outs = step_outputs(head, embed, ids, hidden, depth)
    alive = torch.ones(outs[0].shape[:2], dtype=torch.bool, device=ids.device)  # every earlier step hit
    runs = torch.zeros(outs[0].shape[:2], device=ids.device)
    loss = hidden.new_zeros(())
    labels, hits, ces = [], [], []
    for s, out in enumerate(outs, start=1):
        _, target_ids, valid = step_inputs(ids, loss_mask, s, depth)
        logits = lm_head(out[valid]).float()
        ce = F.cross_entropy(logits, target_ids[valid], reduction="sum")
        count = int(valid.sum())
        if count:
            loss = loss + decay ** (s - 1) * ce / count
        hit = torch.zeros_like(valid)
        hit[valid] = logits.argmax(-1) == target_ids[valid]
        first = valid if s == 1 else first
        alive = alive & hit
        runs = runs + (alive & first).float()
        labels.append(count)
        hits.append(int(hit.sum()))
        ces.append(float(ce.detach()))
    weight_sum = sum(decay ** (s - 1) for s in range(1, depth + 1))
    return StepStats(loss / weight_sum, labels, hits, ces, float(runs.sum()), int(first.sum()))


def pad_rows(rows: list, hidden: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """FeatureRows (and their hidden states) -> ids, loss_mask [B, T] and hidden [B, T, d], right-padded."""
    t = max(len(r.input_ids) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    h = hidden[0].new_zeros(len(rows), t, hidden[0].shape[-1])
    for i, (r, x) in enumerate(zip(rows, hidden)):
        k = len(r.input_ids)
        ids[i, :k], mask[i, :k], h[i, :k] = r.input_ids, r.loss_mask, x
    return ids, mask, h


def init_head(head: MTPHead, target, from_target: bool, seed: int, std: float = 0.02) -> None:
    """HF-style init (normal matrices, output projections scaled down, norms as built), or the
    target's last layer where shapes agree."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                scale = std / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * scale)
        if from_target:
            src = target.layers[-1].state_dict()
            for name, p in head.layers[0].state_dict().items():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name].float())


def final_hidden(target, features: Tensor, feature_ids: list[int]) -> Tensor:
    """The target's normed final hidden states from stored features (the last layer's slice)."""
    last = target.num_layers - 1
    if last not in feature_ids:
        raise FlashtreeError(f"the features hold target layers {feature_ids}; an MTP head reads the last one "
                             f"({last}): extract with --layer-ids including {last}")
    d = target.args.hidden_size
    i = feature_ids.index(last)
    with torch.no_grad():
        return target.norm(features[..., i * d : (i + 1) * d].to(target.embed_tokens.weight.dtype)).float()


def train_mtp(cfg: MTPTrainConfig) -> dict:
    """Train (or resume) an MTP head into `cfg.out`; returns the run summary (rank 0)."""
    from flashtree.models.loader import read_config, text_config

    if cfg.depth < 1:
        raise FlashtreeError(f"--mtp-depth must be >= 1, got {cfg.depth}")
    run = open_run(cfg)
    dd, device, out, dataset, target = run.dd, run.device, run.out, run.dataset, run.target
    feature_ids = dataset.layer_ids if cfg.data is not None else [target.num_layers - 1]

    with torch.device("cpu"):
        head = build_head(text_config(read_config(target.source_dir)), cfg.intermediate_size).float()
    init_head(head, target, cfg.init_from_target, cfg.seed)
    head.to(device).train()
    opt = adamw(head, cfg)
    loader = Loader(dataset, cfg.batch_size, dd, cfg.seed)
    per_step = cfg.batch_size * dd.world
    total = cfg.steps or (None if cfg.minutes else math.ceil(len(dataset) / per_step))
    step, log_rows = 0, []
    ckpt_path = out / "checkpoint.pt"
    ck = resumable(ckpt_path, cfg, device)
    if ck is not None:
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optim"])
        loader.load(ck["loader"])
        step, total, log_rows = ck["step"], ck["total"], ck.get("log", [])
        if dd.main:
            print(f"resumed from {ckpt_path} at step {step}/{total}", flush=True)

    def checkpoint() -> None:
        if not dd.main:
            return
        save_atomic({"step": step, "total": total, "head": head.state_dict(), "optim": opt.state_dict(),
                     "loader": loader.state(), "config": asdict(cfg), "log": log_rows}, ckpt_path)
        export(head, out, target.source_dir, cfg.save_dtype)
        write_log(out / "train_log.csv", log_rows)

    t0, cpu0, window, start_step = time.perf_counter(), time.process_time(), [], step
    budget_s = cfg.minutes * 60 if total is None else None
    if dd.main and (total is None or step < total):
        print(LOG_LEGEND, flush=True)
    while total is None or step < total:
        lr = cfg.lr * (lr_factor(step, total, cfg.warmup, 0.0) if total else (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = loader.next()
        if cfg.data is not None:
            hidden = [final_hidden(target, r.features.to(device), feature_ids) for r in rows]
        else:
            feats = target_features(target, [r.input_ids.tolist() for r in rows], feature_ids, device)
            hidden = [final_hidden(target, f, feature_ids) for f in feats]
        ids, mask, h = (x.to(device) for x in pad_rows(rows, hidden))
        res = head_loss(head, target.embed_tokens, target.lm_head, ids, mask, h, cfg.depth, cfg.step_decay)
        res.loss.backward()
        if dd.world > 1:
            for p in head.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dd.world
        grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        window.append(torch.tensor([float(res.loss.detach()), res.runs, res.entries, *res.labels, *res.hits, *res.ce],
                                   dtype=torch.float64))
        elapsed = time.perf_counter() - t0
        if total is None and step - start_step == 10:
            total = calibrated_steps(step, elapsed, budget_s, dd)
        if step % cfg.log_every == 0 or step == total:
            w = torch.stack(window)
            if dd.world > 1:
                dist.all_reduce(w)
            row = log_row(step, lr, w, cfg.depth, float(grad_norm), loader.epochs_done, elapsed, len(window) * dd.world)
            log_rows.append(row)
            window = []
            if dd.main:
                acc = " ".join(f"{row[f'acc{s}']:.3f}" for s in range(1, cfg.depth + 1))
                print(f"step {step}/{total} loss {row['loss']:.4f} acc {acc} tau~{row['tau_estimate']:.2f} "
                      f"lr {lr:.2e} |g| {row['grad_norm']:.2f} ep {row['epoch']:.2f} {elapsed:.0f}s", flush=True)
        if checkpoint_due(cfg, step, total, start_step, checkpoint):
            return {"steps": step, "stopped": True}
    summary = {}
    if dd.main:
        checkpoint()
        last = log_rows[-1] if log_rows else {}
        summary = write_summary(cfg, out, step, time.perf_counter() - t0, loader, log_rows, "MTP head training",
                                cpu_seconds=round(time.process_time() - cpu0, 1),
                                final_step_accuracy=[last.get(f"acc{s}") for s in range(1, cfg.depth + 1)])
    if dd.world > 1:
        dist.barrier()
    return summary


LOG_LEGEND = ("log: loss = step-weighted cross-entropy since the last line; acc = top-1 accuracy per recursive step "
              "(own hidden states, true tokens); tau~ = 1 + mean leading run of hits (tokens per round if every "
              "drafted token were checked against the labels)")


def log_row(step: int, lr: float, w: Tensor, depth: int, grad_norm: float, epoch: float, elapsed: float,
            batches: int) -> dict:
    """One train_log.csv row from the summed window [loss, runs, entries, labels.., hits.., ce..]."""
    s = w.sum(0)
    labels, hits, ce = s[3 : 3 + depth], s[3 + depth : 3 + 2 * depth], s[3 + 2 * depth :]
    row = {"step": step, "lr": lr, "loss": float(s[0] / batches),
           "tau_estimate": float(1 + s[1] / s[2].clamp(min=1)), "grad_norm": grad_norm, "epoch": round(epoch, 3),
           "elapsed_s": elapsed}
    for k in range(depth):
        row[f"acc{k + 1}"] = float(hits[k] / labels[k].clamp(min=1))
        row[f"ce{k + 1}"] = float(ce[k] / labels[k].clamp(min=1))
    return row


def export(head: MTPHead, out: Path, target_dir: Path, dtype: str) -> None:
    """Write the head directory in `dtype` (a copy: training continues in float32)."""
    from flashtree.models.loader import parse_dtype

    copy = MTPHead(head.args, head.hybrid)
    copy.load_state_dict(head.state_dict())
    save_head(copy.to(parse_dtype(dtype, torch.device("cpu"))), out, target_dir)
