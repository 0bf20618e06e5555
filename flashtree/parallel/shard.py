"""Cut a target built on the meta device down to one rank's slice, Megatron style, before any
weight is read: the loader then reads only that slice of each checkpoint tensor.

- Column-parallel (each rank keeps its share of the output rows, by head or channel): every
  part of a fused projection (`MergedLinear`: q/k/v, gate/up; rank r keeps rows
  [r*s/N, (r+1)*s/N) of each part s), GDN's fused in_proj (its in_proj_qkv part and the conv
  channels with q, k and v sections split by key head, consistently with the heads; in_proj_z/b/a
  by value head), dt_bias and A_log (by value head), and each expert's gate/up (both halves along
  the intermediate dim).
- K/V heads: split when N divides them; with fewer K/V heads than ranks, each rank keeps the
  one head its query heads read (replicated over N / H_kv ranks).
- Row-parallel (input columns; the outputs are partial sums): o_proj, down_proj, each expert's
  down_proj, GDN's out_proj. Their biases stay on rank 0 alone, so the sum counts them once.
- One all-reduce per sub-block: a forward hook on each layer's attention (or GDN) module and on
  its MLP (or MoE: experts and shared expert summed first) adds the ranks' partial outputs, so
  a decoder layer costs 2, as in Megatron, and every rank holds the full hidden state after
  each (the replicated drafter reads the features it needs from there).
- Vocabulary-parallel embedding (masked lookup + all-reduce) and LM head (an all-gather of
  the rank's logits, so every rank walks the same full logits); a tied head shares the slice.
- Replicated: norms, the MoE router and shared-expert gate, RoPE, the drafter.
- An MTP head (flashtree.models.mtp) is cut like the target's layers; its `fc` and norms are
  replicated, and it reads the target's embedding and LM head.

The model's `args` are replaced by the rank's view (its head counts), so `new_cache` sizes the
rank's cache: K/V of its heads, GDN state and conv window of its heads and channels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.errors import FlashtreeError
from flashtree.models.gated_attention import GatedAttention
from flashtree.models.gated_deltanet import GatedDeltaNet
from flashtree.models.layers import MLP, MergedLinear
from flashtree.models.moe import Experts, SparseMoE
from flashtree.models.transformer import Attention
from flashtree.parallel.group import TensorParallel


@dataclass
class Shard:
    """The part of a full parameter (shape `full_shape`) one rank holds: along `dim`, pieces
    (local start, full start, length), in local order."""

    full_shape: tuple[int, ...]
    dim: int
    pieces: list[tuple[int, int, int]]

    def place(self, index: tuple) -> list[tuple[tuple, tuple]]:
        """For a checkpoint tensor that fills `index` of the full parameter (the loader's layout:
        ints and slices over leading dims), the (local index, index into the checkpoint tensor)
        pairs this rank copies. Empty when the tensor lies wholly on other ranks."""
        d = self.dim
        index = tuple(index)
        if d < len(index) and not isinstance(index[d], slice):
            raise ValueError(f"a checkpoint tensor indexes the sharded dim {d} with {index[d]!r}")
        start, stop, _ = (index[d] if d < len(index) else slice(None)).indices(self.full_shape[d])
        tensor_dim = d - sum(not isinstance(i, slice) for i in index[:d])  # ints drop a dim
        out = []
        for local, full, n in self.pieces:
            s, t = max(start, full), min(stop, full + n)
            if s >= t:
                continue
            dest = list(index) + [slice(None)] * (d + 1 - len(index))
            dest[d] = slice(local + s - full, local + t - full)
            source = (slice(None),) * tensor_dim + (slice(s - start, t - start),)
            out.append((tuple(dest), source))
        return out


@dataclass
class ShardPlan:
    """What shard_model did, for the loader: each sharded parameter's Shard, and the row-parallel
    biases only rank 0 keeps (the others zero them after loading)."""

    shards: dict[str, Shard] = field(default_factory=dict)
    rank0_only: set[str] = field(default_factory=set)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding: ids outside look up zeros, and the all-reduce
    fills them in from the rank that holds them."""

    def __init__(self, weight: nn.Parameter, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight, self.start, self.tp = weight, start, tp

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[..., None], 0))


