"""Own target models reproduce HF transformers' logits and hidden states on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.loader import load_target
from tiny import make_target

CPU = torch.device("cpu")


def run_ours(model, ids: torch.Tensor, feature_layers=()):
    cache = model.new_cache(1, ids.shape[1] + 4)
    return model(ids, ForwardContext.prefill(cache, [0], ids.shape[1]), feature_layers)


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("qwen3", {}),
        ("qwen3", {"tie": True}),
        ("llama", {}),
        ("llama", {"kv_heads": 4, "tie": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen3", {"rope_theta": 1000.0}),
    ],
)
def test_logits_and_features_match_hf(tmp_path, arch, extra):
    """Prefill logits (max abs diff < 1e-4) and block outputs (hidden_states[k+1]) equal HF's."""
    path = make_target(tmp_path, arch=arch, **extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path, torch.float32, CPU)
    ids = torch.randint(0, 64, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = run_ours(ours, ids, feature_layers=(0, 2))
    assert (out.logits - ref.logits).abs().max() < 1e-4
    want = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], dim=-1)
    assert (out.features - want).abs().max() < 1e-4


def test_incremental_tree_window_matches_full_sequence(tmp_path):
    """Prefill + a tree window with depth positions gives each node the logits of its ancestor path."""
    path = make_target(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path, torch.float32, CPU)
    from flashtree.tree import TreeSpec

    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    # root 10; children 11, 12 of root; 13 under 11; 14 under 12
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    depths = torch.tensor([[0, 1, 1, 2, 2]])
    spec = TreeSpec(tokens, parents, depths, torch.tensor([5]))
    cache = ours.new_cache(1, 32)
    with torch.no_grad():
        ctx = ForwardContext.prefill(cache, [0], 5)
        ours(prompt, ctx)
        cache.commit(ctx, [5])
        out = ours(tokens, ForwardContext.verify(cache, [0], spec))
        for node, path_nodes in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4]}.items():
            seq = torch.cat([prompt, tokens[:, path_nodes]], dim=1)
            ref = hf(seq).logits[0, -1]
            assert (out.logits[0, node] - ref).abs().max() < 1e-4, node


def test_sharded_checkpoint_loads(tmp_path):
    """A sharded safetensors checkpoint (index json) loads to the same logits."""
    path = make_target(tmp_path / "one")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = load_target(path, torch.float32, CPU)
    b = load_target(tmp_path / "sharded", torch.float32, CPU)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(run_ours(a, ids).logits, run_ours(b, ids).logits)


def test_transformers_4x_rope_layout_reads_the_same(tmp_path):
    """config.json with top-level rope_theta/rope_scaling (4.x) and rope_parameters (5.x) load alike."""
    path = make_target(tmp_path, arch="llama", rope_theta=500.0)
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    a = load_target(path, torch.float32, CPU)
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    b = load_target(path, torch.float32, CPU)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(run_ours(a, ids).logits, run_ours(b, ids).logits)


def test_missing_path_and_bad_architecture_errors(tmp_path):
    with pytest.raises(FlashtreeError, match="no such model directory"):
        load_target(tmp_path / "nope", torch.float32, CPU)
    path = make_target(tmp_path / "t")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FlashtreeError, match="unsupported target model_type"):
        load_target(path, torch.float32, CPU)


def test_offline_hub_id_gives_clear_error(monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE when imported, so the test sets its constant too."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FlashtreeError, match="HF_HUB_OFFLINE is set and it is not in the local cache"):
        load_target("someone/not-a-real-model-xyz", torch.float32, CPU)
