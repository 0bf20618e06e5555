"""Peak host memory and time of loading a 4-shard checkpoint on the CPU, old loader vs new.

    OMP_NUM_THREADS=1 python benchmarks/load_memory.py                  # ~1 GB float32, 4 shards
    OMP_NUM_THREADS=1 python benchmarks/load_memory.py --size-mb 1024 --dtype bfloat16 --passes 2

Writes a random Qwen3-shaped checkpoint (config.json, 4 safetensors shards and their index,
written shard by shard with safetensors directly), then loads it with `load_target` in a fresh
subprocess per run: the new loader from this tree, and the old one from git revision --old-rev
(its whole `flashtree` package, extracted with `git archive`). A child resets its peak RSS
after its imports (/proc/self/clear_refs), then reports the peak (VmHWM, which is ru_maxrss of
this process alone: ru_maxrss also counts the parent's RSS at fork) minus the RSS at that
point, and the wall time of the load (Linux only). The loaders
alternate over --passes passes; the table gives each pass and the RSS as a multiple of the
checkpoint's size. The checkpoint is loaded in its own dtype (no conversion).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "adc07cc"  # the last commit with the read-everything-then-copy loader

CHILD = r"""
import json, sys, time
import torch
import transformers  # the engine imports it for the tokenizer anyway: not the loader's cost
from transformers import AutoConfig, GenerationConfig
from flashtree.models.loader import load_target

def hwm():  # this process's peak RSS in bytes (VmHWM; ru_maxrss also counts a parent's RSS at fork)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024

torch.set_num_threads(1)
with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current RSS
    f.write("5")
base = hwm()
t0 = time.perf_counter()
model = load_target(sys.argv[1], getattr(torch, sys.argv[2]), torch.device("cpu"))
seconds = time.perf_counter() - t0
print(json.dumps({"rss_delta_bytes": hwm() - base, "seconds": seconds,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def qwen3_shape(size_bytes: int, element_size: int) -> dict:
    """A Qwen3 config whose weights take about size_bytes: widths by size, the layer count scaled."""
    d, vocab = (1024, 32000) if size_bytes >= 512e6 else (256, 8000)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=vocab, hidden_size=d,
               intermediate_size=3 * d, num_attention_heads=d // 64, num_key_value_heads=d // 128, head_dim=64,
               rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False,
               max_position_embeddings=4096, attention_bias=False, eos_token_id=2, bos_token_id=1)
    i, hd = cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * i + 2 * d + 2 * hd
    fixed = 2 * vocab * d + d
    cfg["num_hidden_layers"] = max(1, round((size_bytes / element_size - fixed) / per_layer))
    return cfg


def layer_tensors(cfg: dict, layer: int) -> dict[str, tuple[int, ...]]:
    d, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = f"model.layers.{layer}."
    return {p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d), p + "mlp.down_proj.weight": (d, i),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}


def write_checkpoint(out: Path, size_mb: float, dtype: torch.dtype = torch.float32, shards: int = 4,
                     seed: int = 0) -> int:
    """A random Qwen3-shaped checkpoint of about size_mb MB in `shards` files; returns its bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    element = torch.empty((), dtype=dtype).element_size()
    cfg = qwen3_shape(int(size_mb * 1e6), element)
    names = {"model.embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"])}
    for layer in range(cfg["num_hidden_layers"]):
        names.update(layer_tensors(cfg, layer))
    names.update({"model.norm.weight": (cfg["hidden_size"],), "lm_head.weight": (cfg["vocab_size"], cfg["hidden_size"])})
    sizes = {name: torch.Size(shape).numel() * element for name, shape in names.items()}
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name in names:  # in order, each tensor to the shard its middle byte falls in
        groups[min(shards - 1, int((done + sizes[name] / 2) * shards / total))].append(name)
        done += sizes[name]
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        shard = {}
        for name in group:
            shape = names[name]
            t = torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape)
            shard[name] = t.to(dtype)
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


def old_package(rev: str, into: Path) -> Path:
    """The `flashtree` package as of git revision `rev`, extracted under `into`."""
    archive = into / "old.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev, "flashtree"], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "old", filter="data")
    return into / "old"


def measure(checkpoint: Path, dtype: torch.dtype, package_root: Path = ROOT) -> dict:
    """Load `checkpoint` in a fresh process with the flashtree package under package_root."""
    env = {**os.environ, "PYTHONPATH": str(package_root), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), str(dtype).removeprefix("torch.")],
                         env=env, capture_output=True, text=True, cwd=package_root)
    if run.returncode != 0:
        raise RuntimeError(f"loader child failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--old-rev", default=OLD_REV)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = a.dir or tmp / "ckpt"
        t0 = time.perf_counter()
        size = write_checkpoint(ckpt, a.size_mb, dtype, a.shards)
        files = sorted(ckpt.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e6:.0f} MB ({a.dtype}) in {len(files)} shards, written in "
              f"{time.perf_counter() - t0:.1f} s; CPU, 1 thread")
        roots = {"old": old_package(a.old_rev, tmp), "new": ROOT}
        print(f"{'pass':>4} {'loader':>6} {'peak RSS delta MB':>18} {'x size':>7} {'load s':>7}")
        for p in range(a.passes):
            for name, root in roots.items():
                r = measure(ckpt, dtype, root)
                print(f"{p:4d} {name:>6} {r['rss_delta_bytes'] / 1e6:18.0f} {r['rss_delta_bytes'] / size:7.2f} "
                      f"{r['seconds']:7.2f}", flush=True)


if __name__ == "__main__":
    main()
