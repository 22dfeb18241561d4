# SPDX-License-Identifier: Apache-2.0
"""TOPK: each request's experts and weights from the router's logits
(``moe.route``), and the batch's distinct experts in slots, ascending.
Padding rows (sequence length 0) are routed to no expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.moe import route


@dataclass
class Routing:
    weights: torch.Tensor  # [B, top_k] fp32
    slots: torch.Tensor  # [B, top_k] int64: each choice's slot, -1 for padding
    experts: torch.Tensor  # [num_slots] int64: each slot's expert, -1 if empty


def reference(
    logits: torch.Tensor, layer, spec, seq_lens: torch.Tensor, num_slots: int
) -> Routing:
    weights, ids = route(logits, spec.moe, layer.moe.correction_bias)
    real = seq_lens.to(ids.device) > 0
    distinct = ids[real].unique()  # sorted ascending
    experts = torch.full((num_slots,), -1, dtype=torch.int64, device=ids.device)
    experts[: len(distinct)] = distinct
    slots = torch.searchsorted(distinct, ids.contiguous())
    slots[~real] = -1
    return Routing(weights, slots, experts)
