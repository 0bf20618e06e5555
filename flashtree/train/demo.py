"""`flashtree train demo`: rebuild the embedded demo pair from nothing but the stdlib.

corpus -> tokenizer -> target (flashtree.train.pretrain), then the drafter pipeline on that
target: prompts cut from the corpus TRAIN split (the bench prompts come from held-out files)
-> the target's own greedy responses -> features -> DFlash training -> tau on the bench
prompts -> the drafter in flashtree/assets/demo/drafter and its loss curve in docs/figures.
With `mtp`, the same prompts, responses and features train the demo target's MTP head instead
(flashtree/assets/demo/mtp).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashtree.config import DEMO_DRAFTER, DEMO_MTP, DEMO_TARGET

REPO = Path(__file__).resolve().parents[2]


@dataclass
class DemoConfig:
    work: str = "runs/demo"  # intermediate files (prompts, responses, features, checkpoints)
    target: str = str(DEMO_TARGET)
    drafter_out: str = str(DEMO_DRAFTER)
    plot: str = str(REPO / "docs" / "figures" / "demo_drafter_loss.png")
    build_target: bool = True  # False: reuse the target already at `target`
    target_minutes: float = 35.0
    prompts: int = 5000
    prose_fraction: float = 0.45
    max_tokens: int = 128
    regen_method: str = "ar"  # the first drafter cannot draft for its own data
    regen_drafter: str | None = None
    regen_budget: int = 64
    # a mix: prompt n at temperatures[n % k]; sampled text teaches the drafter T > 0 too
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    block_size: int = 16
    num_layers: int = 2
    layer_ids: list[int] = field(default_factory=lambda: [1, 3, 5])
    max_anchors: int = 512
    batch_size: int = 4
    lr: float = 6e-4
    train_steps: int | None = 1200  # ~40 min on one uncontended CPU thread
    train_minutes: float | None = None  # used when train_steps is None
    save_dtype: str = "bfloat16"  # keeps target + drafter under 30 MB
    selector: bool = True  # a DFlash2 drafter (convolutions + candidate selector); False: DFlash-1
    selector_rank: int = 32
    selector_top_k: int = 16
    conv_kernel_size: int = 4
    threads: int = 1
    seed: int = 0
    eval_limit: int | None = None
    # mtp: train the demo target's MTP head (one Qwen3 layer + fc and norms) on the same data instead.
    mtp: bool = False
    mtp_out: str = str(DEMO_MTP)
    mtp_steps: int = 2300  # batch 8, 3 recursive steps: ~0.8 s of CPU a step, the DFlash-1 drafter's ~35 min
    mtp_batch_size: int = 8
    mtp_depth: int = 3


def training_prompts(n: int, prose_fraction: float, seed: int) -> list[dict]:
    """Code and prose prompts cut the same way as the bench suites, but from TRAIN files.

    Same cutting rules -> the drafter trains on the kind of continuation it is measured on;
    different files -> the measurement stays held out.
    """
    from flashtree.train import corpus

    code, prose = [], []
    for doc in corpus.train_documents():
        # The suite cutters are corpus.py's own; reusing them keeps train and bench prompts alike.
        code += [(doc.path, p) for p in dict.fromkeys(corpus._code_prompts(doc))]
        prose += [(doc.path, p) for p in dict.fromkeys(corpus._prose_prompts(doc))]
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    n_prose = min(len(prose), int(round(n * prose_fraction)))
    rows = [{"id": f"prose-{i:05d}", "prompt": p, "source": path} for i, (path, p) in enumerate(prose[:n_prose])]
    rows += [{"id": f"code-{i:05d}", "prompt": p, "source": path} for i, (path, p) in enumerate(code[: n - n_prose])]
    return rows  # ids are stable per kind: a larger n keeps every smaller run's ids (regenerate resumes)


def build_demo(cfg: DemoConfig) -> dict:
    """Run every stage; each one resumes, so a rerun after a crash continues where it stopped."""
    import torch

    from flashtree.train.tau import EvalConfig, evaluate, table
    from flashtree.train.features import ExtractConfig, extract
    from flashtree.train.responses import RegenerateConfig, regenerate
    from flashtree.train.trainer import TrainConfig, train

    torch.set_num_threads(cfg.threads)
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    if cfg.build_target:
        from flashtree.train.pretrain import build_demo_target

        print("== target", flush=True)
        build_demo_target(cfg.target, minutes=cfg.target_minutes, threads=cfg.threads, seed=cfg.seed,
                          plot=str(REPO / "docs" / "figures" / "demo_target_loss.png"))

    print("== prompts", flush=True)
    prompts = work / "prompts.jsonl"
    if not prompts.is_file():
        rows = training_prompts(cfg.prompts, cfg.prose_fraction, cfg.seed)
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    print("== regenerate", flush=True)
    responses = work / "responses.jsonl"
    regenerate(RegenerateConfig(prompts=str(prompts), out=str(responses), target=cfg.target,
                                drafter=cfg.regen_drafter, method=cfg.regen_method, budget=cfg.regen_budget,
                                max_tokens=cfg.max_tokens, temperature=list(cfg.temperatures), chunk=128,
                                max_batch=32, dtype="float32"))

    print("== extract", flush=True)
    features = work / "features"
    extract(ExtractConfig(data=str(responses), out=str(features), target=cfg.target, layer_ids=cfg.layer_ids,
                          shard_size=256, batch_size=16, store_dtype="float32", dtype="float32"))

    if cfg.mtp:
        return build_mtp_head(cfg, features)

    print("== train", flush=True)
    run = work / "drafter"
    summary = train(TrainConfig(out=str(run), data=str(features), target=cfg.target, block_size=cfg.block_size,
                                num_layers=cfg.num_layers, max_anchors=cfg.max_anchors, batch_size=cfg.batch_size,
                                lr=cfg.lr, steps=cfg.train_steps, minutes=cfg.train_minutes, seed=cfg.seed,
                                threads=cfg.threads, save_dtype=cfg.save_dtype, plot=cfg.plot, dtype="float32",
                                selector=cfg.selector, selector_rank=cfg.selector_rank,
                                selector_top_k=cfg.selector_top_k, conv_kernel_size=cfg.conv_kernel_size))

    out = Path(cfg.drafter_out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run / name, out / name)
    recipe = {"demo": {k: v for k, v in asdict(cfg).items() if k not in ("work", "target", "drafter_out", "plot")},
              "train": {k: summary.get(k) for k in ("steps", "train_seconds", "epochs", "final_loss",
                                                   "final_tau_estimate", "torch", "python")}}

    print("== eval", flush=True)
    results = evaluate(EvalConfig(target=cfg.target, drafter=str(out), limit=cfg.eval_limit,
                                  max_tokens=cfg.max_tokens, dtype="float32"))
    recipe["tau"] = results
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    print(table(results), flush=True)
    return recipe


def build_mtp_head(cfg: DemoConfig, features: Path) -> dict:
    """Train the demo target's MTP head on the extracted features, ship it with its recipe, and
    measure its tau at k = 1, 3, 5 on the bench prompts."""
    from flashtree.train.mtp import MTPTrainConfig, train_mtp
    from flashtree.train.tau import EvalConfig, evaluate, table

    print("== train mtp head", flush=True)
    run = Path(cfg.work) / "mtp"
    summary = train_mtp(MTPTrainConfig(out=str(run), data=str(features), target=cfg.target, depth=cfg.mtp_depth,
                                       batch_size=cfg.mtp_batch_size, steps=cfg.mtp_steps, lr=cfg.lr, seed=cfg.seed,
                                       threads=cfg.threads, save_dtype=cfg.save_dtype, dtype="float32",
                                       plot=str(REPO / "docs" / "figures" / "demo_mtp_loss.png")))
    out = Path(cfg.mtp_out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run / name, out / name)
    print("== eval", flush=True)
    results = evaluate(EvalConfig(target=cfg.target, methods=["mtp"], num_speculative_tokens=[1, 3, 5],
                                  mtp_head=str(out), limit=cfg.eval_limit, max_tokens=cfg.max_tokens, dtype="float32"))
    recipe = {"demo": {k: v for k, v in asdict(cfg).items() if k not in ("work", "target", "drafter_out", "plot",
                                                                          "mtp_out")},
              "train": {k: summary.get(k) for k in ("steps", "train_seconds", "cpu_seconds", "epochs", "final_loss",
                                                   "final_tau_estimate", "final_step_accuracy", "torch", "python")},
              "tau": results}
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    print(table(results), flush=True)
    return recipe
