# SPDX-License-Identifier: Apache-2.0
"""The ``MEGAKERNEL`` attention backend: vLLM's own attention layers (prefill
and mixed steps) over the cache layout the megakernel reads.

On a GPU the megakernel shares FlashAttention's cache layout, so prefill runs
on FlashAttention and this backend is not selected. In reference mode on a
CPU no vLLM backend writes that layout (the CPU backend packs K its own way),
so this one does, in PyTorch, through the same indexing functions as the
reference executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from vllm_ext.model_spec import sliding_window_refusal
from vllm_ext.paged_kv import paged_attention, write_kv

# The layout the megakernel reads (see paged_kv).
KV_CACHE_LAYOUT = KVCacheLayout.LBNHC

BLOCK_SIZE_MULTIPLE = 16


class MegakernelAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        # vLLM looks a layer's backend up by this name in AttentionBackendEnum,
        # where the plugin registers this class (vllm_ext.plugin).
        return "MEGAKERNEL"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(BLOCK_SIZE_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KV_CACHE_LAYOUT,)

    @staticmethod
    def get_impl_cls() -> type[MegakernelAttentionImpl]:
        return MegakernelAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MegakernelAttentionMetadataBuilder]:
        return MegakernelAttentionMetadataBuilder


@dataclass
class MegakernelAttentionMetadata:
    # What the reference attention reads in prefill and mixed steps (the
    # decode backend gets its own inputs from the runner).
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class MegakernelAttentionMetadataBuilder(
    AttentionMetadataBuilder[MegakernelAttentionMetadata]
):
    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MegakernelAttentionMetadata:
        m = common_attn_metadata
        return MegakernelAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )


class MegakernelAttentionImpl(AttentionImpl[MegakernelAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        model_config = get_current_vllm_config().model_config
        max_len = model_config.max_model_len if model_config is not None else None
        window = sliding_window_refusal(sliding_window, max_len)
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            str(window): window is not None,
            "logits soft cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "KV sharing": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
        }
        named = [name for name, present in unsupported.items() if present]
        if named:
            raise NotImplementedError(
                f"MEGAKERNEL attention does not support: {', '.join(named)}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MegakernelAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("MEGAKERNEL attention: no fused output quant")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        write_kv(kv_cache, key[:n], value[:n], attn_metadata.slot_mapping[:n])
        paged_attention(
            query[:n],
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            self.scale,
            out=output[:n],
        )
        return output
