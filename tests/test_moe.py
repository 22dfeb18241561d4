# SPDX-License-Identifier: Apache-2.0
"""The reference mixture-of-experts MLP (``vllm_ext.moe``) against vLLM and HF.

* ``route`` against vLLM 0.32's CPU router (``cpu_router.select_experts``,
  which dispatches to ``_softmax_topk`` / ``_grouped_topk``) and, for the
  grouped configurations, against the torch-native ``grouped_topk`` of
  ``grouped_topk_router`` (the GPU path's fallback; called uncompiled). The
  fused CUDA ``fused_topk`` (``ops.topk_softmax``) has no CPU kernel in this
  build, so it is not compared.
* Ties. ``route`` breaks equal scores towards the lower expert (and group)
  index. vLLM's CPU routing is ``torch.topk``, which on CPU is libstdc++'s
  ``std::nth_element`` (``std::partial_sort`` when ``64 * k <= n``) over
  (value, index) pairs compared by value only: a deterministic function of
  the row's contents, independent of the batch, but not "lower index first".
  Those disagreements are pinned as strict xfails, as is one more: vLLM's
  softmax top-k ranks the *logits*, ``route`` the rounded softmax
  probabilities, so two distinct logits whose probabilities round to the
  same fp32 value are a tie for ``route`` only.
* ``moe_mlp`` in fp32 against HF transformers' DeepseekV3MoE,
  Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock run in float64.
* A bf16 smoke check of ``moe_mlp`` against its fp32 result.
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.fused_moe.router.cpu_router import (
    _grouped_topk,
    _softmax_topk,
    select_experts,
)
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import (
    grouped_topk,
)

from vllm_ext.model_spec import MoeSpec
from vllm_ext.moe import route
from vllm_ext.reference import moe_mlp
from vllm_ext.weights import MoeWeights

# The torch-native grouped top-k without its ``torch.compile`` wrapper (the
# CPU inductor build would only slow the test down; the math is the same).
_grouped_topk_native = grouped_topk._torchdynamo_orig_callable


def _spec(num_experts: int, top_k: int, **kw) -> MoeSpec:
    return MoeSpec(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate=32,
        sparse_layers=(True,),
        **kw,
    )


# name -> (MoeSpec, logit scale)
ROUTINGS = {
    "mixtral-8x2": (_spec(8, 2), 2.0),
    "softmax-8x2-no-renorm": (_spec(8, 2, renormalize=False), 2.0),
    "qwen3moe-128x8": (_spec(128, 8), 2.0),
    "qwen3moe-128x8-no-renorm": (_spec(128, 8, renormalize=False), 2.0),
    "deepseek-v3": (
        _spec(
            256,
            8,
            scoring="sigmoid",
            grouped=True,
            num_groups=8,
            topk_groups=4,
            correction_bias=True,
            routed_scaling=2.5,
        ),
        1.0,
    ),
    "kimi-k2": (
        _spec(
            384,
            8,
            scoring="sigmoid",
            grouped=True,
            num_groups=1,
            topk_groups=1,
            correction_bias=True,
            routed_scaling=2.827,
        ),
        1.0,
    ),
    "deepseek-v2": (
        _spec(
            160,
            6,
            scoring="softmax",
            grouped=True,
            num_groups=8,
            topk_groups=3,
            routed_scaling=16.0,
            renormalize=False,
        ),
        2.0,
    ),
}
GROUPED = [name for name, (moe, _) in ROUTINGS.items() if moe.grouped]


def _vllm_route(logits, moe, bias, impl="cpu_router"):
    """vLLM's routing of ``logits`` for ``moe``: (weights, ids)."""
    if impl == "grouped_topk_native":
        assert moe.grouped
        return _grouped_topk_native(
            logits,
            logits,
            moe.top_k,
            moe.renormalize,
            moe.num_groups,
            moe.topk_groups,
            moe.scoring,
            moe.routed_scaling,
            bias,
        )
    # vLLM's softmax top-k ignores the scaling (the model applies it).
    assert moe.grouped or moe.routed_scaling == 1.0
    return select_experts(
        hidden_states=logits,
        router_logits=logits,
        top_k=moe.top_k,
        use_grouped_topk=moe.grouped,
        renormalize=moe.renormalize,
        topk_group=moe.topk_groups if moe.grouped else None,
        num_expert_group=moe.num_groups if moe.grouped else None,
        scoring_func=moe.scoring,
        routed_scaling_factor=moe.routed_scaling,
        e_score_correction_bias=bias,
    )


