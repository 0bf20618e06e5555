"""Tiny random checkpoints that the tests build themselves (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashtree.engine.cost_model import CostModel, Grid
from flashtree.models.dflash import DFlashArgs, DFlashDrafter, save_drafter


def make_target(out: Path, arch: str = "qwen3", vocab: int = 64, layers: int = 4, hidden: int = 32,
                heads: int = 4, kv_heads: int = 2, tie: bool = False, seed: int = 0, logit_scale: float = 1.0,
                **extra) -> Path:
    """Save a random HF Qwen3 or Llama checkpoint. logit_scale > 1 sharpens the LM head so
    greedy text repeats, which gives drafters something to accept."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, eos_token_id=vocab - 1, **extra)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=hidden // heads, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
        if logit_scale != 1.0 and not tie:
            model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(out)
    return out


def make_drafter(out: Path, target_layers: int, vocab: int = 64, hidden: int = 32, layers: int = 2,
                 block_size: int = 8, layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                 seed: int = 1, layer_types: list[str] | None = None, sliding_window: int | None = None) -> Path:
    """Save a random DFlash drafter in the z-lab layout."""
    torch.manual_seed(seed)
    args = DFlashArgs(hidden_size=hidden, intermediate_size=hidden * 2, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6, block_size=block_size,
                      target_layer_ids=layer_ids or [1, target_layers - 2], num_target_layers=target_layers,
                      mask_token_id=vocab - 2 if mask_token_id is None else mask_token_id, vocab_size=vocab,
                      layer_types=layer_types or ["full_attention"] * layers, sliding_window=sliding_window)
    drafter = DFlashDrafter(args)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    save_drafter(drafter, out)
    return out


MTP_COMMON = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
              "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
              "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight"]
MTP_SHARED_EXPERT = ["mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.shared_expert.gate_proj.weight",
                     "mtp.layers.0.mlp.shared_expert.up_proj.weight", "mtp.layers.0.mlp.shared_expert.down_proj.weight",
                     "mtp.layers.0.mlp.shared_expert_gate.weight"]


def mtp_names(kind: str, num_experts: int = 0) -> list[str]:
    """The `mtp.*` names the hub checkpoints ship, as listed by their safetensors indexes:
    "dense" (Qwen3.5/3.6 dense, e.g. Qwen3.5-0.8B: 15 tensors), "fused" (Qwen3.5/3.6-MoE, e.g.
    Qwen3.6-35B-A3B: stacked experts, 19 tensors), "per_expert" (Qwen3-Next: one tensor per expert)."""
    if kind == "dense":
        return MTP_COMMON + [f"mtp.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if kind == "fused":
        return MTP_COMMON + MTP_SHARED_EXPERT + ["mtp.layers.0.mlp.experts.gate_up_proj",
                                                "mtp.layers.0.mlp.experts.down_proj"]
    return MTP_COMMON + MTP_SHARED_EXPERT + [f"mtp.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                             for e in range(num_experts) for p in ("gate", "up", "down")]


def mtp_shape(name: str, c: dict, gated: bool) -> tuple[int, ...]:
    """A hub MTP tensor's shape from the text config (Qwen3.5's q_proj carries each head's output gate)."""
    d, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    e, i, s = c.get("num_experts", 0), c.get("moe_intermediate_size", 0), c.get("shared_expert_intermediate_size", 0)
    leaf = name.removeprefix("mtp.layers.0.")
    table = {"mtp.fc.weight": (d, 2 * d), "self_attn.q_proj.weight": (2 * q if gated else q, d),
             "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "mlp.gate.weight": (e, d),
             "mlp.experts.gate_up_proj": (e, 2 * i, d), "mlp.experts.down_proj": (e, d, i),
             "mlp.shared_expert.gate_proj.weight": (s, d), "mlp.shared_expert.up_proj.weight": (s, d),
             "mlp.shared_expert.down_proj.weight": (d, s), "mlp.shared_expert_gate.weight": (1, d)}
    if leaf in table:
        return table[leaf]
    if leaf.startswith("mlp.experts."):
        return (d, i) if leaf.endswith("down_proj.weight") else (i, d)
    if leaf.startswith("mlp."):
        m = c.get("intermediate_size", 0)
        return (d, m) if leaf.endswith("down_proj.weight") else (m, d)
    return (d,)  # the norms


def add_mtp(path: Path, kind: str, seed: int = 0, drop: str | None = None, reshape: str | None = None) -> dict:
    """Write random `mtp.*` tensors with the hub's names into the checkpoint at `path` (in its own
    shard, listed in a safetensors index as the hub does); `drop` leaves one out, `reshape`
    transposes one. Returns the tensors written."""
    import json

    from safetensors.torch import save_file

    config = json.loads((path / "config.json").read_text())
    c = config.get("text_config", config)
    gated = c["model_type"].startswith(("qwen3_5", "qwen3_next"))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in mtp_names(kind, c.get("num_experts", 0)):
        shape = mtp_shape(name, c, gated)
        if len(shape) == 1:  # zero-centred norms (Qwen3.5) sit near 0, plain ones near 1
            t = torch.rand(shape, generator=g) * 0.4 - 0.2 + (0.0 if gated else 1.0)
        else:
            t = torch.randn(shape, generator=g) * 0.2
        tensors[name] = t.to(torch.float32)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape].transpose(0, -1).contiguous()
    save_file(tensors, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    from safetensors import safe_open

    index = {"metadata": {}, "weight_map": {}}
    for file in sorted(p.name for p in path.glob("*.safetensors")):
        with safe_open(str(path / file), framework="pt") as f:
            index["weight_map"].update({k: file for k in f.keys()})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def synthetic_cost(per_node: float, fixed: float = 0.010, draft: float = 0.004, rows: int = 16) -> CostModel:
    """A cost model with a round costing fixed + per_node x verified nodes, plus draft x drafting rows."""
    windows = [1, 2, 3, 5, 9, 17, 33, 65]
    rs = [1, rows]
    verify = Grid(rs, windows, [[fixed + per_node * r * n for n in windows] for r in rs])
    return CostModel(verify, Grid(rs, [0, 15], [[draft * r, draft * r * 1.2] for r in rs]),
                     Grid([1, rows], [4, 64], [[1e-4, 2e-4], [1e-4 * rows, 2e-4 * rows]]),
                     Grid(rs, [0, 1], [[0, 0], [0, 0]]), {"rows": rows, "window": 65, "budget": 64})
