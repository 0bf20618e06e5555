"""The kernels a layer launches per eager bf16 AR step stay within budget, counted as CUDA would
launch them (flashtree.bench.kernels: views free, F.rms_norm one kernel), so the lean layer cannot
silently erode. Budgets: a dense decoder layer at most 20 (gpt-fast needs about 16); the hybrid
target's layers and the drafter's at most half of what they took before the lean rewrite (GDN
104, gated attention 68, DFlash2 drafter layer 99).

Also: F.rms_norm is bit-exact with the float32/float64 reference norm, and within bf16 rounding
of HF's half-precision order; the three-kernel RoPE equals rotate-half RoPE.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashtree import EngineConfig, LLMEngine, SamplingParams
from flashtree.bench.kernels import count_layer_ops
from flashtree.models.layers import RMSNorm, Rotary, apply_rotary, rope_parameters
from tests.test_qwen3_5 import make_qwen35

DENSE_BUDGET = 20
HALVED = {"gdn": 104 // 2, "attn": 68 // 2, "drafter": 99 // 2}


def ar_step_ops(config: EngineConfig, modules) -> dict:
    """Kernel ops per watched module in one eager AR (or drafting) round after a short warm-up, with
    the CPU's packed products off: the count is CUDA's, which never packs."""
    engine = LLMEngine(replace(config, pack_weights=False))
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=32, ignore_eos=True))
    for _ in range(3):
        engine.step()
    ops = count_layer_ops(engine.step, modules(engine))
    return {label: sum(c.values()) for label, c in ops.items()}


def test_a_dense_layer_launches_at_most_20_kernels_per_ar_step():
    """The demo Qwen3 target in bf16: every decoder layer of an AR step within DENSE_BUDGET."""
    counts = ar_step_ops(EngineConfig(method="ar", dtype="bfloat16"),
                         lambda e: {f"layer{i}": b for i, b in enumerate(e.target.layers)})
    assert max(counts.values()) <= DENSE_BUDGET, counts


def test_the_drafter_layers_launch_at_most_half_their_old_kernels():
    """The demo DFlash2 drafter's layers in a chain round, bf16."""
    counts = ar_step_ops(EngineConfig(method="dflash", dtype="bfloat16"),
                         lambda e: {f"draft{i}": b for i, b in enumerate(e.drafter.layers)})
    assert max(counts.values()) <= HALVED["drafter"], counts


def test_hybrid_layers_launch_at_most_half_their_old_kernels(tmp_path):
    """A tiny Qwen3.5 target (GDN + gated attention) in bf16, AR step."""
    target, _ = make_qwen35(tmp_path / "hybrid", logit_scale=3.0)
    counts = ar_step_ops(EngineConfig(target=str(target), method="ar", dtype="bfloat16"),
                         lambda e: {f"{'gdn' if b.linear else 'attn'}{i}": b for i, b in enumerate(e.target.layers)})
    kinds = {label.rstrip("0123456789") for label in counts}
    assert kinds == {"gdn", "attn"}  # both layer kinds were counted
    for label, n in counts.items():
        assert n <= HALVED[label.rstrip("0123456789")], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_is_bit_exact_with_the_reference_in_full_precision(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 64, dtype=dtype)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x), ref)


def test_rms_norm_in_bf16_is_within_rounding_of_hfs_order():
    """HF normalises in float32, rounds, then scales in bf16; the fused norm scales before rounding:
    at most one bf16 ulp or so apart."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    xf = x.float()
    hf = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(norm(x).float(), hf.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_rope_in_three_kernels_equals_rotate_half(partial):
    """Full and partial RoPE (Qwen3.5 rotates a quarter of each head) against the textbook form."""
    hd = 16
    params = rope_parameters({"rope_theta": 10000.0, "partial_rotary_factor": partial})
    rotary = Rotary(hd, params)
    positions = torch.tensor([[0, 3, 7], [5, 5, 9]])
    x = torch.randn(2, 3, 4, hd, dtype=torch.float64)
    rot = int(hd * partial)
    inv = rotary._inv_freq.double()
    freqs = positions.double()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)[:, :, None]
    xr, xp = x[..., :rot], x[..., rot:]
    half = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], -1)
    ref = torch.cat([xr * emb.cos() + half * emb.sin(), xp], -1)
    got = apply_rotary(x, rotary(positions, torch.float64))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # frequencies are float32, as HF's
