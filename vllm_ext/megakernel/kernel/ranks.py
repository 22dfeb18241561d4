# SPDX-License-Identifier: Apache-2.0
"""Every rank of a tensor-parallel program in one launch on one GPU: the
GPU check's ranks (lent machines have a single GPU).

Kernels on separate streams are not guaranteed to run together, and a
persistent kernel waiting on another that has not started hangs; so the
ranks share one cooperative launch whose CTAs split into rank groups
(``KernelShape.ranks_in_launch``, kernel/persistent.py's ``rank_views``).
Rank k's queues, table rows and counters are the k-th block of stacked
ones; its PEERS entry lists every rank's counters and partial sums in this
GPU's memory, where a TP deployment's lists its peers' symmetric memory.
The same kernel code runs both: only the addresses differ.

Needs torch and the CUDA driver only, like launcher.py.
"""

from __future__ import annotations

import torch

from vllm_ext.megakernel.kernel.launcher import (
    DEFAULT_MAX_SPINS,
    KernelExecutor,
    MegakernelError,
    new_abort_record,
)
from vllm_ext.megakernel.planner import Program
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights


def _no_launch(*args) -> None:
    raise MegakernelError("a rank of OneLaunchRanks launches through it")


class OneLaunchRanks:
    """Runs decode steps of every rank of ``program`` (one rank's program:
    ``spec.tp_size`` ranks), rank k on ``weights[k]`` (its shard, as
    ``parallel.shard_weights`` cuts it) and its own KV cache."""

    def __init__(
        self,
        program: Program,
        weights: list[DecodeWeights],
        launch,  # KernelLibrary.launch, or a stand-in in tests
        *,
        block_size: int,
        max_blocks: int,
        max_spins: int = DEFAULT_MAX_SPINS,
    ) -> None:
        tp = program.spec.tp_size
        if tp < 2 or len(weights) != tp:
            raise MegakernelError(
                f"megakernel: {len(weights)} weight shards for {tp} ranks"
            )
        self.program, self.launch = program, launch
        dev = weights[0].embed.device
        per = program.num_counters + 1
        self.counters = torch.zeros(tp * per, dtype=torch.int32, device=dev)
        self.abort = new_abort_record(dev)
        blocks = self.counters.view(tp, per)
        self.ranks = [
            KernelExecutor(
                program,
                w,
                _no_launch,
                block_size=block_size,
                max_blocks=max_blocks,
                max_spins=max_spins,
                abort=self.abort,
                counters=blocks[k],
                ranks_in_launch=tp,
            )  # fmt: skip
            for k, w in enumerate(weights)
        ]
        self.peers = torch.tensor(
            [[ex.counters.data_ptr() for ex in self.ranks],
             [ex.ws["partial"].data_ptr() for ex in self.ranks]],
            dtype=torch.int64, device=dev,
        )  # fmt: skip
        for ex in self.ranks:
            ex.set_peers(self.peers)
        self.queue = torch.cat([ex.queue for ex in self.ranks])
        self.lengths = torch.cat([ex.lengths for ex in self.ranks])

    def step(self, inputs: list[DecodeInputs]) -> list[torch.Tensor]:
        """Every rank's step (rank k's inputs: its own KV caches), one
        launch; each rank's final-normed hidden states."""
        if len(inputs) != len(self.ranks):
            raise MegakernelError(f"{len(inputs)} inputs for {len(self.ranks)} ranks")
        sizes = [ex.stage(i) for ex, i in zip(self.ranks, inputs, strict=True)]
        strides = {ex.kv_block_stride for ex in self.ranks}
        if len(strides) != 1:
            for ex in self.ranks:
                ex.unstage()
            raise MegakernelError(f"megakernel: the ranks' KV block strides {strides}")
        first = self.ranks[0]
        # (Each rank's table as staged: its KV caches bound.)
        ptrs = torch.cat([ex.ptrs for ex in self.ranks])
        try:
            self.launch(
                self.queue, self.lengths, self.counters, ptrs,
                first.block_table.stride(0), strides.pop(),
                first.weights.attn_scale, first.max_spins, first.stream(),
            )  # fmt: skip
        except Exception:
            for ex in self.ranks:
                ex.unstage()
            raise
        return [ex.output(n) for ex, n in zip(self.ranks, sizes, strict=True)]
