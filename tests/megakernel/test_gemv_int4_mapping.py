# SPDX-License-Identifier: Apache-2.0
"""The INT4 W4A16 tensor-core GEMV (KernelShape.int4_group;
kernel/ops/gemv_int4.py), checked without a GPU.

- ``unpack`` transcribed bit by bit (shift, ``lop3`` with 0x000F000F and
  0x43004300, bf16 subtraction of 136, bf16 product with the scale) gives
  ``quant.Int4Weight.dequantize`` (Marlin's ``(q - 8) * s`` rounded once)
  bit for bit, for every code and scales across the bf16 range.
- ``emulate_group`` runs a row group as the kernel does: the producer's
  copies of packed rows (two codes a byte, low nibble first) into a page
  at ``page_index`` in codes (bytes: half), ``stage_chunk_int4``'s permuted
  bf16 inputs at ``stage_index`` (the INT4 stride), the warps' row blocks
  and k slices (``warp_task``, 128-row groups), each lane's 32 codes of
  rows g and g + 8 unpacked with their rows' group scales into the eight
  bf16 MMAs' registers (``mma_lanes``, the PTX layout), the partials'
  reduction. It must equal the reference: the bf16 inputs times
  ``Int4Weight.dequantize``; an unpermuted staging, a scale of the wrong
  group and a B register pair swapped must not.

Tolerance: dequantized weights and inputs are bf16 values, so every
product is exact in float64; only the order of the sums differs
(relative 1e-12). The kernel itself runs on the GPU.
"""

import numpy as np
import pytest
import torch
from test_gemv_mma_mapping import G, Q, mma_lanes, slice_sums

from vllm_ext.megakernel.kernel.ops.common import NUM_WARPS, VEC
from vllm_ext.megakernel.kernel.ops.gemv_int4 import BF16X2_128, BF16X2_136, permuted
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    K_BLOCK4,
    K_CHUNK4,
    N_BLOCK,
    ROWS,
    STAGE_STRIDE4,
    VEC4,
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
from vllm_ext.megakernel.kernel.shape import INT4_K_BLOCK, PAGE_BYTES
from vllm_ext.quant import Int4Weight


def _bf16_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def unpack(words: np.ndarray, shift: int, scale: torch.Tensor) -> torch.Tensor:
    """``gemv_int4.unpack`` on uint32 ``words`` [...]: the dequantized bf16
    pairs [..., 2] (codes ``shift`` and ``shift + 4`` of each word) with
    ``scale`` (bf16, broadcast) in both halves."""
    t = ((words >> np.uint32(4 * shift)) & np.uint32(0x000F000F)) | np.uint32(
        BF16X2_128
    )
    pair = _bf16_bits(np.stack([t & 0xFFFF, t >> 16], axis=-1))
    c = _bf16_bits(np.array([BF16X2_136 & 0xFFFF]))
    # sub.rn.bf16x2 then mul.rn.bf16x2: each one rounding to bf16.
    v = (pair.float() - c.float()).to(torch.bfloat16)
    return (v.float() * scale.float()[..., None]).to(torch.bfloat16)


