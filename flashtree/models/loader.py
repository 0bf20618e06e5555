"""HF checkpoint directory or hub id -> transformers config -> our module, filled tensor by tensor.

Loading holds the model plus a bounded window of one shard on the host, never a second copy:
1. the config comes from transformers (AutoConfig, GenerationConfig);
2. the model is built on the meta device, so construction allocates nothing;
3. every checkpoint tensor is checked against the model by its safetensors header alone
   (name, shape), so a wrong checkpoint fails before any weight is read;
4. each parameter is allocated once, on its device and in its dtype, and every checkpoint
   tensor is copied straight into its place from safetensors' memory map, shard by shard:
   the whole tensor, or its rows of a fused projection (`MergedLinear`), or its expert of a
   stacked MoE weight (`Experts`). Modules with such layouts describe them with
   `checkpoint_layout(prefix)`; `hub_state_dict` inverts it to write checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from flashtree.config import looks_like_hub_id
from flashtree.errors import FlashtreeError

if TYPE_CHECKING:
    from flashtree.parallel.group import TensorParallel

log = logging.getLogger(__name__)

WEIGHT_PREFIXES = ("model.language_model.", "model.")
IGNORED = ("mtp.", "visual.")  # multi-token-prediction heads and vision towers: not ours to run
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
MAP_BUDGET = 64 << 20  # at most this many bytes of a shard mapped at a time (see ShardReader)
MIN_MAP_BUDGET = 1 << 20
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}


# ---- where a checkpoint is ---------------------------------------------------------------------


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a hub id fetched through huggingface_hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FlashtreeError(f"{path} has no config.json; point at an HF checkpoint directory")
        return path
    name = str(name_or_path)
    if not looks_like_hub_id(name):
        raise FlashtreeError(f"no such model directory: {name}; pass an existing path or a hub id like Qwen/Qwen3-8B")
    return fetch_from_hub(name, HUB_FILES)


def fetch_from_hub(name: str, patterns: list[str]) -> Path:
    """The local snapshot of hub id `name` (its files matching `patterns`), downloaded if need be.
    Failing, one line that says first whether the hub could be reached at all."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                       RepositoryNotFoundError)

    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:  # not cached, and the hub was not asked or did not answer
        if isinstance(e.__cause__, OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE:
            raise FlashtreeError(f"{name!r} is a Hugging Face hub id, but HF_HUB_OFFLINE is set and it is not in the "
                                 f"local cache ({constants.HF_HUB_CACHE}); unset HF_HUB_OFFLINE, or pass a local "
                                 "directory") from None
        cause = e.__cause__ or e.__context__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else "no answer"
        raise FlashtreeError(f"cannot reach the Hugging Face hub ({constants.ENDPOINT}: {reason.splitlines()[0]}) "
                             f"and {name!r} is not in the local cache; check the connection, or pass a local "
                             "directory") from None
    except GatedRepoError:
        raise FlashtreeError(f"{name!r} is gated on the Hugging Face hub: accept its terms on the model page and "
                             "log in (`hf auth login`), or pass a local directory") from None
    except RepositoryNotFoundError:
        raise FlashtreeError(f"no model {name!r} on the Hugging Face hub (or it is private); check the id, or pass a "
                             "local directory") from None
    except Exception as e:  # anything else the hub client raises
        raise FlashtreeError(f"could not fetch {name!r} from the Hugging Face hub ({type(e).__name__}); check the id "
                             "and your connection, or download it and pass the local directory") from None


# ---- configs through transformers ----------------------------------------------------------------


def read_config(path: Path):
    """The checkpoint's config as transformers reads it (both rope layouts, attribute aliases such
    as num_local_experts, the multimodal text_config wrapper). A model type the installed
    transformers does not know falls back to a plain PretrainedConfig over the raw json."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, TypeError) as e:
        try:
            raw = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as bad:
            raise FlashtreeError(f"{path / 'config.json'} is not valid JSON ({bad})") from None
        log.warning("transformers cannot read %s (%s); reading its config.json as it is",
                    path / "config.json", str(e).splitlines()[0] if str(e) else type(e).__name__)
        config = PretrainedConfig(**{k: v for k, v in raw.items() if k != "text_config"})
        if isinstance(raw.get("text_config"), dict):  # get_text_config() then returns it
            config.text_config = PretrainedConfig(**raw["text_config"])
        return config


def text_config(config):
    """The language model's config: `text_config` of a multimodal wrapper (Qwen3.5/3.6), else itself."""
    return config.get_text_config()


def tied_embeddings(config) -> bool:
    """As transformers decides it: the top-level config's flag, for wrappers too."""
    return bool(getattr(config, "tie_word_embeddings", False))


def read_generation_config(path: Path, config):
    """generation_config.json through transformers, or the defaults it derives from the model
    config when the checkpoint ships none."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").is_file():
        try:
            return GenerationConfig.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", path / "generation_config.json", e)
    return GenerationConfig.from_model_config(text_config(config))


def eos_token_ids(model: nn.Module) -> set[int]:
    """EOS ids of a loaded target: its generation config's and its model config's, as a set."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), text_config(model.hf_config)):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids


# ---- building ------------------------------------------------------------------------------------


@contextmanager
def meta_device():
    """Build modules on the meta device without running their initialisers: they would only fill
    storage that does not exist (and torch's meta `normal_` imports torch._dynamo, seconds)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


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


def build_target(config) -> nn.Module:
    """Our implementation of the config's architecture, with random (or, on meta, no) weights."""
    text = text_config(config)
    model_type = getattr(text, "model_type", None)
    if model_type in ("qwen3", "llama", "mistral"):
        from flashtree.models.transformer import Transformer, TransformerArgs

        args, cls = TransformerArgs.from_hf(text), Transformer
    elif model_type == "qwen3_moe":
        from flashtree.models.qwen3_moe import Qwen3Moe, Qwen3MoeArgs

        args, cls = Qwen3MoeArgs.from_hf(text), Qwen3Moe
    elif model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"):
        from flashtree.models.qwen3_5 import Qwen35, Qwen35Args

        args, cls = Qwen35Args.from_hf(text), Qwen35
    else:
        raise FlashtreeError(
            f"unsupported target model_type {model_type!r}; flashtree runs qwen3, qwen3_moe, llama and qwen3_5 targets"
        )
    args.tie_word_embeddings = tied_embeddings(config)
    return cls(args)


def load_target(name_or_path: str | os.PathLike, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel | None = None) -> nn.Module:
    """Build our own implementation of the target architecture and stream its weights in; with
    `tp`, only this rank's slice of it (flashtree.parallel.shard), read as slices of the checkpoint."""
    path = resolve(name_or_path)
    config = read_config(path)
    with meta_device(), default_dtype(dtype):
        model = build_target(config)
    load_checkpoint(model, path, torch.device(device), convert=getattr(model, "convert_checkpoint", None), tp=tp)
    model.source_dir = path
    model.hf_config = config
    model.generation_config = read_generation_config(path, config)
    return model.eval()


# ---- the checkpoint's layout against the model's ---------------------------------------------------


def strip_prefix(name: str) -> str:
    for prefix in WEIGHT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def checkpoint_layout(model: nn.Module) -> dict[str, tuple[str, tuple]]:
    """Checkpoint tensor name (without the `model.` prefix) -> (our parameter, index into it).

    A module with its own layout (`checkpoint_layout(prefix)`: fused projections, stacked
    experts) names its tensors; every other parameter is stored under its own name. Tied
    parameters appear once, under their first name.
    """
    layout: dict[str, tuple[str, tuple]] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        own = module.checkpoint_layout(prefix) if hasattr(module, "checkpoint_layout") else None
        for attr, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if own is None:
                layout[prefix + attr] = (prefix + attr, ())
        for ckpt, (attr, index) in (own or {}).items():
            layout[ckpt] = (prefix + attr, index)
    return layout


def hub_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors under the hub checkpoint's names (q/k/v, gate/up, experts separate)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if hasattr(module, "hub_state"):
            out.update(module.hub_state(prefix))
            seen.update(id(p) for p in module.parameters(recurse=False))
            continue
        for attr, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out[prefix + attr] = p
    return out


@dataclass
class Entry:
    """One checkpoint tensor and what it fills: (our parameter, index) per tensor it stands for."""

    file: str
    name: str  # as stored, prefix included
    targets: dict[str, tuple[str, tuple]]  # our-layout name -> (parameter, index)
    converted: bool = False  # passed through the model's convert_checkpoint first


@dataclass
class LoadPlan:
    """Every checkpoint tensor checked against the model before any weight is read."""

    directory: Path
    files: list[str]
    entries: list[Entry] = field(default_factory=list)

    def describe(self) -> str:
        return f"{len(self.files)} shard{'s' * (len(self.files) != 1)} of {self.directory}"


def checkpoint_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in files if not (path / name).is_file()]
        if missing:
            raise FlashtreeError(f"{index.name} lists {missing[0]}, which is not in {path}; download the whole checkpoint")
        return files
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FlashtreeError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors")
    return files


