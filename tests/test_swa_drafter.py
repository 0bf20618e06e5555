"""Sliding-window DFlash drafters: explicit reference, and a bounded context cache that drafts the same."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from flashtree.cache import KVCache, SlidingDraftCache
from flashtree.models.context import ForwardContext
from flashtree.models.dflash import DFlashDrafter, load_drafter
from flashtree.models.loader import load_target
from tests.tiny import make_drafter, make_target

CPU = torch.device("cpu")
WINDOW, BLOCK = 8, 6


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """Rotate-half RoPE in float64, written out: pair (i, i + d/2) turns by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    ang = pos.double()[:, None] * theta ** (-2 * i / d)
    a, b = x[:, : d // 2], x[:, d // 2:]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)


def reference_logits(drafter_dir, target_dir, features, block):
    """Draft logits from the checkpoint files alone, one head at a time with explicit softmax.

    features [n, F] are the committed context at positions 0..n-1; the block sits at n..n+L-1.
    A sliding layer's query at q sees context key p iff q - p < window; the block is always seen.
    """
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    tw = {k: v.double() for k, v in load_file(str(target_dir / "model.safetensors")).items()}
    H, Hkv, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    n, L = features.shape[0], block.shape[0]
    ctx = rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = tw["model.embed_tokens.weight"][block]
    ctx_pos, blk_pos = torch.arange(n), torch.arange(n, n + L)
    for layer, kind in enumerate(cfg["layer_types"]):
        p = lambda name: w[f"layers.{layer}.{name}"]  # noqa: E731
        h = rms(x, p("input_layernorm.weight"))
        heads = []
        for head in range(H):
            g = head // (H // Hkv)
            qw = p("self_attn.q_proj.weight")[head * hd:(head + 1) * hd]
            kw = p("self_attn.k_proj.weight")[g * hd:(g + 1) * hd]
            vw = p("self_attn.v_proj.weight")[g * hd:(g + 1) * hd]
            q = rope(rms(h @ qw.T, p("self_attn.q_norm.weight")), blk_pos, theta)
            k = torch.cat([rope(rms(ctx @ kw.T, p("self_attn.k_norm.weight")), ctx_pos, theta),
                           rope(rms(h @ kw.T, p("self_attn.k_norm.weight")), blk_pos, theta)])
            v = torch.cat([ctx @ vw.T, h @ vw.T])
            out = torch.zeros(L, hd, dtype=torch.float64)
            for i in range(L):
                seen = list(range(n, n + L))  # the block (indices into k/v)
                for j in range(n):
                    if kind != "sliding_attention" or blk_pos[i] - ctx_pos[j] < cfg["sliding_window"]:
                        seen.append(j)
                scores = torch.stack([q[i] @ k[j] / math.sqrt(hd) for j in seen])
                out[i] = (torch.softmax(scores, 0)[:, None] * v[seen]).sum(0)
            heads.append(out)
        x = x + torch.cat(heads, -1) @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        x = x + (torch.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) \
            @ p("mlp.down_proj.weight").T
    return rms(x, w["norm.weight"])[1:] @ tw["lm_head.weight"].T


def unbounded_cache(drafter: DFlashDrafter, slots: int, max_len: int) -> KVCache:
    """The cache full-attention drafters use: every context position kept for every layer."""
    a, p = drafter.args, drafter.fc.weight
    return KVCache(a.num_layers, slots, max_len, a.num_kv_heads, a.head_dim, p.dtype, p.device)


def append(drafter: DFlashDrafter, cache: KVCache, slots: list[int], feats: torch.Tensor, counts: list[int]) -> None:
    """What the runner does with a round's accepted features: write them all, keep counts[r] per slot."""
    ctx = ForwardContext.block(cache, slots, feats.shape[1])
    drafter.add_context(ctx, feats)
    cache.commit(ctx, counts)


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["sliding_attention"] * 2])
def test_sliding_drafter_matches_reference_and_bounded_cache(tmp_path, layer_types):
    """Two slots go through a long prefill (longer than the ring) then rounds that append a block with
    padding past the accepted count, as the runner does. At every round the ring cache drafts exactly
    what the unbounded cache drafts, and both match the explicit reference."""
    target_dir = make_target(tmp_path / "t", layers=4)
    drafter_dir = make_drafter(tmp_path / "d", target_layers=4, block_size=BLOCK, layer_types=layer_types,
                               sliding_window=WINDOW)
    target = load_target(target_dir, torch.float64, CPU)
    drafter = load_drafter(drafter_dir, target, torch.float64, CPU)
    bounded, full = drafter.new_cache(3, 256), unbounded_cache(drafter, 3, 256)
    assert isinstance(bounded, SlidingDraftCache) and bounded.ring_len == WINDOW + BLOCK
    if all(t == "sliding_attention" for t in layer_types):
        assert bounded.k.numel() == 0  # nothing in this drafter's cache grows with the context

    gen = torch.Generator().manual_seed(0)
    F = 2 * 32
    slots = [2, 0]
    committed = {s: torch.zeros(0, F, dtype=torch.float64) for s in slots}
    with torch.no_grad():
        for slot, n in zip(slots, (23, 5)):  # 23 > ring length 14: the prefill wraps the ring
            feats = torch.randn(1, n, F, generator=gen, dtype=torch.float64)
            for cache in (bounded, full):
                cache.set_length(slot, 0)
                append(drafter, cache, [slot], feats, [n])
            committed[slot] = feats[0]
        for rnd in range(8):
            block = torch.full((2, BLOCK), drafter.args.mask_token_id)
            block[:, 0] = torch.randint(0, 60, (2,), generator=gen)
            noise = target.embed_tokens(block)
            hb = drafter(noise, ForwardContext.block(bounded, slots, BLOCK))
            hf = drafter(noise, ForwardContext.block(full, slots, BLOCK))
            assert (hb - hf).abs().max() < 1e-10
            logits = target.lm_head(hb[:, 1:])
            for r, slot in enumerate(slots):
                ref = reference_logits(drafter_dir, target_dir, committed[slot], block[r])
                assert (logits[r] - ref).abs().max() < 1e-5, (rnd, slot)  # RoPE angles are float32 in ours
            # Commit: a block-wide write whose tail past each row's count is padding (junk features).
            counts = [int(c) for c in torch.randint(1, BLOCK + 1, (2,), generator=gen)]
            feats = torch.randn(2, BLOCK, F, generator=gen, dtype=torch.float64)
            for cache in (bounded, full):
                append(drafter, cache, slots, feats, counts)
            for r, slot in enumerate(slots):
                committed[slot] = torch.cat([committed[slot], feats[r, :counts[r]]])
    assert min(len(c) for c in committed.values()) > WINDOW + BLOCK  # both slots wrapped the ring


