# SPDX-License-Identifier: Apache-2.0
"""The tensor-core GEMV (kernel/ops/gemv_mma.py), the GEMV of every batch
above 1, compiles ahead of time on real shapes: a fixed grid of three
builds (CI time) over both archs and the batch buckets 4, 16 and 64, with
no spill and no local memory, registers within the warp roles' budget,
its MMAs in the SASS and the kernel within shared memory. Its index
arithmetic: test_gemv_mma_mapping.py; its pages: test_weight_pipe.py."""

import dataclasses

import pytest
from test_kernel_aot import ROLES_BUDGET, check_sass, demo_shape, real_shape

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.aot import build
from vllm_ext.megakernel.kernel.ops.gemv_mma import N_BLOCK, n_pad
from vllm_ext.megakernel.kernel.ops.weight_pipe import MIN_SLOTS, QUANT_OPS, geometry
from vllm_ext.megakernel.kernel.persistent import (
    CONSUMER_REGS,
    SMEM_LIMIT,
    ring_slots,
    shared_bytes,
)

# The smallest bucket on Hopper, 8B's batch 16 on Blackwell, and the
# largest accumulators and scratch (8B at batch 64, 3 ring slots) on Hopper.
GRID = [("llama-3.2-1b", 4, "sm_90a"), ("llama-3.1-8b", 16, "sm_100a"),
        ("llama-3.1-8b", 64, "sm_90a")]  # fmt: skip


@pytest.mark.parametrize("config, batch, gpu", GRID)
def test_tensor_core_gemv_compiles_clean(config, batch, gpu, tmp_path):
    shape = real_shape(config, batch)
    assert shape.mma_gemv and len(geometry(shape)) == 5
    assert shared_bytes(shape) <= SMEM_LIMIT and ring_slots(shape) >= MIN_SLOTS
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    # No spill (check_sass: no local load at all).
    assert built.spill_bytes == 0 and built.local_loads == 0
    assert built.registers <= ROLES_BUDGET and built.max_register <= CONSUMER_REGS
    # Every projection's page loop has its MMAs: two per k block, request
    # block and matrix (4 single-matrix opcodes, gate and up).
    assert built.mma_ops >= 12 * (n_pad(batch) // N_BLOCK)
    assert built.bulk_copies > 0 and built.async_copies == 0
    print(f"{config} b{batch} {gpu}: {built.registers} at launch, "
          f"{built.max_register} used, {built.mma_ops} HMMA, "
          f"{shared_bytes(shape)} B shared, {ring_slots(shape)} slots")  # fmt: skip


@pytest.mark.parametrize("batch, block", [(1, False), (4, False), (16, True)])
def test_fp8_gemv_compiles_clean(batch, block, tmp_path):
    """FP8 (KernelShape.fp8; per channel, or 128 x 128 blocks, whose batch
    16 first spilled) on the demo Llama, Hopper: QKV, O_PROJ, GATE_UP and
    DOWN read e4m3 pages on tensor cores at batch 1 too, the LM head bf16
    (rows at batch 1); the inputs' quantization and the MMAs in the SASS,
    no spill. (Real shapes, both archs: scripts/compile_grid.py.)"""
    shape = dataclasses.replace(demo_shape("llama", batch), fp8=True,
                                fp8_block=block)  # fmt: skip
    geo = geometry(shape)
    assert all(geo[op].mma and geo[op].fp8 for op in QUANT_OPS)
    assert not geo[Op.LM_HEAD].fp8 and geo[Op.LM_HEAD].mma == (batch > 1)
    assert shared_bytes(shape) <= SMEM_LIMIT and ring_slots(shape) >= MIN_SLOTS
    built = build("sm_90a", tmp_path, shape)
    check_sass(built)
    assert built.registers <= ROLES_BUDGET and built.max_register <= CONSUMER_REGS
    # Two e4m3 MMAs per k block and matrix of the 4 single-matrix opcodes
    # and gate/up; on sm_90 each runs as two f16 HMMAs.
    assert built.mma_ops >= 2 * 2 * 5 and built.e4m3_converts > 0
    print(f"fp8 b{batch} block={block}: {built.registers} at launch, "
          f"{built.max_register} used, {built.mma_ops} HMMA, "
          f"{built.e4m3_converts} e4m3 conversions")  # fmt: skip


@pytest.mark.parametrize("batch, group", [(1, 64), (16, 128)])
def test_int4_gemv_compiles_clean(batch, group, tmp_path):
    """INT4 W4A16 (KernelShape.int4_group) on the demo Llama, Hopper: the
    quantized projections read 4-bit pages on tensor cores at every batch;
    their eight bf16 MMAs a k block and the codes' unpacking (bf16 halves
    subtracted, then scaled) in the SASS, no spill. (Real shapes, both
    archs: scripts/compile_grid.py.)"""
    shape = dataclasses.replace(demo_shape("llama", batch), int4_group=group)
    geo = geometry(shape)
    assert all(geo[op].mma and geo[op].int4 for op in QUANT_OPS)
    assert shared_bytes(shape) <= SMEM_LIMIT and ring_slots(shape) >= MIN_SLOTS
    built = build("sm_90a", tmp_path, shape)
    check_sass(built)
    assert built.registers <= ROLES_BUDGET and built.max_register <= CONSUMER_REGS
    assert built.mma_ops >= 8 * 5 and built.e4m3_converts == 0
    print(f"int4 b{batch} g{group}: {built.registers} at launch, "
          f"{built.max_register} used, {built.mma_ops} HMMA")  # fmt: skip


def test_which_kernels_run_the_tensor_cores():
    """Every batch above 1 of the dense shapes; not batch 1 (the CUDA-core
    GEMV streams at 3.5-4 TB/s there), not the legacy control (the previous
    kernel, for the side-by-side comparison), not a K that is not whole k
    blocks of 32, not the mixture of experts nor the latent attention."""
    for batch in (2, 4, 8, 16, 64):
        assert real_shape("llama-3.2-1b", batch).mma_gemv
    assert not real_shape("llama-3.2-1b", 1).mma_gemv
    four = real_shape("llama-3.2-1b", 4)
    assert not dataclasses.replace(four, legacy_control=True).mma_gemv
    assert not dataclasses.replace(four, intermediate=344).mma_gemv
    # The row path pages differ (whole rows: no k chunks).
    rows = dataclasses.replace(four, batch=1)
    assert geometry(rows)[Op.DOWN].k_chunk == rows.intermediate
    assert geometry(four)[Op.DOWN].k_chunk < four.intermediate
    for config in ("qwen3-30b-a3b", "deepseek-v3"):
        assert not real_shape(config, 16).mma_gemv
