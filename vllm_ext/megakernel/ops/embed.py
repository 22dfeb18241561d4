# SPDX-License-Identifier: Apache-2.0
"""EMBED: gather the batch's embedding rows, hidden columns [lo, hi)."""

import torch


def reference(
    embed: torch.Tensor, input_ids: torch.Tensor, lo: int, hi: int, dtype
) -> torch.Tensor:
    return embed[input_ids.long(), lo:hi].to(dtype)
