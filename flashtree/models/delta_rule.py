"""The gated delta rule over a window of tree nodes, in closed form (Gated DeltaNet's recurrence).

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
A window keeps (k_j, d_j, c_j) per node, not per-node states (dk + dv numbers per head, not
dk * dv), and commit rebuilds the accepted node's state from them with the formula above
(`advance_state`, batched over layers by the hybrid cache).

Pure tensor math: no modules, no cache. The GDN layer calls the solve; the cache's commit calls
`advance_state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # prefill chunk of the delta rule: the per-chunk solve is CHUNK x CHUNK per head
# Path decays below exp(-floor) are taken as exactly 0: 60x under the dtype's epsilon next to the terms
# they are added to, and it keeps subnormal floats (100x slower on CPUs) out of the solve and matmuls.
DECAY_FLOOR = {torch.float32: 20.0, torch.float64: 40.0}


@dataclass
class DeltaWindow:
    """What a verify window leaves for commit, per node: its conv input, key, delta and path decay."""

    inputs: Tensor  # [R, N, C] conv inputs (the qkv projection before the conv)
    keys: Tensor  # [R, H, N, dk] in the state's dtype, normalised
    deltas: Tensor  # [R, H, N, dv]
    decay: Tensor  # [R, H, N]: c_i, summed log-decay along the node's path in the window


@dataclass
class WindowEnd:
    """What a kept (prefill) window leaves for commit: the state and conv window after its last token."""

    state: Tensor  # [R, H, dk, dv]
    conv: Tensor  # [R, K-1, C]


def delta_rule_window(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The gated delta rule over one window, every node on its own ancestor path.

    q, k [R, H, N, dk] (normalised, q scaled), v [R, H, N, dv], g, beta [R, H, N], state
    [R, H, dk, dv] the state before the window, mask [R, 1, N, N] ancestor-or-self (None = causal
    chain). Returns outputs [R, H, N, dv], deltas [R, H, N, dv] and path decays c [R, H, N].
    """
    n = q.shape[2]
    if n == 1:
        return delta_rule_step(q, k, v, g, beta, state)
    if mask is None:
        c = g.cumsum(-1)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    else:
        c = (mask.to(g.dtype) @ g[..., None])[..., 0]
    hidden = ~mask
    # gamma[i, j] = exp(c_i - c_j) on ancestor pairs (<= 1 there), 0 elsewhere; masked before exp.
    gamma = decay_exp((c[..., :, None] - c[..., None, :]).masked_fill(hidden, float("-inf")))
    decay = decay_exp(c)
    kk = (k @ k.transpose(-1, -2)) * beta[..., None]
    # deltas = (I + T)^-1 (beta v) - exp(c) * [(I + B)^-1 (beta k)] S_0, with T = beta kk gamma and
    # B = beta kk on strict ancestor pairs. The second solve is the decayed one (what HF solves)
    # conjugated by diag(exp(c)), so it carries no decays and its solution stays O(1) instead of
    # sinking into subnormals along long chains.
    u = torch.linalg.solve_triangular(kk * gamma, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(kk.masked_fill(hidden, 0), k * beta[..., None], upper=False, unitriangular=True)
    deltas = u - decay[..., None] * (w @ state)
    out = (q * decay[..., None]) @ state + ((q @ k.transpose(-1, -2)) * gamma) @ deltas
    return out, deltas, c


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """delta_rule_window for a one-node window (an AR step), where both solves are the identity:
    d = beta (v - exp(g) k S_0) and out = exp(g) q S_0 + (q . k) d."""
    decay = decay_exp(g)[..., None]  # [R, H, 1, 1]
    b = beta[..., None]
    deltas = b * torch.addcmul(v, decay, k @ state, value=-1)
    out = torch.addcmul(decay * (q @ state), q @ k.transpose(-1, -2), deltas)
    return out, deltas, g


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """A causal window of any length in chunks of CHUNK tokens: outputs and the state after it."""
    outs = []
    for s in range(0, q.shape[2], CHUNK):
        part = slice(s, s + CHUNK)
        out, deltas, c = delta_rule_window(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part],
                                           beta[:, :, part], state, None)
        state = advance_state(state, k[:, :, part], deltas, c, c[..., -1], torch.ones_like(c[:, :1]))
        outs.append(out)
    return torch.cat(outs, dim=2), state


def decay_exp(x: Tensor) -> Tensor:
    """exp of log-decays x <= 0, exactly 0 at and below exp(-DECAY_FLOOR)."""
    return F.threshold(x, -DECAY_FLOOR[x.dtype], float("-inf")).exp()


def advance_state(state: Tensor, keys: Tensor, deltas: Tensor, decay: Tensor, last: Tensor, weight: Tensor) -> Tensor:
    """S_last = exp(c_last) S_0 + sum_j weight_j exp(c_last - c_j) k_j d_j^T.

    state [..., R, H, dk, dv]; keys/deltas/decay [..., R, H, A, *] for the nodes of last's path;
    last [..., R, H] its decay c; weight [R, 1, A] marks which of the A nodes are on the path.
    Leading dims (layers) broadcast, so one call advances every layer.
    """
    w = decay_exp(last[..., None] - decay) * weight
    return state * decay_exp(last)[..., None, None] + (keys * w[..., None]).transpose(-1, -2) @ deltas
