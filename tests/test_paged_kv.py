# SPDX-License-Identifier: Apache-2.0
"""The cache indexing every executor shares, against dense float64 math."""

import pytest
import torch

from tests.utils import make_kv_cache, random_block_tables, slots_of
from vllm_ext.paged_kv import PAD_SLOT_ID, gather_kv, paged_attention, write_kv


def test_cache_view_is_vllm_flash_layout():
    cache = make_kv_cache(4, 2, 16, 64, torch.float32)
    # Token-major inside a block: the next token is one head-row further on.
    assert cache.stride(2) == 2 * 2 * 64 and cache.stride(1) == 2 * 64


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_then_gather_roundtrip(block_size):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1]
    cache = make_kv_cache(16, 2, block_size, 64, torch.float32)
    table = random_block_tables(seq_lens, block_size, 16, gen)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k, v = torch.randn(2, n, 2, 64, generator=gen)
        slots = slots_of(table[i : i + 1].expand(n, -1), list(range(n)), block_size)
        write_kv(cache, k, v, slots)
        keys.append(k)
        values.append(v)
    for i, n in enumerate(seq_lens):
        k, v = gather_kv(cache, table[i], n)
        torch.testing.assert_close(k, keys[i], rtol=0, atol=0)
        torch.testing.assert_close(v, values[i], rtol=0, atol=0)


def test_padded_slots_are_not_written():
    cache = make_kv_cache(2, 1, 16, 64, torch.float32)
    k = torch.ones(2, 1, 64)
    write_kv(cache, k, k, torch.tensor([3, PAD_SLOT_ID]))
    assert not cache[0, :, 3].isnan().any()
    assert cache.isnan().sum() == cache.numel() - 2 * 64


def _dense_attention(q, k, v, scale):
    """float64 causal attention for the last q.shape[0] of k.shape[0] tokens."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.arange(s)[None, :] > torch.arange(s - n, s)[:, None]
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_matches_dense(num_q_heads, num_kv_heads, head_dim):
    """Mixed batch: a prefill, a chunked prefill and decodes, across blocks.
    fp32 inputs against float64: tolerance is fp32 rounding of the sums."""
    gen = torch.Generator().manual_seed(1)
    block_size = 16
    seq_lens = [5, 40, 17, 33]
    query_lens = [5, 8, 1, 1]
    cache = make_kv_cache(16, num_kv_heads, block_size, head_dim, torch.float32)
    table = random_block_tables(seq_lens, block_size, 16, gen)
    dense = []
    for i, n in enumerate(seq_lens):
        k, v = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
        slots = slots_of(table[i : i + 1].expand(n, -1), list(range(n)), block_size)
        write_kv(cache, k, v, slots)
        dense.append((k, v))
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_attention(q, cache, table, torch.tensor(seq_lens), starts, scale, out)
    for i, (k, v) in enumerate(dense):
        lo, hi = int(starts[i]), int(starts[i + 1])
        expected = _dense_attention(q[lo:hi], k, v, scale)
        torch.testing.assert_close(out[lo:hi].double(), expected, rtol=1e-5, atol=1e-5)
