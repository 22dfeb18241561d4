# SPDX-License-Identifier: Apache-2.0
"""Every rank of a tensor-parallel program in one launch
(kernel/ranks.py's ``OneLaunchRanks``, what the GPU check runs on its one
GPU), through the CPU stand-in (kernel_standin.py's ``RankSetStandIn``):
each rank's table, stacked with the others', holds its shard of the
weights (a quantized layer's codes and scales, cut as vLLM cuts them), its
partial sums, its vocabulary start and PEERS (every rank's
counters and partial sums); the stand-in reads everything through the
tables and runs the ranks together. Its outputs are bit for bit those of
the ranks interpreted directly (interpret.RankSetInterpreter, on the same
shards); a wrong PEERS or VOCAB_START entry fails. (The kernel that reads
these tables: test_parallel_kernel_aot.py, compiled, never run.)"""

import dataclasses

import pytest
import torch
from kernel_standin import RankSetStandIn, bits_equal, register_executor

from tests.megakernel.test_interpret import make_spec
from tests.megakernel.test_mla_program import mla_spec
from tests.megakernel.test_moe_program import spec_of
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import RankSetInterpreter, pad_inputs
from vllm_ext.megakernel.kernel.launcher import KernelExecutor, MegakernelError
from vllm_ext.megakernel.kernel.ranks import OneLaunchRanks
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape
from vllm_ext.megakernel.planner import plan
from vllm_ext.parallel import rank_caches, shard_spec, shard_weights
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    PACK_QUANTIZED,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    QuantFormat,
)
from vllm_ext.testing import BLOCK_SIZE, random_decode_inputs, random_weights

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=8)
TP = 2
FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)
FP8_BLOCKS = QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP)
INT4 = QuantFormat(INT4_W4A16, PACK_QUANTIZED, 4, 32)
SPECS = {
    "llama": lambda: make_spec("llama", torch.bfloat16),
    "qwen3_moe": lambda: spec_of("qwen3_moe", torch.bfloat16),
    "mla": lambda: mla_spec(torch.bfloat16),
    # Dense quantized ranks (parallel.shard_weights cuts codes and scales as
    # vLLM loads them): FP8 per channel and INT4 on Llama's shapes; FP8
    # blocks on Qwen3's, whose rank holds whole blocks of q, k and v rows
    # (Llama's 64-row k heads split a block: vLLM refuses, and so does
    # shard_weights).
    "llama-fp8": lambda: _quantized("llama", FP8),
    "llama-int4": lambda: _quantized("llama", INT4),
    "qwen3-fp8-blocks": lambda: _quantized("qwen3", FP8_BLOCKS),
}


def _quantized(arch: str, fmt):
    return dataclasses.replace(make_spec(arch, torch.bfloat16), quant=fmt)


def _contiguous(x):
    """A rank's shard as vLLM loads it: its own contiguous tensors (the
    table takes contiguous ones only)."""
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    if isinstance(x, tuple):
        return tuple(_contiguous(v) for v in x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _contiguous(getattr(x, f.name))
                                         for f in dataclasses.fields(x)})  # fmt: skip
    return x


