# SPDX-License-Identifier: Apache-2.0
"""One decode step: vLLM's batch metadata -> an executor call.

The executor contract, the same for the GPU megakernel and the reference:

    (input ids, positions, block table, seq lens, slot mapping, KV caches,
     weights) -> final hidden states (after the final norm),

with the new K/V of every layer written into vLLM's paged cache at the
slot mapping. One token per request; request ``i`` owns row ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DecodeInputs:
    input_ids: torch.Tensor  # [B] token ids
    positions: torch.Tensor  # [B] position of each token
    block_table: torch.Tensor  # [B, max_blocks] int32 physical block ids
    seq_lens: torch.Tensor  # [B] tokens in the sequence, the new one included
    slot_mapping: torch.Tensor  # [B] flat cache slot of each new token
    kv_caches: tuple[torch.Tensor, ...]  # per layer, see paged_kv

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


class DecodeExecutor(Protocol):
    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        """Run one decode step; return ``[B, hidden]`` final hidden states."""
        ...


def decode_inputs_from_forward_context(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    num_reqs: int,
    layer_names: list[str],
) -> DecodeInputs:
    """Collect the step's inputs from vLLM's forward context.

    All decoder layers share one KV cache group, so the first layer's
    attention metadata (block table, seq lens, slot mapping) holds for all.
    """
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    metadata = ctx.attn_metadata
    if isinstance(metadata, list):  # micro-batched; never for decode here
        raise RuntimeError("megakernel: micro-batched decode is not supported")
    meta = metadata[layer_names[0]]
    kv_caches = tuple(ctx.no_compile_layers[name].kv_cache for name in layer_names)
    # Model Runner V2 passes slot mappings per layer beside the metadata.
    slot_mapping = (ctx.slot_mapping or {}).get(layer_names[0])
    if slot_mapping is None:
        slot_mapping = meta.slot_mapping
    return DecodeInputs(
        input_ids=input_ids[:num_reqs],
        positions=positions[:num_reqs],
        block_table=meta.block_table[:num_reqs],
        seq_lens=meta.seq_lens[:num_reqs],
        slot_mapping=slot_mapping[:num_reqs],
        kv_caches=kv_caches,
    )
