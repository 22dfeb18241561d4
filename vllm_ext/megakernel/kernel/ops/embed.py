# SPDX-License-Identifier: Apache-2.0
"""EMBED (reference: ``ops/embed.py``): h0[:, lo:hi] = embed[ids, lo:hi],
one 128-bit vector per thread per step."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16

from vllm_ext.megakernel.kernel.ops.common import NUM_THREADS, VEC, gmem, thread_ids
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape


@cute.jit
def embed(s: cutlass.Constexpr, ptrs: cute.Tensor, glob, lo, hi):
    shape: KernelShape = s
    b, h = shape.batch, shape.hidden
    table = gmem(BFloat16, ptrs[glob, GlobalSlot.EMBED], (shape.vocab, h))
    ids = gmem(cutlass.Int32, ptrs[glob, GlobalSlot.INPUT_IDS], (b,))
    h0 = gmem(BFloat16, ptrs[glob, GlobalSlot.H0], (b, h))
    tidx, _, _ = thread_ids()
    # Tiles are multiples of 16 columns (planner.COL_MULTIPLE), so of VEC.
    n_vec = (hi - lo) // VEC
    for idx in cutlass.range(tidx, b * n_vec, NUM_THREADS):
        i, j = idx // n_vec, idx % n_vec
        col = lo + j * VEC
        src = cute.zipped_divide(table[ids[i], None], (VEC,))
        dst = cute.zipped_divide(h0[i, None], (VEC,))
        cute.autovec_copy(src[None, col // VEC], dst[None, col // VEC])
