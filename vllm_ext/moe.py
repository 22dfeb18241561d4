# SPDX-License-Identifier: Apache-2.0
"""Mixture-of-experts routing: which experts each request's MLP runs, and
with what weights (the mixture itself: ``reference.moe_mlp``).

The routing is vLLM's (``fused_moe/router/``): softmax or sigmoid scores of
the router's logits; optionally grouped top-k (groups ranked by their best
score, or by the sum of their best two when a correction bias steers the
selection); the bias added for selection only; the selected scores
renormalised and scaled. One rule more than vLLM states: among equal scores
the lower expert index wins, so a kernel can reproduce the choice exactly.

Routing runs in fp32 on the router's logits as the caller rounded them
(the model dtype: ``reference.moe_mlp``).
"""

from __future__ import annotations

import torch

from vllm_ext.model_spec import MoeSpec


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row, best first; among
    equal scores the lower index first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def selection(
    logits: torch.Tensor, moe: MoeSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``[B, num_experts]`` router logits -> (scores, the scores that select
    (bias added), and each group's score, ``[B, num_groups]``, when the
    routing is grouped), all fp32."""
    logits = logits.float()
    if moe.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif moe.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown MoE scoring {moe.scoring!r}")
    choice = scores
    if correction_bias is not None:
        choice = scores + correction_bias.float()
    if not moe.grouped:
        return scores, choice, None
    batch, experts = choice.shape
    groups = choice.view(batch, moe.num_groups, experts // moe.num_groups)
    if correction_bias is not None:
        return scores, choice, groups.topk(2, dim=-1).values.sum(dim=-1)
    return scores, choice, groups.max(dim=-1).values


def route(
    logits: torch.Tensor, moe: MoeSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, num_experts]`` router logits -> (weights ``[B, top_k]`` fp32,
    expert ids ``[B, top_k]`` int64, best first)."""
    scores, choice, group_scores = selection(logits, moe, correction_bias)
    if group_scores is not None:
        choice = choice.masked_fill(~kept_experts(group_scores, moe), float("-inf"))
    ids = _top(choice, moe.top_k)
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * moe.routed_scaling, ids


def kept_experts(group_scores: torch.Tensor, moe: MoeSpec) -> torch.Tensor:
    """``[B, num_experts]`` bool: the experts of the groups grouped top-k
    keeps (its best ``topk_groups`` groups)."""
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, _top(group_scores, moe.topk_groups), True)
    return kept.repeat_interleave(moe.num_experts // moe.num_groups, dim=1)