def test_full_attention_drafters_keep_the_plain_cache(tmp_path):
    target_dir = make_target(tmp_path / "t", layers=4)
    drafter = load_drafter(make_drafter(tmp_path / "d", target_layers=4), load_target(target_dir, torch.float32, CPU),
                           torch.float32, CPU)
    assert type(drafter.new_cache(2, 64)) is KVCache
    # A window no shorter than the cache bounds nothing, so the plain cache (masked by window) is used.
    swa = make_drafter(tmp_path / "s", target_layers=4, layer_types=["sliding_attention"] * 2, sliding_window=64)
    assert type(load_drafter(swa, load_target(target_dir, torch.float32, CPU), torch.float32, CPU)
                .new_cache(2, 64)) is KVCache


def test_engine_with_sliding_drafter_is_lossless_and_matches_unbounded(tmp_path, monkeypatch):
    """Greedy dflash/ddtree with a sliding drafter emit the AR tokens, and the bounded ring drafts the
    same trees as an unbounded cache (identical acceptance per round)."""
    from flashtree import LLM, SamplingParams

    target = str(make_target(tmp_path / "t", layers=4, logit_scale=4.0))
    drafter = str(make_drafter(tmp_path / "d", target_layers=4, block_size=BLOCK,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW))
    prompts = [[3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6], [26, 43, 3, 8], [10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(target=target, drafter=drafter, dtype="float32", device="cpu", max_batch=3, max_model_len=96)
    ar = [o.token_ids for o in LLM(method="ar", **common).generate(prompts, params)]
    runs = {}
    for method, budget in (("dflash", 8), ("ddtree", 16)):
        llm = LLM(method=method, budget=budget, **common)
        assert isinstance(llm.engine.runner.draft_cache, SlidingDraftCache)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == ar, method
        runs[method] = [o.stats.accept_lengths for o in outs]
    assert max(max(a) for a in runs["ddtree"]) > 1  # drafts were accepted, so the ring's contents mattered

    monkeypatch.setattr(DFlashDrafter, "new_cache", lambda self, slots, max_len: unbounded_cache(self, slots, max_len))
    for method, budget in (("dflash", 8), ("ddtree", 16)):
        outs = LLM(method=method, budget=budget, **common).generate(prompts, params)
        assert [o.stats.accept_lengths for o in outs] == runs[method], method


@pytest.mark.slow
def test_compiled_sliding_drafter_drafts_what_the_eager_one_drafts(tmp_path):
    """compile=True on the CPU compiles the sliding drafter's layers (its ring read inside the opaque
    attention op): every round accepts what the eager engine's round accepts, AR's tokens."""
    from flashtree import LLM, SamplingParams

    target = str(make_target(tmp_path / "t", layers=4, logit_scale=4.0))
    drafter = str(make_drafter(tmp_path / "d", target_layers=4, block_size=BLOCK,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW))
    prompts = [[3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6], [26, 43, 3, 8], [10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(target=target, drafter=drafter, method="ddtree", budget=16, dtype="float32", device="cpu",
                  max_batch=3, max_model_len=96)
    eager = LLM(**common).generate(prompts, params)
    llm = LLM(compile=True, **common)
    assert llm.engine.runner.drafter.compiled is not None
    assert isinstance(llm.engine.runner.draft_cache, SlidingDraftCache)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert [o.stats.accept_lengths for o in outs] == [o.stats.accept_lengths for o in eager]
