# SPDX-License-Identifier: Apache-2.0
"""The kernel's tensor-parallel instructions (ALL_REDUCE, the partial sums
of EMBED, O_PROJ, DOWN and EXPERT_DOWN, the signals to every rank;
kernel/ops/all_reduce.py, kernel/control.py).

* Compiled ahead of time here at TP 2: the Qwen3-MoE demo (a dense layer,
  then a sparse one: every op with a partial sum) at batch 4 on sm_100a as
  a TP deployment builds it (latent attention's ops take a rank's heads
  and nothing else of TP: its TP 8 builds are compile_grid.py's). It has
  the SASS facts of test_kernel_aot.py, and exactly the system-scope operations
  the protocol needs: one strong system-scope add a rank after one
  system-scope fence (a partial sum's signal), one strong system-scope load
  (ALL_REDUCE's acquire); the local signal and the other waits stay at GPU
  scope. A kernel without tensor parallel has none (check_sass). The GPU
  check's build, Llama-3.2-1B with both ranks in one launch (the CTAs'
  rank views), is the dry run's (test_device_check.py), whose bundle
  records the same counts.
  Real shapes (Llama-3.1-70B, DeepSeek-V3 and Kimi-K2 at TP 8):
  scripts/compile_grid.py --tp 8, recorded in docs/perf.md.
* A dense quantized rank (the Llama demo in FP8 per channel and INT4 at
  TP 2, sm_90a): the same system-scope operations beside its format's
  tensor-core GEMVs (Llama-3.1-8B FP8 and W4A16, Qwen3-8B FP8 blocks at
  TP 2: compile_grid.py, docs/perf.md).
* The partial sums' rows and the build CLI's refusals.

Nothing here has run on a GPU.
"""

import dataclasses

import pytest
import torch
from test_kernel_aot import check_sass

from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.isa import Point
from vllm_ext.megakernel.kernel.aot import build
from vllm_ext.megakernel.kernel.shape import (
    KernelShape,
    partial_row,
    partial_rows,
    workspace_sizes,
)
from vllm_ext.megakernel.planner import plan
from vllm_ext.model_spec import ModelSpec
from vllm_ext.parallel import shard_spec
from vllm_ext.quant import FP8_W8A8, INT4_W4A16, PACK_QUANTIZED, PER_TOKEN, QuantFormat

H200 = DEVICES["h200"]
TP = 2
FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)
INT4 = QuantFormat(INT4_W4A16, PACK_QUANTIZED, 4, 32)
# (demo architecture, batch, arch, ranks in one launch): see the docstring.
GRID = [("qwen3_moe", 4, "sm_100a", 1)]


def tp_shape(model: str, batch: int, ranks: int) -> KernelShape:
    spec = shard_spec(ModelSpec.from_hf_config(hf_config(model), torch.bfloat16), TP)
    # One-launch ranks share the GPU's SMs (build.py --one-gpu-ranks).
    device = dataclasses.replace(H200, num_sms=H200.num_sms // ranks)
    program = plan(spec, batch, device, with_lm_head=True)
    return KernelShape.from_program(program, 16, ranks_in_launch=ranks)


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c)))
def test_tensor_parallel_compiles_clean(case, tmp_path):
    model, batch, arch, ranks = case
    built = build(arch, tmp_path, tp_shape(model, batch, ranks))
    check_sass(built, tp=TP)
    # The local signal (GPU scope) beside the ranks' ones.
    assert built.release_atomics == 1
    # L1 invalidations: the GPU-scope acquire, ALL_REDUCE's system-scope
    # one, and the signals' fence (fence.acq_rel.sys: one fence before the
    # ranks' adds, rather than a release fence each, which would wait for
    # the previous rank's add to complete over NVLink).
    assert built.acquire_loads == 3


@pytest.mark.parametrize("fmt", [FP8, INT4], ids=["fp8", "int4"])
def test_quantized_tensor_parallel_compiles_clean(fmt, tmp_path):
    spec = ModelSpec.from_hf_config(hf_config("llama"), torch.bfloat16)
    spec = shard_spec(dataclasses.replace(spec, quant=fmt), TP)
    program = plan(spec, 4, H200, with_lm_head=True)
    built = build("sm_90a", tmp_path, KernelShape.from_program(program, 16))
    check_sass(built, tp=TP)
    # The four projections' MMAs (FP8: two a k block each; INT4: eight),
    # FP8's e4m3 conversions of its inputs.
    if fmt is FP8:
        assert built.mma_ops >= 2 * 2 * 4 and built.e4m3_converts > 0
    else:
        assert built.mma_ops >= 8 * 4 and built.e4m3_converts == 0


def test_partial_rows_are_the_interpreters_points():
    # The embedding's row, then (attention, MLP) a layer: each point of each
    # layer its own row, all of them in the workspace.
    rows = [partial_row(Point.EMBED, 0)] + [
        partial_row(p, layer) for layer in range(3) for p in (Point.ATTN, Point.MLP)
    ]
    assert rows == list(range(partial_rows(3)))
    shape = tp_shape("llama", 1, 1)
    assert workspace_sizes(shape, 3)["partial"] == (7, 1, shape.hidden)
    assert "partial" not in workspace_sizes(dataclasses.replace(shape, tp_size=1), 3)


def test_the_shape_takes_the_ranks_vocabulary_shard():
    spec = ModelSpec.from_hf_config(hf_config("llama"), torch.bfloat16)
    shape = tp_shape("llama", 1, 1)
    assert (shape.tp_size, shape.vocab) == (TP, shard_spec(spec, TP).lm_head_rows)
    assert shape.vocab < spec.vocab_size
    with pytest.raises(ValueError, match="1 or tp_size"):
        dataclasses.replace(shape, ranks_in_launch=3)
    with pytest.raises(ValueError, match="default kernel only"):
        dataclasses.replace(shape, legacy_control=True)


def test_the_build_cli_refuses_what_does_not_split(tmp_path, capsys):
    from vllm_ext.megakernel.build import main

    def refused(*args: str) -> str:
        assert main([*args, "--arch", "sm_90a", "--out", str(tmp_path)]) == 2
        return capsys.readouterr().err

    one = ("--config", "llama-3.2-1b", "--batch", "1")
    assert "do not split over 3" in refused(*one, "--tp", "3")
    assert "with --one-gpu-ranks" in refused(*one, "--one-gpu-ranks")
    assert "--layers must be 1 to 16" in refused(*one, "--layers", "17")
