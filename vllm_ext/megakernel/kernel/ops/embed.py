# SPDX-License-Identifier: Apache-2.0
"""EMBED (reference: ``ops/embed.py``): h0[:, lo:hi] = embed[ids, lo:hi],
one 128-bit vector per thread per step. With tensor parallel the table is
the rank's vocabulary shard (rows from VOCAB_START): the rank's partial sum
holds the rows of the ids it holds, zeros elsewhere (ALL_REDUCE adds them)."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32

from vllm_ext.megakernel.isa import Point
from vllm_ext.megakernel.kernel.ops.all_reduce import own_partials
from vllm_ext.megakernel.kernel.ops.common import NUM_THREADS, VEC, gmem, thread_ids
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape


@cute.jit
def embed(s: cutlass.Constexpr, ptrs: cute.Tensor, glob, lo, hi):
    shape: KernelShape = s
    b, h = shape.batch, shape.hidden
    table = gmem(BFloat16, ptrs[glob, GlobalSlot.EMBED], (shape.vocab, h))
    ids = gmem(cutlass.Int32, ptrs[glob, GlobalSlot.INPUT_IDS], (b,))
    h0 = gmem(BFloat16, ptrs[glob, GlobalSlot.H0], (b, h))
    if cutlass.const_expr(shape.tp_size > 1):
        _embed_shard(shape, ptrs, glob, lo, hi, table, ids)
    else:
        _embed(shape, lo, hi, table, ids, h0)


@cute.jit
def _embed(s: cutlass.Constexpr, lo, hi, table, ids, h0):
    shape: KernelShape = s
    b = shape.batch
    tidx, _, _ = thread_ids()
    # Tiles are multiples of 16 columns (planner.COL_MULTIPLE), so of VEC.
    n_vec = (hi - lo) // VEC
    for idx in cutlass.range(tidx, b * n_vec, NUM_THREADS):
        i, j = idx // n_vec, idx % n_vec
        col = lo + j * VEC
        src = cute.zipped_divide(table[ids[i], None], (VEC,))
        dst = cute.zipped_divide(h0[i, None], (VEC,))
        cute.autovec_copy(src[None, col // VEC], dst[None, col // VEC])


@cute.jit
def _embed_shard(s: cutlass.Constexpr, ptrs: cute.Tensor, glob, lo, hi, table, ids):
    shape: KernelShape = s
    b = shape.batch
    start = Int32(ptrs[glob, GlobalSlot.VOCAB_START])
    dst = own_partials(shape, ptrs, glob, Int32(Point.EMBED), Int32(0))
    zeros = cute.make_rmem_tensor((VEC,), BFloat16)
    zeros.fill(0.0)
    tidx, _, _ = thread_ids()
    n_vec = (hi - lo) // VEC
    for idx in cutlass.range(tidx, b * n_vec, NUM_THREADS):
        i, j = idx // n_vec, lo // VEC + idx % n_vec
        row = ids[i] - start
        out = cute.zipped_divide(dst[i, None], (VEC,))
        if (row >= 0) & (row < shape.vocab):
            src = cute.zipped_divide(table[row, None], (VEC,))
            cute.autovec_copy(src[None, j], out[None, j])
        else:
            cute.autovec_copy(zeros, out[None, j])
