# SPDX-License-Identifier: Apache-2.0
"""A CTA's instruction queue (``isa.py`` words), as the persistent kernel
and the weight pipeline's producer read it."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute


@dataclass(frozen=True)
class Queue:
    """A CTA's instruction queue: row ``sm`` of the queue table, and with
    ``stage_queue`` its first ``n_staged`` entries copied into shared memory
    (``staged``). A trace-time bundle (frozen: read-only in runtime loops)."""

    queue: cute.Tensor  # [num_sms, max_len, WORDS] int32
    sm: object
    staged: cute.Tensor | None = None  # [QUEUE_STAGE, WORDS] int32
    n_staged: object = None


@cute.jit
def fetch(q: cutlass.Constexpr, pc, ins: cute.Tensor):
    """Instruction ``pc``'s words into ``ins`` (one 32-byte vector load)."""
    if cutlass.const_expr(q.staged is not None):
        if pc < q.n_staged:
            cute.autovec_copy(q.staged[pc, None], ins)
        else:
            cute.autovec_copy(q.queue[q.sm, pc, None], ins)
    else:
        cute.autovec_copy(q.queue[q.sm, pc, None], ins)
