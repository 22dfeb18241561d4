# SPDX-License-Identifier: Apache-2.0
"""A CTA's instruction queue (``isa.py`` words), as the controller, the
weight pipeline's producer and the legacy control read it."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from vllm_ext.megakernel.isa import Op


@dataclass(frozen=True)
class Queue:
    """A CTA's instruction queue: row ``sm`` of the queue table. A
    trace-time bundle (frozen: read-only in runtime loops)."""

    queue: cute.Tensor  # [num_sms, max_len, WORDS] int32
    sm: object


@cute.jit
def fetch(q: cutlass.Constexpr, pc, ins: cute.Tensor):
    """Instruction ``pc``'s words into ``ins`` (one 32-byte vector load)."""
    cute.autovec_copy(q.queue[q.sm, pc, None], ins)


@cute.jit
def downs_end(q: cutlass.Constexpr, layer, p, length):
    """The index past the run of ``layer``'s EXPERT_DOWN tiles that starts
    at instruction ``p`` (``p`` if none starts there): those a routed
    EXPERT_UP right before it hints (ops/expert_up.py)."""
    nxt = p
    more = Int32(1)
    while more != 0:
        more = Int32(0)
        if nxt < length:
            if q.queue[q.sm, nxt, 0] == Int32(Op.EXPERT_DOWN):
                if q.queue[q.sm, nxt, 1] == layer:
                    nxt = nxt + 1
                    more = Int32(1)
    return nxt
