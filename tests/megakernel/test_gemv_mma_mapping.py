# SPDX-License-Identifier: Apache-2.0
"""The tensor-core GEMV's index arithmetic (kernel/ops/gemv_mma.py and its
page loop, gemv_paged._paged_mma), checked without a GPU in float64.

- ``mma_m16n8k16`` follows the PTX ISA's fragment layout lane by lane; the
  kernel's permuted k mapping (each lane's 8 consecutive weights and inputs
  split over two MMAs) must give ``W @ x`` for a 16-row block.
- ``emulate_group`` runs one row group's page sequence as the kernel does,
  through the kernel's own index functions (``warp_task``, ``lane_vector``,
  ``stage_index``, ``page_index``, ``row_blocks``) and constants: the
  producer's per-row copies into each k-chunk page (rows past the group's
  valid rows left stale: NaN here), the consumers' staging of every
  request's k-chunk into the buffer of the page's parity (padded stride;
  rows past the batch never written: NaN), each warp's row block and k
  slice, A fragments from the page and B fragments from the staged buffer,
  accumulators carried across the k-chunk pages, the partial tiles'
  reduction in slice order. It must equal ``W @ x`` (the normed path: the
  reference's RMSNorm rounded to bf16), and a shifted staged-activation
  index, a shifted k-chunk offset or the other staging buffer must not.

Tolerance: the inputs are bf16 values, so each product is exact in float64
and only the order of the float64 sums differs from the reference's
(relative 1e-12). The kernel itself runs on the GPU (scripts/device_run.py).
"""

import numpy as np
import pytest
import torch

from vllm_ext.megakernel.kernel.ops.common import NUM_WARPS, VEC
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    GROUP_ROWS,
    K_BLOCK,
    K_CHUNK,
    N_BLOCK,
    ROWS,
    STAGE_STRIDE,
    STAGE_VECS,
    group_rows,
    lane_vector,
    n_pad,
    page_index,
    red_floats,
    row_blocks,
    scratch_floats,
    stage_elems,
    stage_index,
    warp_task,
)
from vllm_ext.megakernel.kernel.ops.weight_pipe import PAGE_ELEMS
from vllm_ext.reference import rms_norm

N = N_BLOCK
LANES = np.arange(32)
G, Q = LANES // 4, LANES % 4


