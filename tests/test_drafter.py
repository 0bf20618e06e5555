"""The z-lab DFlash format loads, and its draft logits equal a from-scratch implementation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.dflash import default_target_layer_ids, load_drafter
from flashtree.models.loader import load_target
from tiny import make_drafter, make_target

CPU = torch.device("cpu")


def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """Rotate pairs (i, i + d/2) of x [n, d] by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = pos.double() * theta ** (-2 * i / d)
        c, s = torch.cos(ang)[:, None].to(x.dtype), torch.sin(ang)[:, None].to(x.dtype)
        a, b = x[:, i : i + 1], x[:, i + d // 2 : i + d // 2 + 1]
        out[:, i : i + 1] = a * c - b * s
        out[:, i + d // 2 : i + d // 2 + 1] = b * c + a * s
    return out


def reference_draft_logits(drafter_dir, target_dir, features, block, start, window_of=lambda layer: None):
    """DFlash forward written from its definition: features [n, F] at positions 0..n-1, block at start.."""
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    tw = {k: v.double() for k, v in load_file(str(target_dir / "model.safetensors")).items()}
    H, Hkv, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    n, L = features.shape[0], block.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = tw["model.embed_tokens.weight"][block]
    ctx_pos, blk_pos = torch.arange(n), torch.arange(start, start + L)
    for layer in range(cfg["num_hidden_layers"]):
        p = lambda name: w[f"layers.{layer}.{name}"]
        h = rms(x, p("input_layernorm.weight"))
        heads = []
        for head in range(H):
            kvh = head // (H // Hkv)
            sl = slice(head * hd, (head + 1) * hd)
            ksl = slice(kvh * hd, (kvh + 1) * hd)
            q = rope(rms(h @ p("self_attn.q_proj.weight")[sl].T, p("self_attn.q_norm.weight")), blk_pos, theta)
            k_ctx = rope(rms(ctx @ p("self_attn.k_proj.weight")[ksl].T, p("self_attn.k_norm.weight")), ctx_pos, theta)
            k_blk = rope(rms(h @ p("self_attn.k_proj.weight")[ksl].T, p("self_attn.k_norm.weight")), blk_pos, theta)
            v = torch.cat([ctx @ p("self_attn.v_proj.weight")[ksl].T, h @ p("self_attn.v_proj.weight")[ksl].T])
            scores = q @ torch.cat([k_ctx, k_blk]).T / math.sqrt(hd)
            window = window_of(layer)
            if window is not None:
                far = blk_pos[:, None] - torch.cat([ctx_pos, blk_pos])[None, :] >= window
                scores = scores.masked_fill(far, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v)
        x = x + torch.cat(heads, -1) @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        mlp = (torch.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T))
        x = x + mlp @ p("mlp.down_proj.weight").T
    out = rms(x, w["norm.weight"])
    return out[1:] @ tw["lm_head.weight"].T


def ours_draft_logits(target_dir, drafter_dir, prompt, block):
    target = load_target(target_dir, torch.float64, CPU)
    drafter = load_drafter(drafter_dir, target, torch.float64, CPU)
    n = len(prompt)
    tcache = target.new_cache(1, 64)
    out = target(torch.tensor([prompt]), ForwardContext.prefill(tcache, [0], n), tuple(drafter.args.target_layer_ids))
    dcache = drafter.new_cache(1, 64)
    ctx = ForwardContext.block(dcache, [0], n)
    drafter.add_context(ctx, out.features)
    dcache.commit(ctx, [n])
    hidden = drafter(target.embed_tokens(torch.tensor([block])), ForwardContext.block(dcache, [0], len(block)))
    return target.lm_head(hidden[:, 1:])[0]


def hf_features(target_dir, prompt, layer_ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    return torch.cat([hs[k + 1][0] for k in layer_ids], -1)


@pytest.mark.parametrize("layout", ["top_level_block_size", "dflash_config_only"])
def test_zlab_drafter_matches_reference(tmp_path, layout):
    target_dir = make_target(tmp_path / "t", layers=5)
    drafter_dir = make_drafter(tmp_path / "d", target_layers=5, layers=2, block_size=6, layer_ids=[1, 3])
    cfg = json.loads((drafter_dir / "config.json").read_text())
    if layout == "dflash_config_only":
        cfg.pop("block_size")
        (drafter_dir / "config.json").write_text(json.dumps(cfg))
    prompt, block = [3, 9, 4, 11, 5, 7, 2], [8] + [cfg["dflash_config"]["mask_token_id"]] * 5
    with torch.no_grad():
        ref = reference_draft_logits(drafter_dir, target_dir, hf_features(target_dir, prompt, [1, 3]).double(),
                                     torch.tensor(block), len(prompt))
        ours = ours_draft_logits(target_dir, drafter_dir, prompt, block)
    # RoPE angles are float32 in our code (as in HF), float64 here: agreement to ~1e-6.
    assert (ours - ref.to(ours.dtype)).abs().max() < 1e-5


def test_default_layer_ids_and_config_roundtrip(tmp_path):
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    drafter_dir = make_drafter(tmp_path / "d", target_layers=4, block_size=16)
    cfg = transformers.AutoConfig.from_pretrained(drafter_dir)
    assert cfg.dflash_config["target_layer_ids"] == [1, 2] and cfg.block_size == 16
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0 and raw["num_target_layers"] == 4


def test_drafter_that_does_not_fit_target_errors(tmp_path):
    target_dir = make_target(tmp_path / "t", layers=4)
    target = load_target(target_dir, torch.float32, CPU)
    bad_ids = make_drafter(tmp_path / "d1", target_layers=4, layer_ids=[1, 7])
    with pytest.raises(FlashtreeError, match="target_layer_ids"):
        load_drafter(bad_ids, target, torch.float32, CPU)
    bad_mask = make_drafter(tmp_path / "d2", target_layers=4, mask_token_id=500)
    with pytest.raises(FlashtreeError, match="mask_token_id 500 is outside"):
        load_drafter(bad_mask, target, torch.float32, CPU)
    with pytest.raises(FlashtreeError, match="not a DFlash drafter"):
        load_drafter(target_dir, target, torch.float32, CPU)
