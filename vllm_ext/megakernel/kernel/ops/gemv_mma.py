# SPDX-License-Identifier: Apache-2.0
"""The GEMV core on tensor cores, the GEMV of every batch above 1
(``KernelShape.mma_gemv``): the same contract as ``gemv.gemv`` (rows
[lo, hi) of ``W @ x[b]`` for every request, fp32 accumulation, the caller's
``epilogue(row, b, s1, s2)``), computed with ``mma.sync.m16n8k16`` (bf16
in, fp32 accumulators) with the batch as the MMA's small N dimension. Its
weights come from the weight pipeline's pages (``weight_pipe.py``; the
loop over them is ``gemv_paged._paged_mma``); batch 1 keeps the CUDA-core
GEMV, which streams at 3.5-4 TB/s there. Quantized weights run here at
every batch: FP8 (e4m3 MMAs on the same registers, inputs quantized as
staged, per channel or in 128 x 128 blocks) below, INT4 in gemv_int4.py.

On the H200 (2026-11-30) the CUDA-core GEMV fell from 3.5-4.0 TB/s at batch
1 to 0.25-0.8 TB/s at batch 16: instruction issue, not bandwidth. Here a
warp's 16 x 32 block of weights costs two 128-bit shared loads per lane
(and matrix) and, per 8 requests, one 128-bit shared load and two MMAs.

Geometry (chosen from bytes):

* A page (32 KiB) is a row group of ``GROUP_ROWS`` = 64 rows by
  ``K_CHUNK`` = 256 columns, or 32 rows of each of gate and up (the same
  256 columns), one bulk copy of 512 bytes per row and matrix; a row
  group's k-chunk pages follow each other. QKV's pages hold a head's 64
  rows at most (fewer when a head part's block is smaller), and any
  instruction's last row group may hold fewer rows.
* Each k-chunk of every request's activations (``K_CHUNK`` bf16, RMS-normed
  and rounded to bf16 as the reference hands it on, when asked) is staged
  in shared memory once per page by all 256 consumer threads
  (``stage_chunk``), and every row block of the page reads its B fragments
  from there: a weight row is read once per step whatever the batch, and
  the activations once per row group (B / 64 of the weight bytes, from
  L2), not once per 16 rows.
* Two staging buffers, alternating by page parity: the consumers' barrier
  after staging page ``g`` is also what frees page ``g - 1``'s buffer for
  page ``g + 1`` (one barrier per page, not two). A staged row is
  ``STAGE_STRIDE`` = 288 bf16 (576 bytes, 64 mod 128): the 8 lanes of a
  quarter warp read two requests' 64 contiguous bytes each, which then
  fall on disjoint banks (at 512 bytes they would conflict two ways). The
  weight rows keep the page's dense 512-byte stride (bulk copies land
  contiguously; padding would cost a 16th of a page): their A loads
  conflict two ways, 2 of the 2 + ceil(B / 8) shared loads per k block.
* At batch 64 the two buffers are 72 KiB; the cross-warp reduction
  (``partials``: [warp, matrix, 16 rows, requests] fp32, 64 KiB at batch
  64) reuses them once the row group's last page is read, so the GEMV's
  scratch is ``scratch_floats(batch)``: 8B's batch-64 kernel keeps 3 ring
  slots (tests/megakernel/test_kernel_aot.py::test_rings_fit_shared_memory).
* Warps split a row group's row blocks and k (``warp_task``): with
  ``nrb`` blocks of 16 rows (1-4, from the rows actually there), warp w
  takes block ``w % nrb`` and every ``8 // nrb``-th k block from
  ``w // nrb``, so all 8 warps are busy on 16, 32 and 64 rows (6 on 48).
  Each warp's accumulators carry across the group's k-chunk pages; the
  slices of a block meet in ``partials`` in a fixed order (deterministic)
  and each (row, request) sum goes to the epilogue.

A sum over k does not depend on the order of k, so each lane loads 8
consecutive weights of its row (the quad of lanes t % 4 covers 32 k) and
feeds them to two MMAs whose k slots it maps to those weights; the B
fragment uses the same mapping, so no shuffle is needed. A row of A or a
column of B only reaches the same row or column of D: rows past the group's
valid rows (stale page bytes) and requests past the batch (staged rows
never written) reach only sums the epilogue never reads.

The index functions below (``row_blocks``, ``warp_task``,
``stage_index``, ``page_index``, ``lane_vector``) are plain arithmetic
that the kernel traces and tests/megakernel/test_gemv_mma_mapping.py runs
in Python.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    load_f32,
    thread_ids,
    vectors,
)
from vllm_ext.megakernel.kernel.shape import FP8_GROUP, FP8_K_BLOCK, INT4_K_BLOCK

ROWS = 16  # an MMA's M: a row block
K_BLOCK = 32  # k per lane quad and step: 4 lanes x 8 weights
N_BLOCK = 8  # an MMA's N: requests per fragment
K_CHUNK = 256  # columns per page (of each matrix) and per staged chunk
GROUP_ROWS = 64  # rows per page of one matrix (half of it each when dual)
STAGE_PAD = 32  # bf16 past K_CHUNK per staged row: a 576-byte stride
STAGE_STRIDE = K_CHUNK + STAGE_PAD
STAGE_VECS = K_CHUNK // VEC
# FP8 (KernelShape.fp8): the same bytes, twice the elements. A lane's
# 128-bit vector holds 16 e4m3 codes, a k block is 64 codes (two
# m16n8k32 MMAs), a page's k chunk 512 codes, a staged row 576 bytes.
VEC8 = 16
K_BLOCK8 = FP8_K_BLOCK  # 4 lanes x VEC8
E4M3_MAX = 448.0
# vLLM's QuantFP8 floor under a per-token scale: amax / 448, at least this.
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)


# INT4 W4A16 (KernelShape.int4_group; gemv_int4.py): a lane's 128-bit
# vector holds 32 codes, a k block is 128 codes (eight bf16 MMAs), a page
# 128 rows (64 of each of gate and up) by a 512-code chunk (256 bytes a
# row), a staged row 512 bf16 plus the pad (1088 bytes, 64 mod 128).
VEC4 = 32
K_BLOCK4 = INT4_K_BLOCK  # 4 lanes x VEC4
K_CHUNK4 = 512
GROUP_ROWS4 = 128
STAGE_STRIDE4 = K_CHUNK4 + STAGE_PAD


def k_chunk(fp8: bool, int4: bool = False) -> int:
    """Columns of a page's k chunk (of each matrix): 512 bytes (INT4: 256
    bytes of 128 rows)."""
    if int4:
        return K_CHUNK4
    return 2 * K_CHUNK if fp8 else K_CHUNK


def k_block(fp8: bool, int4: bool = False) -> int:
    """k of one lane quad's step (4 lanes x one 128-bit vector)."""
    if int4:
        return K_BLOCK4
    return K_BLOCK8 if fp8 else K_BLOCK


