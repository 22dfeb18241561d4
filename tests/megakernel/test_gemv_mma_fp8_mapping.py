# SPDX-License-Identifier: Apache-2.0
"""The FP8 tensor-core GEMV (KernelShape.fp8; kernel/ops/gemv_mma.py with
``fp8``), checked without a GPU: the e4m3 MMA's fragments, the input
scales and the quantized staging, one row group's pages end to end.

- ``mma_m16n8k32`` follows the PTX ISA's e4m3 fragment layout lane by lane
  (a register holds four codes where the bf16 MMA's holds two values); the
  kernel feeds it the bf16 path's registers (each lane's 16 consecutive
  codes of rows g and g + 8, and of request g's staged input, split over
  two MMAs), which must give ``W @ x`` for a 16-row block.
- ``fp8_input`` is ``input_scales`` and ``stage_chunk_fp8`` transcribed in
  fp32 torch arithmetic (the GPU's round-to-nearest fp32 operations):
  dequantized, it must equal the reference's ``quant.quantize_input`` bit
  for bit, the normed path (QKV, GATE_UP) included.
- Block FP8 (``fp8_group_input``, ``emulate_block_group``): inputs
  divided by their k group's scale equal ``quantize_input`` with groups of
  128 bit for bit; each k block's two MMAs summed from zero and added
  times the request's group scale and the block scale of each lane's own
  row, rows straddling a 128-row block and past the matrix's last row,
  equal the reference's block GEMM; the wrong group's scales do not.
- ``emulate_group`` runs a row group's page sequence as the kernel does:
  pages of 512-byte k chunks and staged rows of 576 bytes, both through the
  kernel's own index functions, the warps' row blocks and k slices, the
  partials' reduction, and the epilogue's ``a * (w * sum)``. It must equal
  the reference (the quantized input times the dequantized weights); a
  swapped B quad, a row scale of the wrong row and a staged row read at
  the bf16 stride must not.

Tolerance: codes and quantized inputs are e4m3 values, so every product is
exact in float64 (as in the GPU's fp32: on sm_90 ptxas runs the e4m3 MMA
as f16 MMAs, exact products, fp32 sums) and the sum's order differs from
the reference's; the scales are applied once, after the sum, where the
reference multiplies dequantized operands (each rounded to fp32): 1e-6 of
the sum of the products' magnitudes. The kernel itself runs on the GPU
(scripts/device_run.py).
"""

import numpy as np
import pytest
import torch
from test_gemv_mma_mapping import G, Q, mma_lanes, slice_sums

from vllm_ext.megakernel.kernel.ops.common import NUM_WARPS
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    E4M3_MAX,
    FP8_GROUP,
    K_BLOCK8,
    MIN_SCALE,
    N_BLOCK,
    ROWS,
    STAGE_STRIDE,
    STAGE_VECS,
    VEC8,
    group_rows,
    k_block,
    k_chunk,
    lane_vector,
    n_pad,
    page_index,
    stage_elems,
    stage_index,
    warp_task,
)
from vllm_ext.megakernel.kernel.shape import FP8_K_BLOCK, PAGE_BYTES
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    QuantFormat,
    quantize_input,
)
from vllm_ext.reference import rms_norm

FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)
FP8_BLOCKS = QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP)
E4M3 = torch.float8_e4m3fn
# A staged row of e4m3 codes: the bf16 row's bytes (``staged(fp8=True)``).
STAGE_ROW_BYTES = 2 * STAGE_STRIDE


