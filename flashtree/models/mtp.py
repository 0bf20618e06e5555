"""Multi-token-prediction (MTP) heads: the extra decoder layer Qwen3.5/3.6 and Qwen3-Next checkpoints
ship under `mtp.*`, and the heads `flashtree train train --mtp` learns for any target.

At position t a head reads the target's final hidden state h_t (after the target's own final
norm) and the embedding of token t+1, normalises each, projects [embedding; hidden] back to the
hidden size with `fc`, runs one decoder layer of the target's family over its own K/V cache,
and normalises the result. Through the target's LM head that output predicts token t+2; fed
back with the token it drafts, it drafts the one after (flashtree/engine/mtp_draft.py).
Embeddings and LM head are the target's, so a head holds only `fc`, `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `layers.0.*` and `norm`, stored under `mtp.` as the checkpoints do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from flashtree.cache import KVCache
from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.layers import Linear, RMSNorm, Rotary

if TYPE_CHECKING:
    from flashtree.parallel.group import TensorParallel

SCOPE = "mtp."  # where the head's tensors live in a checkpoint
ARCHITECTURE = "FlashtreeMTPHead"  # config.json of a head trained here (the target's config, re-labelled)
DENSE_FAMILY = ("qwen3", "llama", "mistral", "qwen3_moe")
HYBRID_FAMILY = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3.5/3.6, Qwen3-Next


class MTPHead(nn.Module):
    """fc over [norm(embedding); norm(hidden)], one decoder layer, a final norm (names as in `mtp.*`)."""

    def __init__(self, args, hybrid: bool) -> None:
        super().__init__()
        if hybrid:  # Qwen3.5 / Qwen3-Next: gated full attention, dense MLP or MoE, zero-centred norms
            from flashtree.models.qwen3_5 import Block
            from flashtree.models.qwen3_5_norms import ZeroCentredRMSNorm as Norm
        else:  # Qwen3 / Llama: the target's attention and a dense SwiGLU MLP
            from flashtree.models.transformer import Block
            Norm = RMSNorm
        d, eps = args.hidden_size, args.rms_norm_eps
        self.args = args
        self.hybrid = hybrid
        self.fc = Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = Norm(d, eps)
        self.pre_fc_norm_hidden = Norm(d, eps)
        self.layers = nn.ModuleList([Block(args, 0)])
        self.norm = Norm(d, eps)
        self.rotary = Rotary(args.head_dim, args.rope)

    def forward(self, embeds: Tensor, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        """Output hidden states [R, N, d] for entries [R, N]: the embeddings of tokens t+1 and the
        hidden states they follow (the target's at t, or this head's own previous output)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = self.rotary(ctx.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p, a = self.fc.weight, self.args
        return KVCache(1, num_slots, max_len, a.num_kv_heads, a.head_dim, p.dtype, p.device)


# ---- shape from a config ---------------------------------------------------------------------


def head_args(text_config, intermediate_size: int | None = None):
    """The head's layer shape and family from the target's (or the head's) text config: one full
    attention layer, MoE where the family's layer 0 is sparse (Qwen3.5-MoE, Qwen3-Next)."""
    model_type = getattr(text_config, "model_type", None)
    if model_type in DENSE_FAMILY:
        from flashtree.models.transformer import TransformerArgs

        args, hybrid = TransformerArgs.from_hf(text_config), False
    elif model_type in HYBRID_FAMILY:
        from flashtree.models.qwen3_5_args import Qwen35Args

        args, hybrid = Qwen35Args.from_hf(text_config), True
        args = dataclasses.replace(args, layer_types=["full_attention"])
    else:
        raise FlashtreeError(f"no MTP head for model_type {model_type!r}; flashtree runs MTP heads of "
                             f"{', '.join(DENSE_FAMILY + HYBRID_FAMILY)} targets")
    layers = next((getattr(text_config, k) for k in LAYER_KEYS if getattr(text_config, k, None)), 1)
    if layers != 1:
        raise FlashtreeError(f"the checkpoint's MTP module has {layers} layers; flashtree runs one-layer MTP heads "
                             "(every Qwen3.5/3.6 and Qwen3-Next release)")
    args = dataclasses.replace(args, num_layers=1, tie_word_embeddings=False)
    if intermediate_size:
        args = dataclasses.replace(args, intermediate_size=intermediate_size)
    return args, hybrid


def build_head(text_config, intermediate_size: int | None = None) -> MTPHead:
    args, hybrid = head_args(text_config, intermediate_size)
    return MTPHead(args, hybrid)


# ---- loading and saving ----------------------------------------------------------------------


def tensor_names(path: Path) -> list[str]:
    """Every tensor name of a safetensors checkpoint, from its index or its file headers."""
    from safetensors import safe_open

    from flashtree.models.loader import checkpoint_files

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for file in checkpoint_files(path):
        with safe_open(str(path / file), framework="pt") as f:
            names += list(f.keys())
    return names


def load_head(source: str | os.PathLike, target: nn.Module, dtype: torch.dtype, device: torch.device,
              tp: TensorParallel | None = None) -> MTPHead:
    """The MTP head in `source` (a checkpoint that ships `mtp.*` tensors, or a head directory
    written by save_head), streamed like the target and, with `tp`, sharded like its layers."""
    from flashtree.models.loader import load_checkpoint, meta_device, default_dtype, read_config, resolve, text_config

    path = resolve(source)
    if not any(name.startswith(SCOPE) for name in tensor_names(path)):
        raise FlashtreeError(f"{path} ships no MTP head (no {SCOPE}* tensors such as {SCOPE}fc.weight); method "
                             "'mtp' needs a Qwen3.5/3.6 or Qwen3-Next checkpoint, or a head trained with "
                             "`flashtree train train --mtp` passed as mtp_head / --mtp-head")
    config = text_config(read_config(path))
    want = (target.args.hidden_size, target.vocab_size)
    have = (config.hidden_size, config.vocab_size)
    if have != want:
        raise FlashtreeError(f"the MTP head in {path} has hidden size {have[0]} and vocabulary {have[1]}, the "
                             f"target {want[0]} and {want[1]}: it was made for another target")
    with meta_device(), default_dtype(dtype):
        head = build_head(config)
    load_checkpoint(head, path, torch.device(device), tp=tp, scope=SCOPE)
    head.source_dir = path
    return head.eval()


def head_config(target_config: dict, head: MTPHead) -> dict:
    """config.json of a trained head: the target's config (so any reader sees the layer's shape),
    labelled as a head, with the layer's own MLP width."""
    cfg = {k: v for k, v in target_config.items() if k not in ("auto_map",)}
    text = cfg.get("text_config", cfg)
    text["intermediate_size"] = head.args.intermediate_size
    text["mtp_num_hidden_layers"] = 1
    cfg["architectures"] = [ARCHITECTURE]
    cfg["torch_dtype"] = cfg["dtype"] = str(head.fc.weight.dtype).removeprefix("torch.")
    return cfg


def save_head(head: MTPHead, out_dir: str | os.PathLike, target_dir: str | os.PathLike) -> None:
    """Write a head directory: config.json and model.safetensors with the `mtp.*` names the
    checkpoints use (q/k/v and gate/up stored apart)."""
    from safetensors.torch import save_file

    from flashtree.models.loader import hub_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(head_config(target_config, head), indent=2) + "\n")
    tensors = {SCOPE + k: v.detach().contiguous().cpu() for k, v in hub_state_dict(head).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
