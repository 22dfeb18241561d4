# SPDX-License-Identifier: Apache-2.0
"""The tensor-core GEMV (kernel/ops/gemv_mma.py), the GEMV of every batch
above 1, compiles ahead of time on real shapes: a fixed grid of three
builds (CI time) over both archs and the batch buckets 4, 16 and 64, with
no spill and no local memory, registers within the warp roles' budget,
its MMAs in the SASS and the kernel within shared memory. Its index
arithmetic: test_gemv_mma_mapping.py; its pages: test_weight_pipe.py."""

import dataclasses

import pytest
from test_kernel_aot import ROLES_BUDGET, check_sass, real_shape

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.aot import build
from vllm_ext.megakernel.kernel.ops.gemv_mma import N_BLOCK, n_pad
from vllm_ext.megakernel.kernel.ops.weight_pipe import MIN_SLOTS, geometry
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
