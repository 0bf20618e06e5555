"""Routed experts (models/moe.py) and the Qwen3-MoE target: HF parity, every expert path equal to a
per-token reference, no host sync, both checkpoint layouts, lossless speculative decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from flashtree import LLM, SamplingParams
from flashtree.models.context import ForwardContext
from flashtree.models.loader import hub_state_dict, load_target
from flashtree.models.moe import Experts, Router, SparseMoE, expert_path
from flashtree.tree import TreeSpec
from tiny import make_drafter

CPU = torch.device("cpu")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=63)


def randomize(model, seed: int, logit_scale: float = 1.0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
            if name.endswith("lm_head.weight"):
                p.mul_(logit_scale)


def make_qwen3_moe(out, seed: int = 0, logit_scale: float = 1.0, **overrides):
    """Save a tiny random HF Qwen3-MoE causal LM; returns (dir, HF model)."""
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SMALL, **overrides}))
    randomize(model, seed, logit_scale)
    model.save_pretrained(out)
    return out, model.eval()


def run(model, ids: torch.Tensor, feature_layers=()):
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
    with torch.no_grad():
        return model(ids, ForwardContext.prefill(cache, list(range(ids.shape[0])), ids.shape[1]), feature_layers)


@pytest.mark.parametrize("overrides", [
    {},
    {"norm_topk_prob": False, "tie_word_embeddings": True},
    {"decoder_sparse_step": 2, "mlp_only_layers": [3]},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qwen3_moe_matches_hf(tmp_path, overrides, dtype):
    """Prefill logits and block outputs equal HF's (< 1e-4) at 1 and 2 x 37 tokens: in float32
    through the grouped GEMM, in float64 through the gather (1 token) and dense (74) paths."""
    path, _ = make_qwen3_moe(tmp_path / "m", **overrides)
    # HF's default experts path is a grouped GEMM too, which has no float64: use its eager loop.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    ours = load_target(path, dtype, CPU)
    kinds = [type(b.mlp).__name__ for b in ours.layers]
    assert kinds == [type(b.mlp).__name__.replace("Qwen3MoeSparseMoeBlock", "SparseMoE").replace("Qwen3MoeMLP", "MLP")
                     for b in hf.model.layers]
    for shape in ((1, 1), (2, 37)):
        ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True)
        out = run(ours, ids, feature_layers=(0, 2))
        assert (out.logits - ref.logits).abs().max() < 1e-4
        want = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], dim=-1)
        assert (out.features - want).abs().max() < 1e-4


def test_tree_window_matches_each_path(tmp_path):
    """A tree window after a prefill gives every node HF's logits for its ancestor path."""
    path, hf = make_qwen3_moe(tmp_path / "m", seed=3)
    ours = load_target(path, torch.float32, CPU)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents, depths = torch.tensor([[-1, 0, 0, 1, 2]]), torch.tensor([[0, 1, 1, 2, 2]])
    spec = TreeSpec(tokens, parents, depths, torch.tensor([5]))
    cache = ours.new_cache(1, 32)
    with torch.no_grad():
        ctx = ForwardContext.prefill(cache, [0], 5)
        ours(prompt, ctx)
        cache.commit(ctx, [5])
        out = ours(tokens, ForwardContext.verify(cache, [0], spec))
        for node, nodes in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4]}.items():
            ref = hf(torch.cat([prompt, tokens[:, nodes]], dim=1)).logits[0, -1]
            assert (out.logits[0, node] - ref).abs().max() < 1e-4, node


def reference_experts(experts: Experts, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: the definition the batched paths must equal."""
    out = torch.zeros_like(x)
    i = experts.hidden
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e = int(index[t, s])
            w = experts.gate_up_proj[e]
            h = F.silu(x[t] @ w[:i].T) * (x[t] @ w[i:].T)
            out[t] += weight[t, s] * (h @ experts.down_proj[e].T)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_every_expert_path_equals_the_per_token_reference(dtype, tokens):
    torch.manual_seed(tokens)
    experts, router = Experts(8, 16, 8).to(dtype), Router(8, 16, 3, normalize=True).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
        x = torch.randn(tokens, 16, dtype=dtype)
        index, weight = router(x)
        ref = reference_experts(experts, x, index, weight)
        paths = ["gather", "dense"] + (["grouped"] if dtype == torch.float32 else [])
        for path in paths:
            assert (experts(x, index, weight, path=path) - ref).abs().max() < 1e-5, path
        assert (experts(x, index, weight) - ref).abs().max() < 1e-5  # the path expert_path picks


def test_path_choice_depends_on_shapes_only():
    assert expert_path(256, 8, 128, grouped_ok=True) == "grouped"
    assert expert_path(1, 8, 128, grouped_ok=False) == "gather"
    assert expert_path(16, 8, 128, grouped_ok=False) == "dense"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moe_layer_never_reads_the_device(monkeypatch, dtype):
    """No .item/.tolist/bool()/int()/nonzero/unique on any path: nothing waits for the device."""
    layer = SparseMoE(16, 8, 2, 8, normalize=True, shared_hidden=12).to(dtype)
    xs = [torch.randn(1, n, 16, dtype=dtype) for n in (1, 3, 64)]
    calls = []

    def forbid(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"host sync through {name}")
        return fn

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero", "unique"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    monkeypatch.setattr(torch, "nonzero", forbid("torch.nonzero"))
    monkeypatch.setattr(torch, "unique", forbid("torch.unique"))
    with torch.no_grad():
        for x in xs:
            layer(x)
    assert calls == []


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path):
    """A checkpoint holding transformers' in-memory layout (experts.gate_up_proj [E, 2I, d],
    experts.down_proj [E, d, I]) loads to the same model as the hub's per-expert one."""
    path, hf = make_qwen3_moe(tmp_path / "hub", seed=4)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((path / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    a, b = load_target(path, torch.float32, CPU), load_target(fused, torch.float32, CPU)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_hub_state_dict_names_what_the_hub_checkpoint_stores(tmp_path):
    from safetensors.torch import load_file

    path, _ = make_qwen3_moe(tmp_path / "m")
    stored = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    mine = hub_state_dict(load_target(path, torch.float32, CPU))
    assert set(mine) == set(stored)
    assert all(torch.equal(mine[k], stored[k]) for k in stored)


@pytest.mark.slow
def test_speculative_methods_are_lossless_on_qwen3_moe(tmp_path):
    """Greedy dflash and ddtree (budgets 1, 8, 64) emit exactly AR's tokens on a Qwen3-MoE target,
    batched, so each round's window runs through the expert paths its size picks."""
    target, _ = make_qwen3_moe(tmp_path / "target", seed=11, logit_scale=4.0)
    drafter = make_drafter(tmp_path / "drafter", target_layers=4, vocab=64, hidden=32, block_size=6, layer_ids=[1, 2])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(target=str(target), drafter=str(drafter), dtype="float32", device="cpu", max_batch=3,
                  max_model_len=128)
    ar = [o.token_ids for o in LLM(method="ar", **common).generate(prompts, params)]
    for method, budget in [("dflash", 8), ("ddtree", 1), ("ddtree", 8), ("ddtree", 64)]:
        outs = LLM(method=method, budget=budget, **common).generate(prompts, params)
        assert [o.token_ids for o in outs] == ar, (method, budget)
    assert max(max(o.stats.accept_lengths) for o in outs) > 1
