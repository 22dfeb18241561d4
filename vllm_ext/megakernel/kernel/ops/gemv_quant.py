# SPDX-License-Identifier: Apache-2.0
"""The experts' GEMV on quantized weights (CUDA cores): ``gemv.gemv``'s
contract (rows [lo, hi) of ``W @ x[b]`` for each input row, fp32 sums, the
caller's ``epilogue(row, b, s1, s2)`` on lane 0) for rows of FP8 codes (a
scale per row, or per 128 x 128 block) or INT4 codes (W4A16, a bf16 scale
per row and group). An expert's rows are data (the routing chooses them),
so they are read from global memory as gemv.py reads bf16 rows, not
through the weight pipeline: a warp per row, each lane 8 codes a step
(FP8 a 64-bit load, INT4 a 32-bit one).

FP8 (W8A8): the inputs come quantized (``quantize_rows``, vLLM's QuantFP8:
per token, or per token and group of 128 as its block path does), as bf16
rows that hold the e4m3 values exactly, with their fp32 scales. A product
of two e4m3 values is exact in fp32; each lane's 8 products are summed,
and a sum is scaled as vLLM's GEMMs scale theirs: per block by the input
group's scale, then the weight block's (``(sum * a) * w``, 8 k at a time
instead of 128: fp32 rounding apart), per channel once at the end
(``a * (w * sum)``). A lane's 8 k lie in one group of 128.

INT4 (W4A16): a 32-bit word of 8 codes dequantizes as the tensor-core
GEMV's does (``gemv_int4.unpack``: ``(q - 8) * s`` rounded once to bf16,
Marlin's numerics), pairs (s, s + 4), then meets the bf16 inputs in fp32.

The index arithmetic and numerics: tests/megakernel/test_gemv_quant_mapping.py
(float64)."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from vllm_ext.megakernel.kernel.ops.common import (
    BATCH_GROUP,
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    gmem,
    load_f32,
    stage_rows,
    thread_ids,
    vectors,
    warp_sum,
)
from vllm_ext.megakernel.kernel.ops.gemv_int4 import unpack
from vllm_ext.megakernel.kernel.ops.gemv_mma import E4M3_MAX, MIN_SCALE, asm_f32s
from vllm_ext.megakernel.kernel.shape import FP8_GROUP, KernelShape


@dsl_user_op
def e4m3x4_f32(w, *, loc=None, ip=None) -> tuple:
    """The four e4m3 codes of ``w`` (memory order, low byte first) as fp32
    (exact: e4m3 to f16 to f32)."""
    return asm_f32s(
        4, [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 lo, hi; .reg .b32 a, b; .reg .f16 h0, h1, h2, h3; "
        "mov.b32 {lo, hi}, $4; "
        "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
        "mov.b32 {h0, h1}, a; mov.b32 {h2, h3}, b; "
        "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; "
        "cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
        "=f,=f,=f,=f,r", loc, ip,
    )  # fmt: skip


@dsl_user_op
def bf16x2_f32(w, *, loc=None, ip=None) -> tuple:
    """The bf16 pair in ``w`` (low half first) as two fp32 (exact)."""
    return asm_f32s(
        2, [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 t; shl.b32 t, $2, 16; mov.b32 $0, t; "
        "and.b32 t, $2, 0xFFFF0000; mov.b32 $1, t; }",
        "=f,=f,r", loc, ip,
    )  # fmt: skip


@dsl_user_op
def round_e4m3(v, *, loc=None, ip=None) -> Float32:
    """``v`` rounded to e4m3 (nearest even, saturated at +-448 as vLLM
    clamps before its cast) and back to fp32 (exact)."""
    out = llvm.inline_asm(
        T.f32(),
        [Float32(v).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 c; .reg .b32 a; .reg .f16 lo, hi; .reg .f32 z; "
        "mov.f32 z, 0f00000000; "
        "cvt.rn.satfinite.e4m3x2.f32 c, z, $1; cvt.rn.f16x2.e4m3x2 a, c; "
        "mov.b32 {lo, hi}, a; cvt.f32.f16 $0, lo; }",
        "=f,f",
        has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return Float32(out)


def input_groups(k: int, per_group: bool) -> int:
    """Input scales of a quantized row of ``k``: one a group of 128, or one."""
    return k // FP8_GROUP if per_group else 1


def row_bytes(s: KernelShape, k: int) -> int:
    """Bytes of a weight row of ``k``: bf16, or a quantized kernel's codes
    (FP8 a byte, INT4 two a byte)."""
    if s.int4_group:
        return k // 2
    return k if s.fp8 else 2 * k


def code_bytes(s: KernelShape, rows: int, k: int) -> int:
    """Bytes of a [rows, k] matrix (``row_bytes`` a row)."""
    return rows * row_bytes(s, k)


def scale_bytes(s: KernelShape, rows: int, k: int) -> int:
    """Bytes of its scales (``gemv_paged.weight_scales``)."""
    if s.int4_group:
        return rows * (k // s.int4_group) * 2
    if s.fp8_block:
        return -(-rows // FP8_GROUP) * (k // FP8_GROUP) * 4
    return rows * 4


@cute.jit
def quantize_rows(src: cute.Tensor, dst: cute.Tensor, scales: cute.Tensor, n,
                  per_group: cutlass.Constexpr, rows: cute.Tensor = None):  # fmt: skip
    """Rows [0, n) of ``src`` [*, K] bf16 as an FP8 GEMM's input: each row
    (``per_group``: each group of 128) scaled by its amax over 448, at
    least ``MIN_SCALE`` (vLLM's QuantFP8), and rounded to e4m3, into
    ``dst`` (bf16: the e4m3 values, exact) and ``scales`` [*, groups]
    (fp32). Per token vLLM multiplies by the scale's reciprocal, per group
    it divides. A warp a row (or group); ``dst`` may be ``src``. With
    ``rows``, row r is ``rows[r]`` of each. The caller's barrier publishes
    them."""
    _, warp, lane = thread_ids()
    k = src.shape[1]
    groups = input_groups(k, per_group)
    width = k // groups
    for idx in cutlass.range(warp, n * groups, NUM_WARPS):
        r, g = idx // groups, idx % groups
        if cutlass.const_expr(rows is not None):
            r = rows[r]
        v0 = g * (width // VEC)
        m = Float32(0.0)
        for v in cutlass.range(lane, width // VEC, 32):
            y = load_f32(vectors(src[r, None]), v0 + v)
            for e in cutlass.range_constexpr(VEC):
                m = cute.arch.fmax(m, cute.arch.fmax(y[e], -y[e]))
        m = cute.arch.warp_reduction(m, cute.arch.fmax)
        scale = cute.arch.fmax(m / Float32(E4M3_MAX), Float32(MIN_SCALE))
        inv = Float32(1.0) / scale
        for v in cutlass.range(lane, width // VEC, 32):
            y = load_f32(vectors(src[r, None]), v0 + v)
            q = cute.make_rmem_tensor((VEC,), BFloat16)
            for e in cutlass.range_constexpr(VEC):
                z = y[e] * inv
                if cutlass.const_expr(per_group):
                    z = y[e] / scale
                q[e] = round_e4m3(z).to(BFloat16)
            cute.autovec_copy(q, vectors(dst[r, None])[None, v0 + v])
        if lane == 0:
            scales[r, g] = scale


def x_scale_shape(s: KernelShape) -> tuple[int, int]:
    """FP8: the input scales of a staged pass (``staged_passes``), [stage
    rows, groups of the hidden size] fp32 (a shared buffer of their own)."""
    return max(stage_rows(s), 1), input_groups(s.hidden, s.fp8_block)


@cute.jit
def _row_of(rows: cute.Tensor, j):
    """Gathered request j's row of the batch (all requests: j)."""
    r = j
    if cutlass.const_expr(rows is not None):
        r = rows[j]
    return r


@cute.jit
def gathered_rstd(s: cutlass.Constexpr, src, rows: cute.Tensor, n, rstd: cute.Tensor):
    """RMSNorm's rstd of the gathered requests (``src`` the address of a
    [B, hidden] bf16 buffer; ``rows`` None: requests 0 .. n), rstd[j] for
    the j-th (row_rstd's sum), then a barrier."""
    shape: KernelShape = s
    h = shape.hidden
    _, warp, lane = thread_ids()
    for j in cutlass.range(warp, n, NUM_WARPS):
        r = _row_of(rows, j)
        xv = vectors(gmem(BFloat16, src + Int64(r) * (h * 2), (h,)))
        ss = Float32(0.0)
        for v in cutlass.range(lane, h // VEC, 32):
            xf = load_f32(xv, v)
            for e in cutlass.range_constexpr(VEC):
                ss = ss + xf[e] * xf[e]
        ss = warp_sum(ss)
        if lane == 0:
            rstd[j] = cute.math.rsqrt(ss / Float32(h) + Float32(shape.rms_norm_eps))
    consumer_sync()


@cute.jit
def stage_gathered(s: cutlass.Constexpr, src, norm: cute.Tensor, rows: cute.Tensor,
                   j0, n, rstd: cute.Tensor, x_stage: cute.Tensor):  # fmt: skip
    """Gathered requests j0 .. min(j0 + rows of x_stage, n) normed into
    x_stage (compact, from its row 0), then a barrier."""
    shape: KernelShape = s
    h = shape.hidden
    tidx, _, _ = thread_ids()
    n_vec = h // VEC
    nv = vectors(norm)
    m = cutlass.min(n - j0, x_stage.shape[0])
    for idx in cutlass.range(tidx, m * n_vec, NUM_THREADS):
        j, v = idx // n_vec, idx % n_vec
        r = _row_of(rows, j0 + j)
        xv = vectors(gmem(BFloat16, src + Int64(r) * (h * 2), (h,)))
        y = load_f32(xv, v) * rstd[j0 + j] * load_f32(nv, v)
        q = cute.make_rmem_tensor((VEC,), BFloat16)
        q.store(y.to(BFloat16))
        cute.autovec_copy(q, vectors(x_stage[j, None])[None, v])
    consumer_sync()


@cute.jit
def staged_passes(s: cutlass.Constexpr, src, norm: cute.Tensor, rows: cute.Tensor, n,
                  rstd: cute.Tensor, x_stage: cute.Tensor, x_scales: cute.Tensor,
                  body: cutlass.Constexpr):  # fmt: skip
    """A quantized CUDA-core GEMV's inputs: the gathered requests' rows of
    ``src`` RMS-normed (``norm``) in passes of as many as x_stage holds
    (all of them where the batch fits it), each pass staged and, FP8,
    quantized in place (per token, or per group of 128) with its scales in
    ``x_scales``; ``body(xg, sg, j)`` runs the GEMVs on each group of the
    pass's requests (``xg`` their staged rows, ``sg`` their scales, ``j``
    the first one's gathered index; past n a group's last rows are stale,
    and their sums must not be stored)."""
    shape: KernelShape = s
    h = shape.hidden
    gathered_rstd(shape, src, rows, n, rstd)
    per_pass = x_stage.shape[0]
    group = min(per_pass, BATCH_GROUP)
    for j0 in cutlass.range(0, n, per_pass):
        stage_gathered(shape, src, norm, rows, j0, n, rstd, x_stage)
        if cutlass.const_expr(shape.fp8):
            quantize_rows(x_stage, x_stage, x_scales, cutlass.min(n - j0, per_pass),
                          shape.fp8_block)  # fmt: skip
            consumer_sync()
        for g0 in cutlass.range(0, cutlass.min(n - j0, per_pass), group):
            xg = cute.make_tensor(
                x_stage.iterator + cute.assume(g0 * h, divby=VEC),
                cute.make_layout((group, h), stride=(h, 1)),
            )
            sg = None  # (INT4: no input scales)
            if cutlass.const_expr(shape.fp8):
                cols = x_scales.shape[1]
                sg = cute.make_tensor(
                    x_scales.iterator + g0 * cols,
                    cute.make_layout((group, cols), stride=(cols, 1)),
                )
            body(xg, sg, j0 + g0)
        consumer_sync()  # (the stage is refilled)


def code_vectors(row: cute.Tensor, int4: bool) -> cute.Tensor:
    """A row of codes (bytes) as [bytes of 8 codes, K / 8]: column j holds
    codes 8j .. 8j + 7 (FP8 8 bytes, INT4 4)."""
    return cute.zipped_divide(row, (4 if int4 else 8,))


@cute.jit
def lane_weights(cv: cute.Tensor, j, int4: cutlass.Constexpr, s2) -> list:
    """Lane vector ``j`` of a row of codes (``code_vectors``) as 8 fp32
    weights: FP8 the codes' values, INT4 ``(q - 8) * s`` rounded to bf16
    (``s2`` the group's bf16 scale in both halves)."""
    if cutlass.const_expr(int4):
        r = cute.make_rmem_tensor((4,), Uint8)
        cute.autovec_copy(cv[None, j], r)
        word = cute.recast_tensor(r, Int32)[0]
        we = [Float32(0.0)] * VEC
        for p in cutlass.range_constexpr(4):
            lo, hi = bf16x2_f32(unpack(word, p, s2))
            we[p], we[p + 4] = lo, hi
        return we
    r = cute.make_rmem_tensor((8,), Uint8)
    cute.autovec_copy(cv[None, j], r)
    words = cute.recast_tensor(r, Int32)
    return [*e4m3x4_f32(words[0]), *e4m3x4_f32(words[1])]


@cute.jit
def qgemv(s: cutlass.Constexpr, w: cute.Tensor, w2: cute.Tensor, x: cute.Tensor,
          xs: cute.Tensor, ws: cute.Tensor, ws2: cute.Tensor, lo, hi,
          epilogue: cutlass.Constexpr, dual: cutlass.Constexpr):  # fmt: skip
    """Rows [lo, hi) of quantized ``w`` (and ``w2`` when dual; codes as
    bytes, [M, K] FP8 or [M, K / 2] INT4) against every row of ``x``
    ([G, K] bf16: FP8's quantized values with their scales ``xs`` [G,
    groups]; INT4's inputs, ``xs`` unread); ``ws`` / ``ws2`` the weight
    scales (``gemv_paged.weight_scales``). A warp a row."""
    _, warp, lane = thread_ids()
    for row in cutlass.range(lo + warp, hi, NUM_WARPS):
        _qrow(s, row, w, w2, x, xs, ws, ws2, lane, epilogue, dual)


@cute.jit
def _qrow(s: cutlass.Constexpr, row, w: cute.Tensor, w2: cute.Tensor, x: cute.Tensor,
          xs: cute.Tensor, ws: cute.Tensor, ws2: cute.Tensor, lane,
          epilogue: cutlass.Constexpr, dual: cutlass.Constexpr):  # fmt: skip
    shape = s
    int4 = shape.int4_group > 0
    batch, k_dim = x.shape
    group = min(batch, BATCH_GROUP)
    unroll = 4 if group == 1 else 2
    n_vec = k_dim // VEC
    n_mats = 2 if dual else 1
    cvs = [code_vectors(w[row, None], int4), code_vectors(w2[row, None], int4)]
    for b0 in cutlass.range(0, batch, group):
        acc = cute.make_rmem_tensor((2, group), Float32)
        acc.fill(0.0)
        for j in cutlass.range(lane, n_vec, 32, unroll=unroll):
            g = (j * VEC) // FP8_GROUP  # (a block's k group: FP8 blocks)
            for m in cutlass.range_constexpr(n_mats):
                sc = ws if m == 0 else ws2
                scale2 = Int32(0)
                if cutlass.const_expr(int4):
                    t = Int32(sc[row, (j * VEC) // shape.int4_group])
                    scale2 = t | (t << 16)
                we = lane_weights(cvs[m], j, int4, scale2)
                for i in cutlass.range_constexpr(group):
                    xf = load_f32(vectors(x[b0 + i, None]), j)
                    part = Float32(0.0)
                    for e in cutlass.range_constexpr(VEC):
                        part = part + we[e] * xf[e]
                    if cutlass.const_expr(shape.fp8_block):
                        part = (part * xs[b0 + i, g]) * sc[row // FP8_GROUP, g]
                    acc[m, i] = acc[m, i] + part
        for i in cutlass.range_constexpr(group):
            s1 = warp_sum(acc[0, i])
            s2 = s1
            if cutlass.const_expr(dual):
                s2 = warp_sum(acc[1, i])
            if cutlass.const_expr(shape.fp8 and not shape.fp8_block):
                a = xs[b0 + i, 0]
                s1 = a * (ws[row] * s1)
                s2 = a * (ws2[row] * s2)
            if lane == 0:
                epilogue(row, b0 + i, s1, s2)
