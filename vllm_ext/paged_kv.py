# SPDX-License-Identifier: Apache-2.0
"""vLLM's paged KV cache as the megakernel reads it, in PyTorch.

One layout on every platform: vLLM's FlashAttention layout (LBNHC). Each
layer's cache is a view ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
(K in the first half of the last dim, V in the second) whose memory order is
``[block, token, head, K|V]``. Token ``t`` of a request lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; its flat slot is
``block * block_size + offset`` (what vLLM's slot mapping holds).

These functions are the reference for the kernel's indexing: the reference
executor and the reference attention backend both go through them. Torch
only (no vLLM import): the GPU check runs them where vLLM is not installed.
"""

from __future__ import annotations

import torch

# vLLM's slot mapping marks padded tokens with -1 (PAD_SLOT_ID).
PAD_SLOT_ID = -1


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads: slice = slice(None),
    dims: slice = slice(None),
) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at their slots
    (only kv heads ``heads`` and dims ``dims`` of each when given, the
    values then ``[T, len(heads), len(dims)]``; ``None`` skips K or V)."""
    num_tokens = slot_mapping.shape[0]
    block_size = kv_cache.shape[2]
    head_dim = kv_cache.shape[3] // 2
    slots = slot_mapping.to(torch.long)
    valid = slots != PAD_SLOT_ID
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    lo, hi, _ = dims.indices(head_dim)
    for base, values in ((0, key), (head_dim, value)):
        part = slice(base + lo, base + hi)
        if values is not None:
            kv_cache[blocks, heads, offsets, part] = values[:num_tokens][valid].to(
                kv_cache.dtype
            )


def gather_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``seq_len`` tokens, ``[seq_len, kv_heads,
    head_dim]`` each."""
    block_size = kv_cache.shape[2]
    head_dim = kv_cache.shape[3] // 2
    pos = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table_row.to(torch.long)[pos // block_size]
    kv = kv_cache[blocks, :, pos % block_size, :]
    return kv[..., :head_dim], kv[..., head_dim:]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, q_heads, head_dim]`` over the cache.

    The queries of request ``i`` are rows ``query_start_loc[i]:
    query_start_loc[i+1]`` and are the last tokens of its ``seq_lens[i]``
    tokens. Scores, softmax and the weighted sum are in fp32; ``out`` gets the
    result in its own dtype.
    """
    num_q_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[1]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens[: len(starts) - 1]):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        k, v = gather_kv(kv_cache, block_table[i], seq_len)
        # [kv_heads, group, q, d] x [kv_heads, d, s] keeps GQA without copies.
        q = query[q_lo:q_hi].float().transpose(0, 1)
        q = q.reshape(num_kv_heads, group, q_hi - q_lo, -1)
        k = k.float().permute(1, 2, 0)
        scores = torch.matmul(q, k.unsqueeze(1)) * scale
        # Query j sits at position seq_len - n + j and sees positions <= it.
        n = q_hi - q_lo
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.float().transpose(0, 1).unsqueeze(1))
        out[q_lo:q_hi] = o.reshape(num_q_heads, n, -1).transpose(0, 1).to(out.dtype)
    return out


# Multi-head latent attention (MLA): vLLM's MLAAttentionSpec cache. Each
# layer's cache is ``[num_blocks, block_size, kv_lora_rank + rope_dim]``: one
# latent row ``[kv_c | k_pe]`` per token (no heads, no separate V), at the
# same slots as above.


def write_latent(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``kv_c`` ``[T, kv_lora_rank]`` and ``k_pe`` ``[T, rope_dim]`` as
    the rows of their slots (padded slots skipped), in the cache's dtype."""
    rank, block_size = kv_c.shape[-1], cache.shape[1]
    slots = slot_mapping.to(torch.long)
    num_tokens = slots.shape[0]
    valid = slots != PAD_SLOT_ID
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    cache[blocks, offsets, :rank] = kv_c[:num_tokens][valid].to(cache.dtype)
    cache[blocks, offsets, rank:] = k_pe[:num_tokens][valid].to(cache.dtype)


def gather_latent(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The latent rows of one request's first ``seq_len`` tokens,
    ``[seq_len, kv_lora_rank + rope_dim]``."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row.to(torch.long)[pos // block_size]
    return cache[blocks, pos % block_size]
