"""A dense target's decoder stack and a DFlash drafter's layers, compiled by inductor at start-up,
with attention opaque to it.

On the CPU a decode step is bound by per-op dispatch: a layer's norms, rope, residuals and SwiGLU
are some forty small ops. Inductor fuses them into a few C++ kernels, as vLLM's CPU runner does.
Attention (the cache write and read, SDPA or the tree merge) stays one opaque custom op that reads
the forward's `ForwardContext` from `running`, so key lengths, masks and trees never enter a graph:
one graph, dynamic in rows and window length, serves prefill chunks, AR steps and every tree.
Dynamo specialises sizes 0 and 1, so start-up compiles the (one row or more) x (one token or
more) variants before the first request, and nothing compiles inside one.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor
from tqdm import tqdm

from flashtree.errors import FlashtreeError
from flashtree.models.layers import attention, window_attention
from flashtree.models.ops import opaque

if TYPE_CHECKING:
    from flashtree.models.context import ForwardContext
    from flashtree.models.dflash import DFlashDrafter
    from flashtree.models.transformer import DecoderLM

# The forward a compiled stack is running (one at a time per process): the opaque ops' context.
running: list[ForwardContext] = []


def merged_heads(out: Tensor) -> Tensor:
    """Attention's [R, H, N, D] as the output projection's input [R, N, H * D]."""
    r, h, n, d = out.shape
    return out.transpose(1, 2).reshape(r, n, h * d)


def _fake_attention(q: Tensor, *_) -> Tensor:
    r, n, h, d = q.shape
    return q.new_empty(r, n, h * d)


_window_attention_op = opaque(
    "window_attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor",
    lambda q, k, v, layer, scale: merged_heads(window_attention(q, k, v, running[-1], layer, scale)), _fake_attention)
_draft_attention_op = opaque(
    "draft_attention(Tensor q, Tensor k, Tensor v, Tensor mask, int layer, float scale) -> Tensor",
    lambda q, k, v, mask, layer, scale: _draft_attention(q, k, v, running[-1], layer, mask, scale), _fake_attention)


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext, layer: int, scale: float) -> Tensor:
    """window_attention's result as [R, N, H * D]; traced by dynamo, the opaque op."""
    if torch.compiler.is_compiling():
        return _window_attention_op(q, k, v, layer, scale)
    return merged_heads(window_attention(q, k, v, ctx, layer, scale))


def draft_attend(q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext, layer: int, mask: Tensor, scale: float
                 ) -> Tensor:
    """A drafter block's q [R, L, H, D] over the slot's cached context and the block's own k/v,
    under the additive block mask, as [R, L, H * D]; traced by dynamo, the opaque op."""
    if torch.compiler.is_compiling():
        return _draft_attention_op(q, k, v, mask, layer, scale)
    return _draft_attention(q, k, v, ctx, layer, mask, scale)


def _draft_attention(q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext, layer: int, mask: Tensor, scale: float
                     ) -> Tensor:
    held_k, held_v = ctx.cache.read(layer, ctx)
    keys = torch.cat([held_k, k.transpose(1, 2)], dim=2)
    values = torch.cat([held_v, v.transpose(1, 2)], dim=2)
    return merged_heads(attention(q.transpose(1, 2), keys, values, mask, scale))


def compiled(fn: Callable) -> Callable:
    """`fn` compiled once for every shape (dynamic), with a C++ wrapper around the kernels and no
    size asserts: the Python wrapper's per-kernel bookkeeping costs about a tenth of a one-token
    forward on the CPU otherwise."""
    # Each engine adds a few entries for the same code; dynamo's default of 8 would send a
    # process's third engine back to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"cpp_wrapper": True, "size_asserts": False})


# torch.compiler.set_stance(skip_guard_eval_unsafe=...) where this torch has it (recent ones), else None.
_set_stance = getattr(torch.compiler, "set_stance", None)
if _set_stance is not None and "skip_guard_eval_unsafe" not in inspect.signature(_set_stance).parameters:
    _set_stance = None


def run_with(fn: Callable, ctx: ForwardContext, *args, warmed: bool = False):
    """fn(*args) with `ctx` as the opaque ops' context. Once start-up has compiled every variant
    (`warmed`; nothing compiles inside a request), dynamo checks only the guards that tell the
    variants apart: the full check is ~7% of a compiled AR step on the CPU (docs/performance.md)."""
    running.append(ctx)
    try:
        if warmed and _set_stance is not None and torch.is_inference_mode_enabled():  # grad mode is a guard too
            try:
                with _set_stance(skip_guard_eval_unsafe=True):
                    return fn(*args)
            except RuntimeError as e:  # raised before the call ran: a shape start-up missed compiles, as before
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
        return fn(*args)
    finally:
        running.pop()


