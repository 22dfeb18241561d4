# SPDX-License-Identifier: Apache-2.0
"""A tensor-parallel rank's counters and partial sums in symmetric memory:
what its kernel's ALL_REDUCE reaches on every rank (PEERS), one process
and one GPU a rank, as vLLM runs tensor parallel.

Each rank allocates one buffer of the same size (``torch.distributed.
_symmetric_memory``: the same program, so the same counters and partial
rows) and exchanges its address with the group's (``rendezvous``, a
collective over vLLM's TP group, run while the model loads). Its counters
come first, then its partial sums; PEERS lists every rank's two addresses
as this GPU maps them. The kernel signals its peers' counters and reads
their partials at system scope (ops/all_reduce.py), the one-GPU check's
``OneLaunchRanks`` reaches the same entries in one GPU's memory.

A peer's kernel adds to this rank's counters: every rank's are zeroed, and
the group waits at a barrier, before any rank can launch. GPU-only glue:
on CPU the tests hand in a stand-in for the symmetric-memory module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ext.megakernel.kernel.launcher import MegakernelError
from vllm_ext.megakernel.kernel.shape import KernelShape, workspace_sizes
from vllm_ext.megakernel.planner import Program

# The partial sums start 16-byte aligned (the kernel's 128-bit loads).
ALIGN = 16


@dataclass
class RankBuffers:
    """One rank's views of its symmetric buffer, and PEERS."""

    counters: torch.Tensor  # [num_counters + 1] int32 (the last: the step)
    partial: torch.Tensor  # the workspace's "partial", bf16
    peers: torch.Tensor  # [2, tp] int64: every rank's counters, partials
    handle: Any  # the rendezvous's handle (keeps the mapping alive)


def layout(program: Program, shape: KernelShape) -> tuple[int, int, tuple]:
    """(bytes of the buffer, offset of the partial sums, their dims)."""
    counter_bytes = 4 * (program.num_counters + 1)
    offset = -(-counter_bytes // ALIGN) * ALIGN
    dims = workspace_sizes(shape, program.spec.num_layers)["partial"]
    return offset + 2 * math.prod(dims), offset, tuple(dims)


def symm_mem_module() -> Any:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def rank_buffers(
    program: Program,
    shape: KernelShape,
    group: Any,
    device: torch.device,
    *,
    barrier=None,
) -> RankBuffers:
    """Allocate and exchange this rank's buffer (every rank of ``group``,
    vLLM's TP device group, calls it for the same program in the same
    order); ``barrier``: the group's (vLLM's ``GroupCoordinator.barrier``),
    after which every rank's counters are zero."""
    symm_mem = symm_mem_module()
    tp = program.spec.tp_size
    size, offset, dims = layout(program, shape)
    buf = symm_mem.empty(size, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group)
    bases = [int(p) for p in handle.buffer_ptrs]
    if len(bases) != tp:
        raise MegakernelError(
            f"megakernel: symmetric memory spans {len(bases)} ranks, the program {tp}"
        )
    counters = buf[: 4 * (program.num_counters + 1)].view(torch.int32)
    partial = buf[offset:].view(torch.bfloat16).view(dims)
    counters.zero_()
    # NaN until written, as every workspace buffer.
    partial.fill_(float("nan"))
    peers = torch.tensor(
        [bases, [b + offset for b in bases]], dtype=torch.int64, device=device
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if barrier is not None:
        barrier()
    return RankBuffers(counters, partial, peers, handle)
