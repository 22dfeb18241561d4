# SPDX-License-Identifier: Apache-2.0
"""The persistent kernel: one CTA per SM runs its queue of instructions.

Per instruction (words as in ``isa.py``): thread 0 polls the wait counter
with relaxed loads and a bounded spin (``trap`` with a message past
``max_spins``: a broken program ends the kernel, never hangs the GPU), then
re-reads it with an acquire load whose value is used (an unused acquire
load is dropped by the compiler); the CTA executes the instruction; after a
CTA barrier (all stores issued), thread 0 adds 1 to the signal counter with
a release atomic at GPU scope.

So far one instruction body exists: a GEMV tile, rows [arg0, arg1) of
``W @ x`` for one request, bf16 in, fp32 accumulation, 128-bit loads (the
core of O_PROJ, GATE_UP, DOWN and LM_HEAD). Every other opcode traps.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from vllm_ext.megakernel.kernel.sync import nanosleep, trap

NUM_THREADS = 128
NUM_WARPS = NUM_THREADS // 32
VEC = 8  # bf16 elements per 128-bit load
WORDS = 8
OP_NOP = 0
OP_GEMV = 100  # test-only opcode: no planned program uses it (no residual yet)
POLL_NS = 32


@cute.kernel
def persistent_kernel(
    queue: cute.Tensor,  # [num_sms, max_len, WORDS] int32
    lengths: cute.Tensor,  # [num_sms] int32
    counters: cute.Tensor,  # [num_counters] int32
    w: cute.Tensor,  # [M, K] bf16, row-major
    x: cute.Tensor,  # [K] bf16
    y: cute.Tensor,  # [M] bf16
    epoch: Int32,
    max_spins: Int32,
):
    tidx, _, _ = cute.arch.thread_idx()
    sm, _, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    n_vec = w.shape[1] // VEC
    ins = cute.make_rmem_tensor((WORDS,), Int32)
    for pc in cutlass.range(lengths[sm]):
        cute.autovec_copy(queue[sm, pc, None], ins)  # one 32-byte fetch
        op = ins[0]
        if tidx == 0:
            if ins[4] >= 0:
                target = epoch * ins[5]
                ptr = counters.iterator + ins[4]
                seen = cute.arch.load(ptr, Int32, sem="relaxed", scope="gpu")
                spins = Int32(0)
                while seen < target:
                    spins = spins + 1
                    if spins > max_spins:
                        cute.printf(
                            "megakernel: wait timeout: opcode %d sm %d pc %d "
                            "counter %d expected %d seen %d\n",
                            op, sm, pc, ins[4], target, seen,
                        )  # fmt: skip
                        trap()
                    nanosleep(Int32(POLL_NS))
                    seen = cute.arch.load(ptr, Int32, sem="relaxed", scope="gpu")
                # Acquire: the producers' stores are visible from here on.
                seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
                if seen < target:
                    trap()
        cute.arch.sync_threads()

        if op == OP_GEMV:
            xv = cute.zipped_divide(x, (VEC,))
            for row in cutlass.range(ins[2] + warp, ins[3], NUM_WARPS):
                wv = cute.zipped_divide(w[row, None], (VEC,))
                acc = Float32(0.0)
                for k in cutlass.range(lane, n_vec, 32):
                    wf = cute.make_rmem_tensor((VEC,), BFloat16)
                    xf = cute.make_rmem_tensor((VEC,), BFloat16)
                    cute.autovec_copy(wv[None, k], wf)
                    cute.autovec_copy(xv[None, k], xf)
                    wvals, xvals = wf.load().to(Float32), xf.load().to(Float32)
                    for e in cutlass.range_constexpr(VEC):
                        acc = acc + wvals[e] * xvals[e]
                acc = cute.arch.warp_reduction(acc, lambda a, b: a + b)
                if lane == 0:
                    y[row] = acc.to(BFloat16)
        elif op != OP_NOP:
            if tidx == 0:
                cute.printf("megakernel: opcode %d not implemented (sm %d)\n", op, sm)
                trap()

        # Every thread's stores are issued before the release below.
        cute.arch.sync_threads()
        if tidx == 0:
            if ins[6] >= 0:
                cute.arch.atomic_add(
                    counters.iterator + ins[6], Int32(1), sem="release", scope="gpu"
                )


@cute.jit
def launch(
    queue: cute.Tensor,
    lengths: cute.Tensor,
    counters: cute.Tensor,
    w: cute.Tensor,
    x: cute.Tensor,
    y: cute.Tensor,
    epoch: Int32,
    max_spins: Int32,
    stream: cuda.CUstream,
):
    # Cooperative: the launch fails rather than leave CTAs unscheduled, since
    # a CTA that never runs would leave the others waiting forever.
    persistent_kernel(queue, lengths, counters, w, x, y, epoch, max_spins).launch(
        grid=(queue.shape[0], 1, 1),
        block=(NUM_THREADS, 1, 1),
        stream=stream,
        cooperative=True,
    )


def fake_args():
    """Fake tensors for compiling without a GPU: symbolic sizes, K a multiple
    of 8 and 16-byte aligned rows so the weight loads are 128-bit."""
    from cutlass import Int32 as I32
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    n_sm, q_len, n_ctr, m = (cute.sym_int32() for _ in range(4))
    k = cute.sym_int32(divisibility=VEC)

    def fake(dtype, shape, align, order=None):
        kwargs = {"assumed_align": align}
        if order is not None:
            kwargs["stride_order"] = order
        return make_fake_compact_tensor(dtype, shape, **kwargs)

    return (
        fake(Int32, (n_sm, q_len, WORDS), 32, (2, 1, 0)),
        fake(Int32, (n_sm,), 4),
        fake(Int32, (n_ctr,), 4),
        fake(BFloat16, (m, k), 16, (1, 0)),
        fake(BFloat16, (k,), 16),
        fake(BFloat16, (m,), 16),
        I32(1),
        I32(1 << 24),
        make_fake_stream(),
    )
