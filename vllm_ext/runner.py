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
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    # (Not at run time: the GPU check runs the executors with torch alone.)
    from vllm.v1.worker.decode_backend import DecodeBatch


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


def decode_inputs(batch: DecodeBatch, layer_names: tuple[str, ...]) -> DecodeInputs:
    """The executor's inputs for the batch's real requests (padding rows
    dropped), from what the model runner passed: KV cache group 0 (a
    decoder-only model's every attention layer) and the caches vLLM bound to
    ``layer_names``, in the program's layer order."""
    n = batch.num_reqs
    (group,) = batch.kv_cache_groups  # refused otherwise at start-up
    return DecodeInputs(
        input_ids=batch.input_ids[:n],
        positions=batch.positions[:n],
        block_table=group.block_table[:n],
        seq_lens=batch.seq_lens[:n],
        slot_mapping=group.slot_mapping[:n],
        kv_caches=tuple(group.kv_caches[name] for name in layer_names),
    )