def pack(codes: torch.Tensor) -> np.ndarray:
    """uint8 codes [N, K] as the kernel's rows: bytes [N, K / 2], code 2j in
    the low nibble of byte j (compressed-tensors' words, as bytes)."""
    c = codes.numpy().astype(np.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def test_unpack_is_marlins_dequantization():
    gen = torch.Generator().manual_seed(0)
    codes = torch.arange(16, dtype=torch.uint8).repeat(64, 2)  # [64, 32]
    scales = (torch.randn(64, 1, generator=gen) * 10.0 ** torch.randint(
        -6, 3, (64, 1), generator=gen)).to(torch.bfloat16)  # fmt: skip
    want = Int4Weight(codes, scales).dequantize()  # [64, 32]
    words = pack(codes).reshape(64, -1).view(np.uint32)  # [64, 4]
    got = torch.empty_like(want)
    for t in range(4):
        for s in range(4):
            d = unpack(words[:, t], s, scales[:, 0])
            got[:, 8 * t + s], got[:, 8 * t + s + 4] = d[:, 0], d[:, 1]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert BF16X2_136 == 0x43084308 and _bf16_bits(np.array([0x4308])).item() == 136


def test_constants():
    assert K_BLOCK4 == INT4_K_BLOCK == 4 * VEC4 == k_block(False, True)
    assert k_chunk(False, True) == K_CHUNK4
    for dual in (False, True):
        # A full page: 128 rows (64 of each matrix) by 512 codes, 32 KiB.
        assert (2 if dual else 1) * group_rows(dual, True) * K_CHUNK4 // 2 == PAGE_BYTES
    assert (2 * STAGE_STRIDE4) % 128 == 64
    assert sorted(permuted(e) for e in range(8)) == list(range(8))


MUTATIONS = ("unpermuted", "group", "swap_b")


def emulate_group(codes: list[torch.Tensor], scales: list[torch.Tensor],
                  x: torch.Tensor, row0: int, n_valid: int, group: int,
                  dual: bool, mutation: str = "") -> np.ndarray:  # fmt: skip
    """Rows [row0, row0 + n_valid) of each matrix's ``W @ x.T``, W =
    ``Int4Weight(codes[m], scales[m])`` ([N, K] uint8 codes, [N, K / group]
    bf16 scales), as one INT4 row group of the kernel computes them.
    Returns [matrices, n_valid, batch]."""
    mats, (batch, k) = len(codes), x.shape
    per_page = group_rows(dual, True)
    chunk = min(k_chunk(False, True), k)
    packed = [pack(c) for c in codes]
    xb = x.to(torch.bfloat16)
    n_blocks = n_pad(batch) // N_BLOCK
    acc = np.zeros((NUM_WARPS, mats, n_blocks, 32, 4))
    for kc in range(-(-k // chunk)):
        k0 = kc * chunk
        k_len = min(chunk, k - k0)
        buf = kc % 2
        # The producer: a row's bytes at page_index (codes) / 2.
        page = np.zeros(PAGE_BYTES, np.uint8)
        for m in range(mats):
            for r in range(n_valid):
                at = page_index(m, r, 0, per_page, chunk) // 2
                page[at : at + k_len // 2] = packed[m][row0 + r, k0 // 2 :][
                    : k_len // 2
                ]
        # stage_chunk_int4: each 8-vector permuted (bf16 bits; NaN past batch).
        scratch = np.full(2 * stage_elems(batch, True), 0x7FC0, np.uint16)
        bits = xb.view(torch.int16).numpy().view(np.uint16)
        for n in range(batch):
            for v in range(k_len // VEC):
                vals = bits[n, k0 + v * VEC : k0 + (v + 1) * VEC]
                dst = stage_index(buf, n, v * VEC, batch, True)
                for e in range(VEC):
                    slot = e if mutation == "unpermuted" else permuted(e)
                    scratch[dst + slot] = vals[e]
        for warp in range(NUM_WARPS):
            rb, sl, ks = warp_task(warp, n_valid)
            if sl >= ks:
                continue
            for kb in range(sl, k_len // k_block(False, True), ks):
                j = lane_vector(kb, Q)  # [lanes]: a 16-byte vector of a row
                kcode = k0 + kb * K_BLOCK4 + Q * VEC4  # the lane's first code
                grp = kcode // group + (1 if mutation == "group" else 0)
                lane_args = (rb, row0, j, grp, per_page, chunk)
                a = np.stack([_lane_weights(page, scales[m], m, *lane_args)
                              for m in range(mats)])  # fmt: skip
                for nb in range(n_blocks):
                    n = nb * N_BLOCK + G
                    at = stage_index(buf, n, 0, batch, True)[:, None] + 32 * j[:, None]
                    b = _bf16_bits(scratch[at + np.arange(32)]).double().numpy()
                    b = b.reshape(32, 16, 2)  # [lane, reg, half]
                    swap = mutation == "swap_b"
                    for m in range(mats):
                        acc[warp, m, nb] = _eight_mmas(a[m], b, acc[warp, m, nb], swap)
    return slice_sums(acc, n_valid, batch)


def _lane_weights(page, scales, m, rb, row0, j, grp, per_page, chunk) -> np.ndarray:
    """Each lane's 32 codes of page rows 16 rb + g and + 8 of matrix ``m``,
    unpacked with their rows' scales of group ``grp`` (rows past the
    matrix: its last): [row h, lane, register, half]."""
    a = np.empty((2, 32, 16, 2))
    for h in range(2):
        prow = rb * ROWS + G + 8 * h
        at = page_index(m, prow, 0, per_page, chunk) // 2 + 16 * j
        words = np.ascontiguousarray(np.stack([page[at + i] for i in range(16)], 1))
        words = words.view(np.uint32)  # [32 lanes, 4]
        srow = np.minimum(row0 + prow, scales.shape[0] - 1)
        s = scales[srow, np.minimum(grp, scales.shape[1] - 1)]
        for t in range(4):
            for p in range(4):
                a[h, :, 4 * t + p] = unpack(words[:, t], p, s).double().numpy()
    return a


def _eight_mmas(a: np.ndarray, b: np.ndarray, acc: np.ndarray, swap_b: bool):
    """``int4_step``'s MMAs: MMA i takes word i // 2's pairs p, p + 1 (p = 2
    (i % 2)) of rows g and g + 8 as A, the same staged pairs as B."""
    for i in range(8):
        t, p = i // 2, 2 * (i % 2)
        r0, r1 = 4 * t + p, 4 * t + p + 1
        a_regs = np.stack([a[0, :, r0], a[1, :, r0], a[0, :, r1], a[1, :, r1]], 1)
        b_regs = np.stack([b[:, r0], b[:, r1]], 1)
        if swap_b:  # a plausible slip: B's two registers the other way
            b_regs = b_regs[:, ::-1]
        acc = mma_lanes(a_regs, b_regs, acc)
    return acc


# 128-row groups (one matrix), 64 of each of gate and up, a partial group
# at the matrix's end, groups of 32, 64 and 128, K of several chunks.
GRID = [(1, False, 0, 128, 128, 1024), (1, True, 64, 64, 32, 640),
        (16, False, 200, 40, 64, 512), (4, True, 0, 20, 128, 1152)]  # fmt: skip


@pytest.mark.parametrize("mutation", ["", *MUTATIONS])
@pytest.mark.parametrize("batch, dual, row0, n_valid, group, k", GRID)
def test_row_group_is_the_w4a16_product(batch, dual, row0, n_valid, group, k,
                                        mutation):  # fmt: skip
    gen = torch.Generator().manual_seed(batch * 100 + n_valid + group)
    rows, mats = 240, 2 if dual else 1
    codes = [torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
             for _ in range(mats)]  # fmt: skip
    scales = [(torch.rand(rows, k // group, generator=gen) + 0.05).to(torch.bfloat16)
              / 8 for _ in range(mats)]  # fmt: skip
    x = torch.randn(batch, k, generator=gen).to(torch.bfloat16)
    got = emulate_group(codes, scales, x, row0, n_valid, group, dual, mutation)
    want = np.stack([
        Int4Weight(c, s).dequantize()[row0 : row0 + n_valid].double().numpy()
        @ x.double().numpy().T for c, s in zip(codes, scales, strict=True)
    ])  # fmt: skip
    close = not np.isnan(got).any() and np.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert close == (mutation == "")