def _by_id(weights, ids):
    """Each row's (ids ascending, their weights): vLLM's top-k is unsorted."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def _assert_same_routing(got, want, rtol=1e-6):
    (w, ids), (w_ref, ids_ref) = _by_id(*got), _by_id(*want)
    torch.testing.assert_close(ids, ids_ref, rtol=0, atol=0)
    torch.testing.assert_close(w, w_ref.float(), rtol=rtol, atol=0)


def _rtol(moe):
    # vLLM's softmax top-k without renormalisation weighs an expert
    # exp(logit - logsumexp(logits)), route softmax(logits)[expert]: two fp32
    # formulas a few ulp apart (up to ~1.1e-6 relative on 200 seeds).
    return (
        2e-6
        if moe.scoring == "softmax" and not (moe.renormalize or moe.grouped)
        else 1e-6
    )


def _draw(moe, scale, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, moe.num_experts, generator=gen) * scale
    bias = None
    if moe.correction_bias:
        bias = torch.randn(moe.num_experts, generator=gen) * 0.1
    return logits, bias


def _choice(logits, moe, bias):
    """The fp32 values ``route`` ranks the experts by (selection domain)."""
    logits = logits.float()
    if moe.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits.sigmoid()
    return scores if bias is None else scores + bias.float()


def _group_scores(choice, moe, bias):
    groups = choice.view(choice.shape[0], moe.num_groups, -1)
    if bias is not None:
        return groups.topk(2, dim=-1).values.sum(dim=-1)
    return groups.max(dim=-1).values


def _lower_index_first(values, k):
    """The ``k`` best of ``values`` (a list), ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def _reference_ids(logits, moe, bias):
    """Per row, the experts the stated rule selects, in plain Python: best
    score first, lower index among equals, groups likewise."""
    choice = _choice(logits, moe, bias)
    rows = []
    for b in range(choice.shape[0]):
        values = choice[b].tolist()
        allowed = range(moe.num_experts)
        if moe.grouped:
            size = moe.num_experts // moe.num_groups
            group_scores = _group_scores(choice[b : b + 1], moe, bias)[0].tolist()
            kept = _lower_index_first(group_scores, moe.topk_groups)
            allowed = {e for e in allowed if e // size in kept}
        values = [
            values[e] if e in allowed else float("-inf") for e in range(len(values))
        ]
        rows.append(_lower_index_first(values, moe.top_k))
    return torch.tensor(rows, dtype=torch.int64)


# ---------------------------------------------------------------------------
# 1. route against vLLM on random logits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_matches_vllm_cpu_router(name, batch, seed):
    moe, scale = ROUTINGS[name]
    logits, bias = _draw(moe, scale, batch, seed)
    weights, ids = route(logits, moe, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (batch, moe.top_k)
    # Best first: the ranking values never increase along a row.
    ranked = _choice(logits, moe, bias).gather(1, ids)
    assert (ranked[:, :-1] >= ranked[:, 1:]).all()
    _assert_same_routing((weights, ids), _vllm_route(logits, moe, bias), _rtol(moe))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("name", GROUPED)
def test_route_matches_vllm_grouped_topk_native(name, batch, seed):
    moe, scale = ROUTINGS[name]
    logits, bias = _draw(moe, scale, batch, seed)
    _assert_same_routing(
        route(logits, moe, bias),
        _vllm_route(logits, moe, bias, impl="grouped_topk_native"),
    )


# ---------------------------------------------------------------------------
# 2. ties
# ---------------------------------------------------------------------------


def _tied(moe, batch, seed):
    """Logits (and bias) from a handful of values: exact ties everywhere --
    at the top-k boundary, among groups and inside them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (batch, moe.num_experts), generator=gen).float()
    bias = None
    if moe.correction_bias:
        bias = torch.randint(0, 2, (moe.num_experts,), generator=gen).float() / 4
    return logits, bias


def _boundary_ties(logits, moe, bias):
    """How many rows have an exact tie at a selection boundary: a group
    left out that scores as the last kept one, or an expert left out (in
    a kept group) that scores as the last selected one."""
    choice = _choice(logits, moe, bias)
    count = 0
    for b in range(choice.shape[0]):
        values = choice[b].tolist()
        if moe.grouped:
            size = moe.num_experts // moe.num_groups
            group_scores = _group_scores(choice[b : b + 1], moe, bias)[0].tolist()
            kept = _lower_index_first(group_scores, moe.topk_groups)
            last = group_scores[kept[-1]]
            if sum(s == last for s in group_scores) > sum(
                group_scores[g] == last for g in kept
            ):
                count += 1
                continue
            values = [
                v if e // size in kept else float("-inf") for e, v in enumerate(values)
            ]
        picked = _lower_index_first(values, moe.top_k)
        last = values[picked[-1]]
        if sum(v == last for v in values) > sum(values[e] == last for e in picked):
            count += 1
    return count


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_ties_go_to_the_lower_index(name, seed):
    moe, _ = ROUTINGS[name]
    logits, bias = _tied(moe, 64, seed)
    assert _boundary_ties(logits, moe, bias) > 0
    _, ids = route(logits, moe, bias)
    torch.testing.assert_close(ids, _reference_ids(logits, moe, bias), rtol=0, atol=0)


def _grouped_hand_case():
    moe = _spec(
        8,
        4,
        scoring="sigmoid",
        grouped=True,
        num_groups=4,
        topk_groups=2,
        correction_bias=True,
    )
    logits = torch.tensor([[1.0, 0.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    return logits, moe, torch.zeros(8)


def test_route_ties_hand_cases():
    # Plain top-k: the two 2s tie for the second place; expert 1 wins.
    moe = _spec(4, 2)
    _, ids = route(torch.tensor([[0.0, 2.0, 2.0, 3.0]]), moe)
    assert ids.tolist() == [[3, 1]]
    # A duplicate placed before the original: the earlier one wins.
    _, ids = route(torch.tensor([[2.0, 3.0, 0.0, 2.0]]), moe)
    assert ids.tolist() == [[1, 0]]
    # Grouped: group 1 is best, groups 0 and 2 tie for the second slot;
    # group 0 is kept.
    _, ids = route(*_grouped_hand_case())
    assert ids.tolist() == [[2, 3, 0, 1]]


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_vllm_tie_choice_is_deterministic(name):
    """vLLM's pick among equals depends on the row's contents only: the
    same on every call and wherever the row sits in whatever batch."""
    moe, scale = ROUTINGS[name]
    logits, bias = _tied(moe, 16, 0)
    _, want = _by_id(*_vllm_route(logits, moe, bias))
    for _ in range(3):
        torch.testing.assert_close(_by_id(*_vllm_route(logits, moe, bias))[1], want)
    filler, _ = _draw(moe, scale, 64, 1)
    for row in range(logits.shape[0]):
        _, alone = _by_id(*_vllm_route(logits[row : row + 1], moe, bias))
        torch.testing.assert_close(alone[0], want[row])
        batch = filler.clone()
        batch[row * 3] = logits[row]
        _, inside = _by_id(*_vllm_route(batch, moe, bias))
        torch.testing.assert_close(inside[row * 3], want[row])


@pytest.mark.parametrize("name", [n for n in ROUTINGS if not ROUTINGS[n][0].grouped])
def test_vllm_tie_choice_is_among_the_tied(name):
    """Where no groups are involved, vLLM's pick differs from ``route``'s
    only by swapping tied experts: the same scores and weights."""
    moe, _ = ROUTINGS[name]
    logits, bias = _tied(moe, 64, 0)
    w, ids = _by_id(*route(logits, moe, bias))
    w_ref, ids_ref = _by_id(*_vllm_route(logits, moe, bias))
    choice = _choice(logits, moe, bias)
    torch.testing.assert_close(
        choice.gather(1, ids).sort(dim=1).values,
        choice.gather(1, ids_ref).sort(dim=1).values,
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        w.sort(dim=1).values, w_ref.sort(dim=1).values, rtol=1e-6, atol=0
    )


_VLLM_TIES = (
    "vLLM's CPU top-k (std::nth_element on values only) does not break ties by index"
)


@pytest.mark.xfail(strict=True, reason=_VLLM_TIES)
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_vllm_ties_go_to_the_lower_index(name):
    moe, _ = ROUTINGS[name]
    logits, bias = _tied(moe, 64, 0)
    _, ids = _by_id(*_vllm_route(logits, moe, bias))
    _, want = _by_id(*route(logits, moe, bias))
    torch.testing.assert_close(ids, want, rtol=0, atol=0)


# (logits, moe, bias, the experts vLLM picks here)
_VLLM_TIE_CASES = {
    # Tie for second place between experts 1 and 2: vLLM keeps expert 2.
    "topk-later-duplicate": (
        torch.tensor([[0.0, 2.0, 2.0, 3.0]]),
        _spec(4, 2),
        None,
        [2, 3],
    ),
    # The same tie, highest value first: vLLM keeps expert 1.
    "topk-agrees": (torch.tensor([[3.0, 2.0, 2.0, 0.0]]), _spec(4, 2), None, [0, 1]),
    # Groups 0 and 2 tie for the second kept group: vLLM keeps group 2.
    "group-tie": (*_grouped_hand_case(), [2, 3, 4, 5]),
}


@pytest.mark.parametrize("case", list(_VLLM_TIE_CASES))
def test_vllm_tie_choice_hand_cases(case):
    """Pins what vLLM picks on these ties, with this torch build."""
    logits, moe, bias, picked = _VLLM_TIE_CASES[case]
    _, ids = _by_id(*_vllm_route(logits, moe, bias))
    assert ids[0].tolist() == picked


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            "topk-later-duplicate",
            marks=pytest.mark.xfail(strict=True, reason=_VLLM_TIES),
        ),
        "topk-agrees",
        pytest.param(
            "group-tie", marks=pytest.mark.xfail(strict=True, reason=_VLLM_TIES)
        ),
    ],
)
def test_vllm_tie_hand_cases_agree_with_route(case):
    logits, moe, bias, _ = _VLLM_TIE_CASES[case]
    _assert_same_routing(route(logits, moe, bias), _vllm_route(logits, moe, bias))


@pytest.mark.xfail(
    strict=True,
    reason="vLLM's softmax top-k ranks the logits; route ranks the fp32 softmax "
    "probabilities, where two distinct logits can round to the same value",
)
def test_vllm_softmax_topk_ranks_logits_not_probabilities():
    small = torch.tensor(1e-3)
    logits = torch.tensor(
        [[5.0, small, torch.nextafter(small, torch.tensor(1.0)), -1.0]]
    )
    assert logits[0, 1] < logits[0, 2]
    probs = torch.softmax(logits, dim=-1)
    assert probs[0, 1] == probs[0, 2]  # a tie for route only
    _, vllm_ids = _softmax_topk(logits, 2, True)
    assert sorted(vllm_ids[0].tolist()) == [0, 2]  # the larger logit
    _, ids = route(logits, _spec(4, 2))
    assert sorted(ids[0].tolist()) == [0, 2]  # route: [0, 1], the lower index


def test_cpu_router_helpers_are_what_select_experts_runs():
    """The dispatch the comparisons rely on: select_experts is _softmax_topk
    / _grouped_topk."""
    moe, _ = ROUTINGS["mixtral-8x2"]
    logits, _ = _draw(moe, 2.0, 5, 0)
    for got, want in zip(
        _vllm_route(logits, moe, None), _softmax_topk(logits, 2, True), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    moe, _ = ROUTINGS["deepseek-v3"]
    logits, bias = _draw(moe, 1.0, 5, 0)
    want = _grouped_topk(logits, 8, True, 8, 4, "sigmoid", 2.5, bias)
    for got, ref in zip(_vllm_route(logits, moe, bias), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# 3. moe_mlp against HF transformers' MoE blocks (float64)
# ---------------------------------------------------------------------------

HIDDEN, EXPERT_INTER = 64, 32


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random fp32-representable weights (so the fp32 copies are exact),
    then the module in float64."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1]
            scale = 0.3 if "gate.weight" in name else fan_in**-0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        for name, buf in module.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
    return module.double().eval()


def _moe_weights(block, shared=None) -> MoeWeights:
    bias = getattr(block.gate, "e_score_correction_bias", None)

    def f32(t):
        return t.detach().float()

    return MoeWeights(
        router=f32(block.gate.weight),
        correction_bias=None if bias is None else f32(bias),
        w13=f32(block.experts.gate_up_proj),
        w2=f32(block.experts.down_proj),
        shared_gate_up=None
        if shared is None
        else f32(torch.cat([shared.gate_proj.weight, shared.up_proj.weight])),
        shared_down=None if shared is None else f32(shared.down_proj.weight),
    )


def _compare_to_hf(block, w, moe, tokens=32, seed=0, three_d=False):
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 100))
    x64 = x.double()
    with torch.no_grad():
        want = block(x64[None] if three_d else x64)
    want = want.reshape(tokens, HIDDEN)
    got = moe_mlp(x, w, moe)
    assert got.dtype == torch.float32 and got.shape == (tokens, HIDDEN)
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err


# DeepSeek-V3's routing at a small size (and one shared expert).
SMALL_DEEPSEEK_V3 = _spec(
    16,
    4,
    scoring="sigmoid",
    grouped=True,
    num_groups=4,
    topk_groups=2,
    correction_bias=True,
    routed_scaling=2.5,
    shared_intermediate=EXPERT_INTER,
)


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_mlp_matches_hf_deepseek_v3(seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=EXPERT_INTER,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    config._experts_implementation = "eager"
    block = _randomize(DeepseekV3MoE(config), seed)
    assert block.gate.e_score_correction_bias.abs().min() > 0
    assert block.experts.gate_up_proj.shape == (16, 2 * EXPERT_INTER, HIDDEN)
    moe = SMALL_DEEPSEEK_V3
    _compare_to_hf(block, _moe_weights(block, block.shared_experts), moe, seed=seed)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_mlp_matches_hf_qwen3_moe(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=EXPERT_INTER,
        norm_topk_prob=norm_topk_prob,
    )
    config._experts_implementation = "eager"
    block = _randomize(Qwen3MoeSparseMoeBlock(config), 3)
    moe = _spec(8, 2, renormalize=norm_topk_prob)
    _compare_to_hf(block, _moe_weights(block), moe, three_d=True)


def test_moe_mlp_matches_hf_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=EXPERT_INTER,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    config._experts_implementation = "eager"
    block = _randomize(MixtralSparseMoeBlock(config), 4)
    _compare_to_hf(block, _moe_weights(block), _spec(8, 2), three_d=True)


# ---------------------------------------------------------------------------
# 4. bf16 smoke check
# ---------------------------------------------------------------------------


def _margin(logits, moe, bias):
    """Per row, the smallest gap at a selection boundary (kept group vs the
    next, selected expert vs the next), relative to the value kept."""
    choice = _choice(logits, moe, bias)
    gaps = []
    if moe.grouped:
        groups = _group_scores(choice, moe, bias).sort(dim=1, descending=True).values
        kth, nxt = groups[:, moe.topk_groups - 1], groups[:, moe.topk_groups]
        gaps.append((kth - nxt) / kth.abs())
        size = moe.num_experts // moe.num_groups
        kept = torch.zeros(choice.shape[0], moe.num_groups, dtype=torch.bool)
        _, top_groups = _group_scores(choice, moe, bias).topk(moe.topk_groups, dim=1)
        kept.scatter_(1, top_groups, True)
        choice = choice.masked_fill(~kept.repeat_interleave(size, 1), float("-inf"))
    values = choice.sort(dim=1, descending=True).values
    kth, nxt = values[:, moe.top_k - 1], values[:, moe.top_k]
    gaps.append((kth - nxt) / kth.abs())
    return torch.stack(gaps).min(dim=0).values


_BF16_SPECS = {
    "softmax": _spec(8, 2),
    "grouped-sigmoid": SMALL_DEEPSEEK_V3,
}


@pytest.mark.parametrize("name", list(_BF16_SPECS))
def test_moe_mlp_bf16_smoke(name):
    moe = _BF16_SPECS[name]
    gen = torch.Generator().manual_seed(7)

    def bf(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    e, inter, shared = moe.num_experts, moe.expert_intermediate, moe.shared_intermediate
    w = MoeWeights(
        router=bf(e, HIDDEN, scale=0.3),
        correction_bias=bf(e, scale=0.05) if moe.correction_bias else None,
        w13=bf(e, 2 * inter, HIDDEN, scale=HIDDEN**-0.5),
        w2=bf(e, HIDDEN, inter, scale=inter**-0.5),
        shared_gate_up=bf(2 * shared, HIDDEN, scale=HIDDEN**-0.5) if shared else None,
        shared_down=bf(HIDDEN, shared, scale=shared**-0.5) if shared else None,
    )
    w32 = MoeWeights(
        *(
            None if t is None else t.float()
            for t in (w.router, w.correction_bias, w.w13, w.w2)
        ),
        shared_gate_up=None if w.shared_gate_up is None else w.shared_gate_up.float(),
        shared_down=None if w.shared_down is None else w.shared_down.float(),
    )
    # Keep only tokens whose routing is clear of ties by a margin, so that the
    # bf16 rounding of the router logits cannot change the experts chosen.
    pool = bf(512, HIDDEN, scale=1.0)
    logits = pool.float() @ w32.router.t()
    x = pool[_margin(logits, moe, w32.correction_bias) > 0.05][:32]
    assert x.shape[0] == 32
    _, ids16 = route((x.float() @ w32.router.t()).bfloat16(), moe, w32.correction_bias)
    _, ids32 = route(x.float() @ w32.router.t(), moe, w32.correction_bias)
    # The same experts (their order among themselves may differ).
    torch.testing.assert_close(ids16.sort().values, ids32.sort().values, rtol=0, atol=0)

    got = moe_mlp(x, w, moe)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.isfinite(got).all()
    want = moe_mlp(x.float(), w32, moe)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err