class CompiledStack:
    """`model.blocks` compiled for one set of feature layers (a forward asking for fewer gets its
    subset). Set on the model as `model.compiled`; its forward then runs it."""

    def __init__(self, model: DecoderLM, feature_layers: tuple[int, ...]) -> None:
        self.feature_layers = tuple(feature_layers)
        self.index = {k: i for i, k in enumerate(self.feature_layers)}  # layer -> its place in the result
        self.fn = compiled(model.blocks)
        self.warmed = False  # every variant compiled (compile_stack)

    def covers(self, feature_layers: tuple[int, ...]) -> bool:
        return all(k in self.index for k in feature_layers)

    def __call__(self, tokens: Tensor, ctx: ForwardContext, feature_layers: tuple[int, ...]
                 ) -> tuple[Tensor, list[Tensor]]:
        x, features = run_with(self.fn, ctx, tokens, ctx, self.feature_layers, warmed=self.warmed)
        return x, [features[self.index[k]] for k in feature_layers]


class CompiledDrafter:
    """`drafter.stack` compiled; set on the drafter as `drafter.compiled`."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.fn = compiled(drafter.stack)
        self.warmed = False  # every variant compiled (compile_drafter)

    def __call__(self, noise: Tensor, ctx: ForwardContext, masks: list[Tensor]) -> Tensor:
        return run_with(self.fn, ctx, noise, ctx, masks, warmed=self.warmed)


@contextmanager
def compiling(what: str):
    """Turn a failure to compile (no C++ compiler, an unsupported build) into one clear line."""
    try:
        yield
    except Exception as e:  # inductor's errors span many types; the cause goes in the message
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise FlashtreeError(f"compile=True could not compile {what} with inductor ({type(e).__name__}: {cause}); "
                             "run without compile (--compile), or install a C++ compiler (g++ or clang)") from e


def warm(what: str, max_rows: int, tokens: tuple[int, ...], run: Callable[[int, int], object], progress: bool
         ) -> float:
    """run(rows, tokens) for 2 and 1 rows (as max_rows allows) by each window size, with a progress
    bar and one-line failures; returns the seconds. Rows and tokens differ in each shape, or dynamo
    would assume them equal ("duck sizing")."""
    t0 = time.perf_counter()
    with compiling(f"the {what}'s layers"):
        shapes = [(r, n) for r in (2, 1) if r <= max_rows for n in tokens]
        for r, n in tqdm(shapes, desc=f"compiling the {what}'s forward", unit="shape", disable=not progress):
            run(r, n)
    return time.perf_counter() - t0


@torch.inference_mode()  # as every forward the engine runs: grad mode is part of dynamo's guards
def compile_stack(model: DecoderLM, feature_layers: tuple[int, ...], cache, max_rows: int,
                  progress: bool = True) -> float:
    """Compile `model`'s decoder stack for the engine's feature layers and warm every variant on
    the cache's first slots at length 0 (the writes land past every committed row); returns the
    start-up seconds. The model's forward runs it from here on. An engine sharing the weights of
    one compiled before reuses its stack when that covers its feature layers."""
    from flashtree.models.context import ForwardContext, SlotBatch

    if model.compiled is not None:
        if model.compiled.covers(feature_layers):
            return 0.0
        feature_layers = tuple(sorted({*model.compiled.feature_layers, *feature_layers}))
    stack = CompiledStack(model, feature_layers)
    device = cache.device
    seconds = warm("target", max_rows, (3, 1), lambda r, n: stack(
        torch.zeros(r, n, dtype=torch.long, device=device),
        ForwardContext.prefill(cache, SlotBatch.of(cache, list(range(r))), n), feature_layers), progress)
    stack.warmed = True
    model.compiled = stack
    return seconds


@torch.inference_mode()
def compile_drafter(drafter: DFlashDrafter, cache, max_rows: int, progress: bool = True) -> float:
    """Compile the drafter's layers and warm them on the cache's first slots (its block has one
    size, so only the rows vary), over block + 1 context rows, a count no other size shares;
    returns the start-up seconds."""
    from flashtree.models.context import ForwardContext, SlotBatch

    if drafter.compiled is not None:
        return 0.0
    stack = CompiledDrafter(drafter)
    d, p = drafter.args.hidden_size, drafter.norm.weight

    def run(r: int, n: int) -> None:
        ctx = ForwardContext.block(cache, SlotBatch.of(cache, list(range(r))), n, n + 1)
        stack(torch.zeros(r, n, d, dtype=p.dtype, device=p.device), ctx, drafter.masks(ctx, p.dtype))

    seconds = warm("drafter", max_rows, (drafter.block_size,), run, progress)
    stack.warmed = True
    drafter.compiled = stack
    return seconds
