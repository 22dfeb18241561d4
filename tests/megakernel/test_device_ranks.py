# SPDX-License-Identifier: Apache-2.0
"""The GPU check's tensor-parallel case (scripts/device_ranks.py) where no
GPU is needed: its correctness harness on a TP 2 Llama demo case (both
ranks in one launch), the kernel replaced by the CPU stand-in
(kernel_standin.RankSetStandIn), passes a correct launch and fails one whose
ranks disagree (a rank's hidden states off by one bf16 step) or whose
result is off the rank set; the timing's NOP program keeps every wait and
signal. Nothing here has run on a GPU."""

import dataclasses

import pytest
import torch
from kernel_standin import RankSetStandIn, register_executor

from tests.megakernel.test_interpret import make_spec
from tests.utils import load_script
from vllm_ext.megakernel.build import save_program
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ranks import OneLaunchRanks
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.planner import plan
from vllm_ext.parallel import shard_spec
from vllm_ext.testing import BLOCK_SIZE

pytestmark = pytest.mark.usefixtures("one_thread")
TP = 2


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """(device_ranks, the case, where a plant goes): the case as build.py
    --tp 2 --one-gpu-ranks saves it, on a small model."""
    d = load_script("scripts/device_run.py")
    r = d.device_ranks
    monkeypatch.setattr(r, "CONTEXT", 40)
    full = make_spec("llama", torch.bfloat16)
    device = dataclasses.replace(DEVICES["h200"], num_sms=DEVICES["h200"].num_sms // TP)
    program = plan(shard_spec(full, TP), 2, device, with_lm_head=True)
    save_program(tmp_path / "program.pt", program,
                 KernelShape.from_program(program, BLOCK_SIZE, ranks_in_launch=TP),
                 full)  # fmt: skip
    plant: dict = {}

    def make(case_dir, program, parts, max_blocks):
        standin = RankSetStandIn(program, parts)

        def launch(*args):
            for ex in ranks.ranks:
                register_executor(standin, ex, ex.kv_caches)
            standin(*args)
            if "late" in plant:
                plant["late"](ranks)

        ranks = OneLaunchRanks(program, parts, launch, block_size=BLOCK_SIZE,
                               max_blocks=max_blocks)  # fmt: skip
        standin.register(ranks.peers)
        return ranks, None

    def correctness():
        return r.correctness(tmp_path, None, d.saved_spec, dev="cpu", make=make)

    return r, correctness, plant


def test_a_correct_launch_passes(harness):
    r, correctness, _ = harness
    result = correctness()
    assert result["ok"], result
    assert result["tp"] == TP and len(result["steps"]) == r.STEPS
    for step in result["steps"]:
        assert step["ranks_bit_equal"] and step["vs_rank_set"] == 0.0
        # The one-rank program on the unsharded weights: bf16 apart (each
        # rank's partials round once more), the same greedy tokens.
        assert 0 < step["logits_vs_one_rank"] <= r.TOL
        assert step["greedy_agree"] == f"{step['batch']}/{step['batch']}"


def test_ranks_that_disagree_fail(harness):
    """Rank 1's hidden states one bf16 step off in one element: within any
    tolerance, but the ranks no longer hold the same residual stream."""
    _, correctness, plant = harness

    def nudge(ranks):
        ranks.ranks[1].ws["out"].view(torch.int16)[0, 0] += 1  # the next bf16

    plant["late"] = nudge
    result = correctness()
    assert not result["ok"] and not result["steps"][0]["ranks_bit_equal"]


def test_a_wrong_sum_fails(harness):
    """Both ranks' hidden states scaled alike (a sum that dropped a rank's
    partials would be off like this): equal ranks, off the rank set."""
    r, correctness, plant = harness

    def scale(ranks):
        for ex in ranks.ranks:
            ex.ws["out"].mul_(0.5)

    plant["late"] = scale
    result = correctness()
    assert not result["ok"]
    step = result["steps"][0]
    assert step["ranks_bit_equal"] and step["vs_rank_set"] > r.TOL


def test_the_timings_nop_program_keeps_the_waits(harness):
    r, _, _ = harness
    program = plan(shard_spec(make_spec("llama", torch.bfloat16), TP), 1,
                   DEVICES["h200"], with_lm_head=True)  # fmt: skip
    nops = r._nop_reduces(program)
    words = [(i.wait_counter, i.wait_count, i.signal_counter, i.signal_ranks)
             for q in program.queues for i in q]  # fmt: skip
    assert words == [(i.wait_counter, i.wait_count, i.signal_counter,
                      i.signal_ranks) for q in nops.queues for i in q]  # fmt: skip
    ops = [i.op for q in nops.queues for i in q]
    assert Op.ALL_REDUCE not in ops
    reduces = sum(i.op == Op.ALL_REDUCE for q in program.queues for i in q)
    assert reduces and ops.count(Op.NOP) >= reduces
