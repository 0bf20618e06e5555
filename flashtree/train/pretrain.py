"""Pretrain the small Qwen3 demo target on the stdlib corpus (CPU, minutes).

Plain next-token training on packed documents, plus ~20% ChatML rows
("Continue this Python code:" -> continuation) so the chat endpoint answers
sensibly. The result is saved in the standard HF Qwen3 layout so every code
path that loads hub checkpoints also loads the demo target.

Reproduce the shipped target (CPython 3.11, torch CPU, one thread):
    python -m flashtree.train.pretrain --out flashtree/assets/demo/target \
        --steps 900 --threads 1 --seed 0 \
        --plot docs/figures/demo_target_loss.png
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CHAT_INSTRUCTION = "Continue this Python code:\n"
CALIBRATION_STEPS = 30  # timed steps before a --minutes budget is turned into a step count


@dataclass
class TrainConfig:
    """Hyper-parameters; `steps` wins over `minutes` when both are given."""

    out: str
    minutes: float | None = 35.0
    steps: int | None = None
    threads: int = 1
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_fraction: float = 0.2
    log_every: int = 10
    eval_every: int = 100
    eval_rows: int = 32
    plot: str | None = None
    files: list[str] | None = field(default=None, repr=False)  # corpus subset (tests)


def model_config(vocab_size: int = 4096):
    """The demo target architecture (~5.7M parameters, embeddings tied)."""
    from transformers import Qwen3Config

    from flashtree.train.tokenizer import EOS, SPECIAL_TOKENS

    eos = SPECIAL_TOKENS.index(EOS)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


# --------------------------------------------------------------------------- data


class RowSampler:
    """Seeded stream of training rows (seq_len token ids each).

    Plain rows walk an EOS-joined stream of shuffled documents (reshuffled per
    epoch) so every token is seen once per epoch; chat rows pack ChatML
    continuation examples cut from random documents.
    """

    def __init__(self, tok, texts: list[str], seq_len: int, chat_fraction: float, seed: int):
        from flashtree.train.tokenizer import EOS, IM_END, IM_START

        self.tok, self.texts, self.seq_len, self.chat_fraction = tok, texts, seq_len, chat_fraction
        self.rng = random.Random(seed)
        self.eos, self.im_start, self.im_end = (tok.token_to_id(t) for t in (EOS, IM_START, IM_END))
        self.docs = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        self.n_tokens = sum(len(d) + 1 for d in self.docs)
        self.epoch, self.stream, self.pos = 0, [], 0
        self._newline, self._assistant = self._enc("\n"), self._enc("assistant\n")

    def _enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _next_epoch(self) -> None:
        order = list(range(len(self.docs)))
        self.rng.shuffle(order)
        self.stream = [t for i in order for t in (*self.docs[i], self.eos)]
        self.pos, self.epoch = 0, self.epoch + 1

    def plain_row(self) -> list[int]:
        if self.pos + self.seq_len > len(self.stream):
            self._next_epoch()
        row = self.stream[self.pos : self.pos + self.seq_len]
        self.pos += self.seq_len
        return row

    def _chat_example(self) -> list[int]:
        """One ChatML turn, tokenised exactly as the chat template plus generation would."""
        lines = self.rng.choice(self.texts).splitlines(keepends=True)
        start = self.rng.randrange(max(1, len(lines) - 8))
        want_prefix, want_cont = self.rng.randint(100, 400), self.rng.randint(60, 300)
        end, prefix = start, ""
        while end < len(lines) and len(prefix) < want_prefix:
            prefix, end = prefix + lines[end], end + 1
        cont = ""
        while end < len(lines) and len(cont) < want_cont:
            cont, end = cont + lines[end], end + 1
        if self.rng.random() < 0.5 and " " in prefix.rstrip():  # also teach mid-line prompts
            cut = prefix.rstrip().rfind(" ")
            prefix, cont = prefix[:cut], prefix[cut:] + cont
        user = self._enc("user\n" + CHAT_INSTRUCTION + prefix)
        return (
            [self.im_start, *user, self.im_end, *self._newline, self.im_start, *self._assistant]
            + self._enc(cont)
            + [self.im_end, self.eos]
        )

    def chat_row(self) -> list[int]:
        row: list[int] = []
        while len(row) < self.seq_len:
            row += self._chat_example()
        return row[: self.seq_len]

    def batch(self, batch_size: int) -> torch.Tensor:
        rows = [self.chat_row() if self.rng.random() < self.chat_fraction else self.plain_row() for _ in range(batch_size)]
        return torch.tensor(rows, dtype=torch.long)


def heldout_rows(tok, texts: list[str], seq_len: int, n_rows: int, eos: int) -> torch.Tensor:
    """Fixed validation rows from the held-out files (path order, EOS-joined)."""
    stream: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream += [*enc.ids, eos]
    n = min(n_rows, len(stream) // seq_len)
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


# --------------------------------------------------------------------------- training


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no decay on norms and the (tied) embedding, as is usual for small LMs."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(input_ids=rows[i : i + batch_size], labels=rows[i : i + batch_size]).loss.item() for i in range(0, len(rows), batch_size)]
    model.train()
    return sum(losses) / max(1, len(losses))


def plot_loss(csv_path: Path, png_path: Path) -> None:
    """Loss curve for the docs (train loss per logged step, held-out loss points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [float(r["train_loss"]) for r in rows], lw=1, label="train")
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    if val:
        ax.plot(*zip(*val), "o-", ms=3, label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("flashtree demo target (Qwen3, 5.7M params) on CPython stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def save_target(model, tok_dir: Path, out: Path) -> None:
    """HF layout as on the hub: top-level rope_theta and torch_dtype in config.json."""
    from transformers import GenerationConfig

    from flashtree.train.tokenizer import EOS, IM_END, SPECIAL_TOKENS

    eos, im_end = SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=[eos, im_end], pad_token_id=eos)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["rope_theta"] = float(model.config.rope_parameters["rope_theta"])
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    if tok_dir.resolve() != out.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (out / name).write_bytes((tok_dir / name).read_bytes())


def pretrain(cfg: TrainConfig, tok_dir: str | Path) -> dict:
    """Train the target on the corpus train split and save it to `cfg.out`."""
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    from flashtree.train.corpus import heldout_documents, train_documents

    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.steps is None and cfg.warmup_steps < CALIBRATION_STEPS:
        raise ValueError("warmup must cover the calibration steps for a budgeted run to be replayable")
    out, tok_dir = Path(cfg.out), Path(tok_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))

    texts = [d.text for d in train_documents(files=cfg.files)]
    sampler = RowSampler(tok, texts, cfg.seq_len, cfg.chat_fraction, cfg.seed)
    val = heldout_rows(tok, [d.text for d in heldout_documents(files=cfg.files)], cfg.seq_len, cfg.eval_rows, sampler.eos)
    print(f"train: {len(texts)} files, {sampler.n_tokens} tokens; held-out rows: {len(val)}", flush=True)

    model = Qwen3ForCausalLM(model_config(tok.get_vocab_size()))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = _optimizer(model, cfg)
    total = cfg.steps or 10**9
    budget_s = None if cfg.steps else (cfg.minutes or 0) * 60
    log_path = out / "train_log.csv"
    log = open(log_path, "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "lr", "train_loss", "val_loss", "tokens", "elapsed_s", "tokens_per_s"])

    t0, step, tokens, window = time.perf_counter(), 0, 0, []
    train_s = 0.0  # time in optimisation steps only (excludes eval), for tokens/s
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        batch = sampler.batch(cfg.batch_size)
        ts = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        train_s += time.perf_counter() - ts
        step, tokens = step + 1, tokens + batch.numel()
        window.append(loss.item())
        elapsed = time.perf_counter() - t0
        if budget_s is not None and step == CALIBRATION_STEPS:
            # Fix the schedule length once from measured speed. The steps before this are
            # still in warmup (lr independent of `total`), so `--steps <total>` replays the run.
            total = max(step + 1, int(budget_s / (elapsed / step)))
            print(f"calibrated: {elapsed / step:.3f}s/step -> {total} steps", flush=True)
        last = step == total or (budget_s is not None and elapsed > 1.5 * budget_s)  # CPU contention guard
        if step % cfg.log_every == 0 or last:
            val_loss = evaluate(model, val, cfg.batch_size) if (step % cfg.eval_every == 0 or last) and len(val) else None
            tps = tokens / train_s
            writer.writerow([step, f"{lr_at(step - 1, total, cfg):.6g}", f"{sum(window) / len(window):.4f}",
                             "" if val_loss is None else f"{val_loss:.4f}", tokens, f"{elapsed:.1f}", f"{tps:.0f}"])
            log.flush()
            print(f"step {step}/{total if total < 10**9 else '?'} loss {sum(window) / len(window):.4f}"
                  + ("" if val_loss is None else f" val {val_loss:.4f}") + f" {tps:.0f} tok/s {elapsed:.0f}s", flush=True)
            window = []
        if last:
            break
    log.close()

    save_target(model, tok_dir, out)
    final_val = evaluate(model, val, cfg.batch_size) if len(val) else float("nan")
    summary = {
        "steps": step, "tokens": tokens, "train_seconds": round(time.perf_counter() - t0, 1),
        "tokens_per_s": round(tokens / train_s), "final_val_loss": round(final_val, 4),
        "params": n_params, "epochs": round(tokens / sampler.n_tokens, 2), "python": sys.version.split()[0],
        "torch": torch.__version__, "config": {k: v for k, v in asdict(cfg).items() if k != "files"},
    }
    (out / "train_args.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(log_path, Path(cfg.plot) if cfg.plot else out / "loss.png")
    return summary


def build_demo_target(
    out_dir: str | Path, minutes: float | None = 35.0, threads: int = 1, seed: int = 0, **overrides
) -> dict:
    """Corpus -> tokenizer -> pretrain, end to end; returns the training summary."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # tokenizers' thread pool
    from flashtree.train.tokenizer import build_tokenizer

    out = Path(out_dir)
    build_tokenizer(out, files=overrides.get("files"))
    cfg = TrainConfig(out=str(out), minutes=minutes, threads=threads, seed=seed, **overrides)
    return pretrain(cfg, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build the flashtree demo target (tokenizer + Qwen3) on CPU.")
    p.add_argument("--out", required=True, help="output directory (HF model folder)")
    p.add_argument("--minutes", type=float, default=35.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=None, help="exact number of steps (overrides --minutes)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--plot", default=None, help="loss-curve PNG path (default OUT/loss.png)")
    a = p.parse_args(argv)
    summary = build_demo_target(a.out, a.minutes, a.threads, a.seed, steps=a.steps,
                                batch_size=a.batch_size, lr=a.lr, plot=a.plot)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


if __name__ == "__main__":
    main()
