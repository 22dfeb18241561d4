# SPDX-License-Identifier: Apache-2.0
"""Tensor-parallel programs (parallel.py, isa.py's ALL_REDUCE): every rank's
program run together in one process equals the one-rank program; the
verifier proves the rank set and catches a missing or short wait."""

import dataclasses

import pytest
import torch

from tests.megakernel.test_interpret import make_spec
from tests.megakernel.test_mla_program import mla_spec
from tests.megakernel.test_moe_program import deepseek_routing, spec_of
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import (
    DeadlockError,
    ProgramInterpreter,
    RankSetInterpreter,
)
from vllm_ext.megakernel.isa import NO_COUNTER, Op
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import VerificationError, verify
from vllm_ext.model_spec import UnsupportedModelError
from vllm_ext.parallel import kv_heads_per_rank, shard_spec, shard_weights
from vllm_ext.testing import random_decode_inputs, random_weights

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=16)
# The ranks' partial sums split each o_proj / down product over K and add
# them in another order: fp32 rounding, at most a few ulps of |x| < 8
# through two layers (measured below 2e-6).
FP32_TOL = 1e-5


def _specs():
    f32 = torch.float32
    return {
        # kv heads split (4 q / 2 kv over 2 ranks) and replicated (2 q / 1 kv).
        "llama": make_spec("llama", f32),
        "mistral": make_spec("mistral", f32),
        # QK-norm (ATTN finishes the heads) and QKV bias.
        "qwen3": make_spec("qwen3", f32),
        "qwen2": make_spec("qwen2", f32),
        "qwen3_moe": spec_of("qwen3_moe", f32),
        # Grouped sigmoid routing and a shared expert, split like an expert.
        "deepseek_routing": deepseek_routing(f32),
        # Latent attention: heads split, the latent rows every rank's.
        "mla": mla_spec(f32),
    }


SPECS = _specs()


