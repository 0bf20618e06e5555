"""The attention paths a forward may take give what the fully masked one gives (float64, within
1e-10): no mask for a one-token window over exactly its keys, an in-place view of consecutive
slots, and the gathered, always-masked path a captured round takes."""

from __future__ import annotations

import dataclasses

import torch

from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.models.loader import load_target
from flashtree.models.mask import additive, causal_window_mask
from flashtree.tree import chain_spec
from tests.tiny import make_target

CPU = torch.device("cpu")


def filled(tmp_path, slots: int = 4):
    """A float64 target and a cache whose slots hold prompts of different lengths."""
    model = load_target(make_target(tmp_path / "t", vocab=32, layers=2), torch.float64, CPU)
    cache = model.new_cache(slots, 64)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for slot, n in enumerate((9, 13, 9, 20)[:slots]):
            ctx = ForwardContext.prefill(cache, [slot], n)
            model(torch.randint(0, 32, (1, n), generator=gen), ctx)
            cache.commit(ctx, [n])
    return model, cache


def logits(model, ctx: ForwardContext, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, ctx).logits


def masked(ctx: ForwardContext) -> ForwardContext:
    """The same window with its full causal bias, whatever path the context chose."""
    bias = additive(causal_window_mask(ctx.starts, ctx.num_nodes, ctx.key_len), ctx.cache.dtype)
    return dataclasses.replace(ctx, attn_bias=bias)


def test_a_one_token_window_over_exact_keys_needs_no_mask(tmp_path):
    model, cache = filled(tmp_path)
    tokens = torch.tensor([[5]])
    ctx = ForwardContext.verify(cache, [1], chain_spec(tokens))
    assert ctx.attn_bias is None  # the flash-eligible path
    ref = logits(model, masked(ctx), tokens)
    torch.testing.assert_close(logits(model, ctx, tokens), ref, rtol=0, atol=1e-10)


def test_consecutive_slots_read_in_place_as_gathered_slots_do(tmp_path):
    """Slots 1 and 2 (a view of the cache) against the same slots read by the captured path's
    gather, which also keeps its mask with equal starts."""
    model, cache = filled(tmp_path)
    tokens = torch.tensor([[3], [7]])
    view = ForwardContext.verify(cache, [1, 2], chain_spec(tokens), key_len=24)
    assert view.batch.first == 1
    batch = SlotBatch.captured(view.slots.clone(), view.starts.clone())
    gathered = ForwardContext.verify(cache, batch, chain_spec(tokens), key_len=24)
    torch.testing.assert_close(logits(model, view, tokens), logits(model, gathered, tokens), rtol=0, atol=1e-10)


def test_padded_keys_are_masked_away(tmp_path):
    """A window attending a key bucket longer than its slots hold equals the exact one."""
    model, cache = filled(tmp_path)
    tokens = torch.tensor([[2], [4]])
    exact = ForwardContext.verify(cache, [0, 3], chain_spec(tokens))
    padded = ForwardContext.verify(cache, [0, 3], chain_spec(tokens), key_len=48)
    torch.testing.assert_close(logits(model, exact, tokens), logits(model, padded, tokens), rtol=0, atol=1e-10)


def test_a_causal_window_over_exact_keys_needs_no_mask_tensor(tmp_path, monkeypatch):
    """A chain after a prefix, all rows at one length with exactly their keys: the lower-right
    CausalBias (flash-eligible on CUDA; forced here on the CPU, which keeps its bias) gives the
    masked path's logits; a window from position 0 takes SDPA's own causal mask on every device."""
    import flashtree.models.mask as mask

    model, cache = filled(tmp_path)
    tokens = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    ctx = ForwardContext.verify(cache, [0, 2], chain_spec(tokens))  # both slots hold 9 tokens
    assert torch.is_tensor(ctx.attn_bias) and ctx.attn_bias.dtype == torch.float64  # the CPU keeps its bias
    monkeypatch.setattr(mask, "lower_right_flash", lambda device: True)
    ctx = ForwardContext.verify(cache, [0, 2], chain_spec(tokens))
    assert type(ctx.attn_bias).__name__ == "CausalBias"
    torch.testing.assert_close(logits(model, ctx, tokens), logits(model, masked(ctx), tokens), rtol=0, atol=1e-10)

    fresh = model.new_cache(1, 64)
    prompt = torch.tensor([[2, 7, 1, 8, 2, 8]])
    first = ForwardContext.prefill(fresh, [0], 6)
    assert first.attn_bias is None and first.causal
    ref = dataclasses.replace(masked(first), causal=False)
    torch.testing.assert_close(logits(model, first, prompt), logits(model, ref, prompt), rtol=0, atol=1e-10)
