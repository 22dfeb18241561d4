# SPDX-License-Identifier: Apache-2.0
"""MLA_ATTN on tensor cores (kernel/ops/mla_attn.py): its index arithmetic
checked without a GPU, in float64.

``emulate_chunk`` runs a head group over one chunk as the kernel does, lane
by lane through the PTX fragment layout (``mma_lanes`` of
test_gemv_mma_mapping.py) and the kernel's own index functions and
constants (``q_stride``, ``score_token``, ``lane_vector``, ``pv_tokens``,
``v_dim``, ``heads_per_tile``, ``TOKENS``): the head tile's queries staged
with the padded stride (the padding NaN: never read), each warp's eight
tokens of a block scored over the permuted k, the masked tokens past the
chunk (they read the chunk's last row), the block maxima shared between
warps, P through shared memory, each warp's 64 latent dims of P @ V, the
denominators summed in warp order.

``emulate_request`` runs the shared pass of a verify step the same way: a
request's rows x the group's heads as M rows (``query_row``), tiled by
``HEAD_ROWS``, passes of ``pass_tiles`` tiles, the chunk the longest row's
and each M row masked at its own row's length (its causal end), a row
with no token in the chunk kept at (0, -inf) by the reference point 0.
Against float64 attention of each row over its own tokens; a row that
reads one token past its length must fail.

Tolerances: with P kept in float64 the emulation must equal the float64
softmax to 1e-12 (inputs are bf16 values, so only the order of the sums
differs), and a shifted token or dim index must not. With P rounded to
bf16, as the kernel rounds it, it is within 2^-8 of the fp32 reference
``ops/mla_attn.reference`` (one bf16 rounding of each weight: at most 2^-9
of each term). The kernel itself runs on the GPU (scripts/device_run.py).
"""

import math

import numpy as np
import pytest
import torch
from test_gemv_mma_mapping import mma_lanes

from vllm_ext.megakernel.kernel.ops.common import NUM_WARPS, VEC
from vllm_ext.megakernel.kernel.ops.gemv_mma import K_BLOCK, N_BLOCK, lane_vector
from vllm_ext.megakernel.kernel.ops.mla_attn import (
    HEAD_ROWS,
    K_STEP,
    P_STRIDE,
    PASS_TILES,
    TOKENS,
    heads_per_tile,
    pass_tiles,
    pv_tokens,
    q_stride,
    query_row,
    score_token,
    scratch_floats,
    v_dim,
)
from vllm_ext.megakernel.ops import mla_attn

RANK, ROPE = 512, 64
WIDTH = RANK + ROPE
LANES = np.arange(32)
G, Q = LANES // 4, LANES % 4
MUTATIONS = ("score_token", "pv_tokens", "v_dim")


def bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).double().numpy()


def pairs(vec: np.ndarray) -> np.ndarray:
    """A lane's 8 values as its four registers' packed pairs [4, 2]."""
    return vec.reshape(4, 2)


def emulate_chunk(q: np.ndarray, rows: np.ndarray, scale: float,
                  round_p: bool = True, mutation: str = "") -> tuple:  # fmt: skip
    """(o [heads, RANK], lse [heads]) of one request's head group ``q``
    [heads, WIDTH] (q_latent | q_pe) over the chunk's rows [T, WIDTH]."""
    heads, t_hi = q.shape[0], rows.shape[0]
    o, lse = np.zeros((heads, RANK)), np.full(heads, -math.inf)
    stride = q_stride(WIDTH)
    tile0 = 0
    for n_rows in heads_per_tile(heads):
        qs = np.full((HEAD_ROWS, stride), np.nan)  # padding: never read
        qs[:, :WIDTH] = 0.0
        qs[:n_rows, :WIDTH] = q[tile0 : tile0 + n_rows]
        m = np.full((NUM_WARPS, 32, 2), -math.inf)
        den = np.zeros((NUM_WARPS, 32, 2))
        acc = np.zeros((NUM_WARPS, N_BLOCK, 32, 4))
        for t0 in range(0, t_hi, TOKENS):
            _block(qs, rows, t0, t_hi, scale, m, den, acc, round_p, mutation)
        for w in range(NUM_WARPS):
            for lane in range(32):
                g, qq = G[lane], Q[lane]
                for half in range(2):
                    r = g + 8 * half
                    total = sum(den[v, 4 * g, half] for v in range(NUM_WARPS))
                    if r >= n_rows or total == 0:
                        continue
                    lse[tile0 + r] = m[w, lane, half] + math.log(total)
                    for c in range(2):
                        for nb in range(N_BLOCK):
                            dim = v_dim(w, 2 * qq + c, nb)
                            o[tile0 + r, dim] = acc[w, nb, lane, 2 * half + c] / total
        tile0 += n_rows
    return o, lse


