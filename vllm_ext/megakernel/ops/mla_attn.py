# SPDX-License-Identifier: Apache-2.0
"""MLA_ATTN: absorbed decode attention of one group of heads over one chunk
of each sequence's latent rows (chunks as ATTN's: ops/attn.py). Scores are
``q_latent . kv_c + q_pe . k_pe`` (two fp32 dot products, summed, as
``reference.mla_decode_attention``), times the softmax scale; the values
are the rows' kv_c. The result is a partial (o_latent, lse) in fp32, merged
by MLA_COMBINE."""

import torch


def reference(
    q_latent: torch.Tensor,  # [B, group, kv_lora_rank]
    q_pe: torch.Tensor,  # [B, group, rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,  # [B]
    chunk: int,
    chunks: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o ``[B, group, kv_lora_rank]``, lse ``[B, group]``), fp32. An empty
    chunk (or a padded row, of length 0) gives o = 0 and lse = -inf."""
    batch, group, rank = q_latent.shape
    block_size = cache.shape[1]
    n = seq_lens.long()
    size = (n + chunks - 1) // chunks
    lo = torch.minimum(chunk * size, n)
    hi = torch.minimum(lo + size, n)
    width = int((hi - lo).max()) if batch else 0
    o = torch.zeros(batch, group, rank, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((batch, group), float("-inf"), device=q_latent.device)
    if width == 0:
        return o, lse
    pos = lo[:, None] + torch.arange(width, device=q_latent.device)  # [B, T]
    valid = pos < hi[:, None]
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    blocks = torch.gather(block_table.long(), 1, pos // block_size)
    rows = cache[blocks, pos % block_size].float()  # [B, T, rank + rope]
    kv_c, k_pe = rows[..., :rank], rows[..., rank:]
    scores = torch.einsum("bgl,btl->bgt", q_latent.float(), kv_c)
    scores = scores + torch.einsum("bgr,btr->bgt", q_pe.float(), k_pe)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)  # masked -> 0
    total = p.sum(dim=-1, keepdim=True)
    has = total > 0
    o = torch.where(
        has, torch.einsum("bgt,btl->bgl", p, kv_c) / total.clamp_min(1e-30), o
    )
    lse = torch.where(has.squeeze(-1), (m + torch.log(total)).squeeze(-1), lse)
    return o, lse
