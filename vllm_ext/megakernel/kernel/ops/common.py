# SPDX-License-Identifier: Apache-2.0
"""What every instruction shares: the CTA shape, typed views of addresses
from the table, 128-bit vector loads, warp sums and the row RMS statistic."""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64

from vllm_ext.megakernel.kernel.shape import (
    BATCH_GROUP,
    CONSUMERS_BARRIER,
    STAGE_BYTES,
)

# The consumer threads: those that execute instructions (warps 0-7). The
# default kernel adds a warpgroup for the producer and the controller
# (persistent.py), which never joins the consumers' barriers.
NUM_THREADS = 256
NUM_WARPS = NUM_THREADS // 32
# The consumers' named barrier is CONSUMERS_BARRIER (shape.py). Barrier 0
# (bar.sync 0, the whole CTA) is used once, after start-up init: a CTA-wide
# barrier per instruction would stall the producer and the controller, which
# run ahead of the consumers.
VEC = 8  # bf16 elements per 128-bit load
# Extent given to views of the cos/sin table: only positions below the
# model's max_position are read; this just bounds the layout.
MAX_POSITIONS = 1 << 22
# BATCH_GROUP: requests accumulated per pass over a weight row; more would
# spill the accumulators at batch 64, and larger buckets re-read the row
# (from L1/L2).


def gmem(dtype, addr: Int64, shape: tuple, stride: tuple | None = None) -> cute.Tensor:
    """A global tensor at address ``addr`` (row-major unless ``stride``).
    Every table entry is 16-byte aligned (the host checks)."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16)
    if stride is None:
        stride = tuple(_prod(shape[i + 1 :]) for i in range(len(shape)))  # row-major
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def vectors(row: cute.Tensor) -> cute.Tensor:
    """A contiguous row viewed as [VEC, n / VEC]: column k is one 128-bit load."""
    return cute.zipped_divide(row, (VEC,))


def load_f32(vecs: cute.Tensor, k) -> cute.TensorSSA:
    """Vector ``k`` of a bf16 row (one 128-bit load), widened to fp32."""
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(vecs[None, k], r)
    return r.load().to(Float32)


def warp_sum(x: Float32) -> Float32:
    return cute.arch.warp_reduction(x, operator.add)


def round_bf16(x):
    """Round to bf16 and back: where the reference hands a bf16 tensor on."""
    return x.to(BFloat16).to(Float32)


@cute.jit
def row_rstd(x: cute.Tensor, rstd: cute.Tensor, eps: cutlass.Constexpr):
    """``rstd[b] = rsqrt(mean(x[b]^2) + eps)`` in fp32 for every row of
    ``x`` [B, K] (a warp per row), then a CTA barrier. Every tile of a
    normed projection recomputes it: a row is a few KiB from L2, cheaper
    than another phase and counter."""
    tidx, _, _ = cute.arch.thread_idx()
    warp, lane = tidx // 32, tidx % 32
    rows, k = x.shape
    for b in cutlass.range(warp, rows, NUM_WARPS):
        xv = vectors(x[b, None])
        ss = Float32(0.0)
        for j in cutlass.range(lane, k // VEC, 32):
            v = load_f32(xv, j)
            for e in cutlass.range_constexpr(VEC):
                ss = ss + v[e] * v[e]
        ss = warp_sum(ss)
        if lane == 0:
            rstd[b] = cute.math.rsqrt(ss / Float32(k) + Float32(eps))
    consumer_sync()


def stage_bytes(shape) -> int:
    """The staging buffer's size: ``STAGE_BYTES``, half of it in a quantized
    mixture or latent attention (``quant_stages``), whose tensor-core
    projections stage their own chunks beside a ring of at least three
    pages (Qwen3-30B-A3B W4A16 at batch 16 had no room for the ring beside
    a 64 KiB stage)."""
    return STAGE_BYTES // 2 if quant_stages(shape) else STAGE_BYTES


def quant_stages(shape) -> bool:
    """A quantized kernel whose CUDA-core GEMVs (the experts', latent
    attention's) stage their inputs in passes (``stage_rows``)."""
    return shape.quantized and (shape.moe or shape.mla)


def stages_input(shape) -> bool:
    """Whether QKV / GATE_UP stage their whole normed input: when it fits
    the staging buffer, and not on tensor cores, which norm and stage each
    page's k chunk themselves (gemv_mma.stage_chunk)."""
    return not shape.mma_gemv and shape.batch * shape.hidden * 2 <= stage_bytes(shape)


def stage_rows(shape) -> int:
    """Requests x_stage holds: the batch where ``stages_input``; in a
    quantized mixture or latent attention, which stage their CUDA-core
    GEMVs' inputs in passes (ops/expert_up.py, mla_qkv_a.py), as many as
    fit, a power of two; else none (the kernel allocates a placeholder
    vector)."""
    if stages_input(shape):
        return shape.batch
    if quant_stages(shape):
        fit = min(shape.batch, stage_bytes(shape) // (2 * shape.hidden))
        return 1 << (fit.bit_length() - 1)
    return 0


@cute.jit
def stage_normed(
    x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, out: cute.Tensor
):
    """``out[b] = bf16(x[b] * rstd[b] * norm)`` (the reference's RMSNorm
    output) for every row, a 128-bit vector per thread, then a barrier."""
    tidx, _, _ = thread_ids()
    rows, k = x.shape
    n_vec = k // VEC
    nv = vectors(norm)
    for idx in cutlass.range(tidx, rows * n_vec, NUM_THREADS):
        b, j = idx // n_vec, idx % n_vec
        v = load_f32(vectors(x[b, None]), j) * rstd[b] * load_f32(nv, j)
        r = cute.make_rmem_tensor((VEC,), BFloat16)
        r.store(v.to(BFloat16))
        cute.autovec_copy(r, vectors(out[b, None])[None, j])
    consumer_sync()


def consumer_sync():
    """A barrier among the ``NUM_THREADS`` consumer threads only (the whole
    CTA in the legacy control, which has no other threads)."""
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=NUM_THREADS)


def thread_ids():
    tidx, _, _ = cute.arch.thread_idx()
    return tidx, tidx // 32, tidx % 32


__all__ = [
    "BATCH_GROUP", "CONSUMERS_BARRIER", "NUM_THREADS", "NUM_WARPS", "STAGE_BYTES",
    "VEC", "consumer_sync", "gmem", "load_f32", "round_bf16", "row_rstd",
    "stage_normed", "stages_input", "thread_ids", "vectors", "warp_sum",
]  # fmt: skip