def mma_m16n8k16(a_regs, b_regs, c):
    """D = A B + C from per-lane fragments, as the PTX ISA lays them out:
    lane t (group g = t // 4, q = t % 4) holds A (row, k) pairs
    a0a1 = (g, 2q..2q+1), a2a3 = (g+8, 2q..), a4a5 = (g, 2q+8..),
    a6a7 = (g+8, 2q+8..); B (k, n) pairs b0b1 = (2q.., g), b2b3 = (2q+8.., g);
    C (row, n) c0c1 = (g, 2q..2q+1), c2c3 = (g+8, 2q..)."""
    a = torch.zeros(ROWS, 16, dtype=torch.float64)
    b = torch.zeros(16, N, dtype=torch.float64)
    for t in range(32):
        g, q = t // 4, t % 4
        places = [(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]
        for reg, (row, col) in enumerate(places):
            a[row, col : col + 2] = a_regs[t][reg]
        for reg, k in enumerate([2 * q, 2 * q + 8]):
            b[k : k + 2, g] = b_regs[t][reg]
    d = a @ b
    out = [list(c[t]) for t in range(32)]
    for t in range(32):
        g, q = t // 4, t % 4
        out[t][0] += d[g, 2 * q]
        out[t][1] += d[g, 2 * q + 1]
        out[t][2] += d[g + 8, 2 * q]
        out[t][3] += d[g + 8, 2 * q + 1]
    return out


def mma_lanes(a_regs: np.ndarray, b_regs: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``mma_m16n8k16`` for all lanes at once: ``a_regs`` [32, 4, 2],
    ``b_regs`` [32, 2, 2] (a register's two packed values, low half
    first), ``c`` [32, 4]. With four values a register ([32, 4, 4], [32, 2,
    4]) it is ``mma.m16n8k32``'s e4m3 layout, the same with each pair a
    quad: lane t holds A (g, wq..), (g+8, wq..), (g, wq+4w..), (g+8,
    wq+4w..) and B (wq.., g), (wq+4w.., g), w values a register."""
    w = a_regs.shape[-1]
    k = 8 * w
    a, b = np.empty((ROWS, k)), np.empty((k, N))
    placed_a, placed_b = np.zeros(a.shape, bool), np.zeros(b.shape, bool)
    for reg, (dr, dk) in enumerate([(0, 0), (8, 0), (0, 4 * w), (8, 4 * w)]):
        for h in range(w):
            a[G + dr, w * Q + dk + h] = a_regs[:, reg, h]
            placed_a[G + dr, w * Q + dk + h] = True
    for reg, dk in enumerate([0, 4 * w]):
        for h in range(w):
            b[w * Q + dk + h, G] = b_regs[:, reg, h]
            placed_b[w * Q + dk + h, G] = True
    assert placed_a.all() and placed_b.all()
    d = a @ b
    out = c.copy()
    out[:, 0] += d[G, 2 * Q]
    out[:, 1] += d[G, 2 * Q + 1]
    out[:, 2] += d[G + 8, 2 * Q]
    out[:, 3] += d[G + 8, 2 * Q + 1]
    return out


def gemv_block(w: torch.Tensor, x: torch.Tensor, swap_b: bool = False) -> torch.Tensor:
    """One 16-row block of W [16, K] against x [N, K], fed as the kernel
    does: per k block, lane t loads weights k = 32 kb + 8 q .. + 7 of rows g
    and g + 8 and the same k of request g's input, and issues two MMAs,
    pairs (0, 1) then (2, 3) of each 8."""
    k_dim = w.shape[1]
    acc = [[0.0] * 4 for _ in range(32)]
    for kb in range(k_dim // K_BLOCK):
        a_lo, a_hi, bx = [], [], []
        for t in range(32):
            g, q = t // 4, t % 4
            k0 = VEC * lane_vector(kb, q)
            a_lo.append(_pairs(w[g], k0))
            a_hi.append(_pairs(w[g + 8], k0))
            bx.append(_pairs(x[g], k0))
        for e in (0, 2):
            a_regs = [[a_lo[t][e], a_hi[t][e], a_lo[t][e + 1], a_hi[t][e + 1]]
                      for t in range(32)]  # fmt: skip
            b_regs = [[bx[t][e], bx[t][e + 1]] for t in range(32)]
            if swap_b:  # a plausible slip: B's two registers the other way
                b_regs = [[hi, lo] for lo, hi in b_regs]
            acc = mma_m16n8k16(a_regs, b_regs, acc)
    out = torch.zeros(ROWS, N, dtype=torch.float64)
    for t in range(32):
        g, q = t // 4, t % 4
        out[g, 2 * q], out[g, 2 * q + 1] = acc[t][0], acc[t][1]
        out[g + 8, 2 * q], out[g + 8, 2 * q + 1] = acc[t][2], acc[t][3]
    return out  # [row, request]


def _pairs(v: torch.Tensor, k0: int) -> list[torch.Tensor]:
    """A lane's 8 values from k0 as the four packed pairs of its registers."""
    return [v[k0 + 2 * p : k0 + 2 * p + 2] for p in range(4)]


@pytest.mark.parametrize("k_dim", [32, 96])
def test_permuted_k_mapping_computes_the_product(k_dim):
    gen = torch.Generator().manual_seed(k_dim)
    w = torch.randn(ROWS, k_dim, generator=gen, dtype=torch.float64)
    x = torch.randn(N, k_dim, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(gemv_block(w, x), w @ x.T, rtol=1e-12, atol=1e-12)


def test_a_wrong_mapping_is_caught():
    """The check can fail: B's registers fed the other way round pair each
    weight with the wrong input."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(ROWS, K_BLOCK, generator=gen, dtype=torch.float64)
    x = torch.randn(N, K_BLOCK, generator=gen, dtype=torch.float64)
    assert not torch.allclose(gemv_block(w, x, swap_b=True), w @ x.T)


def test_the_lane_emulation_is_the_ptx_layout():
    """``mma_lanes`` (vectorised, used below) equals the lane-by-lane
    ``mma_m16n8k16``."""
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(32, 4, 2)), rng.normal(size=(32, 2, 2)), rng.normal(
        size=(32, 4))  # fmt: skip
    want = mma_m16n8k16(torch.from_numpy(a), torch.from_numpy(b), c.tolist())
    np.testing.assert_allclose(mma_lanes(a, b, c), np.array(want), rtol=1e-12)


# Mutations of the staged-activation indexing the emulation must reject.
MUTATIONS = ("stage_index", "k_chunk_offset", "stage_buffer")


def emulate_group(w: list[np.ndarray], x: np.ndarray, per_page: int, n_valid: int,
                  page0: int = 5, normed: tuple | None = None,
                  mutation: str = "") -> np.ndarray:  # fmt: skip
    """Rows [0, n_valid) of ``w[m] @ x.T`` for each matrix m (gate, up) as
    one row group of the kernel computes them: its k-chunk pages ``page0``,
    ``page0 + 1``, ..; ``normed``: (norm, rstd), the input RMS-normed and
    rounded to bf16 while staged. Returns [matrices, n_valid, batch]."""
    mats, (batch, k) = len(w), x.shape
    k_chunk = min(K_CHUNK, k)
    k_pages = -(-k // k_chunk)
    # Every request's staged k-chunk, two buffers: rows past the batch are
    # never written (NaN: they must reach no sum the epilogue reads).
    scratch = np.full(2 * stage_elems(batch), np.nan)
    n_blocks = n_pad(batch) // N_BLOCK
    acc = np.zeros((NUM_WARPS, mats, n_blocks, 32, 4))
    for kc in range(k_pages):
        pg = page0 + kc
        buf = pg % 2
        k0 = kc * k_chunk
        k_len = min(k_chunk, k - k0)
        # The producer: one copy per row and matrix, rows past the group's
        # valid rows stale (NaN).
        page = np.full(PAGE_ELEMS, np.nan)
        for m in range(mats):
            for r in range(n_valid):
                dst = page_index(m, r, 0, per_page, k_chunk)
                page[dst : dst + k_len] = w[m][r, k0 : k0 + k_len]
        # stage_chunk: a 128-bit vector per thread.
        sk0 = k0 + (VEC if mutation == "k_chunk_offset" else 0)
        for idx in range(batch * STAGE_VECS):
            n, v = idx // STAGE_VECS, idx % STAGE_VECS
            if v * VEC < k_len:
                cols = slice(sk0 + v * VEC, sk0 + v * VEC + VEC)
                vals = np.zeros(VEC) if cols.stop > k else x[n, cols]
                if normed is not None:
                    norm, rstd = normed
                    vals = _normed(vals, rstd[n], norm[cols])
                dst = stage_index(buf, n, v * VEC, batch)
                scratch[dst : dst + VEC] = vals
        # (The consumers' barrier.) Each warp's row block and k slice.
        read_buf = 1 - buf if mutation == "stage_buffer" else buf
        for warp in range(NUM_WARPS):
            rb, sl, ks = warp_task(warp, n_valid)
            if sl >= ks:
                continue
            for kb in range(sl, k_len // K_BLOCK, ks):
                j = lane_vector(kb, Q)  # [lanes]
                e8 = np.arange(VEC)
                a = np.empty((mats, 2, 32, VEC))
                kk = VEC * j[:, None] + e8
                for m in range(mats):
                    for h, row in enumerate((rb * ROWS + G, rb * ROWS + G + 8)):
                        a[m, h] = page[page_index(m, row[:, None], kk, per_page,
                                                  k_chunk)]  # fmt: skip
                for nb in range(n_blocks):
                    n = nb * N_BLOCK + G
                    kread = kk + 2 if mutation == "stage_index" else kk
                    b = scratch[stage_index(read_buf, n[:, None], kread, batch)]
                    for m in range(mats):
                        for half in range(2):
                            e = 2 * half
                            lo = a[m, 0].reshape(32, 4, 2)
                            hi = a[m, 1].reshape(32, 4, 2)
                            a_regs = np.stack([lo[:, e], hi[:, e], lo[:, e + 1],
                                               hi[:, e + 1]], axis=1)  # fmt: skip
                            b_regs = b.reshape(32, 4, 2)[:, e : e + 2]
                            acc[warp, m, nb] = mma_lanes(a_regs, b_regs,
                                                         acc[warp, m, nb])  # fmt: skip
    # mma_finish: the C fragments into [warp, matrix, row, request] (where
    # the staging buffers were), the slices summed in order.
    part = np.full(scratch_floats(batch), np.nan)
    assert red_floats(batch) <= part.size
    part = part[: NUM_WARPS * mats * ROWS * n_pad(batch)].reshape(
        NUM_WARPS, mats, ROWS, n_pad(batch))  # fmt: skip
    for warp in range(NUM_WARPS):
        _, sl, ks = warp_task(warp, n_valid)
        if sl < ks:
            for nb in range(n_blocks):
                col = nb * N_BLOCK + 2 * Q
                c = acc[warp, :, nb]  # [mats, lanes, 4]
                part[warp, :, G, col] = c[:, :, 0].T
                part[warp, :, G, col + 1] = c[:, :, 1].T
                part[warp, :, G + 8, col] = c[:, :, 2].T
                part[warp, :, G + 8, col + 1] = c[:, :, 3].T
    blocks = row_blocks(n_valid)
    _, _, ks = warp_task(0, n_valid)
    out = np.full((mats, n_valid, batch), np.nan)
    for idx in range(blocks * ROWS * batch):
        i, n = idx // batch, idx % batch
        rb, r = i // ROWS, i % ROWS
        s = sum(part[rb + blocks * sl, :, r, n] for sl in range(ks))
        if i < n_valid:
            out[:, i, n] = s
    return out


def slice_sums(acc: np.ndarray, n_valid: int, batch: int) -> np.ndarray:
    """``mma_finish`` on every warp's accumulators ``acc`` [warp, matrix,
    request block, lane, 4]: the C fragments into [warp, matrix, row,
    request] tiles, then each valid row's slices summed in slice order:
    [matrices, n_valid, batch]."""
    mats, n_blocks = acc.shape[1], acc.shape[2]
    tiles = np.zeros((NUM_WARPS, mats, ROWS, n_pad(batch)))
    for nb in range(n_blocks):
        col = nb * N_BLOCK + 2 * Q
        c = acc[:, :, nb]  # [warp, matrix, lane, 4]
        tiles[:, :, G, col] = c[..., 0]
        tiles[:, :, G, col + 1] = c[..., 1]
        tiles[:, :, G + 8, col] = c[..., 2]
        tiles[:, :, G + 8, col + 1] = c[..., 3]
    blocks, (_, _, ks) = row_blocks(n_valid), warp_task(0, n_valid)
    out = np.empty((mats, n_valid, batch))
    for i in range(n_valid):
        rb, r = i // ROWS, i % ROWS
        out[:, i] = sum(tiles[rb + blocks * sl, :, r, :batch] for sl in range(ks))
    return out


def _normed(x: np.ndarray, rstd: float, norm: np.ndarray) -> np.ndarray:
    """``bf16(x * rstd * norm)`` in fp32, as stage_chunk computes it."""
    t = torch.from_numpy(x).float() * torch.tensor(rstd, dtype=torch.float32)
    t = t * torch.from_numpy(norm).float()
    return t.to(torch.bfloat16).double().numpy()


def _bf16(gen, *shape) -> np.ndarray:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).double().numpy()


# Row groups: full pages, one to three blocks of 16, and rows that are not
# whole blocks (an instruction's last group, a QKV head part's block). K:
# several chunks with a shorter last one (k_len 96), or a single short one.
GRID = [(b, dual, rows, 608) for b in (4, 16, 64) for dual in (False, True)
        for rows in (16, 40, 48, 64, 7) if rows <= group_rows(dual)] + [
    (16, False, 32, 96), (64, True, 32, 288)]  # fmt: skip


@pytest.mark.parametrize("batch, dual, n_valid, k", GRID)
def test_row_group_computes_the_product(batch, dual, n_valid, k):
    gen = torch.Generator().manual_seed(batch * 1000 + n_valid * 10 + dual)
    per_page = group_rows(dual)
    mats = 2 if dual else 1
    w = [_bf16(gen, per_page, k) for _ in range(mats)]
    x = _bf16(gen, batch, k)
    got = emulate_group(w, x, per_page, n_valid)
    want = np.stack([wm[:n_valid] @ x.T for wm in w])
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch, n_valid", [(4, 24), (64, 32)])
def test_normed_staging_rounds_as_the_reference(batch, n_valid):
    """GATE_UP's path (dual, normed while staged): against the reference's
    RMSNorm (fp32, rounded to the model dtype) then the fp32-accumulated
    product, with the kernel's rstd (fp32 rsqrt of the mean square)."""
    gen = torch.Generator().manual_seed(batch + n_valid)
    k, eps = 640, 1e-5
    xb = torch.randn(batch, k, generator=gen).to(torch.bfloat16)
    norm = torch.randn(k, generator=gen).to(torch.bfloat16)
    w = [_bf16(gen, group_rows(True), k) for _ in range(2)]
    rstd = torch.rsqrt(xb.float().pow(2).mean(dim=-1) + eps)
    got = emulate_group(w, xb.double().numpy(), group_rows(True), n_valid,
                        normed=(norm.double().numpy(), rstd.numpy()))  # fmt: skip
    # The staged inputs are the reference's bf16 rounding of the same fp32
    # arithmetic ((x * rstd) * norm), so the only difference left is the
    # order of the float64 sums.
    xn = rms_norm(xb, norm, eps).to(torch.bfloat16).double().numpy()
    want = np.stack([wm[:n_valid] @ xn.T for wm in w])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # (Not the unrounded input: the staging rounds.)
    raw = rms_norm(xb, norm, eps).double().numpy()
    assert not np.allclose(got, np.stack([wm[:n_valid] @ raw.T for wm in w]),
                           rtol=1e-9, atol=1e-9)  # fmt: skip


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("batch, dual", [(4, False), (64, True)])
def test_a_shifted_index_is_caught(mutation, batch, dual):
    """A staged-activation index off by one pair, the chunk staged from a
    k offset one vector late, or the B fragments read from the other
    buffer (the previous chunk's): each must change the product."""
    gen = torch.Generator().manual_seed(7)
    per_page, k = group_rows(dual), 608
    w = [_bf16(gen, per_page, k) for _ in range(2 if dual else 1)]
    x = _bf16(gen, batch, k)
    got = emulate_group(w, x, per_page, per_page, mutation=mutation)
    want = np.stack([wm @ x.T for wm in w])
    assert not np.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=False)


def test_geometry_constants():
    """What the docstring promises: a full page fills the 32 KiB slot, the
    staged row stride is 64 mod 128 bytes (two requests' 64-byte reads in a
    quarter warp on disjoint banks), and the reduction fits the buffers it
    reuses at batch 64."""
    for dual in (False, True):
        assert (2 if dual else 1) * group_rows(dual) * K_CHUNK == PAGE_ELEMS
    assert GROUP_ROWS % ROWS == 0 and K_CHUNK % K_BLOCK == 0
    assert (2 * STAGE_STRIDE) % 128 == 64
    assert red_floats(64) <= scratch_floats(64) == stage_elems(64)
    for n in range(N_BLOCK):
        banks = {(stage_index(0, n, VEC * q, 64) * 2 // 4) % 32 // 4 for q in range(4)}
        other = {(stage_index(0, n ^ 1, VEC * q, 64) * 2 // 4) % 32 // 4
                 for q in range(4)}  # fmt: skip
        assert not banks & other