def _setup(arch: str, batch: int = 2):
    spec = SPECS[arch]()
    weights = random_weights(spec, seed=1)
    shards = [_contiguous(shard_weights(weights, spec, TP, r)) for r in range(TP)]
    program = plan(shard_spec(spec, TP), batch, DEVICE, with_lm_head=True)
    standin = RankSetStandIn(program, shards)
    max_blocks = -(-(3 * BLOCK_SIZE + 8) // BLOCK_SIZE)
    ranks = OneLaunchRanks(program, shards, standin, block_size=BLOCK_SIZE,
                           max_blocks=max_blocks)  # fmt: skip
    standin.register(ranks.peers)
    return spec, program, shards, ranks, standin


def _rank_inputs(spec, batch: int, seed: int) -> list:
    inputs = random_decode_inputs(spec, batch, seed=seed)
    return [dataclasses.replace(inputs, kv_caches=rank_caches(inputs.kv_caches,
                                                               spec, TP, r))
            for r in range(TP)]  # fmt: skip


def _clone(inputs: list) -> list:
    return [dataclasses.replace(i, kv_caches=tuple(c.clone() for c in i.kv_caches))
            for i in inputs]  # fmt: skip


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_one_launch_equals_the_rank_set(arch):
    """Two steps (full, then padded): every rank's output, logits and
    appended cache rows through the tables equal the ranks interpreted
    directly, bit for bit; every rank holds the same hidden states."""
    spec, program, shards, ranks, standin = _setup(arch)
    direct = RankSetInterpreter(program, shards, seed=11)
    for step, n in enumerate((2, 1)):
        inputs = _rank_inputs(spec, n, seed=30 + step)
        for ex, i in zip(ranks.ranks, inputs, strict=True):
            register_executor(standin, ex, i.kv_caches)
        want_inputs = _clone(inputs)
        got = ranks.step(inputs)
        want = direct.step([pad_inputs(i, program.batch) for i in want_inputs])
        for k in range(TP):
            assert bits_equal(got[k], want[k][:n]), f"rank {k}, step {step}"
            assert bits_equal(ranks.ranks[k].logits, direct.ranks[k].logits)
            for a, b in zip(inputs[k].kv_caches, want_inputs[k].kv_caches,
                            strict=True):  # fmt: skip
                assert bits_equal(a, b)
        assert bits_equal(got[0], got[1]) and not got[0].isnan().any()
    assert standin.launches == 2
    # One rank's counters block, then the next: each rank's step number.
    per = program.num_counters + 1
    assert ranks.counters.view(TP, per)[:, -1].tolist() == [2] * TP


def _poison(ranks, k: int, slot: GlobalSlot, value: int) -> None:
    ex = ranks.ranks[k]
    ex.ptrs_host[-1, slot] = value
    ex.ptrs.copy_(ex.ptrs_host)


@pytest.mark.parametrize(
    ("slot", "message"),
    [(GlobalSlot.PEERS, "PEERS"), (GlobalSlot.VOCAB_START, "VOCAB_START")],
)
def test_a_wrong_rank_entry_fails(slot, message):
    """Rank 1's PEERS pointing at a PEERS list whose ranks are swapped, or
    its VOCAB_START at rank 0's first row: the stand-in refuses the table,
    and the step number bumps are taken back."""
    spec, program, shards, ranks, standin = _setup("llama")
    swapped = ranks.peers.flip(1).contiguous()
    standin.register(swapped)
    _poison(ranks, 1, slot, swapped.data_ptr() if slot == GlobalSlot.PEERS else 0)
    inputs = _rank_inputs(spec, 2, seed=40)
    for ex, i in zip(ranks.ranks, inputs, strict=True):
        register_executor(standin, ex, i.kv_caches)
    with pytest.raises(AssertionError, match=message):
        ranks.step(inputs)
    assert ranks.counters.view(TP, -1)[:, -1].tolist() == [0] * TP


def test_a_rank_alone_does_not_launch():
    """A rank's executor without PEERS (neither in a one-launch set nor
    given its peers' symmetric memory: test_symmetric.py) refuses a step."""
    spec = SPECS["llama"]()
    shard = _contiguous(shard_weights(random_weights(spec, seed=1), spec, TP, 0))
    program = plan(shard_spec(spec, TP), 2, DEVICE, with_lm_head=True)
    ex = KernelExecutor(program, shard, None, block_size=BLOCK_SIZE, max_blocks=4)
    with pytest.raises(MegakernelError, match="PEERS"):
        ex.step(random_decode_inputs(spec, 2, seed=1))
    with pytest.raises(MegakernelError, match="vocabulary shard"):
        KernelExecutor(program, dataclasses.replace(shard, vocab_range=None), None,
                       block_size=BLOCK_SIZE, max_blocks=4)  # fmt: skip


def test_what_quantized_ranks_refuse():
    """FP8 blocks a rank would hold part of (Llama's 64-row k heads: vLLM
    refuses the checkpoint too), and a quantized mixture, whose experts'
    codes ``shard_weights`` does not cut and whose kernel the shape
    refuses at TP."""
    blocks = _quantized("llama", FP8_BLOCKS)
    with pytest.raises(ValueError, match="128-row block without the rest"):
        shard_weights(random_weights(blocks, seed=1), blocks, TP, 0)
    moe = dataclasses.replace(SPECS["qwen3_moe"](), quant=FP8)
    with pytest.raises(ValueError, match="quantized mixtures"):
        shard_weights(random_weights(moe, seed=1), moe, TP, 0)
    program = plan(shard_spec(moe, TP), 2, DEVICE, with_lm_head=True)
    with pytest.raises(ValueError, match="dense GQA models only"):
        KernelShape.from_program(program, BLOCK_SIZE)
