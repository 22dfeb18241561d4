# SPDX-License-Identifier: Apache-2.0
"""ATTN: decode attention of one kv head's q heads over one chunk of each
sequence, read from the paged cache; the result is a partial (o, lse) in
fp32, merged by COMBINE. Chunk c of a sequence of length n covers tokens
[c * ceil(n / chunks), (c + 1) * ceil(n / chunks)) ∩ [0, n): the program
is fixed, the chunks are sized at run time. With ``Program.qk_in_attn``
(isa.py) the caller finishes q (``qkv.finish``) and the new K
(``finish_new_k``) first."""

import torch

from vllm_ext.megakernel.ops.qkv import finish


def chunk_tokens(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    chunk: int,
    chunks: int,
    row_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Chunk ``chunk`` of each sequence's tokens in a paged cache: (blocks,
    offsets in their block, valid), each ``[B, T]`` (invalid entries point
    at token 0), or None when the chunk is empty for every request.
    ``row_lens`` (at most ``seq_lens``): each row's own length, tokens past
    it invalid, the chunks still those of ``seq_lens`` (MLA_ATTN's shared
    pass: a request's rows split by its longest)."""
    n = seq_lens.long()
    size = (n + chunks - 1) // chunks
    lo = torch.minimum(chunk * size, n)
    hi = torch.minimum(lo + size, n)
    width = int((hi - lo).max()) if len(n) else 0
    if width == 0:
        return None
    pos = lo[:, None] + torch.arange(width, device=n.device)  # [B, T]
    if row_lens is not None:
        hi = torch.minimum(hi, row_lens.long())
    valid = pos < hi[:, None]
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    blocks = torch.gather(block_table.long(), 1, pos // block_size)
    return blocks, pos % block_size, valid


def newest_in_chunk(seq_lens: torch.Tensor, chunk: int, chunks: int) -> torch.Tensor:
    """``[B]`` bool: chunk ``chunk`` holds the request's newest token (the
    chunk is not empty and ends at the sequence's end; never for a padded
    row, of length 0)."""
    n = seq_lens.long()
    size = (n + chunks - 1) // chunks
    lo = torch.minimum(chunk * size, n)
    return (lo < n) & (lo + size >= n)


def finish_new_k(
    kv_cache: torch.Tensor,
    kv_head: int,
    slot_mapping: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    chunk: int,
    chunks: int,
    k_norm: torch.Tensor,
    spec,  # ModelSpec
    cos: torch.Tensor,  # [B, head_dim / 2]
    sin: torch.Tensor,
) -> None:
    """In place: QK-norm and RoPE (``ops/qkv.finish``) of kv head
    ``kv_head``'s new K, which QKV stored as projected (isa.py:
    ``Program.qk_in_attn``), for each request whose newest token is in this
    chunk, the one chunk that reads it."""
    rows = (newest_in_chunk(seq_lens, chunk, chunks) & (slot_mapping >= 0)).nonzero()
    rows = rows.flatten()
    if len(rows) == 0:
        return
    slots = slot_mapping[rows].long()
    block_size, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    blocks, offsets = slots // block_size, slots % block_size
    k = kv_cache[blocks, kv_head, offsets, :d]  # [R, d]
    k = finish(k[:, None], k_norm, spec, cos[rows], sin[rows])[:, 0]
    kv_cache[blocks, kv_head, offsets, :d] = k.to(kv_cache.dtype)


def partial_softmax(
    scores: torch.Tensor,
    valid: torch.Tensor,
    values: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled ``scores`` ``[B, G, T]`` over a chunk's tokens (``valid``) and
    their ``values`` ``[B, T, D]`` -> (o, lse) in fp32, keeping ``o`` and
    ``lse`` (zeros, -inf) for a request with no token in the chunk."""
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)  # masked -> 0
    total = p.sum(dim=-1, keepdim=True)
    has = total > 0
    o = torch.where(
        has, torch.einsum("bgt,btd->bgd", p, values) / total.clamp_min(1e-30), o
    )
    lse = torch.where(has.squeeze(-1), (m + torch.log(total)).squeeze(-1), lse)
    return o, lse


def reference(
    q: torch.Tensor,  # [B, group, head_dim] the kv head's q heads
    kv_cache: torch.Tensor,
    kv_head: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,  # [B]
    chunk: int,
    chunks: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o ``[B, group, head_dim]``, lse ``[B, group]``), fp32. An empty chunk
    (or a padded row, of length 0) gives o = 0 and lse = -inf."""
    batch, group, d = q.shape
    o = torch.zeros(batch, group, d, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, group), float("-inf"), device=q.device)
    tokens = chunk_tokens(block_table, seq_lens, kv_cache.shape[2], chunk, chunks)
    if tokens is None:
        return o, lse
    blocks, offsets, valid = tokens
    kv = kv_cache[blocks, kv_head, offsets].float()  # [B, T, 2d]
    k, v = kv[..., :d], kv[..., d:]
    scores = torch.einsum("bgd,btd->bgt", q.float(), k) * scale
    return partial_softmax(scores, valid, v, o, lse)
