"""Tree attention around vLLM's CPU attention backend.

vLLM's CPU kernel knows causal and bidirectional attention only. While a tree verifies, its rows
are attended here instead: the committed keys read from the paged cache, the tree's own fresh
keys under the ancestor mask, in one PyTorch SDPA call. Rows of other requests in the same batch
still go through vLLM's kernel. Every other forward (prefill steps, chains, the drafter) is
vLLM's, untouched.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from vllm import _custom_ops as ops
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder

from flashtree.integrations.vllm import settings
from flashtree.integrations.vllm.accept import Walked, compact_kv
from flashtree.integrations.vllm.patching import VllmPatch
from flashtree.integrations.vllm.verify import VerifyPlan

# Cache layouts this module reads: per block and head, keys stored transposed [dim, block] and
# values [block, dim]. AMX packs bf16 blocks differently, so DDTree runs use "vec" there.
READABLE_ISAS = ("vec", "vec16")

_verifying: VerifyPlan | None = None


@contextlib.contextmanager
def verifying(plan: VerifyPlan) -> Iterator[None]:
    """Route the trees' rows of the target forward through tree attention."""
    global _verifying
    _verifying = plan
    try:
        yield
    finally:
        _verifying = None


def paged_kv(kv_cache: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values of whole blocks [R, nblk] of a CPU_ATTN cache [num_blocks, kv_heads, block, 2 * dim],
    as [R, kv_heads, nblk * block, dim] each, with the last dim contiguous (SDPA's fused CPU kernel needs
    it; the cache stores keys transposed per block, so they are copied once more)."""
    _, heads, block, two_dim = kv_cache.shape
    dim = two_dim // 2
    R, nblk = blocks.shape
    cached = kv_cache.index_select(0, blocks.flatten()).view(R, nblk, heads, 2, dim * block)
    keys = cached[:, :, :, 0].unflatten(-1, (dim, block)).permute(0, 2, 1, 4, 3).reshape(R, heads, nblk * block, dim)
    keys = keys.contiguous()  # a one-block reshape is still the transposed view
    values = cached[:, :, :, 1].unflatten(-1, (block, dim)).transpose(1, 2).reshape(R, heads, nblk * block, dim)
    return keys, values


@functools.lru_cache(maxsize=None)
def check_layout(dtype: torch.dtype, block: int, dim: int, isa: str) -> None:
    """Write K/V through vLLM's own cache op and read them back with paged_kv; refuse to start when the
    layout is not the one this module reads."""
    gen = torch.Generator().manual_seed(0)
    heads, blocks = 2, 2
    cache = torch.zeros(blocks, heads, block, 2 * dim, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block, dim).chunk(2, dim=2)
    n = blocks * block
    key = torch.randn(n, heads, dim, generator=gen).to(dtype)
    value = torch.randn(n, heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(n, generator=gen)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    keys, values = paged_kv(cache, torch.arange(blocks)[None])
    order = torch.empty_like(slots)
    order[slots] = torch.arange(n)
    if not (torch.equal(keys[0].transpose(0, 1), key[order]) and torch.equal(values[0].transpose(0, 1), value[order])):
        raise settings.DDTreeConfigError(
            f"DDTree cannot read vLLM's CPU KV cache layout for isa={isa!r}, {dtype}, block {block}, "
            f"head size {dim}; run in float32 or bfloat16 on x86")


def tree_attention(impl: CPUAttentionBackendImpl, query: Tensor, kv_cache: Tensor, block_table: Tensor,
                   plan: VerifyPlan, output: Tensor) -> None:
    """Attention of every tree row: all of its request's committed keys, then its ancestors and itself.

    Every key is read from the paged cache, the tree's own too: vLLM wrote node i's K/V at the
    slot of position prefix + i before this call. The mask hides the rest of the gathered blocks.
    The query heads that share a KV head ride as extra rows of it, so SDPA sees no head grouping.
    """
    Rt, N = plan.rows.shape
    heads, kv_heads, dim = impl.num_heads, impl.num_kv_heads, impl.head_size
    group = heads // kv_heads
    blocks, mask = plan.attention_inputs(block_table, kv_cache.shape[2], group, kv_cache.dtype)
    keys, values = paged_kv(kv_cache, blocks)
    rows = plan.row_slice
    q = query[rows] if rows is not None else query[plan.rows.flatten()]
    q = q.view(Rt, N, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(Rt, kv_heads, group * N, dim)
    out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, scale=impl.scale)
    out = out.view(Rt, kv_heads, group, N, dim).permute(0, 3, 1, 2, 4).reshape(Rt, N, heads, dim)
    if rows is not None:
        output.view(-1, heads, dim)[rows] = out.reshape(Rt * N, heads, dim).to(output.dtype)
    else:
        output.view(-1, heads, dim)[plan.rows[plan.valid]] = out[plan.valid].to(output.dtype)


def move_kv(kv_cache: Tensor, src: Tensor, dst: Tensor) -> None:
    """Copy the K/V at slots `src` to slots `dst` of one CPU_ATTN cache, in its own layout."""
    nb, heads, block, two_dim = kv_cache.shape
    dim = two_dim // 2
    halves = kv_cache.view(nb, heads, 2, dim * block)
    keys = halves[:, :, 0].unflatten(-1, (dim, block))  # [nb, heads, dim, block]
    values = halves[:, :, 1].unflatten(-1, (block, dim))  # [nb, heads, block, dim]
    sb, so, db, do = src // block, src % block, dst // block, dst % block
    keys[db, :, :, do] = keys[sb, :, :, so]
    values[db, :, do] = values[sb, :, so]


def compact(walked: Walked) -> None:
    compact_kv(walked, move_kv)


class CPUAttentionBackendImplPatch(VllmPatch, target=CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = _verifying
        original = CPUAttentionBackendImplPatch.original(self, "forward")
        if plan is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return original(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
        if plan.num_rows < attn_metadata.num_actual_tokens:  # other requests' rows: vLLM's kernel
            original(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        tree_attention(self, query, kv_cache, attn_metadata.block_table, plan, output)
        plan.caches.append(kv_cache)
        plan.slot_mapping = attn_metadata.slot_mapping
        return output


class CPUAttentionMetadataBuilderPatch(VllmPatch, target=CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        CPUAttentionMetadataBuilderPatch.original(self, "__init__")(kv_cache_spec, layer_names, vllm_config, device)
        if not settings.requested(vllm_config.additional_config):
            return
        if self.isa not in READABLE_ISAS:
            self.isa = "vec"
            self._set_isa_to_layers(layer_names)
        for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
            impl = layer.impl
            if impl.alibi_slopes is not None or impl.logits_soft_cap or impl.sinks is not None:
                raise settings.DDTreeConfigError(f"DDTree's tree attention has no ALiBi, soft-capping or sinks, "
                                                 f"which layer {name} uses")
        check_layout(self.dtype, self.block_size, self.head_dim, self.isa)
