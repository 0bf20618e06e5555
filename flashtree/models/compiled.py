"""A dense target's decoder stack compiled by inductor at start-up, with attention opaque to it.

On the CPU a decode step is bound by per-op dispatch: a layer's norms, rope, residuals and SwiGLU
are some forty small ops. Inductor fuses them into a few C++ kernels, as vLLM's CPU runner does.
Attention (the cache write, the cache read, SDPA or the tree merge) stays one opaque custom op
that reads the forward's `ForwardContext` from `running`, so the key length, masks and trees never
enter the graph: one graph, dynamic in rows and window length, serves prefill chunks, AR steps and
every tree. Dynamo specialises sizes 0 and 1, so `warm` compiles the four (one row or more) x (one
token or more) variants before the first request and nothing compiles inside one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm import tqdm

from flashtree.models.layers import window_attention

if TYPE_CHECKING:
    from flashtree.models.context import ForwardContext
    from flashtree.models.transformer import DecoderLM

# The forward a compiled stack is running (one at a time per process): the opaque op's context.
running: list[ForwardContext] = []


@torch.library.custom_op("flashtree::window_attention", mutates_args=())
def _window_attention_op(q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float) -> Tensor:
    return merged_heads(window_attention(q, k, v, running[-1], layer, scale))


@_window_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float) -> Tensor:
    r, n, h, d = q.shape
    return q.new_empty(r, n, h * d)


def merged_heads(out: Tensor) -> Tensor:
    """Attention's [R, H, N, D] as the output projection's input [R, N, H * D]."""
    r, h, n, d = out.shape
    return out.transpose(1, 2).reshape(r, n, h * d)


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext, layer: int, scale: float) -> Tensor:
    """window_attention's result as [R, N, H * D]; traced by dynamo, the opaque op."""
    if torch.compiler.is_compiling():
        return _window_attention_op(q, k, v, layer, scale)
    return merged_heads(window_attention(q, k, v, ctx, layer, scale))


class CompiledStack:
    """`model.blocks` compiled for one set of feature layers (a forward asking for fewer gets its
    subset). Set on the model as `model.compiled`; its forward then runs it."""

    def __init__(self, model: DecoderLM, feature_layers: tuple[int, ...]) -> None:
        self.feature_layers = tuple(feature_layers)
        # Each engine adds up to four entries for the same code; dynamo's default of 8 would send
        # a process's third engine back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # A C++ wrapper around the kernels and no size asserts: the Python wrapper's per-kernel
        # bookkeeping otherwise costs about a tenth of a one-token forward here.
        self.fn = torch.compile(model.blocks, dynamic=True, fullgraph=True,
                                options={"cpp_wrapper": True, "size_asserts": False})
        self.seconds = 0.0

    def covers(self, feature_layers: tuple[int, ...]) -> bool:
        return set(feature_layers) <= set(self.feature_layers)

    def __call__(self, tokens: Tensor, ctx: ForwardContext, feature_layers: tuple[int, ...]
                 ) -> tuple[Tensor, list[Tensor]]:
        running.append(ctx)
        try:
            x, features = self.fn(tokens, ctx, self.feature_layers)
        finally:
            running.pop()
        return x, [features[self.feature_layers.index(k)] for k in feature_layers]

    @torch.inference_mode()  # as every forward the engine runs: grad mode is part of dynamo's guards
    def warm(self, model: DecoderLM, cache, max_rows: int, progress: bool = True) -> float:
        """Compile the variants (1 or 2 rows) x (1 or 3 tokens) on the cache's first slots, at
        length 0 (the writes land past every committed row). Returns the seconds it took. Rows and
        tokens differ in every warm shape, or dynamo would assume them equal ("duck sizing")."""
        from flashtree.models.context import ForwardContext, SlotBatch

        t0 = time.perf_counter()
        shapes = [(r, n) for r in (2, 1) if r <= max_rows for n in (3, 1)]
        device = cache.device
        for r, n in tqdm(shapes, desc="compiling the target's forward", unit="shape", disable=not progress):
            batch = SlotBatch(list(range(r)), [0] * r, torch.arange(r, device=device),
                              torch.zeros(r, dtype=torch.long, device=device))
            model(torch.zeros(r, n, dtype=torch.long, device=device), ForwardContext.prefill(cache, batch, n, n),
                  self.feature_layers)
        self.seconds = time.perf_counter() - t0
        return self.seconds


def compile_stack(model: DecoderLM, feature_layers: tuple[int, ...], cache, max_rows: int,
                  progress: bool = True) -> float:
    """Compile `model`'s decoder stack for the engine's feature layers and warm every variant;
    returns the start-up seconds. The model's forward uses it from here on. An engine sharing the
    weights of one compiled before reuses its stack when that covers its feature layers."""
    if model.compiled is not None:
        if model.compiled.covers(feature_layers):
            return 0.0
        feature_layers = tuple(sorted({*model.compiled.feature_layers, *feature_layers}))
    stack = CompiledStack(model, feature_layers)
    model.compiled = stack
    return stack.warm(model, cache, max_rows, progress)