def emulate_request(q: np.ndarray, rows: np.ndarray, lens: list[int], t_lo: int,
                    t_hi: int, scale: float, mutation: str = "") -> tuple:  # fmt: skip
    """(o [rows, heads, RANK], lse [rows, heads]) of one request's shared
    pass: its query rows ``q`` [rows, heads, WIDTH] over chunk [t_lo, t_hi)
    of its latent rows ``rows`` (the longest row's chunk), row r masked at
    ``lens[r]``; P in float64. ``mutation="length"``: each row reads one
    token past its length."""
    n_rows, heads = q.shape[:2]
    o = np.zeros((n_rows, heads, RANK))
    lse = np.full((n_rows, heads), -math.inf)
    m_end = heads * n_rows
    stride = q_stride(WIDTH)
    n_tiles = pass_tiles(heads, n_rows)
    for m0 in range(0, m_end, n_tiles * HEAD_ROWS):
        for ti in range(n_tiles):
            base = m0 + ti * HEAD_ROWS
            qs = np.full((HEAD_ROWS, stride), np.nan)  # padding: never read
            qs[:, :WIDTH] = 0.0
            row_lens = np.full(HEAD_ROWS, t_hi)  # M rows past the request's
            for r in range(HEAD_ROWS):
                if base + r < m_end:
                    rr, h = query_row(base + r, heads)
                    qs[r, :WIDTH] = q[rr, h]
                    row_lens[r] = lens[rr] + (mutation == "length")
            m = np.full((NUM_WARPS, 32, 2), -math.inf)
            den = np.zeros((NUM_WARPS, 32, 2))
            acc = np.zeros((NUM_WARPS, N_BLOCK, 32, 4))
            for t0 in range(t_lo, t_hi, TOKENS):
                _block(qs, rows, t0, t_hi, scale, m, den, acc, False, "", row_lens)
            for lane in range(32):
                g, qq = G[lane], Q[lane]
                for half in range(2):
                    r = g + 8 * half
                    if base + r >= m_end:
                        continue
                    rr, h = query_row(base + r, heads)
                    total = sum(den[v, 4 * g, half] for v in range(NUM_WARPS))
                    if total == 0:  # no token of this row in the chunk
                        continue
                    lse[rr, h] = m[0, lane, half] + math.log(total)
                    for w in range(NUM_WARPS):
                        for c in range(2):
                            for nb in range(N_BLOCK):
                                dim = v_dim(w, 2 * qq + c, nb)
                                o[rr, h, dim] = acc[w, nb, lane, 2 * half + c] / total
    return o, lse


