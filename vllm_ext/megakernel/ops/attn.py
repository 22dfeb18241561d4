# SPDX-License-Identifier: Apache-2.0
"""ATTN: decode attention of one kv head's q heads over one chunk of each
sequence, read from the paged cache; the result is a partial (o, lse) in
fp32, merged by COMBINE. Chunk c of a sequence of length n covers tokens
[c * ceil(n / chunks), (c + 1) * ceil(n / chunks)) ∩ [0, n): the program
is fixed, the chunks are sized at run time."""

import torch


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
    block_size = kv_cache.shape[2]
    n = seq_lens.long()
    size = (n + chunks - 1) // chunks
    lo = torch.minimum(chunk * size, n)
    hi = torch.minimum(lo + size, n)
    width = int((hi - lo).max()) if batch else 0
    o = torch.zeros(batch, group, d, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, group), float("-inf"), device=q.device)
    if width == 0:
        return o, lse
    pos = lo[:, None] + torch.arange(width, device=q.device)  # [B, T]
    valid = pos < hi[:, None]
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    blocks = torch.gather(block_table.long(), 1, pos // block_size)
    kv = kv_cache[blocks, kv_head, pos % block_size].float()  # [B, T, 2d]
    k, v = kv[..., :d], kv[..., d:]
    scores = torch.einsum("bgd,btd->bgt", q.float(), k) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)  # masked -> 0
    total = p.sum(dim=-1, keepdim=True)
    has = total > 0
    o = torch.where(has, torch.einsum("bgt,btd->bgd", p, v) / total.clamp_min(1e-30), o)
    lse = torch.where(has.squeeze(-1), (m + torch.log(total)).squeeze(-1), lse)
    return o, lse
