# SPDX-License-Identifier: Apache-2.0
"""The wide attention's work mapping (kernel/ops/attn_wide.py), emulated lane
by lane in float64 and held against the attention reference (ops/attn.py, fp32).

The kernel cannot run on this machine; this checks that its mapping covers
every token of the chunk once and merges the softmax states right: request
slots and warps per request, token groups of ``d / 8`` lanes (each lane 8
dims of K and V), the partial dot reduced within a token group, lanes past
the chunk's end keeping their state, the butterfly merges of the token
groups, and the merge of a request's warps through shared memory."""

import math

import pytest
import torch

from vllm_ext.megakernel.kernel.ops.attn_wide import merge_rounds
from vllm_ext.megakernel.ops import attn

WARPS, VEC = 8, 8
NEG_INF = float("-inf")


def _fold(state, other):
    """``_merge``: fold (m, l, acc) ``other`` into ``state``."""
    m, den, acc = state
    m_o, l_o, acc_o = other
    m_new = max(m, m_o)
    if m_new == NEG_INF:
        return state
    a, c = math.exp(m - m_new), math.exp(m_o - m_new)
    return m_new, den * a + l_o * c, acc * a + acc_o * c


def emulate(q, cache, table, seq_lens, g, chunk, chunks, scale, rank_offset=True):
    """The kernel's ATTN(g, chunk) in float64: ([B, group, d], [B, group])."""
    b, group, d = q.shape
    bs = cache.shape[1]
    lanes, per_load = d // VEC, 32 // (d // VEC)
    reqs = min(b, WARPS)
    warps = WARPS // reqs
    q, cache = q.double(), cache.double()
    o = torch.zeros(b, group, d, dtype=torch.float64)
    lse = torch.full((b, group), NEG_INF, dtype=torch.float64)
    for i0 in range(0, b, reqs):
        empty = (NEG_INF, 0.0, torch.zeros(VEC, dtype=torch.float64))
        # state[warp][lane][gi]
        state = [[[empty] * group for _ in range(32)] for _ in range(WARPS)]
        for warp in range(WARPS):
            slot, rank = divmod(warp, warps)
            i = i0 + slot
            if not (slot < reqs and i < b):
                continue
            n = int(seq_lens[i])
            size = (n + chunks - 1) // chunks
            t_lo = min(chunk * size, n)
            t_hi = min(t_lo + size, n)
            start = t_lo + (rank * per_load if rank_offset else 0)
            for t0 in range(start, t_hi, warps * per_load):
                dots, rows = [], []
                for lane in range(32):
                    sub, part = divmod(lane, lanes)
                    t = t0 + sub
                    tt = t if t < t_hi else t0
                    row = cache[int(table[i, tt // bs]), tt % bs, g]
                    k = row[part * VEC : (part + 1) * VEC]
                    v = row[d + part * VEC : d + (part + 1) * VEC]
                    dots.append(q[i, :, part * VEC : (part + 1) * VEC] @ k)
                    rows.append((t < t_hi, v))
                for lane in range(32):
                    valid, v = rows[lane]
                    first = lane - lane % lanes  # the token group's lanes
                    dot = sum(dots[first : first + lanes])
                    if not valid:
                        continue
                    for gi in range(group):
                        score = float(dot[gi]) * scale
                        state[warp][lane][gi] = _fold(
                            state[warp][lane][gi], (score, 1.0, v.clone())
                        )
            for r in range(merge_rounds(d)):
                off = lanes << r
                old = [list(s) for s in state[warp]]
                for lane in range(32):
                    for gi in range(group):
                        state[warp][lane][gi] = _fold(
                            old[lane][gi], old[lane ^ off][gi]
                        )
        for r in range(reqs):
            i = i0 + r
            if i >= b:
                continue
            for gi in range(group):
                # warp_m / warp_l from lane 0, warp_o from the lanes of group 0.
                parts = [state[r * warps + w] for w in range(warps)]
                top = max(p[0][gi][0] for p in parts)
                if top == NEG_INF:
                    continue
                total = sum(p[0][gi][1] * math.exp(p[0][gi][0] - top) for p in parts)
                for part in range(lanes):
                    num = sum(
                        p[part][gi][2] * math.exp(p[part][gi][0] - top) for p in parts
                    )
                    o[i, gi, part * VEC : (part + 1) * VEC] = num / total
                lse[i, gi] = top + math.log(total)
    return o, lse


def case(batch, group, d, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bs, kv_heads = 16, 2
    blocks = sum((n + bs - 1) // bs for n in lengths) + 1
    cache = torch.randn(blocks, bs, kv_heads, 2 * d, generator=gen, dtype=torch.float64)
    q = torch.randn(batch, group, d, generator=gen, dtype=torch.float64)
    width = max(1, max((n + bs - 1) // bs for n in lengths))
    table = torch.zeros(batch, width, dtype=torch.int32)
    perm = torch.randperm(blocks, generator=gen).tolist()
    for i, n in enumerate(lengths):
        for j in range((n + bs - 1) // bs):
            table[i, j] = perm.pop()
    return q, cache, table, torch.tensor(lengths, dtype=torch.int32)


GRID = [
    # batch, group, head_dim, sequence lengths (0: a padded row)
    (1, 4, 64, [70]),
    (1, 1, 128, [33]),
    (3, 7, 64, [5, 0, 41]),
    (4, 2, 128, [17, 64, 1, 30]),
    (8, 4, 64, [9, 100, 0, 3, 40, 16, 77, 2]),
    (16, 4, 128, [(7 * i + 3) % 90 for i in range(16)]),
]


@pytest.mark.parametrize("batch, group, d, lengths", GRID)
@pytest.mark.parametrize("chunks", [1, 3])
def test_wide_attention_mapping_matches_reference(batch, group, d, lengths, chunks):
    q, cache, table, seq_lens = case(batch, group, d, lengths)
    scale = d**-0.5
    for chunk in range(chunks):
        for g in range(2):
            got_o, got_lse = emulate(q, cache, table, seq_lens, g, chunk, chunks, scale)
            want_o, want_lse = attn.reference(
                q, cache.transpose(1, 2), g, table, seq_lens, chunk, chunks, scale
            )
            torch.testing.assert_close(got_o, want_o.double(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_lse, want_lse.double(), rtol=1e-5, atol=1e-5)


def test_a_warp_that_skips_its_rank_offset_is_caught():
    """Each of a request's warps starts ``rank * tokens per load`` into the
    chunk; without that offset the warps read the same tokens."""
    q, cache, table, seq_lens = case(1, 4, 64, [70])
    got, _ = emulate(q, cache, table, seq_lens, 0, 0, 1, 0.125, rank_offset=False)
    want, _ = attn.reference(q, cache.transpose(1, 2), 0, table, seq_lens, 0, 1, 0.125)
    assert not torch.allclose(got, want.double(), atol=1e-6)