class VocabParallelHead(nn.Module):
    """The LM head's rows of this rank's vocabulary slice; the logits are gathered whole, so every
    rank samples and walks the tree from the same full distribution."""

    packed = False  # tensor parallelism multiplies with F.linear (packed.pack_linears skips it)

    def __init__(self, weight: nn.Parameter, sizes: list[int], tp: TensorParallel) -> None:
        super().__init__()
        self.weight, self.sizes, self.tp = weight, sizes, tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight), self.sizes)


def shard_model(model: nn.Module, tp: TensorParallel) -> ShardPlan:
    """Cut `model` (on the meta device, full size) to rank tp.rank's slice; see the module docstring."""
    cut = _Cutter(model, tp)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if isinstance(module, (Attention, GatedAttention)):
            cut.attention(prefix, module)
        elif isinstance(module, GatedDeltaNet):
            cut.gated_deltanet(prefix, module)
        elif isinstance(module, MLP):
            cut.mlp(prefix, module)
        elif isinstance(module, Experts):
            cut.experts(prefix, module)
    for layer in model.layers:
        mixer = layer.linear_attn if getattr(layer, "linear", False) else layer.self_attn
        for module in (mixer, layer.mlp):
            if not isinstance(module, (Attention, GatedAttention, GatedDeltaNet, MLP, SparseMoE)):
                raise FlashtreeError(f"tensor parallelism cannot split {type(module).__name__} layers")
            module.register_forward_hook(lambda _m, _inputs, out: tp.all_reduce(out))
    if hasattr(model, "embed_tokens"):  # an MTP head borrows the target's (already split) vocabulary
        cut.vocabulary()
    model.args = cut.local_args()
    model.tp = tp
    return cut.plan


