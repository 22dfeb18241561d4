# SPDX-License-Identifier: Apache-2.0
"""Mixture-of-experts MLPs: the routing rule and the reference forward.

The routing is vLLM's (``fused_moe/router/``): softmax or sigmoid scores of
the router's logits; optionally grouped top-k (groups ranked by their best
score, or by the sum of their best two when a correction bias steers the
selection); the bias added for selection only; the selected scores
renormalised and scaled. One rule more than vLLM states: among equal scores
the lower expert index wins, so a kernel can reproduce the choice exactly.

The arithmetic is the reference executor's: router logits rounded to the
model dtype (what vLLM's ``GateLinear`` returns in its generic path, the one
the CPU takes; on Hopper its small-batch tiers return fp32, to be matched
when the kernel is held to vLLM on a GPU), routing in fp32,
each expert's gate/up and SiLU-mul rounded as the dense MLP's, and the
weighted sum of the experts' down projections (and the shared experts')
accumulated in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_ext.model_spec import MoeSpec
from vllm_ext.weights import MoeWeights


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row, best first; among
    equal scores the lower index first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def route(
    logits: torch.Tensor, moe: MoeSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, num_experts]`` router logits -> (weights ``[B, top_k]`` fp32,
    expert ids ``[B, top_k]`` int64, best first)."""
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
    if moe.grouped:
        batch, experts = choice.shape
        groups = choice.view(batch, moe.num_groups, experts // moe.num_groups)
        if correction_bias is not None:
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = groups.max(dim=-1).values
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, _top(group_scores, moe.topk_groups), True)
        mask = kept.repeat_interleave(experts // moe.num_groups, dim=1)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = _top(choice, moe.top_k)
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * moe.routed_scaling, ids


def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert (or shared) MLP on ``x`` ``[n, hidden]``; fp32 out, before
    its weighting and rounding."""
    dtype = x.dtype
    gate, up = (x.float() @ gate_up.float().t()).to(dtype).chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(dtype)
    return act.float() @ down.float().t()


def moe_mlp(x: torch.Tensor, w: MoeWeights, moe: MoeSpec) -> torch.Tensor:
    """The mixture on ``x`` ``[B, hidden]`` (normed, model dtype) ->
    ``[B, hidden]`` in the model dtype."""
    dtype = x.dtype
    logits = (x.float() @ w.router.float().t()).to(dtype)
    weights, ids = route(logits, moe, w.correction_bias)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        y = _mlp(x[rows], w.w13[expert], w.w2[expert])
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if w.shared_gate_up is not None:
        assert w.shared_down is not None
        out += _mlp(x, w.shared_gate_up, w.shared_down)
    return out.to(dtype)
