"""HF checkpoint directory or hub id -> config dict + safetensors weights -> our modules."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from flashtree.errors import FlashtreeError

WEIGHT_PREFIXES = ("model.language_model.", "model.")
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a hub id fetched through huggingface_hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FlashtreeError(f"{path} has no config.json; point at an HF checkpoint directory")
        return path
    name = str(name_or_path)
    looks_like_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_id:
        raise FlashtreeError(f"no such model directory: {name}; pass an existing path or a hub id like Qwen/Qwen3-8B")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        reason = type(e).__name__
        raise FlashtreeError(
            f"could not fetch {name!r} from the Hugging Face hub ({reason}); "
            "check the id and your connection, or download it and pass the local directory"
        ) from None


def read_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        cfg = json.load(f)
    # Multimodal wrappers (e.g. Qwen3.5) keep the language model's config under text_config.
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        text = dict(cfg["text_config"])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return text
    return cfg


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded (index json) safetensors checkpoint."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FlashtreeError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    return weights


def strip_prefix(name: str) -> str:
    for prefix in WEIGHT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], tied: bool = False) -> None:
    """Copy checkpoint tensors into `model`, naming any missing or unexpected weight."""
    state = {strip_prefix(k): v for k, v in weights.items()}
    if tied:
        state.pop("lm_head.weight", None)
    own = dict(model.state_dict())
    if tied:
        own.pop("lm_head.weight", None)
    missing = sorted(set(own) - set(state))
    # Multi-token-prediction heads and the vision tower of multimodal checkpoints are not ours to run.
    unexpected = sorted(k for k in set(state) - set(own) if not k.startswith(("mtp.", "visual.")))
    if missing or unexpected:
        raise FlashtreeError(
            f"checkpoint does not match the {type(model).__name__} architecture: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    with torch.no_grad():
        for k, tensor in own.items():
            src = state[k]
            if src.shape != tensor.shape:
                raise FlashtreeError(f"weight {k} has shape {tuple(src.shape)}, the config implies {tuple(tensor.shape)}")
            tensor.copy_(src)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Create modules directly in the run dtype: no float32 copy of a large model first."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise FlashtreeError(f"unknown dtype {dtype!r}; use one of {', '.join(table)} or auto")
    return table[dtype]


def load_target(name_or_path: str | os.PathLike, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build our own implementation of the target architecture and load its weights."""
    path = resolve(name_or_path)
    cfg = read_config(path)
    with default_dtype(dtype), torch.device(device):
        model = build_target(cfg)
    weights = read_weights(path)
    if hasattr(model, "convert_checkpoint"):  # checkpoint layouts that differ from the module's (Qwen3-Next)
        weights = model.convert_checkpoint(weights)
    load_weights(model, weights, tied=cfg.get("tie_word_embeddings", False))
    model.source_dir = path
    return model.eval()


def build_target(cfg: dict) -> nn.Module:
    model_type = cfg.get("model_type")
    if model_type in ("qwen3", "llama", "mistral"):
        from flashtree.models.transformer import Transformer, TransformerArgs

        return Transformer(TransformerArgs.from_hf(cfg))
    if model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"):
        from flashtree.models.qwen3_5 import Qwen35, Qwen35Args

        return Qwen35(Qwen35Args.from_hf(cfg))
    raise FlashtreeError(
        f"unsupported target model_type {model_type!r}; flashtree runs qwen3, llama and qwen3_5 targets"
    )