def plan_load(model: nn.Module, path: Path, convert=None, scope: str | None = None) -> LoadPlan:
    """Match every tensor of the checkpoint's headers to the model: names, shapes, coverage.

    scope: load only the tensors under this prefix, as the model's own names (an MTP head's
    `mtp.`); None reads the target's, under the `model.` prefixes, skipping IGNORED.
    """
    from safetensors import safe_open

    layout = checkpoint_layout(model)
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)  # tied copies
    plan = LoadPlan(path, checkpoint_files(path))
    filled = dict.fromkeys(params, 0)
    found: dict[str, str] = {}  # our-layout name -> file
    stored_prefix = scope or "model."
    kind = type(model).__name__

    def check(file: str, name: str, key: str, shape: tuple) -> tuple[str, tuple]:
        if key not in layout:
            raise FlashtreeError(f"{file}: unexpected tensor {name}; the {kind} architecture has no such weight "
                                 "(is the checkpoint for another model type?)")
        if key in found:
            raise FlashtreeError(f"{file}: {name} is also in {found[key]}; the checkpoint stores it twice")
        param, index = layout[key]
        want = tuple(params[param][index].shape)
        if tuple(shape) != want:
            raise FlashtreeError(f"{file}: {name} has shape {tuple(shape)}, the config implies {want}")
        found[key] = file
        filled[param] += params[param][index].numel()
        return layout[key]

    for file in plan.files:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                if scope is not None:
                    if not name.startswith(scope):
                        continue
                    key = name[len(scope):]
                else:
                    key = strip_prefix(name)
                    if key != name and key.startswith("layers."):
                        stored_prefix = name[: len(name) - len(key)]
                    if key.startswith(IGNORED):
                        continue
                if key in aliases:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if key not in layout and convert is not None:
                    outs = convert(key, torch.empty(shape, device="meta"))
                    if set(outs) != {key}:
                        targets = {k: check(file, f"{name} -> {k}", k, t.shape) for k, t in outs.items()}
                        plan.entries.append(Entry(file, name, targets, converted=True))
                        continue
                plan.entries.append(Entry(file, name, {key: check(file, name, key, shape)}))

    for param, numel in filled.items():
        if numel < params[param].numel():
            keys = [k for k, (p, _) in layout.items() if p == param and k not in found]
            keys = [k for k in keys if layout[k][1] != ()] or keys  # name a missing part, not the fused form
            shown = keys[0] if keys[0].startswith("lm_head.") else stored_prefix + keys[0]
            raise FlashtreeError(f"no tensor {shown} in any of the {plan.describe()}; "
                                 f"the checkpoint does not match the {kind} architecture")
        if numel > params[param].numel():
            raise FlashtreeError(f"{param} is filled twice from {path}: the checkpoint stores it in two layouts")
    return plan


