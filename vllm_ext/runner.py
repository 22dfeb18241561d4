# SPDX-License-Identifier: Apache-2.0
"""One decode step: vLLM's batch metadata -> an executor call.

The executor contract, the same for the GPU megakernel and the reference:

    (input ids, positions, block table, seq lens, slot mapping, KV caches,
     weights) -> final hidden states (after the final norm),

with the new K/V of every layer written into vLLM's paged cache at the
slot mapping. One row per token: in a decode-only step request ``i`` owns
row ``i``; in a speculative verify step each of a request's ``1 + k``
tokens is a row of its own, with the request's block table and the
sequence up to that token (so attention over the cache is causal among
the new tokens, whose K/V every layer writes before it attends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

# Query rows a request: a decode step's one, or a speculative verify step's
# 1 + k for k up to 7 drafts (MTP, EAGLE, n-gram).
MAX_QUERY_LEN = 8

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
    # Pipeline parallel, past the first stage: [B, hidden] the previous
    # stage's residual stream (its hidden states plus residual).
    hidden_in: torch.Tensor | None = None
    # A verify step: [B, 2] int32, each row's request's first row and row
    # count (a latent attention reads a request's cache once for all its
    # rows); None: a row per request.
    query_map: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


class DecodeExecutor(Protocol):
    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        """Run one decode step; return ``[B, hidden]`` final hidden states."""
        ...

    def residual_stream(self, layer: int) -> torch.Tensor:
        """``[B, hidden]`` of the last step: the residual stream entering
        ``layer`` (0: the embedding; the number of layers: before the final
        norm), as vLLM's models return it for an EAGLE-3 drafter."""
        ...


def decode_inputs(batch: DecodeBatch, layer_names: tuple[str, ...]) -> DecodeInputs:
    """The executor's inputs for the batch's real tokens (padding rows
    dropped), from what the model runner passed: KV cache group 0 (a
    decoder-only model's every attention layer) and the caches vLLM bound to
    ``layer_names``, in the program's layer order."""
    n = batch.num_reqs
    (group,) = batch.kv_cache_groups  # refused otherwise at start-up
    caches = tuple(group.kv_caches[name] for name in layer_names)
    stage_in = batch.intermediate_tensors
    if batch.max_query_len == 1:
        return DecodeInputs(
            input_ids=batch.input_ids[:n],
            positions=batch.positions[:n],
            block_table=group.block_table[:n],
            seq_lens=batch.seq_lens[:n],
            slot_mapping=group.slot_mapping[:n],
            kv_caches=caches,
            hidden_in=_residual_stream(stage_in, n),
        )
    # A verify step: each token a row of its request. (The number of
    # tokens is read on the host: one sync a verify step.)
    starts = batch.query_start_loc[: n + 1]
    tokens = int(starts[n])
    row = torch.arange(tokens, device=starts.device)
    request = torch.searchsorted(starts[1:], row, right=True)
    positions = batch.positions[:tokens]
    first = starts[request]
    return DecodeInputs(
        input_ids=batch.input_ids[:tokens],
        positions=positions,
        block_table=group.block_table[request],
        seq_lens=(positions + 1).to(batch.seq_lens.dtype),
        slot_mapping=group.slot_mapping[:tokens],
        kv_caches=caches,
        hidden_in=_residual_stream(stage_in, tokens),
        query_map=torch.stack([first, starts[request + 1] - first], 1).int(),
    )


def _residual_stream(stage_in, rows: int) -> torch.Tensor | None:
    """The previous pipeline stage's ``hidden_states + residual`` (vLLM's
    decoder layers carry the residual stream in two parts), as the next
    layer's fused add forms it; None on the first stage."""
    if stage_in is None:
        return None
    hidden, residual = stage_in["hidden_states"][:rows], stage_in["residual"]
    return hidden if residual is None else hidden + residual[:rows]
