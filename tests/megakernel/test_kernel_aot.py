# SPDX-License-Identifier: Apache-2.0
"""The whole persistent kernel (every instruction) compiles ahead of time on
this GPU-less machine for Hopper and Blackwell, for each test model's shape,
and its SASS has what the design needs. (Real shapes: test_build_cli.py.)"""

import ctypes
import dataclasses
import subprocess

import pytest
import torch

from vllm_ext.demo_models import DEMO_ARCHS, hf_config
from vllm_ext.megakernel.build import spec_or_exit
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel.aot import ARCHS, BuildResult, build
from vllm_ext.megakernel.kernel.ops.weight_pipe import MIN_SLOTS, warps_per_row
from vllm_ext.megakernel.kernel.persistent import (
    QUEUE_STAGE,
    SMEM_LIMIT,
    Megakernel,
    ring_slots,
    shared_bytes,
)
from vllm_ext.megakernel.kernel.shape import KernelShape, page_rows
from vllm_ext.megakernel.planner import plan
from vllm_ext.model_spec import ModelSpec

# One 256-thread CTA per SM must fit the 64K-register file (a cooperative
# launch needs every CTA resident): at most 255 registers per thread.
REGISTER_BUDGET = 255


def demo_shape(arch: str, batch: int, stage_weights: bool = False) -> KernelShape:
    spec = ModelSpec.from_hf_config(hf_config(arch), torch.bfloat16)
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
    return KernelShape.from_program(program, 16, stage_weights=stage_weights)


def check_sass(built: BuildResult) -> None:
    # Spills live in the stack frame (printf's arguments do too): a spill
    # shows as a local load.
    assert built.spill_bytes == 0 and built.local_loads == 0, "register spills"
    assert 0 < built.registers <= REGISTER_BUDGET
    assert built.ldg128 > 0, "the weight streams lost their 128-bit loads"
    # Waits end with an acquire load (strong load + L1 invalidate); signals
    # are a GPU-scope fence then a strong atomic add.
    assert built.acquire_loads >= 1
    assert built.release_fences >= 1 and built.release_atomics >= 1
    assert built.l2_prefetches >= 1, "weight tiles are no longer prefetched"


# The dense demo architectures; the mixtures of experts compile on real
# shapes in test_moe_kernel_aot.py (CI time: one build set each).
DENSE = [
    a
    for a in sorted(DEMO_ARCHS)
    if ModelSpec.from_hf_config(hf_config(a), torch.bfloat16).moe is None
]


@pytest.fixture(scope="module", params=[(a, g) for a in DENSE for g in ARCHS],
                ids=str)  # fmt: skip
def built(request, tmp_path_factory):
    model, gpu = request.param
    return build(gpu, tmp_path_factory.mktemp(f"{model}-{gpu}"), demo_shape(model, 4))


def test_demo_shapes_compile_clean(built):
    check_sass(built)
    # No weight staging, tensor cores or weight pipe unless asked for.
    assert built.async_copies == 0 and built.mma_ops == 0
    assert built.bulk_copies == 0 and built.page_waits == 0