# ---- filling -------------------------------------------------------------------------------------


class ShardReader:
    """Tensors of one safetensors file, read through safe_open's memory map.

    Pages the map has touched count in this process's resident memory until the file is
    closed, so the file is reopened every `budget` bytes read (a 16th of the shard, at most
    MAP_BUDGET), and a bigger tensor is read in row blocks: loading holds the model plus about
    one budget of the checkpoint, not a whole shard.
    """

    def __init__(self, path: Path, budget: int | None = None) -> None:
        self.path = path
        self.budget = budget or max(MIN_MAP_BUDGET, min(MAP_BUDGET, path.stat().st_size // 16))
        self.opened = 0
        self.file = None
        self.mapped = 0

    def _open(self):
        from safetensors import safe_open

        if self.file is None or self.mapped >= self.budget:
            self.close()
            self.file = safe_open(str(self.path), framework="pt").__enter__()
            self.opened += 1
        return self.file

    def close(self) -> None:
        if self.file is not None:
            self.file.__exit__(None, None, None)
        self.file, self.mapped = None, 0

    def tensor(self, name: str) -> Tensor:
        """The whole tensor (a view of the map: copy from it, do not keep it)."""
        t = self._open().get_tensor(name)
        self.mapped += t.numel() * t.element_size()
        return t

    def copy_into(self, name: str, dest: Tensor, source: tuple[slice, ...] = ()) -> None:
        """dest.copy_(tensor[source]), in row blocks of at most `budget` bytes; `source` (slices
        over leading dims, a tensor-parallel rank's part) is read alone, through get_slice."""
        view = self._open().get_slice(name)
        shape = view.get_shape()
        if not shape:
            dest.copy_(self.tensor(name))
            return
        first, rest = (source[0], tuple(source[1:])) if source else (slice(None), ())
        begin, end, _ = first.indices(shape[0])
        row_bytes = DTYPE_BYTES.get(view.get_dtype(), 8) * max(1, dest[0].numel() if len(dest) else 1)
        step = max(1, self.budget // row_bytes)
        for start in range(begin, end, step):
            stop = min(start + step, end)
            block = self._open().get_slice(name)[(slice(start, stop), *rest)]
            dest[start - begin:stop - begin].copy_(block)
            self.mapped += block.numel() * block.element_size()
            del block


def transposed_weights(model: nn.Module, device: torch.device) -> set[int]:
    """ids of the weights to store transposed (W^T contiguous, W a view of it): float32 linear weights on
    the CPU, where MKL multiplies a window of rows by a contiguous W^T up to 1.5x faster than by W
    (docs/performance.md). A tied LM head too: its embedding then gathers a window's rows strided, which
    costs far less than the head's matmul saves every round."""
    if device.type != "cpu":
        return set()
    from flashtree.models.layers import MergedLinear

    return {id(m.weight) for m in model.modules()
            if isinstance(m, (nn.Linear, MergedLinear)) and m.weight.dtype == torch.float32 and m.weight.dim() == 2}


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter real (uninitialised) storage on `device`, keeping ties, in the
    layout `transposed_weights` picks."""
    new: dict[int, nn.Parameter] = {}
    transposed = transposed_weights(model, device)
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                flip = id(p) in transposed
                data = torch.empty(p.shape[::-1] if flip else p.shape, dtype=p.dtype, device=device)
                new[id(p)] = nn.Parameter(data.t() if flip else data, requires_grad=p.requires_grad)
            module._parameters[attr] = new[id(p)]
    leftover = [n for n, b in model.named_buffers() if b.is_meta]
    leftover += [f"{n}.{k}" for n, m in model.named_modules() for k, v in vars(m).items()
                 if isinstance(v, Tensor) and v.is_meta]
    if leftover:  # a model bug, not a checkpoint problem: such tensors must be built on the CPU
        raise RuntimeError(f"{type(model).__name__} computes {leftover[:3]} in __init__ on the meta device; "
                           "create them with an explicit device")


def load_checkpoint(model: nn.Module, path: Path, device: torch.device, convert=None,
                    tp: TensorParallel | None = None, scope: str | None = None) -> None:
    """Fill a model built on the meta device from the safetensors checkpoint in `path`.

    convert(name, tensor) -> {name: tensor}: the model's per-tensor format conversion, for
    checkpoint tensors its layout does not name (Qwen3-Next's packed projections).
    tp: cut the model to this rank's slice after checking the checkpoint against the full model,
    and read only that slice of each tensor.
    scope: the checkpoint's tensors under this prefix fill the model (see plan_load).
    """
    plan = plan_load(model, path, convert, scope)
    shards = None
    if tp is not None:
        from flashtree.parallel.shard import shard_model, zero_rank0_only

        shards = shard_model(model, tp)
    materialize(model, device)
    params = dict(model.named_parameters())

    def places(param: str, index: tuple) -> list[tuple[tuple, tuple]]:
        """(index into our parameter, index into the checkpoint tensor) pairs to copy."""
        shard = shards.shards.get(param) if shards is not None else None
        return [(index, ())] if shard is None else shard.place(index)

    with torch.no_grad():
        for file in plan.files:
            reader = ShardReader(path / file)
            try:
                for entry in (e for e in plan.entries if e.file == file):
                    if entry.converted:
                        outs = convert(strip_prefix(entry.name), reader.tensor(entry.name))
                        for key, (param, index) in entry.targets.items():
                            for dest, source in places(param, index):
                                params[param][dest].copy_(outs[key][source])
                        del outs
                    else:
                        (param, index), = entry.targets.values()
                        for dest, source in places(param, index):
                            reader.copy_into(entry.name, params[param][dest], source)
            finally:
                reader.close()
        if shards is not None:
            zero_rank0_only(model, shards, tp)
