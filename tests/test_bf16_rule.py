# SPDX-License-Identifier: Apache-2.0
"""The project's bf16 rule (tests/utils.py) on made-up streams: what it
holds, where it lets two streams part, and the routing near-tie excuse."""

import pytest
import torch

from tests.utils import (
    BF16_LOGPROB_TOL,
    BF16_TIE,
    ROUTING_TIE,
    check_bf16_close,
    routing_margin,
)
from vllm_ext.model_spec import MoeSpec
from vllm_ext.moe import route


def _stream(tokens, logprobs):
    """(token_ids, per-step {token: logprob}) with the top two per step."""
    return list(tokens), [dict(step) for step in logprobs]


# Three steps: picks 1, 2, 3, each against a runner-up (9) 0.5 behind.
REF = _stream([1, 2, 3], [{1: -0.1, 9: -0.6}, {2: -0.2, 9: -0.7}, {3: -0.3, 9: -0.8}])


def _shifted(step: int, by: float):
    ids, lps = _stream(*REF)
    lps[step] = {t: lp + (by if t == ids[step] else 0.0) for t, lp in lps[step].items()}
    return ids, lps


def test_equal_streams_compare_every_token():
    stats = check_bf16_close([REF], [REF], "a", "b")
    assert (stats["compared"], stats["parted"]) == (3, 0)


def test_a_logprob_beyond_the_tolerance_fails():
    check_bf16_close([REF], [_shifted(1, BF16_LOGPROB_TOL)], "a", "b")
    with pytest.raises(AssertionError, match="step 1: both picked 2"):
        check_bf16_close([REF], [_shifted(1, 2 * BF16_LOGPROB_TOL)], "a", "b")


def test_streams_part_only_at_a_near_tie():
    near = _stream([1, 9, 5], [{1: -0.1, 9: -0.6}, {9: -0.45, 2: -0.45}, {5: 0.0}])
    ref = _stream([1, 2, 3], [{1: -0.1, 9: -0.6}, {2: -0.4, 9: -0.4}, {3: -0.3}])
    stats = check_bf16_close([ref], [near], "a", "b")
    assert (stats["compared"], stats["parted"]) == (1, 1)
    far = _stream([1, 9, 5], [{1: -0.1, 9: -0.6}, {9: -0.2, 2: -0.7}, {5: 0.0}])
    with pytest.raises(AssertionError, match="not near a tie"):
        check_bf16_close([REF], [far], "a", "b")
    assert BF16_TIE < 0.5


def test_a_routing_tie_excuses_its_own_step_only():
    far = _shifted(1, 0.5)
    stats = check_bf16_close([REF], [far], "a", "b", routing_ties={(0, 1)})
    assert (stats["compared"], stats["at_routing_tie"]) == (1, 1)
    # A tie at another step excuses nothing here.
    for ties in ({(0, 0)}, {(0, 2)}, {(1, 1)}):
        with pytest.raises(AssertionError, match="both picked 2"):
            check_bf16_close([REF], [far], "a", "b", routing_ties=ties)
    # A tie where the streams agree within the rule is no part.
    stats = check_bf16_close([REF], [REF], "a", "b", routing_ties={(0, 1)})
    assert (stats["compared"], stats["parted"]) == (3, 0)


def _moe(**kw) -> MoeSpec:
    base = dict(num_experts=8, top_k=2, expert_intermediate=8,
                sparse_layers=(True,), renormalize=True, scoring="sigmoid")  # fmt: skip
    return MoeSpec(**(base | kw))


@pytest.mark.parametrize(
    "moe, biased",
    [(_moe(), False),
     (_moe(grouped=True, num_groups=4, topk_groups=2), False),
     (_moe(grouped=True, num_groups=4, topk_groups=2), True),
     # Kimi-K2's one group: every group kept, no group margin.
     (_moe(grouped=True, num_groups=1, topk_groups=1), True)],
)  # fmt: skip
def test_routing_margin_is_how_far_the_choice_is_from_changing(moe, biased):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, moe.num_experts, generator=gen)
        bias = torch.randn(moe.num_experts, generator=gen) * 0.1 if biased else None
        margin = float(routing_margin(logits, moe, bias)[0])
        assert margin > 0  # (random logits: no exact tie)
        # Scores moved by less than the margin keep the choice.
        scores = logits.sigmoid() + (0 if bias is None else bias)
        nudged = (scores + (torch.rand(scores.shape, generator=gen) - 0.5)
                  * margin * (0.49 if biased and moe.grouped else 0.99))  # fmt: skip
        base = route(logits, moe, bias)[1]
        shifted = torch.logit(
            (nudged - (0 if bias is None else bias)).clamp(1e-6, 1 - 1e-6)
        )
        assert set(route(shifted, moe, bias)[1][0].tolist()) == set(base[0].tolist())
    assert ROUTING_TIE == 2**-7


def test_routing_margin_is_tight():
    """Ungrouped: the last chosen expert and the best left out, each moved
    half the margin and a little more towards the other, trade places."""
    moe = _moe()
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(1))
    scores = logits.sigmoid()
    margin = float(routing_margin(logits, moe)[0])
    ranked = scores[0].argsort(descending=True)
    last, first_out = int(ranked[moe.top_k - 1]), int(ranked[moe.top_k])
    moved = scores.clone()
    moved[0, last] -= 0.51 * margin
    moved[0, first_out] += 0.51 * margin
    assert first_out in route(torch.logit(moved), moe)[1][0].tolist()
