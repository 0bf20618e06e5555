"""Qwen3.5 / Qwen3.6 hybrid targets: Gated DeltaNet layers + gated full attention, read top-down.

Most layers are Gated DeltaNet (GDN): a causal depthwise conv over the qkv projection, then the
gated delta rule, a linear recurrence over a [dk, dv] state per head. Every few layers is a full
attention layer with an output gate, q/k norm and partial RoPE. The MLP is dense (qwen3_5) or
top-k routed experts plus a gated shared expert (qwen3_5_moe, qwen3_next). Module names follow the
HF checkpoints (minus the `model.` / `model.language_model.` prefix), with q/k/v and gate/up fused
(`MergedLinear`, packed by the loader); Qwen3-Next's packed GDN projections are split on load
(`Qwen35.convert_checkpoint`).

Verifying a draft tree needs every node to see the recurrent state of its own ancestor path.
Rather than stepping depth by depth, a window is solved in closed form: within a window, the
delta rule's state after node i is

    S_i = exp(c_i) S_0 + sum_{j in path(i)} exp(c_i - c_j) k_j d_j^T

where S_0 is the slot's committed state, c_i the summed log-decay along i's path, and d_j the
"delta" (what node j writes). The d_j solve a unit lower-triangular system whose off-diagonal
entries live only on ancestor pairs (the chunked delta rule of the GDN paper, with the causal
mask replaced by the ancestor mask). In a topological order that system is still triangular,
and each node's row involves only its own path, so every node gets exactly the values its path
would give as a plain sequence: one batched solve per layer, no host sync, no per-depth loop.
The window keeps (k_j, d_j, c_j) per node, not per-node states (dk + dv numbers per head, not
dk * dv), and `commit` rebuilds the accepted node's state from them with the formula above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.cache import CacheView, KVCache
from flashtree.errors import FlashtreeError
from flashtree.models.layers import MLP, MergedLinear, apply_rotary, attention, rope_parameters
from flashtree.models.mask import window_mask
from flashtree.models.moe import SparseMoE
from flashtree.models.transformer import DecoderLM, ForwardOutput
from flashtree.tree import TreeSpec, ancestor_mask, ancestor_table

CHUNK = 64  # prefill chunk of the delta rule: the per-chunk solve is CHUNK x CHUNK per head
# Path decays below exp(-floor) are taken as exactly 0: 60x under the dtype's epsilon next to the terms
# they are added to, and it keeps subnormal floats (100x slower on CPUs) out of the solve and matmuls.
DECAY_FLOOR = {torch.float32: 20.0, torch.float64: 40.0}


@dataclass
class Qwen35Args:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: list[str]
    linear_conv_kernel: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    # Mixture of experts (qwen3_5_moe, qwen3_next); num_experts == 0 means dense MLPs throughout.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, config) -> "Qwen35Args":
        """From the text config transformers reads (Qwen3_5TextConfig, Qwen3_5MoeTextConfig,
        Qwen3NextConfig: loader.read_config unwraps the multimodal layout)."""
        c = config
        layers = c.num_hidden_layers
        types = getattr(c, "layer_types", None)
        if not types:  # a raw config of a type this transformers does not know
            every = getattr(c, "full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        rope = rope_parameters(c)
        rope.setdefault("partial_rotary_factor", 0.25)  # HF's default for this family
        if rope["rope_type"] == "mrope":
            rope["rope_type"] = "default"  # text positions: all three mrope axes agree, so 1-D RoPE
        heads = c.num_attention_heads

        def opt(key: str, default=0):  # dense configs have no MoE keys; some hold None
            return getattr(c, key, None) or default

        return cls(
            model_type=getattr(c, "model_type", None) or "qwen3_5_text",
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=opt("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=opt("num_key_value_heads", heads),
            head_dim=opt("head_dim", c.hidden_size // heads),
            rms_norm_eps=opt("rms_norm_eps", 1e-6),
            layer_types=list(types),
            linear_conv_kernel=opt("linear_conv_kernel_dim", 4),
            linear_key_head_dim=opt("linear_key_head_dim", 128),
            linear_value_head_dim=opt("linear_value_head_dim", 128),
            linear_num_key_heads=opt("linear_num_key_heads", 16),
            linear_num_value_heads=opt("linear_num_value_heads", 32),
            rope=rope,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            max_position_embeddings=opt("max_position_embeddings", 32768),
            num_experts=opt("num_experts"),
            num_experts_per_tok=opt("num_experts_per_tok"),
            moe_intermediate_size=opt("moe_intermediate_size"),
            shared_expert_intermediate_size=opt("shared_expert_intermediate_size"),
            norm_topk_prob=bool(getattr(c, "norm_topk_prob", True)),
            decoder_sparse_step=opt("decoder_sparse_step", 1),
            mlp_only_layers=list(opt("mlp_only_layers", [])),
        )

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:
        a = self
        return 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim


# ---- norms ------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: scales by (1 + weight), in float32, then casts (Qwen3.5's order)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the GDN output per value head, then times silu(z): plain weight, not zero-centred."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        f = torch.promote_types(dtype, torch.float32)
        y = x.to(f)
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (y * F.silu(gate.to(f))).to(dtype)


# ---- the gated delta rule over a window ---------------------------------------------------------


@dataclass
class DeltaWindow:
    """What a window leaves for `commit`: per node the key, the delta it wrote, its path decay."""

    slots: list[int]
    inputs: Tensor  # [R, N, C] conv inputs (the qkv projection before the conv)
    keys: Tensor  # [R, H, N, dk] in the state's dtype, normalised
    deltas: Tensor  # [R, H, N, dv]
    decay: Tensor  # [R, H, N]: c_i, summed log-decay along the node's path in the window


def delta_rule_window(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The gated delta rule over one window, every node on its own ancestor path.

    q, k [R, H, N, dk] (normalised, q scaled), v [R, H, N, dv], g, beta [R, H, N], state
    [R, H, dk, dv] the state before the window, mask [R, 1, N, N] ancestor-or-self (None = causal
    chain). Returns outputs [R, H, N, dv], deltas [R, H, N, dv] and path decays c [R, H, N].
    """
    n = q.shape[2]
    if mask is None:
        c = g.cumsum(-1)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    else:
        c = (mask.to(g.dtype) @ g[..., None])[..., 0]
    # gamma[i, j] = exp(c_i - c_j) on ancestor pairs (<= 1 there), 0 elsewhere; masked before exp.
    gamma = decay_exp((c[..., :, None] - c[..., None, :]).masked_fill(~mask, float("-inf")))
    decay = decay_exp(c)
    kk = (k @ k.transpose(-1, -2)) * beta[..., None]
    # deltas = (I + T)^-1 (beta v) - exp(c) * [(I + B)^-1 (beta k)] S_0, with T = beta kk gamma and
    # B = beta kk on strict ancestor pairs. The second solve is the decayed one (what HF solves)
    # conjugated by diag(exp(c)), so it carries no decays and its solution stays O(1) instead of
    # sinking into subnormals along long chains.
    u = torch.linalg.solve_triangular(kk * gamma, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(kk.masked_fill(~mask, 0), k * beta[..., None], upper=False, unitriangular=True)
    deltas = u - decay[..., None] * (w @ state)
    out = (q * decay[..., None]) @ state + ((q @ k.transpose(-1, -2)) * gamma) @ deltas
    return out, deltas, c


def decay_exp(x: Tensor) -> Tensor:
    """exp of log-decays x <= 0, exactly 0 below exp(-DECAY_FLOOR)."""
    return torch.where(x < -DECAY_FLOOR[x.dtype], float("-inf"), x).exp()


def advance_state(state: Tensor, keys: Tensor, deltas: Tensor, decay: Tensor, last: Tensor, weight: Tensor) -> Tensor:
    """S_last = exp(c_last) S_0 + sum_j weight_j exp(c_last - c_j) k_j d_j^T.

    state [R, H, dk, dv]; keys/deltas/decay [R, H, A, *] for the nodes of last's path;
    last [R, H] its decay c; weight [R, 1, A] marks which of the A nodes are on the path.
    """
    w = decay_exp(last[..., None] - decay) * weight
    return state * decay_exp(last)[..., None, None] + (keys * w[..., None]).transpose(-1, -2) @ deltas


# ---- layers -------------------------------------------------------------------------------------


@dataclass
class Step:
    """What every layer of one forward shares: cache rows, masks and conv gathers for the window."""

    view: CacheView
    rows: Tensor  # [R, N] cache rows the window's K/V go to
    mask: Tensor  # [R, 1, N, key_len] attention mask
    key_len: int
    keep_all: bool  # tree=None: the whole window is kept (prefill), states advance in place
    tree_mask: Tensor | None  # [R, 1, N, N] ancestor-or-self; None for a chain
    conv_index: Tensor | None  # [R, N, K] rows of [conv window ++ window inputs] each node convolves

    @classmethod
    def make(cls, view: CacheView, tree: TreeSpec | None, n: int, kernel: int) -> "Step":
        rows = view.starts[:, None] + torch.arange(n, device=view.starts.device)
        tree_mask = conv_index = None
        if tree is not None and not tree.is_chain:
            tree_mask = ancestor_mask(tree)[:, None]
            conv_index = conv_gather_index(tree, kernel)
        return cls(view, rows, window_mask(view, tree, n), view.max_start + n, tree is None, tree_mask, conv_index)


def conv_gather_index(tree: TreeSpec, kernel: int) -> Tensor:
    """idx[r, i, t]: where tap t of node i's conv reads, in [committed window (K-1) ++ nodes (N)].

    Tap t sees the node's ancestor at depth d_i - (K-1) + t; depths before the root fall back to
    the slot's committed conv window.
    """
    table = ancestor_table(tree)  # [R, N, D+1]
    e = tree.depths[..., None] - (kernel - 1) + torch.arange(kernel, device=table.device)
    node = table.gather(2, e.clamp(0, table.shape[2] - 1))
    return torch.where(e >= 0, kernel - 1 + node, kernel - 1 + e)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: Qwen35Args, index: int) -> None:
        super().__init__()
        a = args
        self.index = index  # which GDN layer: row of the cache's recurrent state
        self.num_k_heads, self.num_v_heads = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.dk, self.num_v_heads * self.dv
        self.kernel = a.linear_conv_kernel
        conv_dim = a.conv_dim
        self.in_proj_qkv = nn.Linear(a.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(a.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(a.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(a.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, a.hidden_size, bias=False)

    def conv(self, u: Tensor, window: Tensor, step: Step) -> Tensor:
        """silu(causal depthwise conv) of inputs u [R, N, C] after the committed window [R, K-1, C]."""
        ext = torch.cat([window, u], dim=1)  # [R, K-1+N, C]
        w = self.conv1d.weight[:, 0]  # [C, K]
        if step.conv_index is None:  # a chain: each node's taps are the K inputs ending at it
            out = F.conv1d(ext.transpose(1, 2).to(w.dtype), w[:, None], groups=w.shape[0])
            return F.silu(out).transpose(1, 2).to(u.dtype)
        r, n, k = step.conv_index.shape
        taps = ext.gather(1, step.conv_index.reshape(r, n * k, 1).expand(-1, -1, ext.shape[2]))
        out = (taps.view(r, n, k, -1) * w.t()).sum(2)
        return F.silu(out).to(u.dtype)

    def forward(self, x: Tensor, step: Step) -> Tensor:
        r, n, _ = x.shape
        cache: HybridCache = step.view.cache
        slots = step.view.slots
        u = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(r, n, self.num_v_heads, self.dv)
        f = cache.state.dtype  # the recurrence runs in float32 (float64 for a float64 model)
        beta = self.in_proj_b(x).sigmoid().to(f)
        g = -self.A_log.to(f).exp() * F.softplus(self.in_proj_a(x).to(f) + self.dt_bias)

        window = cache.conv[self.index, slots]  # [R, K-1, C]
        mixed = self.conv(u, window, step)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(r, n, self.num_k_heads, self.dk).transpose(1, 2).to(f)
        k = k.reshape(r, n, self.num_k_heads, self.dk).transpose(1, 2).to(f)
        v = v.reshape(r, n, self.num_v_heads, self.dv).transpose(1, 2).to(f)
        if self.num_v_heads != self.num_k_heads:  # each q/k head serves consecutive value heads
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = l2norm(q) * self.dk**-0.5
        k = l2norm(k)
        beta, g = beta.transpose(1, 2), g.transpose(1, 2)  # [R, H, N]

        state = cache.state[self.index, slots]  # [R, H, dk, dv]
        if step.keep_all:
            out = self.prefill(q, k, v, g, beta, state, slots, cache)
            cache.conv[self.index, slots] = torch.cat([window, u], dim=1)[:, -(self.kernel - 1):]
        else:
            out, deltas, c = delta_rule_window(q, k, v, g, beta, state, step.tree_mask)
            cache.windows[self.index] = DeltaWindow(step.view.slot_list, u, k, deltas, c)

        out = self.norm(out.transpose(1, 2).to(x.dtype), z)
        return self.out_proj(out.reshape(r, n, self.value_dim))

    def prefill(self, q, k, v, g, beta, state, slots, cache: "HybridCache") -> Tensor:
        """A kept window in chunks of CHUNK tokens; writes the state after its last token."""
        outs = []
        for s in range(0, q.shape[2], CHUNK):
            part = slice(s, s + CHUNK)
            out, deltas, c = delta_rule_window(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part],
                                               beta[:, :, part], state, None)
            state = advance_state(state, k[:, :, part], deltas, c, c[..., -1], torch.ones_like(c[:, :1]))
            outs.append(out)
        cache.state[self.index, slots] = state
        return torch.cat(outs, dim=2)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate from q_proj."""

    def __init__(self, args: Qwen35Args, index: int) -> None:
        super().__init__()
        d, hd, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.index = index  # which attention layer: row of the cache's K/V
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        # q_proj holds each head's query and output gate: [H, 2, hd] rows.
        self.qkv_proj = MergedLinear(d, [("q_proj", args.num_heads * hd * 2), ("k_proj", args.num_kv_heads * hd),
                                         ("v_proj", args.num_kv_heads * hd)], bias=bias)
        self.o_proj = nn.Linear(args.num_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], step: Step) -> Tensor:
        r, n, _ = x.shape
        qg, k, v = self.qkv_proj(x)
        q, gate = qg.view(r, n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(r, n, self.num_kv_heads, self.head_dim)
        v = v.view(r, n, self.num_kv_heads, self.head_dim)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), *rope)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), *rope)
        cache = step.view.cache
        cache.write(self.index, step.view, step.rows, k.transpose(1, 2), v)
        keys, values = cache.read(self.index, step.view, step.key_len)
        out = attention(q, keys, values, step.mask, self.head_dim**-0.5).transpose(1, 2).reshape(r, n, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(r, n, -1)))


class Block(nn.Module):
    def __init__(self, args: Qwen35Args, layer: int) -> None:
        super().__init__()
        self.linear = args.layer_types[layer] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(args, args.gdn_layers.index(layer))
        else:
            self.self_attn = GatedAttention(args, args.attention_layers.index(layer))
        if args.is_moe(layer):
            self.mlp = SparseMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                                 args.norm_topk_prob, args.shared_expert_intermediate_size)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], step: Step) -> Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, step) if self.linear else self.self_attn(h, rope, step))
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- the cache ----------------------------------------------------------------------------------


class HybridCache(KVCache):
    """K/V for the attention layers (the parent KVCache) plus, per GDN layer and slot, the
    recurrent state [H, dk, dv] (at least float32, whatever the model dtype) and the conv window [K-1, C].

    A verify window leaves each GDN layer's `DeltaWindow`; `commit` sets every slot's state and
    conv window to those after its last accepted node. A window run with tree=None is kept whole
    (prefill), so it advances the states in place and `set_length` only confirms the length.
    """

    def __init__(self, args: Qwen35Args, num_slots: int, max_len: int, dtype: torch.dtype, device) -> None:
        super().__init__(len(args.attention_layers), num_slots, max_len, args.num_kv_heads, args.head_dim, dtype, device)
        g = len(args.gdn_layers)
        a = args
        self.conv = torch.zeros(g, num_slots, a.linear_conv_kernel - 1, a.conv_dim, dtype=dtype, device=device)
        self.state = torch.zeros(g, num_slots, a.linear_num_value_heads, a.linear_key_head_dim,
                                 a.linear_value_head_dim, dtype=torch.promote_types(dtype, torch.float32),
                                 device=device)
        self.windows: dict[int, DeltaWindow] = {}
        self.state_len = [0] * num_slots  # tokens folded into each slot's recurrent state

    def set_length(self, slot: int, length: int) -> None:
        """0 starts the slot afresh. A recurrence cannot be rewound, so a shorter length than the
        state holds is refused; a longer one (a benchmark that fakes a context's K/V) is taken as is."""
        if length == 0:
            self.conv[:, slot] = 0
            self.state[:, slot] = 0
        elif length < self.state_len[slot]:
            raise FlashtreeError(
                f"cannot set slot {slot} of a hybrid cache to length {length}: its recurrent state holds "
                f"{self.state_len[slot]} tokens, and a recurrence cannot be rewound"
            )
        self.state_len[slot] = length
        super().set_length(slot, length)

    def commit(self, view: CacheView, path: Tensor, num_nodes: list[int], chain: bool = False) -> None:
        """Keep the accepted path's K/V, and move each GDN state to the path's last node.

        path [R, A] holds window node indices, root first, -1 past num_nodes: exactly the nodes on
        the last accepted node's path, so the state needs no ancestor lookups.
        """
        super().commit(view, path, num_nodes, chain)
        for slot, start, n in zip(view.slot_list, view.start_list, num_nodes):
            self.state_len[slot] = start + n
        if not self.windows:
            return
        count = torch.tensor(num_nodes, device=path.device)
        node = path.clamp(min=0)  # [R, A]
        on_path = (torch.arange(path.shape[1], device=path.device) < count[:, None]).float()[:, None]  # [R, 1, A]
        last = path.gather(1, (count - 1)[:, None])  # [R, 1]
        for layer, win in self.windows.items():
            if win.slots != view.slot_list:
                raise FlashtreeError("commit got a different view than the window it commits")
            h = win.keys.shape[1]
            idx = node[:, None, :].expand(-1, h, -1)
            keys = win.keys.gather(2, idx[..., None].expand(-1, -1, -1, win.keys.shape[-1]))
            deltas = win.deltas.gather(2, idx[..., None].expand(-1, -1, -1, win.deltas.shape[-1]))
            decay = win.decay.gather(2, idx)
            c_last = win.decay.gather(2, last[:, None, :].expand(-1, h, -1))[..., 0]
            state = self.state[layer, view.slots]
            self.state[layer, view.slots] = advance_state(state, keys, deltas, decay, c_last, on_path)
            # Conv window after the last node: the last K-1 inputs of [old window ++ path inputs].
            k1 = self.conv.shape[2]
            seq = torch.cat([self.conv[layer, view.slots], win.inputs.gather(
                1, node[..., None].expand(-1, -1, win.inputs.shape[-1]))], dim=1)
            take = count[:, None] + torch.arange(k1, device=path.device)
            self.conv[layer, view.slots] = seq.gather(1, take[..., None].expand(-1, -1, seq.shape[-1]))
        self.windows = {}


# ---- the model ----------------------------------------------------------------------------------


class Qwen35(DecoderLM):
    def __init__(self, args: Qwen35Args) -> None:
        # Qwen3.5's final norm is zero-centred like its others.
        layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        super().__init__(args, layers, RMSNorm(args.hidden_size, args.rms_norm_eps))

    def convert_checkpoint(self, name: str, w: Tensor) -> dict[str, Tensor]:
        """One checkpoint tensor -> the tensors of this model's layout it stands for (the loader calls
        it per tensor). Qwen3-Next packs each key head's q, k, v, z (and b, a) rows together in
        in_proj_qkvz (in_proj_ba); they are split into the Qwen3.5 projections this model has."""
        a = self.args
        hk, r = a.linear_num_key_heads, a.linear_num_value_heads // a.linear_num_key_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            q, k, v, z = w.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            return {base + "in_proj_qkv.weight": torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)]),
                    base + "in_proj_z.weight": z.reshape(-1, w.shape[-1])}
        if name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            b, a_ = w.view(hk, 2 * r, -1).split([r, r], dim=1)
            return {base + "in_proj_b.weight": b.reshape(-1, w.shape[-1]),
                    base + "in_proj_a.weight": a_.reshape(-1, w.shape[-1])}
        return {name: w}

    def new_cache(self, num_slots: int, max_len: int) -> HybridCache:
        p = self.embed_tokens.weight
        return HybridCache(self.args, num_slots, max_len, p.dtype, p.device)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: CacheView,
        tree: TreeSpec | None = None,
        feature_layers: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> ForwardOutput:
        """Run a window of tokens [R, N] at `positions` [R, N] after each slot's prefix.

        tree=None: a chain that is kept whole (prefill); recurrent states advance in place. With a
        TreeSpec (chain_spec for a plain chain), states stay put until `cache.commit`.
        Features are the outputs of the blocks in `feature_layers` (HF hidden_states[k+1]).
        """
        step = Step.make(cache, tree, tokens.shape[1], self.args.linear_conv_kernel)
        out = self.run(tokens, positions, step, feature_layers, last_only)
        if step.keep_all:
            for slot, start in zip(cache.slot_list, cache.start_list):
                cache.cache.state_len[slot] = start + tokens.shape[1]
        return out