def mma_m16n8k32(a_regs: np.ndarray, b_regs: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D = A B + C from per-lane fragments as the PTX ISA lays out
    ``mma.m16n8k32`` with e4m3 operands (``mma_lanes`` with four codes a
    register): ``a_regs`` [32, 4, 4], ``b_regs`` [32, 2, 4] (a register's
    four codes, low byte first), ``c`` [32, 4]."""
    assert a_regs.shape[1:] == (4, 4) and b_regs.shape[1:] == (2, 4)
    return mma_lanes(a_regs, b_regs, c)


def _mma_pair(lo, hi, b, acc, swap_b: bool = False):
    """The kernel's two MMAs over a lane's 16 codes (``mma_chunk``): quads
    (0, 1) of rows g / g + 8 and of the input, then quads (2, 3)."""
    for e in (0, 2):
        a_regs = np.stack([lo[:, e], hi[:, e], lo[:, e + 1], hi[:, e + 1]], axis=1)
        b_regs = b[:, e : e + 2]
        if swap_b:  # a plausible slip: B's two quads the other way
            b_regs = b_regs[:, ::-1]
        acc = mma_m16n8k32(a_regs, b_regs, acc)
    return acc


def _e4m3(gen, *shape) -> np.ndarray:
    """Random e4m3 codes' values."""
    return (4 * torch.randn(*shape, generator=gen)).to(E4M3).double().numpy()


@pytest.mark.parametrize("swap_b", [False, True])
def test_the_kernels_registers_compute_the_product(swap_b):
    gen = torch.Generator().manual_seed(3)
    k = 3 * K_BLOCK8
    w, x = _e4m3(gen, ROWS, k), _e4m3(gen, N_BLOCK, k)
    acc = np.zeros((32, 4))
    for kb in range(k // K_BLOCK8):
        kk = VEC8 * lane_vector(kb, Q)[:, None] + np.arange(VEC8)
        lo, hi = w[G[:, None], kk], w[G[:, None] + 8, kk]
        acc = _mma_pair(lo.reshape(32, 4, 4), hi.reshape(32, 4, 4),
                        x[G[:, None], kk].reshape(32, 4, 4), acc, swap_b)  # fmt: skip
    got = np.empty((ROWS, N_BLOCK))
    got[G, 2 * Q], got[G, 2 * Q + 1] = acc[:, 0], acc[:, 1]
    got[G + 8, 2 * Q], got[G + 8, 2 * Q + 1] = acc[:, 2], acc[:, 3]
    want = w @ x.T
    if swap_b:
        assert not np.allclose(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def input_scales(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemv_mma.input_scales`` in fp32: each row's amax over 448, at least
    MIN_SCALE, and the reciprocal (IEEE division, as the kernel's)."""
    amax = y.abs().amax(dim=-1)
    scale = torch.maximum(amax / torch.tensor(E4M3_MAX),
                          torch.tensor(MIN_SCALE, dtype=torch.float32))  # fmt: skip
    return scale, torch.tensor(1.0) / scale


def fp8_input(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``stage_chunk_fp8``'s codes of inputs ``y`` [B, K] (fp32 values of
    the bf16 input the kernel reads), and the scales: ``y * inv`` rounded
    to fp32, then to e4m3 with saturation (``cvt.rn.satfinite``)."""
    scale, inv = input_scales(y)
    z = y * inv[:, None]
    return z.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_group_input(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 (``input_group_scales``, ``stage_chunk_fp8`` with
    ``block``): a scale per request and k group of FP8_GROUP, each input
    divided by its group's; codes [B, K], scales [B, K / FP8_GROUP]."""
    b, k = y.shape
    groups = y.view(b, k // FP8_GROUP, FP8_GROUP)
    scale = torch.maximum(groups.abs().amax(dim=-1) / torch.tensor(E4M3_MAX),
                          torch.tensor(MIN_SCALE, dtype=torch.float32))  # fmt: skip
    z = (groups / scale[..., None]).view(b, k)
    return z.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


@pytest.mark.parametrize("normed", [False, True])
def test_staged_codes_are_the_references_quantization(normed):
    """Bit for bit vLLM's per-token QuantFP8 (``quantize_input``), over rows
    of very different ranges (one tiny enough for the scale's floor)."""
    gen = torch.Generator().manual_seed(11)
    k, eps = 512, 1e-5
    x = (
        torch.randn(5, k, generator=gen)
        * torch.tensor([1, 1e-3, 300, 1e-9, 7])[:, None]
    )
    x = x.to(torch.bfloat16)
    if normed:
        norm = torch.rand(k, generator=gen).add(0.5).to(torch.bfloat16)
        rstd = torch.rsqrt(x.float().pow(2).mean(dim=-1) + eps)
        # stage_chunk's arithmetic: (x * rstd) * norm in fp32, rounded.
        y = (x.float() * rstd[:, None] * norm.float()).to(torch.bfloat16)
        want_in = rms_norm(x, norm, eps).to(torch.bfloat16)
        assert torch.equal(y, want_in)  # what the reference hands on
    else:
        y = x
    codes, scale = fp8_input(y.float())
    assert scale[3] == torch.tensor(MIN_SCALE, dtype=torch.float32)
    got = codes.float() * scale[:, None]
    want = quantize_input(y, FP8)
    assert torch.equal(got, want)
    # Block FP8's groups of 128: divided by each group's scale.
    codes, scale = fp8_group_input(y.float())
    got = (codes.float().view(5, -1, FP8_GROUP) * scale[..., None]).view(5, k)
    assert torch.equal(got, quantize_input(y, FP8_BLOCKS))


def test_constants_are_vllms():
    assert torch.finfo(E4M3).max == E4M3_MAX
    assert K_BLOCK8 == FP8_K_BLOCK == k_block(True) == 4 * VEC8
    # A page's 512-byte k chunk and a staged row: the bf16 path's bytes.
    for dual in (False, True):
        assert (2 if dual else 1) * group_rows(dual) * k_chunk(True) == PAGE_BYTES
    assert k_chunk(True) == STAGE_VECS * VEC8 and STAGE_ROW_BYTES % 128 == 64


MUTATIONS = ("row_scale", "bf16_stride")


def emulate_group(codes: list[np.ndarray], scales: list[np.ndarray], x: torch.Tensor,
                  per_page: int, n_valid: int, page0: int = 3,
                  mutation: str = "") -> np.ndarray:  # fmt: skip
    """Rows [0, n_valid) of each matrix's ``W @ quant(x).T`` as one row
    group of the FP8 kernel computes them: codes ``codes[m]`` [per_page, K]
    with row scales ``scales[m]``, inputs ``x`` [B, K] (bf16 values). Bytes
    throughout: a page is PAGE_BYTES of codes at ``page_index`` with the
    512-code chunk, a staged row STAGE_ROW_BYTES. Returns [matrices,
    n_valid, batch] after the epilogue's scaling."""
    mats, (batch, k) = len(codes), x.shape
    chunk = min(k_chunk(True), k)
    q, a_scale = fp8_input(x.float())
    q = q.double().numpy()
    stride = STAGE_STRIDE if mutation == "bf16_stride" else STAGE_ROW_BYTES
    scratch = np.full(2 * 2 * stage_elems(batch), np.nan)  # two buffers' bytes
    n_blocks = n_pad(batch) // N_BLOCK
    acc = np.zeros((NUM_WARPS, mats, n_blocks, 32, 4))
    for kc in range(-(-k // chunk)):
        pg, k0 = page0 + kc, kc * chunk
        buf, k_len = pg % 2, min(chunk, k - k0)
        page = np.full(PAGE_BYTES, np.nan)
        for m in range(mats):
            for r in range(n_valid):
                at = page_index(m, r, 0, per_page, chunk)
                page[at : at + k_len] = codes[m][r, k0 : k0 + k_len]
        base = 2 * stage_index(buf, 0, 0, batch)  # the buffer's first byte
        for idx in range(batch * STAGE_VECS):
            n, v = idx // STAGE_VECS, idx % STAGE_VECS
            if v * VEC8 < k_len:
                at = base + n * STAGE_ROW_BYTES + v * VEC8
                scratch[at : at + VEC8] = q[n, k0 + v * VEC8 : k0 + (v + 1) * VEC8]
        for warp in range(NUM_WARPS):
            rb, sl, ks = warp_task(warp, n_valid)
            if sl >= ks:
                continue
            for kb in range(sl, k_len // k_block(True), ks):
                kk = VEC8 * lane_vector(kb, Q)[:, None] + np.arange(VEC8)
                for nb in range(n_blocks):
                    n = (nb * N_BLOCK + G)[:, None]
                    b = scratch[base + n * stride + kk].reshape(32, 4, 4)
                    for m in range(mats):
                        lo, hi = (page[page_index(m, rb * ROWS + G[:, None] + dr, kk,
                                                  per_page, chunk)].reshape(32, 4, 4)
                                  for dr in (0, 8))  # fmt: skip
                        acc[warp, m, nb] = _mma_pair(lo, hi, b, acc[warp, m, nb])
    # mma_finish: the slices of each block summed in order; the epilogue.
    sums = slice_sums(acc, n_valid, batch)
    a = a_scale.double().numpy()
    out = np.empty((mats, n_valid, batch))
    for i in range(n_valid):
        row = i + 1 if mutation == "row_scale" else i
        for m in range(mats):
            out[m, i] = a * (scales[m][row % len(scales[m])] * sums[m, i])
    return out


# Row groups of whole and partial blocks, one matrix and gate/up, batch 1
# (the FP8 kernel's batch-1 GEMV) to 16; K of two chunks and a short last.
GRID = [(1, False, 64, 1216), (1, True, 32, 1216), (1, False, 7, 576),
        (4, True, 20, 1216), (16, False, 48, 640)]  # fmt: skip


def _case(batch, dual, n_valid, k, seed):
    gen = torch.Generator().manual_seed(seed)
    per_page, mats = group_rows(dual), 2 if dual else 1
    codes = [_e4m3(gen, per_page, k) for _ in range(mats)]
    scales = [torch.rand(per_page, generator=gen).add(0.01).numpy() / 64
              for _ in range(mats)]  # fmt: skip
    x = (torch.randn(batch, k, generator=gen) * 3).to(torch.bfloat16)
    return codes, scales, x, per_page


@pytest.mark.parametrize("batch, dual, n_valid, k", GRID)
def test_row_group_is_the_w8a8_product(batch, dual, n_valid, k):
    codes, scales, x, per_page = _case(batch, dual, n_valid, k, batch + n_valid)
    got = emulate_group(codes, scales, x, per_page, n_valid)
    xq = quantize_input(x, FP8).double().numpy()
    want = np.stack([(c[:n_valid] * s[:n_valid, None]) @ xq.T
                     for c, s in zip(codes, scales, strict=True)])  # fmt: skip
    # (The reference's dequantized input is rounded to fp32: relative 2^-24
    # of each product's magnitude.)
    size = np.stack([np.abs(c[:n_valid] * s[:n_valid, None]) @ np.abs(xq).T
                     for c, s in zip(codes, scales, strict=True)])  # fmt: skip
    assert not np.isnan(got).any()
    assert (np.abs(got - want) <= 1e-6 * size).all()


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_wrong_scale_or_stride_is_caught(mutation):
    codes, scales, x, per_page = _case(4, True, 32, 1216, 9)
    got = emulate_group(codes, scales, x, per_page, 32, mutation=mutation)
    xq = quantize_input(x, FP8).double().numpy()
    want = np.stack([(c[:32] * s[:32, None]) @ xq.T
                     for c, s in zip(codes, scales, strict=True)])  # fmt: skip
    assert np.isnan(got).any() or not np.allclose(got, want, rtol=1e-4)


def test_lanes_cover_the_k_block_once():
    """Each lane quad's 16-code vectors tile the 64 k of a block."""
    for kb in range(3):
        kk = VEC8 * lane_vector(kb, Q[:4])[:, None] + np.arange(VEC8)
        assert sorted(kk.ravel()) == list(range(kb * K_BLOCK8, (kb + 1) * K_BLOCK8))


def emulate_block_group(codes: list[np.ndarray], wsc: list[np.ndarray],
                        x: torch.Tensor, row0: int, n_valid: int,
                        per_page: int, mutation: str = "") -> np.ndarray:  # fmt: skip
    """Block FP8's row group, rows [row0, row0 + n_valid) of each matrix
    (``codes[m]`` [N, K], block scales ``wsc[m]`` [N / 128, K / 128]), as
    ``_block_step`` computes it: per k block, the two MMAs from zero, then
    ``(sum * a) * w`` added, ``a`` the request's group scale and ``w`` the
    scale of each lane's own row's block (rows past the matrix: its last
    block's). Pages and staging as ``emulate_group``'s. Returns [matrices,
    n_valid, batch]."""
    mats, (batch, k) = len(codes), x.shape
    chunk = min(k_chunk(True), k)
    q, a_scale = fp8_group_input(x.float())
    q, a_scale = q.double().numpy(), a_scale.double().numpy()
    n_blocks = n_pad(batch) // N_BLOCK
    a_pad = np.full((n_pad(batch), k // FP8_GROUP), np.nan)
    a_pad[:batch] = a_scale
    staged = np.full((n_pad(batch), k), np.nan)
    staged[:batch] = q
    acc = np.zeros((NUM_WARPS, mats, n_blocks, 32, 4))
    for kc in range(-(-k // chunk)):
        k0 = kc * chunk
        k_len = min(chunk, k - k0)
        page = np.full(PAGE_BYTES, np.nan)
        for m in range(mats):
            for r in range(n_valid):
                at = page_index(m, r, 0, per_page, chunk)
                page[at : at + k_len] = codes[m][row0 + r, k0 : k0 + k_len]
        for warp in range(NUM_WARPS):
            rb, sl, ks = warp_task(warp, n_valid)
            if sl >= ks:
                continue
            for kb in range(sl, k_len // k_block(True), ks):
                kk = VEC8 * lane_vector(kb, Q)[:, None] + np.arange(VEC8)
                grp = (k0 + kb * K_BLOCK8) // FP8_GROUP
                if mutation == "group":
                    grp = (k0 + kb * K_BLOCK8) // K_BLOCK8 % (k // FP8_GROUP)
                row = row0 + rb * ROWS + G  # this lane's rows: row, row + 8
                for nb in range(n_blocks):
                    n = nb * N_BLOCK + G[:, None]
                    b = staged[n, k0 + kk].reshape(32, 4, 4)
                    a0 = a_pad[nb * N_BLOCK + 2 * Q, grp]
                    a1 = a_pad[nb * N_BLOCK + 2 * Q + 1, grp]
                    for m in range(mats):
                        last = wsc[m].shape[0] - 1
                        w_lo = wsc[m][np.minimum(row // FP8_GROUP, last), grp]
                        w_hi = wsc[m][np.minimum((row + 8) // FP8_GROUP, last), grp]
                        lo, hi = (page[page_index(m, rb * ROWS + G[:, None] + dr, kk,
                                                  per_page, chunk)].reshape(32, 4, 4)
                                  for dr in (0, 8))  # fmt: skip
                        d = _mma_pair(lo, hi, b, np.zeros((32, 4)))
                        pairs = ((a0, w_lo), (a1, w_lo), (a0, w_hi), (a1, w_hi))
                        for c, (a, w) in enumerate(pairs):
                            acc[warp, m, nb, :, c] += d[:, c] * a * w
    return slice_sums(acc, n_valid, batch)


# Row groups straddling a 128-row block (row0 96), ending past the matrix
# (the last group of a 200-row matrix), batch 1 and 16, gate/up.
BLOCK_GRID = [(1, False, 96, 64, 1024), (16, True, 96, 32, 640),
              (4, False, 192, 8, 512)]  # fmt: skip


@pytest.mark.parametrize("mutation", ["", "group"])
@pytest.mark.parametrize("batch, dual, row0, n_valid, k", BLOCK_GRID)
def test_block_row_group_is_the_block_gemm(batch, dual, row0, n_valid, k, mutation):
    """Against the reference: the input quantized per token in groups of
    128 times the blocks' dequantization (vLLM's block_dequant, partial
    last block); a k block scaled by the wrong group's scales fails."""
    from vllm_ext.quant import _dequantize_blocks

    gen = torch.Generator().manual_seed(batch * 7 + row0)
    per_page, mats, rows = group_rows(dual), 2 if dual else 1, 200
    codes = [_e4m3(gen, rows, k) for _ in range(mats)]
    grid = (-(-rows // FP8_GROUP), k // FP8_GROUP)
    wsc = [(torch.rand(*grid, generator=gen) + 0.01) / 64 for _ in range(mats)]
    x = (torch.randn(batch, k, generator=gen) * 3).to(torch.bfloat16)
    got = emulate_block_group(codes, [w.numpy() for w in wsc], x, row0, n_valid,
                              per_page, mutation)  # fmt: skip
    xq = quantize_input(x, FP8_BLOCKS).double().numpy()
    rows_ = slice(row0, row0 + n_valid)
    dense = [_dequantize_blocks(torch.from_numpy(c).to(E4M3), w).double().numpy()
             for c, w in zip(codes, wsc, strict=True)]  # fmt: skip
    want = np.stack([d[rows_] @ xq.T for d in dense])
    size = np.stack([np.abs(d[rows_]) @ np.abs(xq).T for d in dense])
    assert not np.isnan(got).any()
    close = (np.abs(got - want) <= 1e-6 * size).all()
    assert close == (mutation == "")
