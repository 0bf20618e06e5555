"""The streaming loader: bounded host memory, exact placement of fused parts, clear errors, configs
through transformers, and checkpoints written back in the hub layout."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flashtree.errors import FlashtreeError
from flashtree.models import loader
from flashtree.models.context import ForwardContext
from flashtree.models.dflash import load_drafter
from flashtree.models.layers import MergedLinear, inv_frequencies
from flashtree.models.loader import eos_token_ids, hub_state_dict, load_target, read_config
from tiny import make_drafter, make_target

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids) + 2)
    with torch.no_grad():
        return model(torch.tensor([ids]), ForwardContext.prefill(cache, [0], len(ids))).logits


def load_memory_module():
    spec = importlib.util.spec_from_file_location("load_memory", ROOT / "benchmarks" / "load_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_peak_rss_of_a_four_shard_load_stays_near_its_size(tmp_path):
    """A 64 MB float32 checkpoint in 4 shards loads (in a fresh process) with peak RSS at most
    1.25x its size + 16 MB; the read-all-then-copy loader this replaced needed about 2x."""
    bench = load_memory_module()
    size = bench.write_checkpoint(tmp_path / "ckpt", 64, torch.float32, shards=4)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 4
    result = bench.measure(tmp_path / "ckpt", torch.float32)
    assert result["params"] * 4 == size
    assert result["rss_delta_bytes"] <= 1.25 * size + 16e6, result


def test_row_blocks_and_reopening_load_the_same_weights(tmp_path, monkeypatch):
    """With a 1 KB mapping budget every tensor is read in row blocks across many reopenings of its
    shard; the weights are bit-identical to a plain load."""
    path = make_target(tmp_path / "t")
    ref = load_target(path, torch.float32, CPU)
    monkeypatch.setattr(loader, "MAP_BUDGET", 1024)
    monkeypatch.setattr(loader, "MIN_MAP_BUDGET", 1024)
    readers = []
    close = loader.ShardReader.close
    monkeypatch.setattr(loader.ShardReader, "close", lambda self: (readers.append(self), close(self))[1])
    small = load_target(path, torch.float32, CPU)
    assert max(r.opened for r in readers) > 20
    for (name, a), (_, b) in zip(ref.state_dict().items(), small.state_dict().items()):
        assert torch.equal(a, b), name


def test_fused_parts_sit_at_their_rows(tmp_path):
    """qkv_proj rows are q_proj, k_proj, v_proj in order; gate_up_proj rows are gate_proj, up_proj."""
    path = make_target(tmp_path / "t")
    ckpt = load_file(str(path / "model.safetensors"))
    model = load_target(path, torch.float32, CPU)
    attn, mlp = model.layers[1].self_attn.qkv_proj, model.layers[1].mlp.gate_up_proj
    assert isinstance(attn, MergedLinear) and attn.parts == ["q_proj", "k_proj", "v_proj"]
    for part in attn.parts:
        assert torch.equal(attn.weight[attn.offset(part)], ckpt[f"model.layers.1.self_attn.{part}.weight"])
    for part in mlp.parts:
        assert torch.equal(mlp.weight[mlp.offset(part)], ckpt[f"model.layers.1.mlp.{part}.weight"])


def test_bf16_checkpoint_loads_into_float32(tmp_path):
    """Each tensor is converted on its way in: a bf16 checkpoint run in float32 matches HF's
    float32 model over the same (bf16-rounded) weights."""
    path = make_target(tmp_path / "f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    ours = load_target(tmp_path / "bf16", torch.float32, CPU)
    assert ours.embed_tokens.weight.dtype == torch.float32
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        assert (logits(ours, ids) - ref(torch.tensor([ids])).logits).abs().max() < 1e-4


def test_rotary_frequencies_survive_the_meta_build(tmp_path):
    """The inverse frequencies live outside the state dict; a meta build must still compute them."""
    path = make_target(tmp_path / "t", arch="llama", rope_theta=500.0)
    model = load_target(path, torch.float32, CPU)
    inv = model.rotary._inv_freq
    assert not inv.is_meta and inv.dtype == torch.float32
    assert torch.equal(inv, inv_frequencies(model.args.head_dim, model.args.rope))
    assert all(not p.is_meta for p in model.parameters())


def test_tied_checkpoint_with_an_lm_head_copy_and_mtp_tensors_loads(tmp_path):
    """A tied model keeps one embedding matrix; a stored lm_head copy and mtp.* heads are skipped."""
    path = make_target(tmp_path / "t", tie=True)
    state = load_file(str(path / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["mtp.fc.weight"] = torch.ones(4, 4)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = load_target(path, torch.float32, CPU)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_cpu_float32_linear_weights_are_stored_transposed_and_hold_the_checkpoint(tmp_path):
    """On the CPU in float32 every linear weight is the transposed view of a contiguous W^T (the fast
    operand for MKL) holding exactly the checkpoint's values, and the logits equal HF's; a tied LM
    head's embedding shares that layout, an untied embedding keeps its rows, and bfloat16 weights
    keep theirs."""
    for tie in (False, True):
        path = make_target(tmp_path / f"t{tie}", tie=tie)
        state = load_file(str(path / "model.safetensors"))
        model = load_target(path, torch.float32, CPU)
        qkv = model.layers[0].self_attn.qkv_proj.weight
        assert qkv.t().is_contiguous() and not qkv.is_contiguous()
        assert torch.equal(qkv[model.layers[0].self_attn.qkv_proj.offset("k_proj")],
                           state["model.layers.0.self_attn.k_proj.weight"])
        down = model.layers[1].mlp.down_proj.weight
        assert down.t().is_contiguous() and torch.equal(down, state["model.layers.1.mlp.down_proj.weight"])
        head = model.lm_head.weight
        stored = state["model.embed_tokens.weight" if tie else "lm_head.weight"]
        assert head.t().is_contiguous() and torch.equal(head, stored)
        assert model.embed_tokens.weight.is_contiguous() != tie
        assert (model.embed_tokens.weight is head) == tie
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        with torch.no_grad():
            assert (logits(model, ids) - hf(torch.tensor([ids])).logits).abs().max() < 1e-4
    half = load_target(path, torch.bfloat16, CPU)
    assert all(p.is_contiguous() for p in half.parameters())


def shard(path: Path, out: Path, parts: int = 2) -> list[str]:
    """Re-save a single-file checkpoint as `parts` shards with an index json; returns the file names."""
    state = load_file(str(path / "model.safetensors"))
    out.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    names = sorted(state)
    files, weight_map = [], {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        group = names[i::parts]
        save_file({k: state[k] for k in group}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        files.append(file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def test_missing_tensor_is_named_with_the_shards_searched(tmp_path):
    path = make_target(tmp_path / "t")
    files = shard(path, tmp_path / "s")
    victim = "model.layers.3.mlp.up_proj.weight"
    for file in files:
        state = load_file(str(tmp_path / "s" / file))
        if victim in state:
            del state[victim]
            save_file(state, str(tmp_path / "s" / file), metadata={"format": "pt"})
    with pytest.raises(FlashtreeError, match=rf"no tensor {victim} in any of the 2 shards of .*/s"):
        load_target(tmp_path / "s", torch.float32, CPU)


def test_wrong_shape_names_the_file_and_the_tensor(tmp_path):
    path = make_target(tmp_path / "t")
    files = shard(path, tmp_path / "s")
    name = "model.layers.2.self_attn.k_proj.weight"
    file = next(f for f in files if name in load_file(str(tmp_path / "s" / f)))
    state = load_file(str(tmp_path / "s" / file))
    state[name] = torch.zeros(5, 32)
    save_file(state, str(tmp_path / "s" / file), metadata={"format": "pt"})
    with pytest.raises(FlashtreeError, match=rf"{file}: {name} has shape \(5, 32\), the config implies \(16, 32\)"):
        load_target(tmp_path / "s", torch.float32, CPU)


def test_unexpected_tensor_names_its_file(tmp_path):
    path = make_target(tmp_path / "t")
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FlashtreeError, match=r"model.safetensors: unexpected tensor model.layers.0.mlp.extra_proj"):
        load_target(path, torch.float32, CPU)


def test_drafter_is_saved_in_the_hub_layout_and_loads_back(tmp_path):
    """save_drafter writes q/k/v and gate/up apart (z-lab's names); loading packs them again."""
    target_dir = make_target(tmp_path / "t")
    path = make_drafter(tmp_path / "d", target_layers=4)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and "layers.1.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    target = load_target(target_dir, torch.float32, CPU)
    drafter = load_drafter(path, target, torch.float32, CPU)
    stored = load_file(str(path / "model.safetensors"))
    mine = hub_state_dict(drafter)
    assert set(mine) == set(stored)
    assert all(torch.equal(mine[k], stored[k]) for k in stored)


def test_generation_config_eos_and_its_absence(tmp_path):
    """EOS ids come from generation_config.json (a list here) and config.json; without the
    generation config, transformers derives it from config.json."""
    path = make_target(tmp_path / "t", vocab=64)  # config.json eos = 63
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [61, 62], "bos_token_id": 1}))
    assert eos_token_ids(load_target(path, torch.float32, CPU)) == {61, 62, 63}
    (path / "generation_config.json").unlink()
    model = load_target(path, torch.float32, CPU)
    assert model.generation_config.eos_token_id == 63
    assert eos_token_ids(model) == {63}


def test_a_model_type_transformers_does_not_know_falls_back_to_the_raw_config(tmp_path):
    path = make_target(tmp_path / "t")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "qwen9_unknown"
    (path / "config.json").write_text(json.dumps(cfg))
    config = read_config(path)
    assert config.model_type == "qwen9_unknown" and config.hidden_size == cfg["hidden_size"]
    with pytest.raises(FlashtreeError, match="unsupported target model_type 'qwen9_unknown'"):
        load_target(path, torch.float32, CPU)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen9_vl", "tie_word_embeddings": True,
                                                  "text_config": {**cfg, "tie_word_embeddings": False}}))
    config = read_config(path)
    assert loader.text_config(config).hidden_size == cfg["hidden_size"] and loader.tied_embeddings(config)
