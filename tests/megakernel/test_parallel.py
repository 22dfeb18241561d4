# SPDX-License-Identifier: Apache-2.0
"""Parallel programs (parallel.py): tensor-parallel ranks (isa.py's
ALL_REDUCE) run together in one process, and pipeline stages run one after
the other, equal the one-rank program; the verifier proves the rank set and
catches a missing or short wait."""

import dataclasses
import json

import pytest
import torch
from vllm.distributed.utils import get_pp_indices

from tests.megakernel.test_interpret import make_spec
from tests.megakernel.test_mla_program import mla_spec
from tests.megakernel.test_moe_program import deepseek_routing, spec_of
from vllm_ext.megakernel.cost import DEVICES, predict
from vllm_ext.megakernel.interpret import (
    DeadlockError,
    ProgramInterpreter,
    RankSetInterpreter,
)
from vllm_ext.megakernel.isa import NO_COUNTER, Op
from vllm_ext.megakernel.plan import load_spec
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import VerificationError, verify
from vllm_ext.model_spec import UnsupportedModelError
from vllm_ext.parallel import rank_caches, shard_spec, shard_weights, stage_spec
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


def per_rank(inputs, spec, tp: int) -> list:
    """Each rank's inputs: its own copy of its part of the caches."""
    return [
        dataclasses.replace(
            inputs, kv_caches=rank_caches(inputs.kv_caches, spec, tp, r)
        )
        for r in range(tp)
    ]


def run_rank_set(spec, tp: int, batch: int, seed: int = 0):
    """(one-rank output and caches, every rank's outputs and caches)."""
    weights = random_weights(spec, seed=1)
    one = ProgramInterpreter(plan(spec, batch, DEVICE), weights)
    inputs = random_decode_inputs(spec, batch, seed=7)
    ranks = per_rank(inputs, spec, tp)
    expected = one.step(inputs)
    rank_spec = shard_spec(spec, tp)
    program = plan(rank_spec, batch, DEVICE)
    verify(program)
    shards = [shard_weights(weights, spec, tp, r) for r in range(tp)]
    outs = RankSetInterpreter(program, shards, seed=seed).step(ranks)
    return (expected, inputs.kv_caches), (outs, [x.kv_caches for x in ranks])


def test_each_rank_computes_its_rows_of_the_logits():
    # The LM head is vocab-parallel (vLLM gathers the logits): a rank's
    # program computes its rows, padded as vLLM pads them.
    spec, tp, batch = SPECS["llama"], 2, 2
    weights = random_weights(spec, seed=1)
    one = ProgramInterpreter(plan(spec, batch, DEVICE, with_lm_head=True), weights)
    one.step(random_decode_inputs(spec, batch, seed=7))
    inputs = random_decode_inputs(spec, batch, seed=7)
    program = plan(shard_spec(spec, tp), batch, DEVICE, with_lm_head=True)
    shards = [shard_weights(weights, spec, tp, r) for r in range(tp)]
    rank_set = RankSetInterpreter(program, shards)
    rank_set.step(per_rank(inputs, spec, tp))
    logits = torch.cat([r.logits for r in rank_set.ranks], dim=1)
    assert logits.shape[1] == tp * program.spec.lm_head_rows >= spec.vocab_size
    torch.testing.assert_close(
        logits[:, : spec.vocab_size], one.logits, rtol=0, atol=FP32_TOL
    )


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


def run_stages(spec, pp: int, batch: int, tp: int = 1):
    """(one-rank output, the last stage's outputs): each stage's program
    (of every tensor-parallel rank) on its layers, the next starting from
    the previous stage's residual stream."""
    weights = random_weights(spec, seed=1)
    inputs = random_decode_inputs(spec, batch, seed=7)
    expected = ProgramInterpreter(plan(spec, batch, DEVICE), weights).step(inputs)
    hidden = None
    inputs = random_decode_inputs(spec, batch, seed=7)  # fresh caches
    for stage in range(pp):
        stage_spec_ = stage_spec(shard_spec(spec, tp), stage, pp)
        start, end = get_pp_indices(spec.num_layers, stage, pp)
        program = plan(stage_spec_, batch, DEVICE)
        verify(program)
        layers = dataclasses.replace(weights, layers=weights.layers[start:end])
        stage_in = dataclasses.replace(
            inputs, kv_caches=inputs.kv_caches[start:end], hidden_in=hidden
        )
        shards = [shard_weights(layers, spec, tp, r) for r in range(tp)]
        ranks = per_rank(stage_in, spec, tp)
        outs = RankSetInterpreter(program, shards).step(ranks)
        hidden = outs[0]
    return expected, outs


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "mla"])
def test_pipeline_stages_equal_the_one_rank_program(name):
    # Two stages of one layer each: the same instructions on the same data,
    # split at a layer boundary: the same bits.
    expected, (out,) = run_stages(SPECS[name], 2, 3)
    assert torch.equal(out, expected)


def test_pipeline_and_tensor_parallel_together():
    expected, outs = run_stages(SPECS["qwen3_moe"], 2, 3, tp=2)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=FP32_TOL)


def test_a_later_stage_has_no_embedding_nor_final_norm():
    spec = SPECS["llama"]
    first, last = (stage_spec(spec, r, 2) for r in range(2))
    ops = [{i.op for q in plan(s, 1, DEVICE).queues for i in q} for s in (first, last)]
    assert Op.EMBED in ops[0] and Op.FINAL_NORM not in ops[0]
    assert Op.EMBED not in ops[1] and Op.FINAL_NORM in ops[1]
    # The later stage reads h[0] as its input: no writer needed.
    verify(plan(last, 1, DEVICE))
    with pytest.raises(UnsupportedModelError, match="leave stage 2 none"):
        stage_spec(spec, 2, 3)


def test_plan_cli_plans_one_rank(capsys):
    from vllm_ext.megakernel.plan import main

    assert main(["--config", "llama-3.2-1b", "--batch", "1", "--tp", "2",
                 "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    spec = load_spec("llama-3.2-1b", torch.bfloat16)
    one = plan(spec, 1, DEVICES["h200"], with_lm_head=True)
    assert result["tp"] == 2 and result["verified"]
    # A rank reads about half the weights (the norms whole, the LM head's
    # padded half, the embedding's rows never: only the batch's rows).
    assert result["weight_bytes"] < 0.6 * one.weight_bytes()
    # 32 q heads, 8 kv heads: 3 ranks do not split them.
    assert main(["--config", "llama-3.2-1b", "--batch", "1", "--tp", "3"]) == 2
    assert "do not split over 3" in capsys.readouterr().err


def test_the_cost_model_counts_the_links():
    program = plan(shard_spec(load_spec("llama-3.2-1b", torch.bfloat16), 8), 1,
                   DEVICES["h200"])  # fmt: skip
    reduce = next(i for q in program.queues for i in q if i.op == Op.ALL_REDUCE)
    cost = program.cost(reduce)
    assert cost.link_bytes == 7 * cost.other_bytes // 3  # 7 peers' partials
    free = dataclasses.replace(DEVICES["h200"], link_bytes_per_s=1e18,
                               peer_latency_s=0.0)  # fmt: skip
    assert predict(program).step_s > predict(program, free).step_s
