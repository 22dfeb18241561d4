# SPDX-License-Identifier: Apache-2.0
"""Weight staging into shared memory (no reference: it moves bytes, the
GEMV that reads them is checked against its reference).

Experimental, built with ``KernelShape.stage_weights``. Weights never depend
on activations, so before an instruction waits for its inputs all threads
issue ``cp.async`` copies of the head of its weight tile (up to
``W_STAGE_BYTES``; half each for gate and up) into shared memory. The GEMV
then reads those rows from shared memory and the rest from global memory
(prefetched into L2). On the H200 (2026-11-30) waits cost 45% of a 1B
batch-1 step while the tile's bytes were still to be read after the wait;
this moves the first of them before it.

The staged rows of a tile are ``[stage_lo, stage_lo + staged)`` of the
matrix, with ``staged = min(tile rows, cap)``: both the copy and the GEMV
compute them from the same instruction and compile-time cap."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.common import NUM_THREADS, gmem, vectors
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot

# With the normed-input stage (64 KiB) and the attention scratch this keeps
# the kernel under the 227 KiB a Hopper CTA may use.
W_STAGE_BYTES = 128 * 1024
W_STAGE_ELEMS = W_STAGE_BYTES // 2


def cap_rows(k: int, dual: bool = False) -> int:
    """Rows of a [*, k] bf16 matrix that one stage holds (per matrix)."""
    return (W_STAGE_BYTES // (2 if dual else 1)) // (2 * k)


def staged_rows(lo, hi, cap: int):
    """Rows of tile [lo, hi) that come from shared memory."""
    return cutlass.min(Int32(hi - lo), Int32(cap))


def stage_view(w_stage: cute.Tensor, k: int, dual: bool = False, second: bool = False):
    """The stage as a [cap, k] matrix; with ``dual``, one of two halves (gate
    first, then up)."""
    cap = cap_rows(k, dual)
    if cap == 0:
        raise ValueError(f"a {k}-wide weight row does not fit the weight stage")
    offset = cap * k if second else 0
    return cute.make_tensor(
        w_stage.iterator + offset, cute.make_layout((cap, k), stride=(k, 1))
    )


@cute.jit
def _copy(w: cute.Tensor, first_row, n_rows, dst: cute.Tensor):
    """cp.async of rows [first_row, first_row + n_rows) of w [M, K] into dst
    [cap, K], 16 bytes per thread and copy (L1 bypassed)."""
    tidx, _, _ = cute.arch.thread_idx()
    k = w.shape[1]
    atom = cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
        BFloat16,
        num_bits_per_copy=128,
    )
    per_row = k // 8
    for idx in cutlass.range(tidx, n_rows * per_row, NUM_THREADS):
        r, j = idx // per_row, idx % per_row
        cute.copy(atom, vectors(w[first_row + r, None])[None, j],
                  vectors(dst[r, None])[None, j])  # fmt: skip


@cute.jit
def stage_weights(
    s: cutlass.Constexpr, ptrs: cute.Tensor, glob, op, layer, lo, hi,
    w_stage: cute.Tensor,
):  # fmt: skip
    """Issue the copies of instruction (op, layer, lo, hi)'s staged rows and
    commit them as one group; ``cp_async_wait_group(0)`` and a CTA barrier
    make them visible (persistent.py does both after the wait)."""
    shape: KernelShape = s
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    rows = (shape.q_heads + 2 * shape.kv_heads) * d
    if op == Op.QKV:
        w = gmem(BFloat16, ptrs[layer, LayerSlot.QKV], (rows, h))
        n = staged_rows(lo * d, hi * d, cap_rows(h))
        _copy(w, lo * d, n, stage_view(w_stage, h))
    elif op == Op.O_PROJ:
        w = gmem(BFloat16, ptrs[layer, LayerSlot.O_PROJ], (h, shape.q_size))
        n = staged_rows(lo, hi, cap_rows(shape.q_size))
        _copy(w, lo, n, stage_view(w_stage, shape.q_size))
    elif op == Op.GATE_UP:
        w = gmem(BFloat16, ptrs[layer, LayerSlot.GATE_UP], (2 * inter, h))
        n = staged_rows(lo, hi, cap_rows(h, dual=True))
        _copy(w, lo, n, stage_view(w_stage, h, dual=True))
        _copy(w, inter + lo, n, stage_view(w_stage, h, dual=True, second=True))
    elif op == Op.DOWN:
        w = gmem(BFloat16, ptrs[layer, LayerSlot.DOWN], (h, inter))
        n = staged_rows(lo, hi, cap_rows(inter))
        _copy(w, lo, n, stage_view(w_stage, inter))
    elif op == Op.LM_HEAD:
        w = gmem(BFloat16, ptrs[glob, GlobalSlot.LM_HEAD], (shape.vocab, h))
        n = staged_rows(lo, hi, cap_rows(h))
        _copy(w, lo, n, stage_view(w_stage, h))
    cute.arch.cp_async_commit_group()
