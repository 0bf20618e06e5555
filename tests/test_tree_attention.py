"""Tree verification as a mask-free prefix part plus a masked tree part merged by log-sum-exp
(flashtree/models/tree_attention.py) gives what one SDPA over [prefix ++ window] with the tree's
full additive mask gives: within 1e-10 in float64 for equal and unequal starts, start 0, captured
rounds (starts known only as tensors), GQA and random trees; and greedy DDTree with the path
forced on emits AR's tokens, eager and captured, on a dense and a hybrid target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtree.models.tree_attention as tree_attention
from flashtree import LLM, SamplingParams
from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.models.loader import load_target
from flashtree.models.mask import additive, tree_window_mask
from flashtree.models.tree_attention import _math, tree_parts
from flashtree.tree import TreeSpec, ancestor_mask
from tests.test_captured import pairs  # noqa: F401 (the dense and hybrid pairs' fixture)
from tests.tiny import make_target

CPU = torch.device("cpu")
F64 = torch.float64


def random_spec(rows: int, n: int, gen: torch.Generator) -> TreeSpec:
    """Random trees in topological order: each node's parent drawn among the nodes before it."""
    parents = torch.full((rows, n), -1, dtype=torch.long)
    depths = torch.zeros(rows, n, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (rows,), generator=gen)
        depths[:, i] = depths.gather(1, parents[:, i : i + 1])[:, 0] + 1
    tokens = torch.randint(0, 16, (rows, n), generator=gen)
    return TreeSpec(tokens, parents, depths, torch.full((rows,), n))