# Block FP8 (KernelShape.fp8_block): inputs quantized per token in groups
# of FP8_GROUP, weights' scales per FP8_GROUP x FP8_GROUP block (shape.py).


def fp8_scale_floats(batch: int, groups: int = 0) -> int:
    """fp32 words of an FP8 kernel's per-request input scales: per channel
    (``input_scales``) every warp's amax, then the scales, then their
    reciprocals; with ``groups`` k groups (block FP8,
    ``input_group_scales``) a scale per group; each a row of the padded
    batch."""
    return max(NUM_WARPS + 2, groups) * n_pad(batch)


def group_rows(dual: bool, int4: bool = False) -> int:
    """Rows of a full page (of each matrix when dual)."""
    rows = GROUP_ROWS4 if int4 else GROUP_ROWS
    return rows // 2 if dual else rows


def n_pad(batch: int) -> int:
    """The batch rounded up to whole MMA fragments."""
    return (batch + N_BLOCK - 1) // N_BLOCK * N_BLOCK


def stage_elems(batch: int, int4: bool = False) -> int:
    """bf16 elements of one staging buffer: a padded row per request of the
    padded batch (rows past the batch are read, never written)."""
    return n_pad(batch) * (STAGE_STRIDE4 if int4 else STAGE_STRIDE)


