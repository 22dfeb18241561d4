# SPDX-License-Identifier: Apache-2.0
"""Mutation tests: the verifier rejects broken programs, with the reason."""

import dataclasses

import pytest
import torch

from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.isa import NO_COUNTER, Op, unpack_cols
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import VerificationError, verify
from vllm_ext.model_spec import ModelSpec

SPEC = ModelSpec(
    architecture="Qwen3ForCausalLM", dtype=torch.bfloat16, vocab_size=1024,
    hidden_size=256, intermediate_size=512, num_layers=2, num_q_heads=4,
    num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, qkv_bias=False,
    qk_norm=True, tie_word_embeddings=True,
)  # fmt: skip
DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=8)


@pytest.fixture
def program():
    p = plan(SPEC, 4, DEVICE, with_lm_head=True)
    verify(p)  # the unmodified program is fine
    return p


def mutate(program, sm: int, queue) -> object:
    queues = list(program.queues)
    queues[sm] = tuple(queue)
    return dataclasses.replace(program, queues=tuple(queues))


def find(program, op: Op, nth: int = 0) -> tuple[int, int]:
    hits = [
        (sm, i)
        for sm, q in enumerate(program.queues)
        for i, instr in enumerate(q)
        if instr.op == op
    ]
    return hits[nth]


def replace_instr(program, where, **changes):
    sm, i = where
    q = list(program.queues[sm])
    q[i] = dataclasses.replace(q[i], **changes)
    return mutate(program, sm, q)


def test_missing_signal(program):
    bad = replace_instr(program, find(program, Op.O_PROJ, 3), signal_counter=NO_COUNTER)
    with pytest.raises(VerificationError, match="waits for .* but .* signal it"):
        verify(bad)


@pytest.mark.parametrize("delta", [1, -1])
def test_wait_on_wrong_value(program, delta):
    where = find(program, Op.GATE_UP, 2)
    instr = program.queues[where[0]][where[1]]
    bad = replace_instr(program, where, wait_count=instr.wait_count + delta)
    with pytest.raises(VerificationError, match="waits for"):
        verify(bad)


def test_order_swapped_within_a_queue_deadlocks(program):
    # Put an instruction before one it (transitively) depends on, same SM.
    for sm, q in enumerate(program.queues):
        for i in range(len(q) - 1):
            if q[i].op == Op.O_PROJ and q[i + 1].op == Op.GATE_UP:
                swapped = [*q[:i], q[i + 1], q[i], *q[i + 2 :]]
                with pytest.raises(VerificationError, match="deadlock"):
                    verify(mutate(program, sm, swapped))
                return
    pytest.fail("no O_PROJ followed by GATE_UP on one SM")


def test_two_sms_order_swapped_deadlocks(program):
    # Each SM's queue reversed: the first instruction of each waits on a
    # counter that only instructions behind it (on every SM) signal.
    queues = tuple(tuple(reversed(q)) for q in program.queues)
    with pytest.raises(VerificationError, match="deadlock"):
        verify(dataclasses.replace(program, queues=queues))


def test_wait_on_the_wrong_phase_is_a_race(program):
    # GATE_UP waiting for QKV instead of O_PROJ: counts match, no deadlock,
    # but it would read hmid before O_PROJ wrote it.
    qkv = program.queues[find(program, Op.QKV)[0]][find(program, Op.QKV)[1]]
    gate_up = find(program, Op.GATE_UP, 0)
    bad = replace_instr(
        program,
        gate_up,
        wait_counter=qkv.signal_counter,
        wait_count=sum(
            1
            for q in program.queues
            for i in q
            if i.signal_counter == qkv.signal_counter
        ),
    )
    with pytest.raises(VerificationError, match="reads hmid.*before"):
        verify(bad)


def test_read_before_its_writer_in_the_same_queue_is_a_race():
    # One SM: GATE_UP, its wait dropped, moved ahead of the last O_PROJ of
    # its layer. Counting and progress still hold; queue order alone says
    # that the O_PROJ tile it reads has not run yet.
    p = plan(SPEC, 1, dataclasses.replace(DEVICE, num_sms=1), with_lm_head=True)
    verify(p)
    (q,) = p.queues
    gate_up = next(i for i, instr in enumerate(q) if instr.op == Op.GATE_UP)
    last_o = max(
        i for i, instr in enumerate(q[:gate_up]) if instr.op == Op.O_PROJ
    )  # fmt: skip
    moved = dataclasses.replace(q[gate_up], wait_counter=NO_COUNTER, wait_count=0)
    rest = [instr for i, instr in enumerate(q) if i != gate_up]
    bad = mutate(p, 0, [*rest[:last_o], moved, *rest[last_o:]])
    with pytest.raises(VerificationError, match="reads hmid.*before SM 0"):
        verify(bad)


def test_double_write(program):
    # Layer 0's first DOWN tile: 16 more columns are its neighbour's.
    where = min(
        ((sm, i) for sm, i, instr in program.in_global_order()
         if instr.op == Op.DOWN and instr.layer == 0),
        key=lambda w: program.queues[w[0]][w[1]].arg0,
    )  # fmt: skip
    instr = program.queues[where[0]][where[1]]
    bad = replace_instr(program, where, arg1=instr.arg1 + 16)
    with pytest.raises(VerificationError, match="written twice"):
        verify(bad)


