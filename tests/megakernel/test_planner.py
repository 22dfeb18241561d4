# SPDX-License-Identifier: Apache-2.0
"""The planner on real model shapes: fast, verified, balanced, costed."""

import dataclasses
import math

import pytest
import torch

from vllm_ext import configs
from vllm_ext.megakernel.calibrate import probe
from vllm_ext.megakernel.cost import DEVICES, predict
from vllm_ext.megakernel.isa import Op, decode
from vllm_ext.megakernel.planner import (
    batch_buckets,
    plan,
    qkv_group_tiles,
    qkv_parts_to_fill,
    split,
    split_within,
)
from vllm_ext.megakernel.verify import verify
from vllm_ext.model_spec import ModelSpec

REAL = ["llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "mistral-7b-v0.3"]
BUCKETS = batch_buckets(64)


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(configs.hf_config(name), torch.bfloat16, 4096)


def test_buckets():
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(100) == BUCKETS and batch_buckets(1) == (1,)


@pytest.mark.parametrize(
    "n, parts, multiple", [(2048, 132, 16), (100, 7, 16), (5, 9, 1)]
)
def test_split_covers_exactly(n, parts, multiple):
    ranges = split(n, parts, multiple)
    assert ranges[0][0] == 0 and ranges[-1][1] == n and len(ranges) <= parts
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        assert hi == lo
    assert all(lo % multiple == 0 for lo, _ in ranges)


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("batch", BUCKETS)
def test_plans_in_global_order(name, batch):
    # (No wall-clock bound here: a timed unit test flakes on a loaded CI
    # machine; the plan CLI reports plan_s.)
    program = plan(spec_of(name), batch, DEVICES["h200"], with_lm_head=True)
    # Every queue is a subsequence of the global order: (sm, idx) pairs of one
    # SM appear in increasing idx.
    seen = [-1] * len(program.queues)
    for sm, idx in program.order:
        assert idx == seen[sm] + 1
        seen[sm] = idx
    assert [len(q) for q in program.queues] == [s + 1 for s in seen]
    # The encoding the kernel reads round-trips.
    table, lengths = program.encode()
    assert decode(table, lengths) == [list(q) for q in program.queues]


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("batch", [1, 16, 64])  # (tiles do not depend on it)
def test_real_programs_verify(name, batch):
    program = plan(spec_of(name), batch, DEVICES["h200"], with_lm_head=True)
    report = verify(program)
    assert report.num_instructions == program.num_instructions


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_qkv_head_parts_spread_qkv_and_verify(name):
    """Head parts (the planner's default) double the Llama shapes' 48 QKV
    tiles; the model predicts a shorter step than whole heads (the QKV phase
    no longer runs on 48 of 132 SMs)."""
    spec = spec_of(name)
    parts = qkv_parts_to_fill(spec, DEVICES["h200"].num_sms)
    assert parts == 2
    plain = plan(spec, 1, DEVICES["h200"], with_lm_head=True, qkv_parts=1)
    split = plan(spec, 1, DEVICES["h200"], with_lm_head=True)
    assert split.qkv_parts == parts
    verify(split)
    qkv = [i for q in split.queues for i in q if i.op == Op.QKV]
    assert len(qkv) == 96 * spec.num_layers
    # The same matrices; each extra tile reads the input norm's weight too.
    extra = 48 * spec.num_layers * spec.hidden_size * 2
    assert split.weight_bytes() - plain.weight_bytes() == extra
    assert predict(split).step_s < predict(plain).step_s


def test_qkv_parts_refused_where_heads_cannot_split():
    with pytest.raises(ValueError, match="power of two"):
        plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"], qkv_parts=3)
    with pytest.raises(ValueError, match="multiples of 16"):  # d = 64: 8 per half
        plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"], qkv_parts=4)
    # QK-norm splits too (ATTN finishes the heads: Program.qk_in_attn).
    qwen3 = plan(spec_of("qwen3-8b"), 1, DEVICES["h200"])
    assert qwen3.qkv_parts == 2 and qwen3.qk_in_attn
    # Heads that already fill the SMs stay whole, and QK-norm stays QKV's; a
    # latent attention has no QKV.
    wide = dataclasses.replace(spec_of("qwen3-8b"), num_q_heads=64)
    assert qkv_parts_to_fill(wide, 132) == 1
    assert not plan(wide, 1, DEVICES["h200"]).qk_in_attn
    assert qkv_parts_to_fill(spec_of("deepseek-v3"), 132) == 1


@pytest.mark.parametrize(
    "segments, parts, multiple",
    [([(0, 96), (96, 672)], 16, 16), ([(0, 4), (4, 5), (9, 10)], 132, 1),
     ([(0, 40), (40, 41), (41, 42), (60, 61)], 3, 1)],
)  # fmt: skip
def test_split_within_keeps_ranges_inside_their_segment(segments, parts, multiple):
    tiles = split_within(segments, parts, multiple)
    assert len(tiles) == len(segments)
    assert sum(len(t) for t in tiles) <= max(parts, len(segments))
    for (lo, hi), ranges in zip(segments, tiles, strict=True):
        assert ranges[0][0] == lo and ranges[-1][1] == hi
        for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
            assert end == start and (start - lo) % multiple == 0


def unit_group(spec: ModelSpec, parts: int, unit: int) -> int:
    """The kv group a QKV unit (isa.py) belongs to."""
    head, nq, nkv = unit // parts, spec.num_q_heads, spec.num_kv_heads
    return head // (nq // nkv) if head < nq else (head - nq) % nkv


@pytest.mark.parametrize("name", [*REAL, "qwen3-30b-a3b", "mixtral-8x7b",
                                  "qwen2.5-0.5b"])  # fmt: skip
@pytest.mark.parametrize("num_sms", [132, 16, 5])
def test_qkv_tiles_lie_within_one_kv_group(name, num_sms):
    """Each tile covers units of one kv group; together they cover every
    unit once; at most one tile per SM (the groups' three segments
    allowing), one per unit where the units are fewer than the SMs."""
    spec = spec_of(name)
    for parts in sorted({1, qkv_parts_to_fill(spec, num_sms)}):
        tiles = qkv_group_tiles(spec, parts, num_sms)
        assert len(tiles) == spec.num_kv_heads
        covered = []
        for g, ranges in enumerate(tiles):
            for lo, hi in ranges:
                assert {unit_group(spec, parts, u) for u in range(lo, hi)} == {g}
                covered += range(lo, hi)
        units = (spec.num_q_heads + 2 * spec.num_kv_heads) * parts
        assert sorted(covered) == list(range(units))
        count = sum(len(t) for t in tiles)
        assert count <= max(num_sms, 3 * spec.num_kv_heads)
        if units <= num_sms:
            assert count == units


def qkv_signallers(program) -> dict[int, list]:
    by_counter: dict[int, list] = {}
    for _, _, i in program.in_global_order():
        if i.op == Op.QKV:
            by_counter.setdefault(i.signal_counter, []).append(i)
    return by_counter


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b"])
@pytest.mark.parametrize("parts", [1, 2])
def test_attn_waits_for_its_own_groups_qkv_only(name, parts):
    """ATTN(l, g) waits for a counter that exactly the QKV tiles of layer l
    holding kv group g's units signal, all of them."""
    spec = spec_of(name)
    parts = min(parts, qkv_parts_to_fill(spec, 132))
    program = plan(spec, 1, DEVICES["h200"], qkv_parts=parts)
    signallers = qkv_signallers(program)
    nq, nkv = spec.num_q_heads, spec.num_kv_heads
    per_group = (nq // nkv + 2) * parts
    for _, _, i in program.in_global_order():
        if i.op != Op.ATTN:
            continue
        tiles = signallers[i.wait_counter]
        assert i.wait_count == len(tiles)
        assert program.counter_names[i.wait_counter] == f"L{i.layer}.qkv.g{i.arg0}"
        units = [u for t in tiles for u in range(t.arg0, t.arg1)]
        assert all(t.layer == i.layer for t in tiles)
        assert len(units) == per_group
        assert {unit_group(spec, parts, u) for u in units} == {i.arg0}


def whole_phase_qkv(program):
    """``program`` with each layer's QKV tiles signalling one counter that
    every ATTN of the layer waits for: the dependency before kv groups had
    counters of their own (still a valid program)."""
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for _, _, i in program.in_global_order():
        if i.op == Op.QKV:
            first.setdefault(i.layer, i.signal_counter)
            count[i.layer] = count.get(i.layer, 0) + 1

    def coarse(i):
        if i.op == Op.QKV:
            return dataclasses.replace(i, signal_counter=first[i.layer])
        if i.op == Op.ATTN:
            return dataclasses.replace(i, wait_counter=first[i.layer],
                                       wait_count=count[i.layer])  # fmt: skip
        return i

    queues = tuple(tuple(coarse(i) for i in q) for q in program.queues)
    return dataclasses.replace(program, queues=queues)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_group_counters_never_lengthen_the_predicted_step(name):
    """By the cost model (docs/design.md, "Dependencies as fine as the
    data"): a group's attention no longer waits for the slowest QKV tile of
    every group, and the step is never longer for it. (Its gain has shrunk
    as the rest caught up: QKV's tiles one a SM under the placement caps,
    the past KV rows hinted before the wait, COMBINE a tile per q head (now
    per dim part); at
    batch 4 it is now 0.1% on Llama-3.1-8B and none on Qwen3-8B.)"""
    for batch in (1, 4):
        program = plan(spec_of(name), batch, DEVICES["h200"], with_lm_head=True)
        before = whole_phase_qkv(program)
        verify(before)
        assert predict(program).step_s <= predict(before).step_s


@pytest.mark.parametrize(
    "name, batch",
    [("llama-3.2-1b", 1), ("llama-3.2-1b", 16), ("qwen3-0.6b", 1), ("deepseek-v3", 1)],
)
def test_no_sm_takes_more_than_its_share(name, batch):
    """The placement caps: no SM holds more than its even share of a
    phase's tiles (told apart by what they wait for and signal), nor of an
    opcode's in a layer (every kv group's QKV tiles and ATTN chunks): not
    piled on the SMs that the last phases' bytes left light. A sparse
    layer's EXPERT_DOWN follows its routed EXPERT_UP instead."""
    from vllm_ext.megakernel.build import spec_or_exit

    spec = spec_or_exit("test", name, "bfloat16", batch)
    n_sm = DEVICES["h200"].num_sms
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
    phases: dict[tuple, list[int]] = {}
    ops: dict[tuple, list[int]] = {}
    for sm, q in enumerate(program.queues):
        for i in q:
            if i.op == Op.EXPERT_DOWN:
                continue
            phase = (i.op, i.layer, i.wait_counter, i.signal_counter)
            for key, at in ((phase, phases), ((i.op, i.layer), ops)):
                at.setdefault(key, [0] * n_sm)[sm] += 1
    for at in (phases, ops):
        for key, tiles in at.items():
            assert max(tiles) == math.ceil(sum(tiles) / n_sm), key


def test_default_program_reaches_the_floor_at_batch_1():
    """By the model at the H200's figures: the default 1B program within
    10% of the weight-read floor (0.85 of it before the placement caps)."""
    pred = predict(plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"],
                        with_lm_head=True))  # fmt: skip
    assert pred.step_s <= 1.1 * pred.floor_s


@pytest.mark.parametrize("device", ["h100", "h200", "b200"])
def test_weights_are_balanced_over_sms(device):
    pred = predict(plan(spec_of("llama-3.1-8b"), 1, DEVICES[device], with_lm_head=True))
    lo, hi = min(pred.sm_weight_bytes), max(pred.sm_weight_bytes)
    assert hi / lo < 1.1


def test_llama_1b_batch1_prediction_stays_within_15_percent_of_floor():
    """A regression guard on the model's prediction for the default program
    (QKV in head parts, COMBINE in dim parts), not a speed claim: the model
    missed its one GPU check by 2.1x (docs/predictions.md); the speed
    target is a GPU measurement's."""
    program = plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"], with_lm_head=True)
    pred = predict(program)
    # Floor: bf16 weights incl. the tied 128256 x 2048 LM head at 4.3 TB/s.
    assert 0.55e-3 < pred.floor_s < 0.60e-3
    assert pred.step_s <= 1.15 * pred.floor_s
    assert pred.critical_path_s < pred.step_s


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_the_chain_of_phase_boundaries_dominates_the_walk(name):
    """The all-NOP program: each SM walks its queue at the instruction
    overhead (the H200's figure: test_calibrate.py). With the waits kept the
    chain of phase boundaries adds the dependency latency per phase."""
    program = plan(spec_of(name), 1, DEVICES["h200"], with_lm_head=True)
    walk = predict(probe(program, keep=(), waits=False))
    assert walk.floor_s == 0
    longest = max(len(q) for q in program.queues)
    assert walk.step_s == pytest.approx(
        longest * DEVICES["h200"].instruction_overhead_s, rel=0.05
    )
    chained = predict(probe(program, keep=()))
    assert chained.step_s > 2 * walk.step_s


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_every_layer_phase_spreads_over_the_sms(name, batch):
    """Each opcode of a layer runs on at least 96 of the H200's 132 SMs at
    every bucket: QKV's head parts (48 whole heads would take 48), COMBINE's
    dim parts (32 q heads would take 32), the GEMVs' tiles and the
    attention chunks (128 each; a tile has 16-column multiples)."""
    program = plan(spec_of(name), batch, DEVICES["h200"], with_lm_head=True)
    sms: dict[Op, set[int]] = {}
    for sm, _, instr in program.in_global_order():
        if instr.layer == 1:
            sms.setdefault(instr.op, set()).add(sm)
    assert set(sms) == {Op.QKV, Op.ATTN, Op.COMBINE, Op.O_PROJ, Op.GATE_UP, Op.DOWN}
    assert min(len(s) for s in sms.values()) >= 96, {
        op.name: len(s) for op, s in sms.items()
    }
