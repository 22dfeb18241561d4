# SPDX-License-Identifier: Apache-2.0
"""MLA_ATTN: absorbed decode attention of one group of heads over one chunk
of each sequence's latent rows (chunks as ATTN's: ops/attn.py). Scores are
``q_latent . kv_c + q_pe . k_pe`` (two fp32 dot products, summed, as
``reference.mla_decode_attention``), times the softmax scale; the values
are the rows' kv_c. The result is a partial (o_latent, lse) in fp32, merged
by MLA_COMBINE.

With a query map (a verify step in a program of ``query_rows`` > 1): a
request's rows share one pass over its cache, so the chunks are those of
its longest row (its last), and each row masks the tokens past its own
length (its position + 1: causal among the step's new tokens)."""

import torch

from vllm_ext.megakernel.ops.attn import chunk_tokens, partial_softmax


def reference(
    q_latent: torch.Tensor,  # [B, group, kv_lora_rank]
    q_pe: torch.Tensor,  # [B, group, rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,  # [B]
    chunk: int,
    chunks: int,
    scale: float,
    query_map: torch.Tensor | None = None,  # [B, 2]: first row, row count
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o ``[B, group, kv_lora_rank]``, lse ``[B, group]``), fp32. An empty
    chunk (or a padded row, of length 0) gives o = 0 and lse = -inf."""
    batch, group, rank = q_latent.shape
    o = torch.zeros(batch, group, rank, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((batch, group), float("-inf"), device=q_latent.device)
    spans, row_lens = seq_lens, None
    if query_map is not None:
        last = (query_map[:, 0] + query_map[:, 1] - 1).long()
        spans, row_lens = seq_lens[last], seq_lens
    tokens = chunk_tokens(block_table, spans, cache.shape[1], chunk, chunks,
                          row_lens)  # fmt: skip
    if tokens is None:
        return o, lse
    blocks, offsets, valid = tokens
    rows = cache[blocks, offsets].float()  # [B, T, rank + rope]
    kv_c, k_pe = rows[..., :rank], rows[..., rank:]
    scores = torch.einsum("bgl,btl->bgt", q_latent.float(), kv_c)
    scores = scores + torch.einsum("bgr,btr->bgt", q_pe.float(), k_pe)
    return partial_softmax(scores * scale, valid, kv_c, o, lse)