def both_paths(starts: list[int], n: int, heads: int, kv_heads: int, captured: bool = False, pad: int = 0,
               seed: int = 0, attend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, reference) outputs for queries of an n-node random tree per row over cache-laid K/V
    whose window keys sit at rows start..start+n-1; `pad` extra key rows as a key bucket adds."""
    gen = torch.Generator().manual_seed(seed)
    r, d = len(starts), 8
    st = torch.tensor(starts)
    key_len = max(starts) + n + pad
    anc = ancestor_mask(random_spec(r, n, gen))
    k_cache = torch.randn(r, key_len, kv_heads, d, generator=gen, dtype=F64)
    v_cache = torch.randn(r, key_len, kv_heads, d, generator=gen, dtype=F64)
    keys, values = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    rows = st[:, None] + torch.arange(n)
    k_win = k_cache[torch.arange(r)[:, None], rows].transpose(1, 2)
    v_win = v_cache[torch.arange(r)[:, None], rows].transpose(1, 2)
    q = torch.randn(r, n, heads, d, generator=gen, dtype=F64).transpose(1, 2)  # strided, as layers pass it
    bias = additive(tree_window_mask(st, anc, key_len), F64)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=d**-0.5, enable_gqa=heads != kv_heads)
    parts = tree_parts(st, [] if captured else starts, anc, key_len, F64)
    p = parts.prefix_len
    fn = tree_attention.tree_attention
    if attend is not None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tree_attention, "_attend", attend)
            return fn(q, k_win, v_win, keys[:, :, :p], values[:, :, :p], parts, d**-0.5), ref
    return fn(q, k_win, v_win, keys[:, :, :p], values[:, :, :p], parts, d**-0.5), ref


@pytest.mark.parametrize("starts", [[9], [9, 9, 9], [0], [0, 0], [5, 17], [0, 11, 3], [13, 0]])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_lse_merge_equals_one_masked_sdpa(starts, heads, kv_heads):
    """Equal starts (mask-free prefix), unequal starts (key padding mask), rows with no prefix
    (their prefix weight is exactly 0, never NaN), MHA, GQA and MQA: float64 within 1e-10."""
    for n, seed in ((1, 0), (7, 1), (24, 2)):
        new, ref = both_paths(starts, n, heads, kv_heads, seed=seed)
        assert not new.isnan().any()
        torch.testing.assert_close(new, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("starts", [[9, 9], [0, 0], [5, 17, 0]])
def test_a_captured_round_attends_its_key_bucket_through_the_padding_mask(starts):
    """Starts known only as tensors: the prefix part spans key_len - n rows (window and padding
    rows included, all masked away) and still equals the masked SDPA."""
    new, ref = both_paths(starts, 6, 4, 2, captured=True, pad=10)
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-10)


def test_the_softmax_by_hand_equals_the_kernels():
    """_math, the fallback for a device or dtype with no LSE kernel, gives the same merge."""
    new, ref = both_paths([4, 12, 0], 9, 4, 2, attend=_math)
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-10)


def test_the_prefix_is_mask_free_when_rows_share_a_start():
    """One shared start: no prefix bias; different starts: a [R, 1, 1, P] padding bias and -inf
    LSE for a row with no prefix; every row at 0: no prefix part at all."""
    anc = torch.ones(2, 3, 3, dtype=torch.bool).tril()
    shared = tree_parts(torch.tensor([7, 7]), [7, 7], anc, 10, F64)
    assert shared.prefix_len == 7 and shared.prefix_bias is None and shared.prefix_lse_bias is None
    mixed = tree_parts(torch.tensor([0, 7]), [0, 7], anc, 10, F64)
    assert mixed.prefix_len == 7 and mixed.prefix_bias.shape == (2, 1, 1, 7)
    assert mixed.prefix_lse_bias.flatten().tolist() == [float("-inf"), 0.0]
    assert tree_parts(torch.tensor([0, 0]), [0, 0], anc, 3, F64).prefix_len == 0


def test_a_target_forward_takes_the_path_where_the_rule_says(tmp_path, monkeypatch):
    """A float64 target's tree verify: the CPU rule leaves short prefixes on the one-bias path;
    forced on, the LSE path gives the same logits for slots at different lengths."""
    model = load_target(make_target(tmp_path / "t", vocab=32, layers=2), F64, CPU)
    cache = model.new_cache(3, 64)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for slot, n in enumerate((9, 20, 9)):
            ctx = ForwardContext.prefill(cache, [slot], n)
            model(torch.randint(0, 32, (1, n), generator=gen), ctx)
            cache.commit(ctx, [n])
        spec = random_spec(3, 11, gen)
        old = ForwardContext.verify(cache, [0, 1, 2], spec)
        assert old.tree_parts is None and torch.is_tensor(old.attn_bias)
        monkeypatch.setattr(tree_attention, "CPU_MIN_PREFIX", 0)
        new = ForwardContext.verify(cache, [0, 1, 2], spec)
        assert new.tree_parts is not None and new.attn_bias is None
        captured = ForwardContext.verify(cache, SlotBatch.captured(new.slots.clone(), new.starts.clone()), spec,
                                         key_len=48)
        assert captured.tree_parts.prefix_len == 48 - 11
        ref = model(spec.tokens, old).logits
        torch.testing.assert_close(model(spec.tokens, new).logits, ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(model(spec.tokens, captured).logits, ref, rtol=0, atol=1e-10)


PROMPTS = [[1, 2, 3], [4], list(range(1, 15)) * 2, [7, 7, 7, 7, 7, 7, 9]]


def generate(pair, method: str, budget: int, captured: bool = False) -> list[list[int]]:
    target, drafter = pair
    llm = LLM(target, None if method == "ar" else drafter, method=method, budget=budget, device="cpu",
              max_batch=3, max_model_len=192, capture=captured)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("captured", [False, True])
def test_greedy_ddtree_on_the_lse_path_matches_ar(pairs, kind, captured, monkeypatch):
    """Four prompts through three slots (unequal starts, slots freed and reused), every tree
    verify forced onto the LSE path: DDTree's tokens are AR's, eager and in captured rounds."""
    ref = generate(pairs[kind], "ar", 1)
    calls = []
    real = tree_attention.tree_attention
    monkeypatch.setattr(tree_attention, "CPU_MIN_PREFIX", 0)
    monkeypatch.setattr("flashtree.models.layers.tree_attention", lambda *a: calls.append(1) or real(*a))
    assert generate(pairs[kind], "ddtree", 16, captured) == ref
    assert calls  # the trees went through the LSE path


def test_the_kernel_check_admits_a_build_whose_kernels_agree_and_refuses_one_that_fails(monkeypatch, capsys):
    """check_kernels runs the LSE path once against one masked SDPA: kernels that agree pass; a
    kernel this PyTorch build lacks (a RuntimeError) keeps the one-bias path, said in one line."""
    monkeypatch.setattr(tree_attention, "_checked", {})
    assert tree_attention.check_kernels(torch.device("cpu"), F64)

    def missing(*args, **kwargs):
        raise RuntimeError("no kernel image is available\nsecond line")

    monkeypatch.setattr(tree_attention, "_attend", missing)
    assert not tree_attention.check_kernels(torch.device("cpu"), torch.float32)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keeps one masked SDPA" in err[0] and "no kernel image" in err[0]
    assert not tree_attention.lse_path(torch.device("meta"), 4096, torch.float32)  # never checked: the bias path
