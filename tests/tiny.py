"""Tiny random checkpoints that the tests build themselves (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

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