def red_floats(batch: int) -> int:
    """fp32 elements of the cross-warp reduction (room for two matrices)."""
    return NUM_WARPS * 2 * ROWS * n_pad(batch)


def scratch_floats(batch: int, int4: bool = False) -> int:
    """fp32 words of the GEMV's shared scratch: the two staging buffers,
    which the reduction reuses."""
    return max(red_floats(batch), stage_elems(batch, int4))  # 2 bf16 buffers


def row_blocks(n_valid):
    """Blocks of 16 rows that cover a row group of ``n_valid`` rows."""
    return (n_valid + ROWS - 1) // ROWS


def warp_task(warp, n_valid):
    """(row block, k slice, slices) of ``warp`` in a row group of
    ``n_valid`` rows: blocks of 16 rows side by side, each split over
    ``NUM_WARPS // blocks`` warps taking every slices-th k block (a warp
    whose slice is not below ``slices`` idles)."""
    blocks = row_blocks(n_valid)
    return warp % blocks, warp // blocks, NUM_WARPS // blocks


def lane_vector(kb, q):
    """The 128-bit vector (8 k) of the chunk that lane quad position ``q``
    loads in k block ``kb``, for A and B alike."""
    return kb * (K_BLOCK // VEC) + q


def stage_index(buf, n, k, batch: int, int4: bool = False):
    """Element of request ``n``'s staged k (within the chunk) in buffer
    ``buf`` (the page's parity)."""
    stride = STAGE_STRIDE4 if int4 else STAGE_STRIDE
    return buf * stage_elems(batch, int4) + n * stride + k


def page_index(m, row, k, per_page: int, k_chunk: int):
    """Element of matrix ``m``'s row ``row``, column ``k`` in a page (its
    slot's start: gate rows, then up rows)."""
    return (m * per_page + row) * k_chunk + k


def asm_f32s(n: int, args, asm: str, constraints: str, loc=None, ip=None) -> tuple:
    """Inline PTX with ``n`` fp32 outputs (the first ``n`` of
    ``constraints``, ``=f``), returned as a tuple."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n), args, asm, constraints,
        has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return tuple(
        Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip)) for i in range(n)
    )


def _mma(shape_types: str, regs, acc, loc=None, ip=None) -> tuple:
    """``mma.sync.aligned.<shape_types>``: six 32-bit A and B registers,
    four fp32 accumulators in and out (a lane's fragments)."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in regs]
    args += [Float32(v).ir_value(loc=loc, ip=ip) for v in acc]
    return asm_f32s(
        4, args,
        f"mma.sync.aligned.{shape_types} "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip,
    )  # fmt: skip


@dsl_user_op
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: A as four
    packed bf16 pairs, B as two, C and D as four fp32 per lane."""
    return _mma("m16n8k16.row.col.f32.bf16.bf16.f32", (a0, a1, a2, a3, b0, b1),
                (c0, c1, c2, c3), loc, ip)  # fmt: skip


def staged(scratch: cute.Tensor, batch: int, buf, fp8: bool = False,
           int4: bool = False) -> cute.Tensor:  # fmt: skip
    """Staging buffer ``buf`` of the GEMV's scratch as [padded batch,
    K_CHUNK] bf16 with the padded row stride (``fp8``: the same bytes as
    [padded batch, 2 K_CHUNK] e4m3 codes, as bytes; ``int4``: [padded
    batch, K_CHUNK4] bf16)."""
    base = cute.recast_ptr(scratch.iterator, dtype=BFloat16)
    base = base + stage_index(buf, 0, 0, batch, int4)
    if int4:
        return cute.make_tensor(
            base, cute.make_layout((n_pad(batch), K_CHUNK4), stride=(STAGE_STRIDE4, 1))
        )
    if fp8:
        return cute.make_tensor(
            cute.recast_ptr(base, dtype=Uint8),
            cute.make_layout((n_pad(batch), 2 * K_CHUNK), stride=(2 * STAGE_STRIDE, 1)),
        )
    return cute.make_tensor(
        base, cute.make_layout((n_pad(batch), K_CHUNK), stride=(STAGE_STRIDE, 1))
    )


def fp8_scales(scratch: cute.Tensor, batch: int, groups: int = 0) -> cute.Tensor:
    """An FP8 kernel's input scales past the GEMV's scratch
    (``fp8_scale_floats``), fp32: per channel [NUM_WARPS + 2, padded batch]
    (the warps' amax rows, the scales, their reciprocals); block FP8
    [groups, padded batch]."""
    n = n_pad(batch)
    rows = groups if groups else NUM_WARPS + 2
    at = scratch.iterator + (cute.size(scratch) - fp8_scale_floats(batch, groups))
    return cute.make_tensor(at, cute.make_layout((rows, n), stride=(n, 1)))


def partials(scratch: cute.Tensor, batch: int, dual: bool) -> cute.Tensor:
    """The scratch as [warp, matrix, row, request] partial tiles."""
    n = n_pad(batch)
    n_mats = 2 if dual else 1
    return cute.make_tensor(
        scratch.iterator,
        cute.make_layout(
            (NUM_WARPS, n_mats, ROWS, n),
            stride=(n_mats * ROWS * n, ROWS * n, n, 1),
        ),
    )


@cute.jit
def stage_chunk(
    x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, k0, k_len,
    stage: cute.Tensor, normed: cutlass.Constexpr,
):  # fmt: skip
    """Every request's inputs k0 .. k0 + k_len into ``stage`` (a vector per
    thread), normed (``bf16(x * rstd * norm)``, as the reference rounds it)
    when asked. The caller's barrier publishes them."""
    tidx, _, _ = thread_ids()
    batch = x.shape[0]
    v0 = k0 // VEC
    for idx in cutlass.range(tidx, batch * STAGE_VECS, NUM_THREADS):
        n, v = idx // STAGE_VECS, idx % STAGE_VECS
        if v * VEC < k_len:
            r = cute.make_rmem_tensor((VEC,), BFloat16)
            if cutlass.const_expr(normed):
                xr = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(vectors(x[n, None])[None, v0 + v], xr)
                nr = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(vectors(norm)[None, v0 + v], nr)
                y = xr.load().to(Float32) * rstd[n] * nr.load().to(Float32)
                r.store(y.to(BFloat16))
            else:
                cute.autovec_copy(vectors(x[n, None])[None, v0 + v], r)
            cute.autovec_copy(r, vectors(stage[n, None])[None, v])


@cute.jit
def load_frag(vecs: cute.Tensor, j, frag: cute.Tensor):
    """Vector ``j`` of a bf16 row, or of an e4m3 row as bytes (one 128-bit
    shared load), as four 32-bit registers (packed pairs, or quads)."""
    r = cute.make_rmem_tensor((vecs.shape[0],), vecs.element_type)
    cute.autovec_copy(vecs[None, j], r)
    frag.store(cute.recast_tensor(r, Int32).load())


@dsl_user_op
def mma_e4m3(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32``: A as four
    registers of four e4m3 codes, B as two, C and D as four fp32 per lane:
    the bf16 MMA's register layout, each 2-byte pair now a 4-byte quad."""
    return _mma("m16n8k32.row.col.f32.e4m3.e4m3.f32", (a0, a1, a2, a3, b0, b1),
                (c0, c1, c2, c3), loc, ip)  # fmt: skip


@dsl_user_op
def to_e4m3x4(v0, v1, v2, v3, *, loc=None, ip=None) -> Int32:
    """Four fp32 values rounded to e4m3 (nearest even, saturated at +-448
    as vLLM clamps before its cast), packed low to high: memory order."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
    out = llvm.inline_asm(
        T.i32(), args,
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f",
        has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return Int32(out)


@cute.jit
def _input_vector(x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, n, v,
                  normed: cutlass.Constexpr) -> cute.TensorSSA:  # fmt: skip
    """Request ``n``'s 128-bit bf16 vector ``v`` of its input in fp32,
    normed and rounded as the reference hands it on when asked."""
    y = load_f32(vectors(x[n, None]), v)
    if cutlass.const_expr(normed):
        y = (y * rstd[n] * load_f32(vectors(norm), v)).to(BFloat16).to(Float32)
    return y


@cute.jit
def input_scales(x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor,
                 sc: cute.Tensor, normed: cutlass.Constexpr):  # fmt: skip
    """FP8: each request's input scale (``sc`` from ``fp8_scales``), as
    vLLM's per-token QuantFP8 takes it: the row's amax over 448, at least
    ``MIN_SCALE``, and its reciprocal; all 256 threads on a row, once an
    instruction. Barriers before the scales are read and after."""
    tidx, warp, lane = thread_ids()
    batch, k = x.shape
    for n in cutlass.range(batch):
        m = Float32(0.0)
        for v in cutlass.range(tidx, k // VEC, NUM_THREADS):
            y = _input_vector(x, norm, rstd, n, v, normed)
            for e in cutlass.range_constexpr(VEC):
                m = cute.arch.fmax(m, cute.arch.fmax(y[e], -y[e]))
        m = cute.arch.warp_reduction(m, cute.arch.fmax)
        if lane == 0:
            sc[warp, n] = m
    consumer_sync()
    for n in cutlass.range(tidx, batch, NUM_THREADS):
        m = sc[0, n]
        for w in cutlass.range_constexpr(1, NUM_WARPS):
            m = cute.arch.fmax(m, sc[w, n])
        scale = cute.arch.fmax(m / Float32(E4M3_MAX), Float32(MIN_SCALE))
        sc[NUM_WARPS, n] = scale
        sc[NUM_WARPS + 1, n] = Float32(1.0) / scale
    consumer_sync()


@cute.jit
def input_group_scales(x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor,
                       sc: cute.Tensor, normed: cutlass.Constexpr):  # fmt: skip
    """Block FP8: each request's scale per k group of FP8_GROUP (``sc``
    from ``fp8_scales`` with groups), as vLLM's per-token-group
    quantization takes it: the group's amax over 448, at least
    ``MIN_SCALE``; a thread a group. Barrier after."""
    tidx, _, _ = thread_ids()
    batch, k = x.shape
    groups = k // FP8_GROUP
    for idx in cutlass.range(tidx, batch * groups, NUM_THREADS):
        n, grp = idx // groups, idx % groups
        m = Float32(0.0)
        for v in cutlass.range(FP8_GROUP // VEC, unroll=4):
            y = _input_vector(x, norm, rstd, n, grp * (FP8_GROUP // VEC) + v, normed)
            for e in cutlass.range_constexpr(VEC):
                m = cute.arch.fmax(m, cute.arch.fmax(y[e], -y[e]))
        sc[grp, n] = cute.arch.fmax(m / Float32(E4M3_MAX), Float32(MIN_SCALE))
    consumer_sync()


@cute.jit
def stage_chunk_fp8(
    x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, sc: cute.Tensor, k0,
    k_len, stage: cute.Tensor, normed: cutlass.Constexpr,
    block: cutlass.Constexpr = False,
):  # fmt: skip
    """``stage_chunk`` for FP8: every request's inputs k0 .. k0 + k_len
    (normed when asked) times its scale's reciprocal, rounded to e4m3
    (vLLM's QuantFP8 per token), 16 codes a thread; ``block``: divided by
    its k group's scale instead (vLLM's per-token-group quantization
    divides)."""
    tidx, _, _ = thread_ids()
    batch = x.shape[0]
    v0 = k0 // VEC
    for idx in cutlass.range(tidx, batch * STAGE_VECS, NUM_THREADS):
        n, v = idx // STAGE_VECS, idx % STAGE_VECS
        if v * VEC8 < k_len:
            q = cute.make_rmem_tensor((4,), Int32)
            for h in cutlass.range_constexpr(2):
                y = _input_vector(x, norm, rstd, n, v0 + 2 * v + h, normed)
                z = y
                if cutlass.const_expr(block):
                    z = y / sc[(k0 + v * VEC8) // FP8_GROUP, n]
                else:
                    z = y * sc[NUM_WARPS + 1, n]
                for i in cutlass.range_constexpr(2):
                    e = 4 * i
                    q[2 * h + i] = to_e4m3x4(z[e], z[e + 1], z[e + 2], z[e + 3])
            dst = cute.recast_tensor(q, Uint8)
            cute.autovec_copy(dst, cute.zipped_divide(stage[n, None], (VEC8,))[None, v])


@cute.jit
def mma_chunk(
    w: cute.Tensor, w2: cute.Tensor, dual: cutlass.Constexpr, stage: cute.Tensor,
    rb, sl, ks, kblocks, batch: cutlass.Constexpr, acc: cute.Tensor,
    fp8: cutlass.Constexpr = False, wsc: cute.Tensor = None,
    wsc2: cute.Tensor = None, sc: cute.Tensor = None, row0=0, k0=0,
):  # fmt: skip
    """This warp's share of one page: rows ``16 rb`` .. ``16 rb + 15`` of
    ``w`` (and ``w2``) against every staged request, k blocks ``sl``,
    ``sl + ks``, .. below ``kblocks``, accumulated into ``acc`` [matrices,
    request blocks, 4]. ``fp8``: e4m3 weights and staged inputs, the same
    registers through ``mma_e4m3``. Block FP8 (``wsc``: the weights' block
    scales, ``wsc2`` gate/up's up half; ``sc`` the inputs' group scales;
    the page's first matrix row ``row0`` and column ``k0``): each k
    block's MMAs sum from zero, then ``(sum * a) * w`` is added (vLLM's
    block GEMM), w the scale of each lane's own row's block."""
    _, _, lane = thread_ids()
    vec = VEC8 if fp8 else VEC
    mma = mma_e4m3 if fp8 else mma_bf16
    block = wsc is not None
    g, q = lane // 4, lane % 4
    row = rb * ROWS + g
    n_mats = 2 if dual else 1
    n_blocks = n_pad(batch) // N_BLOCK
    for kb in cutlass.range(sl, kblocks, ks):
        j = lane_vector(kb, q)
        a = cute.make_rmem_tensor((n_mats, 2, 4), Int32)
        for m in cutlass.range_constexpr(n_mats):
            mat = w if m == 0 else w2
            load_frag(cute.zipped_divide(mat[row, None], (vec,)), j, a[m, 0, None])
            load_frag(cute.zipped_divide(mat[row + 8, None], (vec,)), j,
                      a[m, 1, None])  # fmt: skip
        if cutlass.const_expr(block):
            grp = (k0 + kb * K_BLOCK8) // FP8_GROUP
            _block_step(a, stage, vec, j, g, q, n_mats, n_blocks, acc, wsc, wsc2, sc,
                        row0 + rb * ROWS + g, grp)  # fmt: skip
        else:
            for nb in cutlass.range_constexpr(n_blocks):
                b = cute.make_rmem_tensor((4,), Int32)
                load_frag(cute.zipped_divide(stage[nb * N_BLOCK + g, None], (vec,)),
                          j, b)  # fmt: skip
                for m in cutlass.range_constexpr(n_mats):
                    for half in cutlass.range_constexpr(2):
                        e = 2 * half
                        d = mma(
                            a[m, 0, e], a[m, 1, e], a[m, 0, e + 1], a[m, 1, e + 1],
                            b[e], b[e + 1],
                            acc[m, nb, 0], acc[m, nb, 1], acc[m, nb, 2], acc[m, nb, 3],
                        )  # fmt: skip
                        for c in cutlass.range_constexpr(4):
                            acc[m, nb, c] = d[c]


@cute.jit
def _block_step(a: cute.Tensor, stage: cute.Tensor, vec: cutlass.Constexpr, j, g, q,
                n_mats: cutlass.Constexpr, n_blocks: cutlass.Constexpr,
                acc: cute.Tensor, wsc: cute.Tensor, wsc2: cute.Tensor,
                sc: cute.Tensor, row, grp):  # fmt: skip
    """One k block of block FP8 (``mma_chunk``): rows ``row`` and ``row +
    8`` (this lane's, of the matrix) in k group ``grp``."""
    last = wsc.shape[0] - 1  # (stale rows past the matrix: any valid scale)
    ws = cute.make_rmem_tensor((2, 2), Float32)
    for m in cutlass.range_constexpr(n_mats):
        t = wsc if m == 0 else wsc2
        ws[m, 0] = t[cutlass.min(row // FP8_GROUP, last), grp]
        ws[m, 1] = t[cutlass.min((row + 8) // FP8_GROUP, last), grp]
    for nb in cutlass.range_constexpr(n_blocks):
        b = cute.make_rmem_tensor((4,), Int32)
        load_frag(cute.zipped_divide(stage[nb * N_BLOCK + g, None], (vec,)), j, b)
        a0 = sc[grp, nb * N_BLOCK + 2 * q]
        a1 = sc[grp, nb * N_BLOCK + 2 * q + 1]
        for m in cutlass.range_constexpr(n_mats):
            d = (Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0))
            for half in cutlass.range_constexpr(2):
                e = 2 * half
                d = mma_e4m3(a[m, 0, e], a[m, 1, e], a[m, 0, e + 1], a[m, 1, e + 1],
                             b[e], b[e + 1], d[0], d[1], d[2], d[3])  # fmt: skip
            # C fragment: (row, requests 2q, 2q + 1), then row + 8.
            acc[m, nb, 0] = acc[m, nb, 0] + d[0] * a0 * ws[m, 0]
            acc[m, nb, 1] = acc[m, nb, 1] + d[1] * a1 * ws[m, 0]
            acc[m, nb, 2] = acc[m, nb, 2] + d[2] * a0 * ws[m, 1]
            acc[m, nb, 3] = acc[m, nb, 3] + d[3] * a1 * ws[m, 1]


@cute.jit
def mma_finish(
    part: cute.Tensor, acc: cute.Tensor, first, n_valid, sl, ks, blocks,
    batch: cutlass.Constexpr, epilogue: cutlass.Constexpr, dual: cutlass.Constexpr,
):  # fmt: skip
    """The warps' accumulators of a row group meet in ``part`` (which
    aliases the staging buffers: a barrier first, once every warp has read
    the last chunk); the sum over the slices of each of the group's first
    ``n_valid`` rows and each request goes to the epilogue. A barrier after
    (the next staging overwrites ``part``)."""
    tidx, warp, lane = thread_ids()
    g, q = lane // 4, lane % 4
    n_blocks = n_pad(batch) // N_BLOCK
    n_mats = 2 if dual else 1
    consumer_sync()
    if sl < ks:
        # C fragment: (row g, requests 2q, 2q + 1), then row g + 8.
        for m in cutlass.range_constexpr(n_mats):
            for nb in cutlass.range_constexpr(n_blocks):
                col = nb * N_BLOCK + 2 * q
                part[warp, m, g, col] = acc[m, nb, 0]
                part[warp, m, g, col + 1] = acc[m, nb, 1]
                part[warp, m, g + 8, col] = acc[m, nb, 2]
                part[warp, m, g + 8, col + 1] = acc[m, nb, 3]
    consumer_sync()
    for idx in cutlass.range(tidx, blocks * ROWS * batch, NUM_THREADS):
        i, n = idx // batch, idx % batch
        rb, r = i // ROWS, i % ROWS
        s1 = Float32(0.0)
        s2 = Float32(0.0)
        for s in cutlass.range(ks):
            s1 = s1 + part[rb + blocks * s, 0, r, n]
            if cutlass.const_expr(dual):
                s2 = s2 + part[rb + blocks * s, 1, r, n]
        if cutlass.const_expr(not dual):
            s2 = s1
        if i < n_valid:
            epilogue(first + i, n, s1, s2)
    consumer_sync()
