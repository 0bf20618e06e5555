"""Top-k routed experts (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next), computed with no host sync.

The experts are stacked: `gate_up_proj` [E, 2I, d] and `down_proj` [E, d, I], the layout
transformers 5.x keeps in memory. Hub checkpoints store one tensor per expert
(`experts.N.{gate,up,down}_proj.weight`); the loader places each at its expert and rows, and a
checkpoint with the fused tensors loads as it is.

Which expert runs on which token is data, and reading it on the host (`.unique().tolist()`,
`nonzero`) stalls the device once per layer. Every path here has shapes fixed by the token
count alone (see `expert_path`; benchmarks/moe_cost.py measured the choice):
- "grouped": (token, slot) pairs sorted by expert, one grouped GEMM (`torch._grouped_mm`)
  whose per-expert offsets stay on the device. It touches only the experts that were chosen.
- "gather": each pair gathers its expert's weights and runs one batched matmul; for a handful
  of pairs where grouped GEMMs do not exist (float64, CUDA float32, odd widths).
- "dense": every expert on every token, weighted by a [T, E] routing matrix that is zero off
  the top k; the same fallback for more pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.models.layers import MLP, linear_init


class Router(nn.Module):
    """Softmax over the experts (float32 at least), top k; `normalize` (norm_topk_prob) rescales
    the k weights to sum to one."""

    def __init__(self, num: int, dim: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.weight = nn.Parameter(torch.zeros(num, dim))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = F.linear(x, self.weight).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32))
        weight, index = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weight = weight / weight.sum(-1, keepdim=True)
        return index, weight.to(x.dtype)


def grouped_mm_works(x: Tensor, *widths: int) -> bool:
    """torch._grouped_mm takes float32/bf16/fp16 on the CPU and bf16 on CUDA (Hopper and later),
    with rows that are whole multiples of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(w * x.element_size() % 16 == 0 for w in widths)


def expert_path(tokens: int, top_k: int, num_experts: int, grouped_ok: bool) -> str:
    """Which computation a layer uses for `tokens` tokens: decided by shapes only, never by data.

    benchmarks/moe_cost.py (CPU, one thread, float32 and bf16): at the Qwen3-30B-A3B/4 expert
    shape the grouped GEMM was the fastest at every T in {1, 16, 64, 256}. Without it, gathering
    (which copies T*k expert weight sets) beat the dense compute at T*k = E/16 and lost from
    T*k = E on, so it is kept to T*k <= E/4.
    """
    if grouped_ok:
        return "grouped"
    return "gather" if 4 * tokens * top_k <= num_experts else "dense"


class Experts(nn.Module):
    """E SwiGLU experts, stacked (see the module docstring for the checkpoint names)."""

    def __init__(self, num: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts, self.hidden = num, hidden
        self.gate_up_proj = nn.Parameter(linear_init(2 * hidden, dim, num))
        self.down_proj = nn.Parameter(linear_init(dim, hidden, num))

    def checkpoint_layout(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """Checkpoint name -> (own parameter, index): per expert as the hub stores them, or fused as
        some transformers 5.x versions write them."""
        i = self.hidden
        out = {}
        for e in range(self.num_experts):
            out[f"{prefix}{e}.gate_proj.weight"] = ("gate_up_proj", (e, slice(0, i)))
            out[f"{prefix}{e}.up_proj.weight"] = ("gate_up_proj", (e, slice(i, 2 * i)))
            out[f"{prefix}{e}.down_proj.weight"] = ("down_proj", (e,))
        out[f"{prefix}gate_up_proj"] = ("gate_up_proj", ())
        out[f"{prefix}down_proj"] = ("down_proj", ())
        return out

    def hub_state(self, prefix: str) -> dict[str, Tensor]:
        """Per-expert tensors under the hub's names, for writing checkpoints."""
        layout = self.checkpoint_layout(prefix)
        return {name: getattr(self, attr)[index] for name, (attr, index) in layout.items() if index != ()}

    def forward(self, x: Tensor, index: Tensor, weight: Tensor, path: str | None = None) -> Tensor:
        """x [T, d]; index/weight [T, k]: each token through its k experts, weighted and summed."""
        t, k = index.shape
        if path is None:
            grouped_ok = grouped_mm_works(x, x.shape[-1], self.hidden)
            path = expert_path(t, k, self.num_experts, grouped_ok)
        if path == "dense":
            return self.dense(x, index, weight)
        y = self.gather(x, index) if path == "gather" else self.grouped(x, index)
        return (y.view(t, k, -1) * weight[..., None]).sum(1)

    def swiglu(self, h: Tensor) -> Tensor:
        gate, up = h.split(self.hidden, dim=-1)
        return F.silu(gate) * up

    def gather(self, x: Tensor, index: Tensor) -> Tensor:
        """[T*k, d]: pair (t, s) through expert index[t, s], by gathered weights and one bmm each."""
        k = index.shape[1]
        flat = index.reshape(-1)
        h = torch.bmm(x.repeat_interleave(k, dim=0)[:, None], self.gate_up_proj[flat].transpose(1, 2))
        return torch.bmm(self.swiglu(h), self.down_proj[flat].transpose(1, 2))[:, 0]

    def grouped(self, x: Tensor, index: Tensor) -> Tensor:
        """[T*k, d]: pairs sorted by expert, each expert's run through one grouped GEMM."""
        k = index.shape[1]
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        rows = x[order // k]
        h = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)
        y = torch._grouped_mm(self.swiglu(h), self.down_proj.transpose(1, 2), offs=offsets)
        return torch.empty_like(y).index_copy_(0, order, y)

    def dense(self, x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        """Every expert on every token; the routing matrix is zero off each token's top k."""
        route = torch.zeros(x.shape[0], self.num_experts, dtype=weight.dtype, device=x.device)
        route.scatter_(1, index, weight)
        h = torch.einsum("td,ehd->teh", x, self.gate_up_proj)
        y = torch.einsum("teh,edh->ted", self.swiglu(h), self.down_proj)
        return torch.einsum("ted,te->td", y, route)


class SparseMoE(nn.Module):
    """Routed experts, plus (Qwen3.5-MoE, Qwen3-Next) a shared expert behind a sigmoid gate.
    Names as in the hub checkpoints: mlp.gate, mlp.experts, mlp.shared_expert(_gate)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int, normalize: bool,
                 shared_hidden: int = 0) -> None:
        super().__init__()
        self.gate = Router(num_experts, dim, top_k, normalize)
        self.experts = Experts(num_experts, dim, hidden)
        if shared_hidden:
            self.shared_expert = MLP(dim, shared_hidden)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        index, weight = self.gate(flat)
        out = self.experts(flat, index, weight)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)