def rank_caches(caches, spec, tp: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The rank's own KV cache (a copy): its kv heads of every layer, or
    the whole latent cache."""
    if spec.mla is not None:
        return tuple(c.clone() for c in caches)
    nkv, n = spec.num_kv_heads, kv_heads_per_rank(spec.num_kv_heads, tp)
    first = rank * n if nkv >= tp else rank // (tp // nkv)
    return tuple(c[:, first : first + n].clone() for c in caches)


def run_rank_set(spec, tp: int, batch: int, seed: int = 0):
    """(one-rank output and caches, every rank's outputs and caches)."""
    weights = random_weights(spec, seed=1)
    one = ProgramInterpreter(plan(spec, batch, DEVICE), weights)
    inputs = random_decode_inputs(spec, batch, seed=7)
    ranks = [
        dataclasses.replace(
            inputs, kv_caches=rank_caches(inputs.kv_caches, spec, tp, r)
        )
        for r in range(tp)
    ]
    expected = one.step(inputs)
    rank_spec = shard_spec(spec, tp)
    program = plan(rank_spec, batch, DEVICE)
    verify(program)
    shards = [shard_weights(weights, spec, tp, r) for r in range(tp)]
    outs = RankSetInterpreter(program, shards, seed=seed).step(ranks)
    return (expected, inputs.kv_caches), (outs, [x.kv_caches for x in ranks])


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("batch", [1, 3])
def test_ranks_together_equal_the_one_rank_program(name, batch):
    spec = SPECS[name]
    (expected, caches), (outs, ranks_caches) = run_rank_set(spec, 2, batch)
    assert not expected.isnan().any() and expected.abs().max() < 8
    for out in outs:
        # Every rank holds the same hidden states (the sum in rank order).
        assert torch.equal(out, outs[0])
        torch.testing.assert_close(out, expected, rtol=0, atol=FP32_TOL)
    # Each rank appended its own heads' new K/V (a latent row: every rank
    # the whole row) at the same slots.
    for r, per_layer in enumerate(ranks_caches):
        want = rank_caches(caches, spec, 2, r)
        for got, w in zip(per_layer, want, strict=True):
            torch.testing.assert_close(got, w, rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_four_ranks_and_replicated_kv_heads(tp):
    # llama at 4 ranks: 1 q head each, its 2 kv heads held by two ranks each.
    (expected, _), (outs, _) = run_rank_set(SPECS["llama"], tp, 2)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=FP32_TOL)


def test_rank_interleavings_agree_bitwise():
    spec = SPECS["qwen3_moe"]
    _, (first, _) = run_rank_set(spec, 2, 3, seed=0)
    for seed in (1, 2):
        _, (outs, _) = run_rank_set(spec, 2, 3, seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(outs, first, strict=True))


def test_program_all_reduces_each_residual_block():
    spec = shard_spec(SPECS["qwen3_moe"], 2)
    program = plan(spec, 2, DEVICE)
    reduces = [i for q in program.queues for i in q if i.op == Op.ALL_REDUCE]
    points = {(i.layer, i.arg0) for i in reduces}
    # The embedding, then each layer's attention and MLP.
    assert points == {(0, 0)} | {
        (ly, p) for ly in range(spec.num_layers) for p in (1, 2)
    }
    # Every partial signals every rank; nothing else does.
    partial_ops = {Op.EMBED, Op.O_PROJ, Op.DOWN, Op.EXPERT_DOWN}
    for q in program.queues:
        for i in q:
            assert i.signal_ranks == (i.op in partial_ops), i
    # One rank's program has none.
    one = plan(SPECS["qwen3_moe"], 2, DEVICE)
    assert not any(
        i.op == Op.ALL_REDUCE or i.signal_ranks for q in one.queues for i in q
    )


def _mutated(program, change):
    """``program`` with the first ALL_REDUCE of layer 1's MLP changed."""
    queues = [list(q) for q in program.queues]
    for q in queues:
        for k, i in enumerate(q):
            if i.op == Op.ALL_REDUCE and i.layer == 1 and i.arg0 == 2:
                q[k] = change(i)
                return dataclasses.replace(program, queues=tuple(map(tuple, queues)))
    raise AssertionError("no such ALL_REDUCE")


def test_a_missing_all_reduce_wait_fails_the_verifier():
    program = plan(shard_spec(SPECS["llama"], 2), 2, DEVICE)
    verify(program)
    no_wait = _mutated(program, lambda i: dataclasses.replace(
        i, wait_counter=NO_COUNTER, wait_count=0))  # fmt: skip
    with pytest.raises(VerificationError, match=r"reads partial\.mlp@\d.*before rank"):
        verify(no_wait)


def test_a_wait_for_one_ranks_partials_fails_the_verifier():
    program = plan(shard_spec(SPECS["llama"], 2), 2, DEVICE)
    short = _mutated(program, lambda i: dataclasses.replace(
        i, wait_count=i.wait_count // 2))  # fmt: skip
    with pytest.raises(VerificationError, match="waits for .* signals"):
        verify(short)


def test_a_partial_signalled_to_its_own_rank_only_hangs_not_passes():
    program = plan(shard_spec(SPECS["llama"], 2), 2, DEVICE)
    queues = [
        tuple(dataclasses.replace(i, signal_ranks=False)
              if i.op == Op.DOWN and i.layer == 0 else i for i in q)
        for q in program.queues
    ]  # fmt: skip
    local = dataclasses.replace(program, queues=tuple(queues))
    with pytest.raises(VerificationError):
        verify(local)
    spec = local.spec
    weights = random_weights(SPECS["llama"], seed=1)
    shards = [shard_weights(weights, SPECS["llama"], 2, r) for r in range(2)]
    inputs = random_decode_inputs(spec, 2, seed=7)
    with pytest.raises(DeadlockError):
        RankSetInterpreter(local, shards).step([inputs, inputs])


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_q_heads", 6, "6 attention heads"),
        ("num_kv_heads", 3, "3 kv heads"),
        ("intermediate_size", 510, "intermediate size of 510"),
    ],
)
def test_shapes_that_do_not_split_are_refused_by_name(field, value, named):
    spec = dataclasses.replace(SPECS["llama"], **{field: value})
    if field == "num_kv_heads":
        spec = dataclasses.replace(spec, num_q_heads=12)
    with pytest.raises(UnsupportedModelError, match=f"{named} do not split over 4"):
        shard_spec(spec, 4)


def test_rank_spec_is_vllms_shard():
    spec = shard_spec(SPECS["deepseek_routing"], 2)
    full = SPECS["deepseek_routing"]
    assert (spec.num_q_heads, spec.num_kv_heads) == (full.num_q_heads // 2, 1)
    assert spec.moe.expert_intermediate == full.moe.expert_intermediate // 2
    assert spec.moe.shared_intermediate == full.moe.shared_intermediate // 2
    assert spec.moe.num_experts == full.moe.num_experts  # split by width, not experts
    mla = shard_spec(SPECS["mla"], 2)
    assert mla.mla.num_heads == 2 and mla.num_kv_heads == 1
    assert mla.mla.kv_lora_rank == SPECS["mla"].mla.kv_lora_rank
