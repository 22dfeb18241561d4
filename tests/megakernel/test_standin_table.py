# SPDX-License-Identifier: Apache-2.0
"""The stand-in for the compiled kernel (kernel_standin.py) reads every
weight of a dense model through the address table, as the kernel does: the
table as the launcher wrote it gives the interpreter's step bit for bit,
and one entry of each kind pointed at another tensor of the same shape
gives another step (or, for the residual stream's columns and an entry the
kernel cannot read, fails loudly). The mixtures' and the latent
attentions' entries: test_moe_kernel_aot.py, test_mla_kernel_aot.py."""

import dataclasses
import functools

import pytest
import torch
from kernel_standin import KernelStandIn, bits_equal, register_executor
from test_interpret import make_spec

from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import ProgramInterpreter
from vllm_ext.megakernel.kernel.launcher import KernelExecutor
from vllm_ext.megakernel.kernel.shape import GlobalSlot, LayerSlot
from vllm_ext.megakernel.planner import plan
from vllm_ext.testing import BLOCK_SIZE, random_decode_inputs, random_weights

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=16)
BATCH = 2
G = 2  # the table's global row: make_spec's models have 2 layers


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def model(arch: str):
    """qwen2 (QKV bias) or qwen3 (QK norm) with an LM head of its own (so
    EMBED and LM_HEAD are two addresses), its program, a step's inputs
    and the interpreter's output and logits for them."""
    spec = dataclasses.replace(make_spec(arch, torch.bfloat16),
                               tie_word_embeddings=False)  # fmt: skip
    assert spec.num_layers == G
    weights = random_weights(spec, seed=1)
    weights = dataclasses.replace(weights, lm_head=weights.embed.flip(0))
    program = plan(spec, BATCH, DEVICE, with_lm_head=True)
    inputs = random_decode_inputs(spec, BATCH, seed=3)
    interp = ProgramInterpreter(program, weights, seed=9)
    out = interp.step(fresh(inputs)).clone()
    return program, weights, inputs, out, interp.logits.clone()


def fresh(inputs):
    return dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )


def run(arch: str, corrupt=None):
    """One step through the executor and the stand-in, its table first
    corrupted by ``corrupt(ex, standin)``; and the interpreter's step."""
    program, weights, inputs, out, logits = model(arch)
    standin = KernelStandIn(program, weights)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=4)  # fmt: skip
    mine = fresh(inputs)
    register_executor(standin, ex, mine.kv_caches)
    if corrupt is not None:
        corrupt(ex, standin)
        ex.ptrs.copy_(ex.ptrs_host)
    got = ex.step(mine).clone()
    return (got, ex.logits.clone(), mine.kv_caches), (out, logits, inputs)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_the_table_round_trips_bit_for_bit(arch):
    (got, got_logits, _), (out, logits, _) = run(arch)
    assert not got.isnan().any()
    assert bits_equal(got, out) and bits_equal(got_logits, logits)


def swap_layers(slot: LayerSlot):
    """Layers 0 and 1 each given the other's entry (same shape)."""

    def corrupt(ex, standin):
        ex.ptrs_host[[0, 1], slot] = ex.ptrs_host[[1, 0], slot]

    return corrupt


def repoint(row: int, column, value):
    """``ptrs[row, column] = value(ptrs)``."""

    def corrupt(ex, standin):
        ex.ptrs_host[row, column] = value(ex.ptrs_host)

    return corrupt


def entry(row: int, column):
    return lambda ptrs: ptrs[row, column]


def shifted_cos_sin(ex, standin):
    """cos/sin one position off: another registered fp32 table of the
    same shape."""
    shifted = ex.cos_sin.roll(1, 0)
    standin.register(shifted)
    ex.ptrs_host[G, GlobalSlot.COS_SIN] = shifted.data_ptr()


# Each weight the kernel reads from a dense model's table (qwen2: the QKV
# bias; qwen3: the QK norms), pointed at another tensor of its shape.
DENSE = ("INPUT_NORM", "QKV", "Q_NORM", "K_NORM", "O_PROJ", "POST_NORM",
         "GATE_UP", "DOWN")  # fmt: skip
WEIGHT_CASES = {
    **{f"qwen3-{n}": ("qwen3", swap_layers(LayerSlot[n])) for n in DENSE},
    "qwen2-QKV_BIAS": ("qwen2", swap_layers(LayerSlot.QKV_BIAS)),
    "qwen3-EMBED": ("qwen3", repoint(G, GlobalSlot.EMBED,
                                     entry(G, GlobalSlot.LM_HEAD))),
    "qwen3-LM_HEAD": ("qwen3", repoint(G, GlobalSlot.LM_HEAD,
                                       entry(G, GlobalSlot.EMBED))),
    "qwen3-FINAL_NORM": ("qwen3", repoint(G, GlobalSlot.FINAL_NORM,
                                          entry(1, LayerSlot.POST_NORM))),
    "qwen3-COS_SIN": ("qwen3", shifted_cos_sin),
}  # fmt: skip


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_a_wrong_weight_entry_changes_the_step(case):
    """Were that kind read from the stand-in's Python weights instead of
    the table, the step would be the interpreter's: this fails."""
    arch, corrupt = WEIGHT_CASES[case]
    (got, got_logits, _), (out, logits, _) = run(arch, corrupt)
    assert not (bits_equal(got, out) and bits_equal(got_logits, logits))


# The residual stream crosses columns (EMBED writes H0, layer i reads H_IN
# and writes H_OUT, FINAL_NORM reads H_LAST); and entries the kernel cannot
# read: 0 where it reads one, one where it reads none, an address nobody
# allocated, a tensor of another shape or dtype.
LOUD_CASES = {
    "H0": (repoint(G, GlobalSlot.H0, entry(1, LayerSlot.H_IN)), "layer 0 H_IN"),
    "H_IN": (repoint(1, LayerSlot.H_IN, entry(1, LayerSlot.HMID)), "layer 1 H_IN"),
    "H_LAST": (repoint(G, GlobalSlot.H_LAST, entry(1, LayerSlot.H_IN)), "H_LAST"),
    "QKV-0": (repoint(0, LayerSlot.QKV, lambda ptrs: 0), "layer 0 QKV: .* is 0"),
    "QKV_BIAS-absent": (repoint(1, LayerSlot.QKV_BIAS, entry(1, LayerSlot.QKV)),
                        "layer 1 QKV_BIAS: the kernel reads none"),
    "O_PROJ-unknown": (repoint(0, LayerSlot.O_PROJ,
                               lambda ptrs: ptrs[0, LayerSlot.O_PROJ] + 64),
                       "unknown"),
    "FINAL_NORM-shape": (repoint(G, GlobalSlot.FINAL_NORM,
                                 entry(0, LayerSlot.Q_NORM)),
                         r"FINAL_NORM: the kernel reads .* \(256,\)"),
    "COS_SIN-dtype": (repoint(G, GlobalSlot.COS_SIN, entry(G, GlobalSlot.EMBED)),
                      "COS_SIN: the kernel reads torch.float32"),
}  # fmt: skip


@pytest.mark.parametrize("case", LOUD_CASES)
def test_an_entry_the_kernel_cannot_use_fails_loudly(case):
    corrupt, message = LOUD_CASES[case]
    with pytest.raises(AssertionError, match=message):
        run("qwen3", corrupt)