def _block(qs, rows, t0, t_hi, scale, m, den, acc, round_p, mutation, lens=None):
    """``lens`` [HEAD_ROWS]: each M row's own length (a shared pass), else
    the chunk's end for every row."""

    def row(t):
        return rows[min(t, t_hi - 1)]

    if lens is None:
        lens = np.full(HEAD_ROWS, t_hi)

    ps = np.full((HEAD_ROWS, P_STRIDE), np.nan)
    sc = np.zeros((NUM_WARPS, 32, 4))
    for w in range(NUM_WARPS):
        tok = [score_token(w, g) for g in G]
        if mutation == "score_token":
            tok = [score_token(w, (g + 1) % 8) for g in G]
        for kb in range(WIDTH // K_BLOCK):
            j = [VEC * lane_vector(kb, qq) for qq in Q]
            a_lo = np.stack(
                [pairs(qs[g, k : k + VEC]) for g, k in zip(G, j, strict=True)]
            )
            a_hi = np.stack(
                [pairs(qs[g + 8, k : k + VEC]) for g, k in zip(G, j, strict=True)]
            )
            kv = np.stack(
                [pairs(row(t0 + t)[k : k + VEC]) for t, k in zip(tok, j, strict=True)]
            )
            for e in (0, 2):
                a = np.stack(
                    [a_lo[:, e], a_hi[:, e], a_lo[:, e + 1], a_hi[:, e + 1]], 1
                )
                sc[w] = mma_lanes(a, kv[:, e : e + 2], sc[w])
    col = np.array(
        [[t0 + score_token(w, 0) + 2 * qq for qq in Q] for w in range(NUM_WARPS)]
    )
    sc = sc * scale
    for c in range(4):
        ends = lens[G + 8 * (c // 2)]  # [lane]: its M row's length
        sc[:, :, c] = np.where(col + c % 2 >= ends, -math.inf, sc[:, :, c])
    # Each head's block maximum over every warp's quads (lane 4g's value).
    quad_max = np.stack(
        [np.maximum.reduce([sc[:, :, 2 * h], sc[:, :, 2 * h + 1]]) for h in range(2)],
        -1,
    )  # [warp, lane, half]
    for w in range(NUM_WARPS):
        for lane in range(32):
            g = G[lane]
            for half in range(2):
                bm = max(
                    quad_max[v, 4 * g + k, half]
                    for v in range(NUM_WARPS)
                    for k in range(4)
                )
                m_new = max(m[w, lane, half], bm)
                # (A row without a token yet: the kernel's reference point 0.)
                m_ref = 0.0 if m_new == -math.inf else m_new
                corr = math.exp(m[w, lane, half] - m_ref)
                p = np.exp(sc[w, lane, 2 * half : 2 * half + 2] - m_ref)
                quad = [np.exp(sc[w, 4 * g + k, 2 * half : 2 * half + 2] - m_ref).sum()
                        for k in range(4)]  # fmt: skip
                den[w, lane, half] = den[w, lane, half] * corr + sum(quad)
                acc[w, :, lane, 2 * half : 2 * half + 2] *= corr
                m[w, lane, half] = m_new
                c0 = score_token(w, 0) + 2 * Q[lane]
                ps[g + 8 * half, c0 : c0 + 2] = bf16(p) if round_p else p
    for w in range(NUM_WARPS):
        for step in range(TOKENS // K_STEP):
            ts = [pv_tokens(step, qq) for qq in Q]
            if mutation == "pv_tokens":
                ts = [(t[1], t[0], t[2], t[3]) for t in ts]
            a = np.stack(
                [np.stack([ps[g, t[0] : t[0] + 2], ps[g + 8, t[0] : t[0] + 2],
                           ps[g, t[2] : t[2] + 2], ps[g + 8, t[2] : t[2] + 2]])
                 for g, t in zip(G, ts, strict=True)]
            )  # fmt: skip
            cols = [v_dim(w, g, 0) for g in G]
            if mutation == "v_dim":
                cols = [v_dim(w, g, 0) + 1 for g in G]
            vecs = np.stack(
                [
                    np.stack([row(t0 + tk)[c : c + VEC] for tk in t])
                    for t, c in zip(ts, cols, strict=True)
                ]
            )  # [lane, 4 tokens, 8 dims]
            for nb in range(N_BLOCK):
                b = np.stack([vecs[:, 0:2, nb], vecs[:, 2:4, nb]], 1)
                acc[w, nb] = mma_lanes(a, b, acc[w, nb])


def reference64(q: np.ndarray, rows: np.ndarray, scale: float):
    s = q @ rows.T * scale
    m = s.max(1, keepdims=True)
    p = np.exp(s - m)
    den = p.sum(1, keepdims=True)
    return p @ rows[:, :RANK] / den, (m + np.log(den))[:, 0]


def _inputs(heads: int, tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    q = bf16(rng.normal(size=(heads, WIDTH)))
    rows = bf16(rng.normal(size=(tokens, WIDTH)))
    return q, rows, 1 / math.sqrt(192)


def reference_rows64(q, rows, lens, t_lo, t_hi, scale):
    """Float64 attention of each query row over its own tokens of the chunk
    ([t_lo, min(t_hi, its length)); none: o 0, lse -inf)."""
    n_rows, heads = q.shape[:2]
    o, lse = np.zeros((n_rows, heads, RANK)), np.full((n_rows, heads), -math.inf)
    for r in range(n_rows):
        end = min(t_hi, lens[r])
        if end > t_lo:
            o[r], lse[r] = reference64(q[r], rows[t_lo:end], scale)
    return o, lse


# A request's rows x heads a group: DeepSeek-V3's 16 (2 rows: one pass of
# two tiles; 4 rows: two passes), Kimi-K2's 8 (3 rows: 24 M rows, a short
# tile), a small group (5 heads, 3 rows: rows straddle a tile); chunks:
# the whole sequence, and a late chunk the earlier rows end before.
SHARED = [(16, 2, 150, 0, 150), (16, 4, 200, 0, 200), (8, 3, 97, 0, 97),
          (5, 3, 70, 0, 70), (16, 3, 160, 120, 160)]  # fmt: skip


def _request(heads: int, n_rows: int, longest: int, seed: int):
    rng = np.random.default_rng(seed)
    q = bf16(rng.normal(size=(n_rows, heads, WIDTH)))
    rows = bf16(rng.normal(size=(longest, WIDTH)))
    # A verify step's rows: consecutive positions, the last the longest.
    lens = [longest - n_rows + 1 + r for r in range(n_rows)]
    return q, rows, lens, 1 / math.sqrt(192)


@pytest.mark.parametrize("heads, n_rows, longest, t_lo, t_hi", SHARED)
def test_the_shared_pass_is_each_rows_causal_softmax(heads, n_rows, longest,
                                                     t_lo, t_hi):  # fmt: skip
    q, rows, lens, scale = _request(heads, n_rows, longest, heads + n_rows)
    o, lse = emulate_request(q, rows, lens, t_lo, t_hi, scale)
    want_o, want_lse = reference_rows64(q, rows, lens, t_lo, t_hi, scale)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    if t_lo >= lens[0]:  # the first row ends before the chunk: nothing
        assert np.all(lse[0] == -math.inf) and not o[0].any()


def test_a_row_reading_past_its_length_is_caught():
    q, rows, lens, scale = _request(16, 2, 150, 3)
    o, _ = emulate_request(q, rows, lens, 0, 150, scale, mutation="length")
    want, _ = reference_rows64(q, rows, lens, 0, 150, scale)
    # The first row would read the second's new token.
    assert not np.allclose(o[0], want[0], rtol=1e-3, atol=1e-3)


def test_pass_tiles():
    """A row per request: one tile at a time (the kernel without
    speculation); a verify step's heads x rows up to PASS_TILES tiles."""
    assert [pass_tiles(per, 1) for per in (8, 16, 32)] == [1, 1, 1]
    assert pass_tiles(16, 2) == 2 == PASS_TILES and pass_tiles(8, 2) == 1
    assert pass_tiles(16, 8) == PASS_TILES and pass_tiles(1, 8) == 1
    assert [query_row(m, 16) for m in (0, 15, 16, 31)] == [(0, 0), (0, 15), (1, 0),
                                                          (1, 15)]  # fmt: skip


def test_the_reference_chunks_a_request_by_its_longest_row():
    """ops/mla_attn.reference with a query map: the chunks of the request's
    last row, each row masked at its own length; merged over the chunks
    (MLA_COMBINE's lse merge) it is each row's attention over its tokens,
    and without the map a row's chunks are its own."""
    heads, longest, block, chunks = 4, 40, 16, 3
    q, rows, _, scale = _request(heads, 3, longest, 11)
    n_blocks = -(-longest // block)
    cache = torch.zeros(n_blocks, block, WIDTH, dtype=torch.bfloat16)
    cache.view(-1, WIDTH)[:longest] = torch.from_numpy(rows).to(torch.bfloat16)
    q_t = torch.from_numpy(q).to(torch.bfloat16)
    lens = torch.tensor([38, 39, 40])
    table = torch.arange(n_blocks).expand(3, -1)
    qmap = torch.tensor([[0, 3], [0, 3], [0, 3]], dtype=torch.int32)
    parts = [mla_attn.reference(q_t[..., :RANK], q_t[..., RANK:], cache, table,
                                lens, c, chunks, scale, qmap)
             for c in range(chunks)]  # fmt: skip
    # Chunks of 14 tokens (the longest row's): row 0 ends at 38.
    assert torch.all(parts[2][1][0] > -math.inf)  # tokens 28..37
    own = mla_attn.reference(q_t[..., :RANK], q_t[..., RANK:], cache, table, lens,
                             2, chunks, scale)  # fmt: skip
    assert not torch.equal(own[1], parts[2][1])  # 13-token chunks per row
    lse = torch.stack([p[1] for p in parts])  # [chunks, rows, heads]
    w = torch.softmax(lse, 0)
    o = (w[..., None] * torch.stack([p[0] for p in parts])).sum(0)
    want, _ = reference_rows64(q, rows, lens.tolist(), 0, longest, scale)
    np.testing.assert_allclose(o.double().numpy(), want, rtol=1e-4, atol=1e-5)


# Heads: DeepSeek-V3's 16 a group, Kimi-K2's 8, two tiles; tokens: one, a
# whole block, blocks and a masked tail.
@pytest.mark.parametrize("heads, tokens", [(16, 150), (8, 150), (24, 64), (16, 1)])
def test_the_mapping_is_the_softmax(heads, tokens):
    q, rows, scale = _inputs(heads, tokens, heads * 1000 + tokens)
    o, lse = emulate_chunk(q, rows, scale, round_p=False)
    want_o, want_lse = reference64(q, rows, scale)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_shifted_index_is_caught(mutation):
    q, rows, scale = _inputs(16, 150, 7)
    o, _ = emulate_chunk(q, rows, scale, round_p=False, mutation=mutation)
    assert not np.allclose(o, reference64(q, rows, scale)[0], rtol=1e-3, atol=1e-3)


def test_bf16_p_is_within_the_stated_tolerance_of_the_reference():
    """The kernel's rounding (P to bf16) against ops/mla_attn.reference in
    fp32, through the cache layout the kernel reads."""
    heads, tokens, block = 16, 150, 16
    q, rows, scale = _inputs(heads, tokens, 3)
    n_blocks = -(-tokens // block)
    cache = torch.zeros(n_blocks, block, WIDTH, dtype=torch.bfloat16)
    cache.view(-1, WIDTH)[:tokens] = torch.from_numpy(rows).to(torch.bfloat16)
    q_t = torch.from_numpy(q).to(torch.bfloat16)[None]
    o_ref, lse_ref = mla_attn.reference(
        q_t[..., :RANK], q_t[..., RANK:], cache, torch.arange(n_blocks)[None],
        torch.tensor([tokens]), 0, 1, scale,
    )  # fmt: skip
    o, lse = emulate_chunk(q, rows, scale)
    want = o_ref[0].double().numpy()
    err = np.abs(o - want).max() / np.abs(want).max()
    assert err < 2**-8
    np.testing.assert_allclose(lse, lse_ref[0].double().numpy(), rtol=1e-5)


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_the_scratch_holds_the_staged_rows(model):
    """The kernel's shared scratch for MLA_ATTN (MLA_Q's W_UK sums,
    persistent.mla_red_floats) holds a tile's queries, P and the warps'
    maxima, at every bucket; a query row's stride keeps lanes g and g + 1
    of a quarter warp on disjoint banks (64 bytes apart modulo 128), and
    P's rows put the 32 lanes' 32-bit loads on 32 banks."""
    from test_mla_kernel_aot import real_shape

    from vllm_ext.megakernel.kernel.persistent import mla_red_floats

    stride = q_stride(WIDTH)
    assert stride >= WIDTH and stride * 2 % 128 == 64
    need = (HEAD_ROWS * stride + HEAD_ROWS * P_STRIDE) // 2 + NUM_WARPS * HEAD_ROWS
    for batch in (1, 64):
        shape = real_shape(model, batch, layers=1)
        assert shape.kv_lora_rank + shape.qk_rope == WIDTH
        assert mla_red_floats(shape) >= need == scratch_floats(WIDTH)
    banks = {(g * P_STRIDE // 2 + q) % 32 for g in range(8) for q in range(4)}
    assert len(banks) == 32
