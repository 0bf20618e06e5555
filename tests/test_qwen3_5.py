"""Qwen3.5 hybrid targets: HF parity, tree verification through Gated DeltaNet, lossless decoding."""

from __future__ import annotations

import copy

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.loader import load_target
from flashtree.tree import TreeSpec, chain_spec
from tests.tiny import make_drafter

CPU = torch.device("cpu")
# Float32 against HF's float32 reference: the fused kernels (norms, projections) round differently,
# and four random layers of recurrence amplify it: 0.5-1.5e-4 on logits of magnitude ~7 on one CPU;
# on an AVX-512 EPYC HF's own float32 logits sat 2.6e-4 from its float64 ones, ours 5.4e-4, and up
# to 1.9e-3 from HF's float32 after 80 tokens.
HF_TOL = 3e-3
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6)


def randomize(model, seed: int, logit_scale: float = 1.0) -> None:
    """Weights big enough that every path matters (HF's init leaves norms and gates trivial)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
            if name.endswith("lm_head.weight"):
                p.mul_(logit_scale)


def make_qwen35(out, seed: int = 0, logit_scale: float = 1.0, moe: bool = False, fast_decay: bool = False,
                **overrides):
    """Save a tiny random HF Qwen3.5 (or Qwen3.5-MoE) causal LM; returns (dir, HF model).

    fast_decay: per-token log-decays around -20, so path decays underflow within a few tokens.
    """
    import transformers

    kw = {**SMALL, **overrides}
    if moe:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
        kw.pop("intermediate_size")
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    randomize(model, seed, logit_scale)
    if fast_decay:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(2.5, 3.0)
    model.save_pretrained(out)
    return out, model.eval()


def prefill(model, cache, slot: int, ids: list[int]):
    cache.set_length(slot, 0)
    ctx = ForwardContext.prefill(cache, [slot], len(ids))
    out = model(torch.tensor([ids]), ctx)
    cache.commit(ctx, [len(ids)])
    return out


@pytest.mark.parametrize("overrides", [
    {},
    dict(linear_num_key_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                          "mrope_section": [1, 1, 0], "mrope_interleaved": True}, linear_conv_kernel_dim=3,
         layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
])
def test_prefill_and_decode_match_hf(tmp_path, overrides):
    from transformers import DynamicCache

    path, hf = make_qwen35(tmp_path / "t", **overrides)
    ours = load_target(path, torch.float32, CPU)
    ids = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = ours.new_cache(3, 128)
        for s in (1, 2):
            cache.set_length(s, 0)
        ctx = ForwardContext.prefill(cache, [1, 2], 80)
        out = ours(ids[:, :80], ctx)  # chunked: 64 + 16
        cache.commit(ctx, [80, 80])
        hf_cache = DynamicCache(config=hf.config)
        ref = hf(ids[:, :80], cache=hf_cache, use_cache=True)
        assert (out.logits - ref.logits).abs().max() < HF_TOL
        for t in range(80, 90):  # step-by-step decode through commit, as the engine runs AR
            ref = hf(ids[:, t:t + 1], cache=hf_cache, use_cache=True)
            spec = chain_spec(ids[:, t:t + 1])
            ctx = ForwardContext.verify(cache, [1, 2], spec)
            out = ours(spec.tokens, ctx)
            cache.commit(ctx, [1, 1], torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
            assert (out.logits - ref.logits).abs().max() < HF_TOL


def test_multimodal_checkpoint_layout_loads(tmp_path):
    """Hub Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: text_config, model.language_model.*,
    and a vision tower that the text engine skips."""
    import transformers

    cfg = transformers.Qwen3_5Config(
        text_config=SMALL, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                              out_hidden_size=32))
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg)
    randomize(hf, 3)
    hf.save_pretrained(tmp_path / "mm")
    ours = load_target(tmp_path / "mm", torch.float32, CPU)
    ids = [5, 9, 2, 33, 7, 1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
        out = prefill(ours, ours.new_cache(1, 16), 0, ids)
    assert (out.logits - ref).abs().max() < HF_TOL


def test_moe_variant_matches_hf(tmp_path):
    path, hf = make_qwen35(tmp_path / "moe", moe=True)
    ours = load_target(path, torch.float32, CPU)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(2)).tolist()[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
        out = prefill(ours, ours.new_cache(1, 64), 0, ids)
    assert (out.logits - ref).abs().max() < HF_TOL


def test_qwen3_next_packed_layout_matches_hf(tmp_path):
    """Qwen3-Next: same math, but each key head's q/k/v/z (and b/a) rows are packed together, and
    only every decoder_sparse_step-th layer is MoE (router weights not renormalised here)."""
    import transformers

    kw = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 24, "decoder_sparse_step": 2, "norm_topk_prob": False}
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**kw))
    randomize(hf, 5)
    hf.save_pretrained(tmp_path / "next")
    ours = load_target(tmp_path / "next", torch.float32, CPU)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(4)).tolist()[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
        out = prefill(ours, ours.new_cache(1, 64), 0, ids)
    assert (out.logits - ref).abs().max() < HF_TOL


def random_tree(n: int, vocab: int, gen: torch.Generator, max_depth: int = 6) -> tuple[list[int], list[int], list[int]]:
    """Tokens, parents, depths of a random topologically ordered tree (parent index < child index)."""
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    parents, depths = [-1], [0]
    for i in range(1, n):
        choices = [j for j in range(i) if depths[j] < max_depth]
        j = choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
        parents.append(j)
        depths.append(depths[j] + 1)
    return tokens, parents, depths


def path_to(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("seed,fast_decay", [(7, False), (8, False), (9, True)])
def test_tree_nodes_match_their_paths(tmp_path, seed, fast_decay):
    """Every node's logits, and the recurrent state, conv window and K/V after committing its path,
    equal running that path as a plain sequence (float64, so only the order of sums differs)."""
    path, _ = make_qwen35(tmp_path / "t", seed=seed, fast_decay=fast_decay)
    model = load_target(path, torch.float64, CPU)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (70, 5)]
    sizes = (13, 9)
    trees = [random_tree(n, 64, gen) for n in sizes]
    N = max(sizes)
    # Pad the shorter row the way build_tree does: token -1, parent 0, depth 1.
    rows = [(t + [-1] * (N - len(t)), p + [0] * (N - len(p)), d + [1] * (N - len(d))) for t, p, d in trees]
    spec = TreeSpec(tokens=torch.tensor([r[0] for r in rows]), parents=torch.tensor([r[1] for r in rows]),
                    depths=torch.tensor([r[2] for r in rows]), sizes=torch.tensor(sizes))
    with torch.no_grad():
        cache = model.new_cache(2, 128)
        for slot, prompt in enumerate(prompts):
            prefill(model, cache, slot, prompt)
        ctx = ForwardContext.verify(cache, [0, 1], spec)
        out = model(spec.tokens.clamp(min=0), ctx, feature_layers=(1, 2))

        ref_cache = model.new_cache(1, 128)
        for r, (tokens, parents, _) in enumerate(trees):
            for i in range(len(tokens)):
                nodes = path_to(parents, i)
                seq = prompts[r] + [tokens[j] for j in nodes]
                ref = prefill(model, ref_cache, 0, seq)
                assert (out.logits[r, i] - ref.logits[0, -1]).abs().max() < 1e-9

                committed = copy.deepcopy(cache)  # ctx (slots, starts, GDN window records) commits into the copy
                accepted = torch.full((2, spec.depth_bound + 1), -1)
                accepted[r, :len(nodes)] = torch.tensor(nodes)
                accepted[1 - r, 0] = 0
                counts = [1, 1]
                counts[r] = len(nodes)
                committed.commit(ctx, counts, accepted, torch.tensor(counts))
                assert committed.lengths[r] == len(seq)
                assert (committed.state[:, r] - ref_cache.state[:, 0]).abs().max() < 1e-9
                assert (committed.conv[:, r] - ref_cache.conv[:, 0]).abs().max() < 1e-9
                n = len(seq)
                assert (committed.k[:, r, :n] - ref_cache.k[:, 0, :n]).abs().max() < 1e-9
                assert (committed.v[:, r, :n] - ref_cache.v[:, 0, :n]).abs().max() < 1e-9


def test_chain_window_commit_equals_sequence(tmp_path):
    """A DFlash-style chain window committed at every length leaves the state AR would have."""
    path, _ = make_qwen35(tmp_path / "t", seed=4)
    model = load_target(path, torch.float64, CPU)
    prompt, chain = list(range(3, 40)), [11, 12, 13, 14, 15, 16]
    with torch.no_grad():
        for keep in range(1, len(chain) + 1):
            cache = model.new_cache(1, 64)
            prefill(model, cache, 0, prompt)
            spec = chain_spec(torch.tensor([chain]))
            ctx = ForwardContext.verify(cache, [0], spec)
            model(spec.tokens, ctx)
            cache.commit(ctx, [keep], torch.arange(len(chain))[None].masked_fill(torch.arange(len(chain)) >= keep, -1),
                         torch.tensor([keep]))
            ref = model.new_cache(1, 64)
            prefill(model, ref, 0, prompt + chain[:keep])
            assert (cache.state - ref.state).abs().max() < 1e-9
            assert (cache.conv - ref.conv).abs().max() < 1e-9


def test_fast_decay_prefill_equals_token_by_token(tmp_path):
    """With decays that underflow within a few tokens (where DECAY_FLOOR zeroes terms), chunked
    prefill, one-token windows and the state they leave agree. float64: HF's float32 norms make
    this regime too sensitive to compare against HF itself."""
    path, _ = make_qwen35(tmp_path / "t", fast_decay=True)
    model = load_target(path, torch.float64, CPU)
    ids = torch.randint(0, 64, (1, 100), generator=torch.Generator().manual_seed(3))[0].tolist()
    with torch.no_grad():
        whole = model.new_cache(1, 128)
        ref = prefill(model, whole, 0, ids)
        step = model.new_cache(1, 128)
        prefill(model, step, 0, ids[:1])
        for t in range(1, len(ids)):
            spec = chain_spec(torch.tensor([[ids[t]]]))
            ctx = ForwardContext.verify(step, [0], spec)
            out = model(spec.tokens, ctx)
            step.commit(ctx, [1], torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
            assert (out.logits[0, 0] - ref.logits[0, t]).abs().max() < 1e-9
    assert (step.state - whole.state).abs().max() < 1e-9


def test_recurrent_state_cannot_be_rewound(tmp_path):
    path, _ = make_qwen35(tmp_path / "t")
    model = load_target(path, torch.float32, CPU)
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        prefill(model, cache, 0, [1, 2, 3, 4])
    with pytest.raises(FlashtreeError, match="cannot be rewound"):
        cache.set_length(0, 2)
    cache.set_length(0, 0)  # a fresh start is always fine
    assert cache.state.abs().max() == 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35pair")
    target, _ = make_qwen35(root / "target", seed=11, logit_scale=4.0)
    drafter = make_drafter(root / "drafter", target_layers=4, vocab=64, hidden=32, block_size=6, layer_ids=[1, 2])
    return str(target), str(drafter)


def test_speculative_methods_are_lossless(pair):
    """Greedy dflash and ddtree (budgets 1, 8, 64) emit exactly the AR tokens, batched."""
    from flashtree import LLM, SamplingParams

    target, drafter = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(target=target, drafter=drafter, dtype="float32", device="cpu", max_batch=4, max_model_len=128)
    ar = [o.token_ids for o in LLM(method="ar", **common).generate(prompts, params)]
    assert all(len(t) == 24 for t in ar)
    runs = [("dflash", 8), ("ddtree", 1), ("ddtree", 8), ("ddtree", 64)]
    for method, budget in runs:
        outs = LLM(method=method, budget=budget, **common).generate(prompts, params)
        assert [o.token_ids for o in outs] == ar, (method, budget)
    # The trees did accept drafted tokens (otherwise losslessness would be trivial).
    assert max(max(o.stats.accept_lengths) for o in outs) > 1
