# SPDX-License-Identifier: Apache-2.0
"""The fragment mapping of the tensor-core GEMV (kernel/ops/gemv_mma.py),
checked without a GPU: an emulation of ``mma.sync.m16n8k16`` that follows
the PTX ISA's fragment layout lane by lane, fed the way the kernel feeds it
(each lane's 8 consecutive weights and inputs split over two MMAs), must
give ``W @ x`` for a 16-row block. This checks the index arithmetic the
kernel uses; the kernel itself is checked on the GPU (scripts/device_run.py).
"""

import pytest
import torch

K_BLOCK, ROWS, N = 32, 16, 8


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


def gemv_block(w: torch.Tensor, x: torch.Tensor, swap_b: bool = False) -> torch.Tensor:
    """One 16-row block of W [16, K] against x [N, K], fed as gemv_mma does:
    per k block, lane t loads weights k = 32 kb + 8 q .. + 7 of rows g and
    g + 8 and the same k of request g's input, and issues two MMAs, pairs
    (0, 1) then (2, 3) of each 8."""
    k_dim = w.shape[1]
    acc = [[0.0] * 4 for _ in range(32)]
    for kb in range(k_dim // K_BLOCK):
        a_lo, a_hi, bx = [], [], []
        for t in range(32):
            g, q = t // 4, t % 4
            k0 = kb * K_BLOCK + 8 * q
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
