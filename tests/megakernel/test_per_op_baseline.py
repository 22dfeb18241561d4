# SPDX-License-Identifier: Apache-2.0
"""The GPU check's per-op baseline (scripts/baseline/per_op.py) computes the
decode step the megakernel does: held to the plain reference forward on CPU,
eager and compiled, so a timing against it compares like with like."""

import dataclasses

import pytest
import torch
from test_interpret import SPECS, make_spec

from tests.utils import load_script
from vllm_ext.demo_models import hf_config
from vllm_ext.model_spec import ModelSpec
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import random_decode_inputs, random_weights

# Logits against the reference's, max |a - b| / max |b|: the baseline's LM
# head rounds to bf16 before widening (as vLLM's does), and its GEMMs sum in
# another order: two layers of bf16 leave 2e-3 (7e-3 through Inductor's CPU
# code, which skips roundings inside a fused kernel, as it does on a GPU).
TOL = 1e-2


def _per_op():
    return load_script("scripts/baseline/per_op.py")


def _reference_logits(spec, weights, inputs) -> torch.Tensor:
    out = ReferenceExecutor(spec, weights).step(inputs)
    return out.float() @ weights.lm_head.float().t()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _clone(inputs):
    kv = tuple(c.clone() for c in inputs.kv_caches)
    return dataclasses.replace(inputs, kv_caches=kv)


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_op_step_is_the_reference_step(arch, compiled):
    per_op = _per_op()
    spec = make_spec(arch, torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    mine = _clone(inputs)
    ref = _reference_logits(spec, weights, inputs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # aot_eager: Dynamo and AOTAutograd trace the pieces as Inductor gets
    # them (the GPU check compiles with Inductor), without C++ codegen here.
    options = {"backend": "aot_eager"} if compiled else None
    step = per_op.per_op_step(spec, weights, mine, per_op.paged_attend(weights, mine),
                              compile_options=options)  # fmt: skip
    assert _rel(step(), ref) < TOL
    # The new token's K/V went into the cache where the reference put them.
    for got, want in zip(mine.kv_caches, inputs.kv_caches, strict=True):
        assert _rel(got.float(), want.float()) < 2**-7
    if compiled:
        # One graph per piece, whatever the number of layers: the weights
        # are arguments, so no layer recompiles (past Dynamo's recompile
        # limit a piece would silently run eagerly) and none breaks.
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        assert not torch._dynamo.utils.counters["graph_break"]
        step()
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3


def test_per_op_step_is_the_reference_verify_step():
    """The GPU check's per-op verify step: each row of a request of 1 + 3
    tokens is a request of its own to the decode attention (its request's
    block table, its own length), after the step's KV writes: the reference
    verify step, so its timing compares like with like (FlashInfer's decode
    stands where paged_attend does here)."""
    from vllm_ext.testing import random_verify_inputs

    per_op = _per_op()
    spec = make_spec("llama", torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_verify_inputs(spec, 4, 4, seed=5)
    assert inputs.block_table.unique(dim=0).shape[0] == 1  # one request
    mine = _clone(inputs)
    ref = _reference_logits(spec, weights, inputs)
    step = per_op.per_op_step(spec, weights, mine, per_op.paged_attend(weights, mine))
    assert _rel(step(), ref) < TOL
    for got, want in zip(mine.kv_caches, inputs.kv_caches, strict=True):
        assert _rel(got.float(), want.float()) < 2**-7


def test_the_gemm_and_attention_floor_leaves_the_elementwise_ops_out():
    """The floor variant is not the step (so the comparison above can fail),
    and it keeps every GEMM and the attention (the logits' shape)."""
    per_op = _per_op()
    spec = make_spec("llama", torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref = _reference_logits(spec, weights, _clone(inputs))
    step = per_op.per_op_step(spec, weights, inputs,
                              per_op.paged_attend(weights, inputs),
                              elementwise=False)  # fmt: skip
    got = step()
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert _rel(got, ref) > TOL


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_mixture_runs_between_the_compiled_pieces(compiled):
    """Qwen3-MoE (a dense layer, then a sparse one): the mixture is an op
    of its own between compiled pieces, and the step is still the
    reference's."""
    per_op = _per_op()
    spec = ModelSpec.from_hf_config(hf_config("qwen3_moe"), torch.bfloat16, 512)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref = _reference_logits(spec, weights, _clone(inputs))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    calls = []

    def mixture(layer, x):
        calls.append(layer)
        return per_op.reference_mixture(spec, weights)(layer, x)

    options = {"backend": "aot_eager"} if compiled else None
    step = per_op.per_op_step(spec, weights, inputs,
                              per_op.paged_attend(weights, inputs),
                              compile_options=options, mixture=mixture)  # fmt: skip
    assert _rel(step(), ref) < TOL
    assert calls == [i for i, s in enumerate(spec.moe.sparse_layers) if s]
    if compiled:
        # first, middle (dense layer 0 into 1), moe_in, final: no break.
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
        assert not torch._dynamo.utils.counters["graph_break"]
