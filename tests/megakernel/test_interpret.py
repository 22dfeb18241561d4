# SPDX-License-Identifier: Apache-2.0
"""The program interpreter: same result under every interleaving, bit for
bit; the plain PyTorch forward's result; counters that survive steps."""

import dataclasses

import pytest
import torch

from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import (
    DeadlockError,
    ProgramExecutor,
    ProgramInterpreter,
)
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.planner import (
    batch_buckets,
    combine_parts_to_fill,
    plan,
    qkv_group_tiles,
    qkv_parts_to_fill,
)
from vllm_ext.model_spec import ModelSpec
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import random_decode_inputs, random_verify_inputs, random_weights

# The demo architectures' features (MHA + bias, GQA + QK norm, head dims).
SPECS = {
    "llama": dict(num_q_heads=4, num_kv_heads=2, head_dim=64),
    "mistral": dict(num_q_heads=2, num_kv_heads=1, head_dim=128),
    "qwen2": dict(num_q_heads=4, num_kv_heads=4, head_dim=64, qkv_bias=True),
    "qwen3": dict(num_q_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True),
}
# Split-KV attention sums in another order than the plain forward: fp32
# agrees to rounding; bf16 to one rounding step of |x| < 8 (0.0625).
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.0625}


def make_spec(arch: str, dtype) -> ModelSpec:
    base = dict(
        architecture=arch, dtype=dtype, vocab_size=1024, hidden_size=256,
        intermediate_size=512, num_layers=2, rms_norm_eps=1e-6, qkv_bias=False,
        qk_norm=False, tie_word_embeddings=True,
    )  # fmt: skip
    return ModelSpec(**{**base, **SPECS[arch]})


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5])
def test_interleavings_agree_bitwise_and_match_reference(arch, dtype, batch):
    spec = make_spec(arch, dtype)
    weights = random_weights(spec, seed=1)
    device = dataclasses.replace(DEVICES["h200"], num_sms=16)
    program = plan(spec, batch, device, with_lm_head=True)

    outs, logits, caches = [], [], []
    for seed in range(3):
        inputs = random_decode_inputs(spec, batch, seed=7)
        interp = ProgramInterpreter(program, weights, seed=seed)
        outs.append(interp.step(inputs))
        logits.append(interp.logits)
        caches.append(inputs.kv_caches)
    for o, lg, kv in zip(outs[1:], logits[1:], caches[1:], strict=True):
        assert torch.equal(o, outs[0]) and torch.equal(lg, logits[0])
        assert all(torch.equal(a, b) for a, b in zip(kv, caches[0], strict=True))

    ref_inputs = random_decode_inputs(spec, batch, seed=7)
    expected = ReferenceExecutor(spec, weights).step(ref_inputs)
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], expected, rtol=0, atol=TOL[dtype])
    # The new K/V went to the same slots, with the same values.
    for got, want in zip(caches[0], ref_inputs.kv_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL[dtype])
    # fp32 logits over the final norm's output.
    lm = outs[0].float() @ weights.lm_head.float().t()
    torch.testing.assert_close(logits[0], lm, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_verify_step_is_its_tokens_decoded_one_at_a_time(arch):
    """A speculative verify step (rows of a request at consecutive
    positions, each causal over what the step writes) through the program
    gives, row for row, what the plain forward gives decoding the same
    tokens one step at a time, and leaves the same cache."""
    spec = make_spec(arch, torch.float32)
    weights = random_weights(spec, seed=1)
    device = dataclasses.replace(DEVICES["h200"], num_sms=16)
    rows, tokens = 5, 3  # requests of 3 and 2 rows
    program = plan(spec, rows, device, with_lm_head=True)
    verify = random_verify_inputs(spec, rows, tokens, seed=3)
    assert verify.block_table[0].equal(verify.block_table[2])
    assert verify.positions[:3].diff().eq(1).all()
    out = ProgramInterpreter(program, weights, seed=0).step(verify)

    one = random_verify_inputs(spec, rows, tokens, seed=3)  # fresh caches
    ref = ReferenceExecutor(spec, weights)
    first = torch.tensor([0, 0, 0, 3, 3])  # each row's request's first row
    expected = torch.empty_like(out)
    for j in range(tokens):
        (idx,) = (torch.arange(rows) - first == j).nonzero(as_tuple=True)
        step = dataclasses.replace(
            one, **{f: getattr(one, f)[idx] for f in
                    ("input_ids", "positions", "block_table", "seq_lens",
                     "slot_mapping")},
        )  # fmt: skip
        expected[idx] = ref.step(step)
    torch.testing.assert_close(out, expected, rtol=0, atol=TOL[torch.float32])
    for got, want in zip(verify.kv_caches, one.kv_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL[torch.float32])


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize("batch", [1, 5])
def test_head_and_dim_parts_give_the_whole_heads_bits(arch, batch):
    """QKV over head parts with COMBINE over dim parts (the planner's
    default): under any interleaving, and on the second step (counters at
    twice their counts), the results are bit for bit the program of whole
    heads' (a QKV unit per head, a COMBINE per q head)."""
    spec = make_spec(arch, torch.float32)
    weights = random_weights(spec, seed=1)
    device = dataclasses.replace(DEVICES["h200"], num_sms=16)
    parts = qkv_parts_to_fill(spec, 64)
    assert parts > 1
    plain = plan(spec, batch, device, with_lm_head=True, qkv_parts=1,
                 combine_parts=1)  # fmt: skip
    other = plan(spec, batch, device, with_lm_head=True, qkv_parts=parts)
    ops = [i.op for q in other.queues for i in q]
    # QKV tiles: whole kv groups' units, at most one per SM (planner.py).
    tiles = sum(len(t) for t in qkv_group_tiles(spec, parts, 16))
    assert ops.count(Op.QKV) == tiles * spec.num_layers
    heads = spec.num_q_heads + 2 * spec.num_kv_heads
    assert tiles == min(heads * parts, 16) or heads * parts > 16
    # COMBINE: a tile per q head in the plain program, per dim part in the
    # other.
    merges = spec.num_layers * spec.num_q_heads
    assert other.combine_parts == combine_parts_to_fill(spec, 16) > 1
    assert ops.count(Op.COMBINE) == merges * other.combine_parts
    assert len(ops) == plain.num_instructions - merges + ops.count(Op.COMBINE) + (
        ops.count(Op.QKV) - min(heads, 16) * spec.num_layers)  # fmt: skip

    def run(program, seed):
        interp = ProgramInterpreter(program, weights, seed=seed)
        got = []
        for step in range(2):
            inputs = random_decode_inputs(spec, batch, seed=7 + step)
            got.append((interp.step(inputs).clone(), interp.logits.clone(),
                        inputs.kv_caches))  # fmt: skip
        return got

    want = run(plain, 0)
    for seed in (1, 2):
        for (o, lg, kv), (wo, wlg, wkv) in zip(run(other, seed), want, strict=True):
            assert torch.equal(o, wo) and torch.equal(lg, wlg)
            assert all(torch.equal(a, b) for a, b in zip(kv, wkv, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_group_attends_before_other_groups_qkv_with_the_same_bits(arch):
    """Each kv group's ATTN waits for its own QKV tiles only (planner.py), so
    some interleavings run a group's attention while another group's QKV
    tiles are still to run (never, were the dependency the whole phase);
    the results are bit for bit the same under every interleaving."""
    spec = make_spec(arch, torch.float32)
    weights = random_weights(spec, seed=1)
    device = dataclasses.replace(DEVICES["h200"], num_sms=16)
    program = plan(spec, 2, device, with_lm_head=True)

    def inputs():
        return random_decode_inputs(spec, 2, seed=7)

    want = ProgramInterpreter(program, weights, seed=0).step(inputs())

    def group_of(i) -> int:
        """The kv group of a QKV tile (the planner keeps one per tile)."""
        head, nq = i.arg0, spec.num_q_heads
        return head // (nq // spec.num_kv_heads) if head < nq else (
            (head - nq) % spec.num_kv_heads)  # fmt: skip

    class Recording(ProgramInterpreter):
        def _execute(self, i) -> None:
            self.ran.append(i)
            super()._execute(i)

    early = 0
    for seed in range(8):
        interp = Recording(program, weights, seed=seed)
        interp.ran = ran = []
        assert torch.equal(interp.step(inputs()), want)
        for k, i in enumerate(ran):
            if i.op == Op.ATTN:
                early += any(
                    j.op == Op.QKV and j.layer == i.layer and group_of(j) != i.arg0
                    for j in ran[k + 1 :]
                )
    assert early > 0


def test_counters_need_no_reset_between_steps():
    spec = make_spec("qwen3", torch.float32)
    weights = random_weights(spec)
    program = plan(spec, 4, dataclasses.replace(DEVICES["h200"], num_sms=16))
    interp = ProgramInterpreter(program, weights, seed=3)
    for step in range(3):
        got = interp.step(random_decode_inputs(spec, 4, seed=step))
        fresh = ProgramInterpreter(program, weights, seed=11)
        assert torch.equal(got, fresh.step(random_decode_inputs(spec, 4, seed=step)))
    assert interp.epoch == 3
    # Each counter holds epochs x signallers: monotone, never reset.
    signals = [0] * program.num_counters
    for q in program.queues:
        for instr in q:
            signals[instr.signal_counter] += 1
    assert interp.counters == [3 * n for n in signals]


def test_padded_rows_do_not_change_real_rows():
    spec = make_spec("llama", torch.float32)
    weights = random_weights(spec)
    executor = ProgramExecutor(
        spec,
        weights,
        dataclasses.replace(DEVICES["h200"], num_sms=16),
        batch_buckets(8),
    )
    got = executor.step(random_decode_inputs(spec, 3, seed=5))
    assert set(executor.interpreters) == {4}
    expected = ReferenceExecutor(spec, weights).step(
        random_decode_inputs(spec, 3, seed=5)
    )
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL[torch.float32])


def test_broken_program_is_caught_not_hung():
    spec = make_spec("llama", torch.float32)
    program = plan(spec, 1, dataclasses.replace(DEVICES["h200"], num_sms=4))
    broken = dataclasses.replace(
        program, queues=tuple(tuple(reversed(q)) for q in program.queues)
    )
    interp = ProgramInterpreter(broken, random_weights(spec))
    with pytest.raises(DeadlockError, match="no SM can proceed"):
        interp.step(random_decode_inputs(spec, 1))