@pytest.mark.parametrize(
    "heads, error",
    [((0, 2), "written twice"), ((1, 1), "no instruction writes"),
     ((0, 5), "beyond kv head 0's 4")],
)  # fmt: skip
def test_combine_heads_written_twice_or_not_at_all(program, heads, error):
    """COMBINE runs a tile per unit, a q head's dim part (isa.pack_cols):
    one that takes its neighbour's unit too, none, or units past its kv
    head's, is caught."""
    assert program.combine_parts == 2
    where = next(
        (sm, i) for sm, i, instr in program.in_global_order()
        if instr.op == Op.COMBINE and unpack_cols(instr.arg1) == (0, 1)
    )  # fmt: skip
    lo, hi = heads
    arg1 = lo << 16 | hi  # (pack_cols refuses an empty range)
    with pytest.raises(VerificationError, match=error):
        verify(replace_instr(program, where, arg1=arg1))


def test_unwritten_read(program):
    where = find(program, Op.DOWN, 1)
    instr = program.queues[where[0]][where[1]]
    bad = replace_instr(program, where, arg1=instr.arg1 - 8)
    with pytest.raises(VerificationError, match="no instruction writes"):
        verify(bad)


# ------------------------------------------------- ATTN -> COMBINE -> O_PROJ


def chunks_of(program, layer: int, head: int) -> list[tuple[int, int]]:
    return [
        (sm, i)
        for sm, q in enumerate(program.queues)
        for i, instr in enumerate(q)
        if instr.op == Op.ATTN and (instr.layer, instr.arg0) == (layer, head)
    ]


def replace_all(program, where, **changes):
    for w in where:
        program = replace_instr(program, w, **changes)
    return program


def test_o_proj_waiting_for_attention_not_the_merges_is_a_race(program):
    # O_PROJ waiting for one head's chunks instead of every COMBINE unit:
    # the counts match for that counter, but attn is read before written.
    sm, i = chunks_of(program, 0, 0)[0]
    attn = program.queues[sm][i]
    where = find(program, Op.O_PROJ, 0)
    bad = replace_instr(program, where, wait_counter=attn.signal_counter,
                        wait_count=program.attn_chunks)  # fmt: skip
    with pytest.raises(VerificationError, match="reads attn.*before"):
        verify(bad)


# ------------------------------------------------- QKV over head parts


def test_head_parts_verify_and_a_part_written_twice_is_caught():
    spec = dataclasses.replace(SPEC, architecture="LlamaForCausalLM", qk_norm=False)
    split = plan(spec, 4, DEVICE, with_lm_head=True, qkv_parts=2)
    verify(split)
    where = next(
        (sm, i)
        for sm, q in enumerate(split.queues)
        for i, ins in enumerate(q)
        if ins.op == Op.QKV and ins.arg0 == 0
    )
    instr = split.queues[where[0]][where[1]]
    with pytest.raises(VerificationError, match="written twice"):
        verify(replace_instr(split, where, arg1=instr.arg1 + 1))


# ------------------------------------------------- QKV -> ATTN per kv group


def attn_of(program, layer: int, group: int) -> list[tuple[int, int]]:
    return [
        (sm, i)
        for sm, q in enumerate(program.queues)
        for i, instr in enumerate(q)
        if instr.op == Op.ATTN and (instr.layer, instr.arg0) == (layer, group)
    ]


def at(program, where):
    return program.queues[where[0]][where[1]]


def test_attn_waiting_for_another_groups_qkv_is_a_race(program):
    # Group 1's chunks waiting for group 0's QKV tiles: as many as group
    # 1's, so the counts match and nothing deadlocks, but group 1's q, k
    # and v are read before their tiles are known to have run.
    other = at(program, attn_of(program, 0, 0)[0])
    bad = replace_all(program, attn_of(program, 0, 1),
                      wait_counter=other.wait_counter,
                      wait_count=other.wait_count)  # fmt: skip
    with pytest.raises(VerificationError, match=r"reads [qkv]\[layer 0\].*before"):
        verify(bad)


def test_qkv_tile_signalling_another_groups_counter_is_caught(program):
    # A tile of group 0 signals group 1's counter: group 0's chunks wait for
    # one signal more than its counter gets. With both counts made to
    # match, group 0's chunks read that tile's heads unordered.
    g0, g1 = (at(program, attn_of(program, 0, g)[0]) for g in (0, 1))
    tile = next(
        (sm, i)
        for sm, q in enumerate(program.queues)
        for i, instr in enumerate(q)
        if instr.op == Op.QKV and instr.signal_counter == g0.wait_counter
    )
    moved = replace_instr(program, tile, signal_counter=g1.wait_counter)
    with pytest.raises(VerificationError, match="waits for .* but .* signal it"):
        verify(moved)
    bad = replace_all(moved, attn_of(program, 0, 0), wait_count=g0.wait_count - 1)
    bad = replace_all(bad, attn_of(program, 0, 1), wait_count=g1.wait_count + 1)
    with pytest.raises(VerificationError, match=r"reads [qkv]\[layer 0\].*before"):
        verify(bad)
