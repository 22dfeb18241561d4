# SPDX-License-Identifier: Apache-2.0
"""EMBED: gather the batch's embedding rows, hidden columns [lo, hi). With
tensor parallel a rank holds the rows of its vocabulary shard: tokens
outside it get zeros, which ALL_REDUCE fills in from the rank that holds
them (vLLM's ``VocabParallelEmbedding``)."""

import torch


def reference(
    embed: torch.Tensor,
    input_ids: torch.Tensor,
    lo: int,
    hi: int,
    dtype,
    vocab_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    ids = input_ids.long()
    if vocab_range is None:
        return embed[ids, lo:hi].to(dtype)
    start, end = vocab_range
    held = (ids >= start) & (ids < end)
    rows = embed[torch.where(held, ids - start, 0), lo:hi].to(dtype)
    return rows * held[:, None].to(dtype)
