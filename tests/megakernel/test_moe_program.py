# SPDX-License-Identifier: Apache-2.0
"""Mixtures of experts in the instruction program: planned, verified, and
interpreted bit for bit under every interleaving, matching the plain
forward (reference.moe_mlp); expert slots filled at run time; the kernel
refuses them until it has their device functions."""

import dataclasses

import pytest
import torch

from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import ProgramExecutor, ProgramInterpreter
from vllm_ext.megakernel.isa import Op, unpack_cols
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import VerificationError, verify
from vllm_ext.model_spec import ModelSpec
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import random_decode_inputs, random_weights

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=16)
# qwen3_moe: a dense layer, then 8 experts top 2; mixtral: 4 experts top 2.
ARCHS = ["qwen3_moe", "mixtral"]
# fp32: split-KV attention sums in another order than the plain forward.
# bf16: equal (on these models each fp32 difference stays under a rounding
# step; docs/design.md states it).
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.0}


def spec_of(arch: str, dtype) -> ModelSpec:
    return ModelSpec.from_hf_config(hf_config(arch), dtype, 512)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 4])
def test_interleavings_agree_bitwise_and_match_reference(arch, dtype, batch):
    spec = spec_of(arch, dtype)
    weights = random_weights(spec, seed=1)
    program = plan(spec, batch, DEVICE, with_lm_head=True)
    verify(program)
    outs = []
    for seed in range(3):
        interp = ProgramInterpreter(program, weights, seed=seed)
        outs.append(interp.step(random_decode_inputs(spec, batch, seed=7)))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    expected = ReferenceExecutor(spec, weights).step(
        random_decode_inputs(spec, batch, seed=7)
    )
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], expected, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("arch", ARCHS)
def test_slots_are_filled_at_run_time(arch):
    """Bucket 4 with 3 real requests (the fourth is padding, routed to no
    expert): the slots hold the distinct experts of the real rows,
    ascending, the rest empty; every output matches the plain forward."""
    spec = spec_of(arch, torch.float32)
    weights = random_weights(spec, seed=2)
    executor = ProgramExecutor(spec, weights, DEVICE, (4,), seed=3)
    inputs = random_decode_inputs(spec, 3, seed=11)
    got = executor.step(inputs)
    expected = ReferenceExecutor(spec, weights).step(
        random_decode_inputs(spec, 3, seed=11)
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL[torch.float32])
    interp = executor.interpreters[4]
    moe = spec.moe
    for layer, routing in enumerate(interp.routing):
        if not moe.sparse_layers[layer]:
            assert routing is None
            continue
        real = routing.slots[:3]
        assert routing.slots[3].eq(-1).all()  # the padding row
        chosen = routing.experts[real].unique()
        used = len(chosen)
        assert routing.experts[:used].tolist() == chosen.tolist()
        assert routing.experts[used:].eq(-1).all()
        assert interp.program.num_slots == min(4 * moe.top_k, moe.num_experts)


def test_expected_experts_and_weight_bytes():
    """A step reads the experts it routes to: the floor counts the expected
    distinct ones under uniform routing, not every slot."""
    spec = ModelSpec.from_hf_config(hf_config("qwen3_moe"), torch.bfloat16, 512)
    moe = spec.moe
    one = plan(spec, 1, DEVICE)
    many = plan(spec, 64, DEVICE)
    assert (one.num_slots, many.num_slots) == (moe.top_k, moe.num_experts)
    assert one.expected_experts == pytest.approx(moe.top_k)
    assert many.expected_experts == pytest.approx(
        moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** 64)
    )
    e, h, inter = spec.dtype.itemsize, spec.hidden_size, moe.expert_intermediate
    expert_bytes = 3 * h * inter * e  # gate, up and down rows of one expert
    sparse = sum(moe.sparse_layers)
    gap = many.weight_bytes() - one.weight_bytes()
    # Only the experts read differ (the rest is the same weights), give or
    # take the RMSNorm weight every EXPERT_UP tile re-reads.
    assert gap == pytest.approx(
        sparse * (many.expected_experts - one.expected_experts) * expert_bytes,
        rel=0.02,
    )


def test_an_expert_read_before_its_routing_is_caught():
    """EXPERT_UP made to wait for ROUTE instead of TOPK: it reads the
    routing table before its writer is known to have run."""
    spec = spec_of("mixtral", torch.bfloat16)
    program = plan(spec, 2, DEVICE)
    topk = next(i for _, _, i in program.in_global_order() if i.op == Op.TOPK)
    route = next(i for _, _, i in program.in_global_order() if i.op == Op.ROUTE)
    signallers = sum(
        1 for _, _, i in program.in_global_order()
        if i.signal_counter == route.signal_counter
    )  # fmt: skip
    queues = tuple(
        tuple(
            dataclasses.replace(i, wait_counter=route.signal_counter,
                                wait_count=signallers)
            if i.op == Op.EXPERT_UP and i.layer == topk.layer else i
            for i in q
        )
        for q in program.queues
    )  # fmt: skip
    with pytest.raises(VerificationError, match="reads route"):
        verify(dataclasses.replace(program, queues=queues))


def test_expert_tiles_cover_each_slot():
    spec = spec_of("qwen3_moe", torch.bfloat16)
    program = plan(spec, 1, DEVICE)
    ups = [i for _, _, i in program.in_global_order() if i.op == Op.EXPERT_UP]
    covered: dict[int, int] = {}
    for i in ups:
        lo, hi = unpack_cols(i.arg1)
        covered[i.arg0] = covered.get(i.arg0, 0) + hi - lo
    assert covered == dict.fromkeys(range(program.num_slots),
                                    spec.moe.expert_intermediate)  # fmt: skip


def test_the_kernel_refuses_them_until_it_has_them():
    spec = spec_of("mixtral", torch.bfloat16)
    with pytest.raises(ValueError, match="no mixture-of-experts instructions"):
        KernelShape.from_program(plan(spec, 1, DEVICE), 16)