class _Cutter:
    def __init__(self, model: nn.Module, tp: TensorParallel) -> None:
        self.model, self.tp, self.plan = model, tp, ShardPlan()
        self.heads: dict[str, int] = {}  # local head counts for the model's args

    def _replace(self, module: nn.Module, attr: str, name: str, dim: int, pieces: list[tuple[int, int]]) -> None:
        """Keep the full-parameter ranges `pieces` [(full start, length)] of dim `dim`, in order."""
        p = getattr(module, attr)
        shape = list(p.shape)
        local, placed = 0, []
        for full, n in pieces:
            placed.append((local, full, n))
            local += n
        shape[dim] = local
        self.plan.shards[name + attr] = Shard(tuple(p.shape), dim, placed)
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                           requires_grad=p.requires_grad))

    def merged(self, prefix: str, ml: MergedLinear, keep: list[tuple[int, int] | list[tuple[int, int]]]) -> None:
        """Each part keeps its rows [start, start + n) (keep[i] for part i; a list of such ranges
        for a part whose sections split alike, like GDN's q, k and v)."""
        offsets = [sum(ml.sizes[:i]) for i in range(len(ml.sizes))]
        ranges = [part if isinstance(part, list) else [part] for part in keep]
        pieces = [(o + s, n) for o, part in zip(offsets, ranges) for s, n in part]
        self._replace(ml, "weight", prefix, 0, pieces)
        if ml.bias is not None:
            self._replace(ml, "bias", prefix, 0, pieces)
        ml.sizes = [sum(n for _, n in part) for part in ranges]

    def column(self, prefix: str, linear: nn.Linear, pieces: list[tuple[int, int]]) -> None:
        self._replace(linear, "weight", prefix, 0, pieces)
        if linear.bias is not None:
            self._replace(linear, "bias", prefix, 0, pieces)
        linear.out_features = sum(n for _, n in pieces)

    def row(self, prefix: str, linear: nn.Linear, start: int, n: int) -> None:
        self._replace(linear, "weight", prefix, 1, [(start, n)])
        linear.in_features = n
        if linear.bias is not None:
            self.plan.rank0_only.add(prefix + "bias")

    def kv_heads(self, total: int, q_start: int, q_per_rank: int, q_total: int) -> tuple[int, int]:
        """This rank's K/V heads: its equal share, or, with fewer heads than ranks, the one its
        query heads read."""
        world = self.tp.world
        if total % world == 0:
            return self.tp.split(total, "key/value heads")
        if world % total:
            raise FlashtreeError(f"the target has {total} key/value heads and tensor_parallel_size={world}: "
                                 "one must divide the other")
        return q_start // (q_total // total), 1

    def attention(self, prefix: str, m: Attention | GatedAttention) -> None:
        hd = m.head_dim
        per_head = m.qkv_proj.sizes[0] // m.num_heads  # head_dim, or 2 x head_dim with a gate
        q0, nq = self.tp.split(m.num_heads, "attention heads")
        k0, nk = self.kv_heads(m.num_kv_heads, q0, nq, m.num_heads)
        self.merged(prefix + "qkv_proj.", m.qkv_proj, [(q0 * per_head, nq * per_head), (k0 * hd, nk * hd),
                                                      (k0 * hd, nk * hd)])
        self.row(prefix + "o_proj.", m.o_proj, q0 * hd, nq * hd)
        m.num_heads, m.num_kv_heads = nq, nk
        self.heads.update(num_heads=nq, num_kv_heads=nk)

    def gated_deltanet(self, prefix: str, m: GatedDeltaNet) -> None:
        dk, dv = m.dk, m.dv
        k0, nk = self.tp.split(m.num_k_heads, "linear-attention key heads")
        rep = m.num_v_heads // m.num_k_heads  # value heads per key head, kept together
        v0, nv = k0 * rep, nk * rep
        qkv = [(k0 * dk, nk * dk), (m.key_dim + k0 * dk, nk * dk), (2 * m.key_dim + v0 * dv, nv * dv)]
        self.merged(prefix + "in_proj.", m.in_proj, [qkv, (v0 * dv, nv * dv), (v0, nv), (v0, nv)])
        self._replace(m.conv1d, "weight", prefix + "conv1d.", 0, qkv)
        channels = 2 * nk * dk + nv * dv
        m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = channels
        for attr in ("dt_bias", "A_log"):
            self._replace(m, attr, prefix, 0, [(v0, nv)])
        self.row(prefix + "out_proj.", m.out_proj, v0 * dv, nv * dv)
        m.num_k_heads, m.num_v_heads, m.key_dim, m.value_dim = nk, nv, nk * dk, nv * dv
        self.heads.update(linear_num_key_heads=nk, linear_num_value_heads=nv)

    def mlp(self, prefix: str, m: MLP) -> None:
        hidden = m.gate_up_proj.sizes[0]
        s, n = self.tp.split(hidden, "MLP channels")
        self.merged(prefix + "gate_up_proj.", m.gate_up_proj, [(s, n), (s, n)])
        self.row(prefix + "down_proj.", m.down_proj, s, n)

    def experts(self, prefix: str, m: Experts) -> None:
        s, n = self.tp.split(m.hidden, "expert channels")
        self._replace(m, "gate_up_proj", prefix, 1, [(s, n), (m.hidden + s, n)])
        self._replace(m, "down_proj", prefix, 2, [(s, n)])
        m.hidden = n

    def vocabulary(self) -> None:
        model, tp = self.model, self.tp
        tied = model.lm_head.weight is model.embed_tokens.weight
        sizes = tp.balanced(model.embed_tokens.weight.shape[0])
        start, n = sum(sizes[: tp.rank]), sizes[tp.rank]
        self._replace(model.embed_tokens, "weight", "embed_tokens.", 0, [(start, n)])
        embed = model.embed_tokens.weight
        model.embed_tokens = VocabParallelEmbedding(embed, start, tp)
        if not tied:
            self._replace(model.lm_head, "weight", "lm_head.", 0, [(start, n)])
        model.lm_head = VocabParallelHead(embed if tied else model.lm_head.weight, sizes, tp)

    def local_args(self):
        args = self.model.args
        return dataclasses.replace(args, **{k: v for k, v in self.heads.items() if hasattr(args, k)})


def zero_rank0_only(model: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    """Row-parallel biases count once in the sum: ranks other than 0 hold zeros."""
    if tp.rank == 0:
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in plan.rank0_only:
            params[name].zero_()