@pytest.mark.parametrize("batch", [1, 8, 16, 64])
@pytest.mark.parametrize("config", ["llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
def test_staged_variants_fit_shared_memory(config, batch):
    spec = spec_or_exit("test", config, "bfloat16", batch)
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
    shape = KernelShape.from_program(program, 16, True, True)
    assert shared_bytes(shape) <= SMEM_LIMIT
    mma = KernelShape.from_program(program, 16, False, True, True)
    assert shared_bytes(mma) <= SMEM_LIMIT
    pipe = KernelShape.from_program(program, 16, stage_queue=True, weight_pipe=True)
    assert ring_slots(pipe) >= MIN_SLOTS
    assert shared_bytes(pipe) <= SMEM_LIMIT
    # The staged queue covers every SM's whole queue for these models.
    assert max(len(q) for q in program.queues) <= QUEUE_STAGE


def test_a_kernel_over_the_shared_memory_limit_is_refused():
    # 64 q heads per kv head: the attention merge scratch alone is 256 KiB.
    big = dataclasses.replace(demo_shape("llama", 4, stage_weights=True),
                              head_dim=128, q_heads=64, kv_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="shared memory"):
        Megakernel(big)


# The variants compile for one arch each here, the other in
# test_build_cli.py's real-shape grid or the GPU check's bundle (CI time).
@pytest.mark.parametrize("gpu", ["sm_90a"])
def test_weight_staging_variant_compiles_clean(gpu, tmp_path):
    """The experimental variant (weights copied into shared memory before
    each wait): the same checks, plus its cp.async copies."""
    shape = dataclasses.replace(demo_shape("qwen3", 4, True), stage_queue=True)
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    assert built.async_copies > 0
    assert built.mma_ops == 0


@pytest.mark.parametrize("gpu", ["sm_100a"])
def test_tensor_core_variant_compiles_clean(gpu, tmp_path):
    """The experimental tensor-core GEMV: the same checks, plus its MMAs."""
    shape = dataclasses.replace(demo_shape("qwen2", 4), mma_gemv=True)
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    assert built.mma_ops > 0 and built.async_copies == 0


@pytest.mark.parametrize("gpu", ["sm_90a"])
@pytest.mark.parametrize("mma", [False, True], ids=["rows", "mma"])
def test_weight_pipe_variant_compiles_clean(gpu, mma, tmp_path):
    """The experimental weight pipeline, read by the CUDA-core GEMV (pages
    of whole rows) or the tensor-core one (pages of 16 rows): the same
    checks, plus its bulk copies and page waits. Qwen2 has the QKV bias; an
    8192-wide MLP (compiled, never run) puts two rows of DOWN on a page, so
    warps split each row as well, and needs eight k pages per MMA row block."""
    shape = dataclasses.replace(demo_shape("qwen2", 4), weight_pipe=True,
                                stage_queue=True, intermediate=8192,
                                mma_gemv=mma)  # fmt: skip
    assert warps_per_row(page_rows(shape.intermediate)) > 1
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    assert built.bulk_copies > 0 and built.page_waits > 0
    assert built.async_copies == 0 and (built.mma_ops > 0) == mma


@pytest.mark.parametrize("model, gpu", [("mistral", "sm_90a"), ("qwen2", "sm_100a")])
def test_wide_attention_variant_compiles_clean(gpu, model, tmp_path):
    """The experimental wide attention, alone: head dim 128 with 2 q heads
    per kv head (Mistral) and 64 with one (Qwen2), at batch 4 (two warps per
    request) and beside the weight pipeline at batch 16 (one per request)."""
    shape = dataclasses.replace(demo_shape(model, 4), wide_attn=True)
    built = build(gpu, tmp_path / "b4", shape)
    check_sass(built)
    assert built.bulk_copies == 0 and built.async_copies == 0
    both = dataclasses.replace(demo_shape(model, 16), wide_attn=True,
                               weight_pipe=True, stage_queue=True)  # fmt: skip
    check_sass(build(gpu, tmp_path / "b16", both))


@pytest.mark.parametrize("gpu", ["sm_100a"])
def test_fused_combine_variant_compiles_clean(gpu, tmp_path):
    """The experimental fused COMBINE: the last ATTN chunk's signal is an
    acq_rel atomic (fence, add, L1 invalidate) and the merge it then runs
    ends with a release atomic of its own (the default kernel has one
    release atomic and one acquire load: test_build_cli.py)."""
    spec = ModelSpec.from_hf_config(hf_config("llama"), torch.bfloat16)
    program = plan(spec, 4, DEVICES["h200"], with_lm_head=True, fuse_combine=True)
    shape = KernelShape.from_program(program, 16)
    assert shape.fused_combine
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    assert built.release_atomics >= 3 and built.acquire_loads >= 2


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(weight_pipe=True, stage_weights=True), "pick one"),
        (dict(l2_ahead=True), "needs weight_pipe"),
        # A 20480-wide row (40 KiB) does not fit a page of whole rows.
        (dict(weight_pipe=True, intermediate=20480), "page"),
        (dict(mma_gemv=True, stage_weights=True), "pick one"),
        (dict(mma_gemv=True, intermediate=344), "multiple of 32"),
    ],
)
def test_variants_refuse_what_they_cannot_run(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(demo_shape("llama", 4), **changes)


def test_library_needs_only_libc(built):
    dynamic = subprocess.run(
        ["readelf", "-d", built.library], capture_output=True, text=True, check=True
    ).stdout
    needed = sorted(line.split("[")[1].rstrip("]") for line in dynamic.splitlines()
                    if "(NEEDED)" in line)  # fmt: skip
    assert needed == ["ld-linux-x86-64.so.2", "libc.so.6"]


def test_loading_without_a_gpu_fails_cleanly(built):
    lib = ctypes.CDLL(built.library)
    lib.megakernel_error_string.restype = ctypes.c_char_p
    # Launch before load: cudaErrorInitializationError, no crash.
    assert lib.megakernel_launch(*([None] * 13)) == 3
    error = lib.megakernel_load(0)
    assert error != 0 and lib.megakernel_error_string(error)


def test_shape_refuses_what_the_kernel_cannot_run():
    good = demo_shape("llama", 1).as_dict()
    with pytest.raises(ValueError, match="head_dim"):
        KernelShape(**{**good, "head_dim": 96})
    with pytest.raises(ValueError, match="multiple of 8"):
        KernelShape(**{**good, "hidden": 260})
    with pytest.raises(ValueError, match="head_dim"):
        KernelShape(**{**good, "head_dim": 192})
    with pytest.raises(ValueError, match="batch 12"):
        KernelShape(**{**good, "batch": 12})
