# SPDX-License-Identifier: Apache-2.0
"""A CTA's instruction queue (``isa.py`` words), as the controller, the
weight pipeline's producer and the legacy control read it."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute


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
