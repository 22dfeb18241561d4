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
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.aot import ARCHS, BuildResult, build
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    MIN_SLOTS,
    geometry,
    warps_per_row,
)
from vllm_ext.megakernel.kernel.persistent import (
    CONSUMER_REGS,
    SMEM_LIMIT,
    Megakernel,
    ring_slots,
    shared_bytes,
)
from vllm_ext.megakernel.kernel.shape import KernelShape, page_rows
from vllm_ext.megakernel.planner import plan
from vllm_ext.model_spec import ModelSpec

# One CTA per SM must fit the 64K-register file (a cooperative launch needs
# every CTA resident): 255 registers per thread at 256 threads (legacy), 168
# at 384 (the launch's grant; setmaxnreg then moves registers between the
# warpgroups: persistent.CONSUMER_REGS).
REGISTER_BUDGET = 255
ROLES_BUDGET = 168


def demo_shape(arch: str, batch: int, **flags) -> KernelShape:
    spec = ModelSpec.from_hf_config(hf_config(arch), torch.bfloat16)
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
    return KernelShape.from_program(program, 16, **flags)


def check_sass(built: BuildResult, legacy: bool = False, tp: int = 1) -> None:
    # Spills live in the stack frame: a spill shows as a local load. The
    # kernel makes no call (nothing prints: an abort is recorded), so no
    # local load at all, and no stack kept across a call.
    assert built.spill_bytes == 0 and built.local_loads == 0, "register spills"
    # System scope only in a tensor-parallel rank's kernel: a partial sum's
    # signal to each rank after a system fence, ALL_REDUCE's acquire
    # (test_parallel_kernel_aot.py).
    sys_ops = (built.sys_release_atomics, built.sys_fences, built.sys_acquire_loads)
    assert sys_ops == ((tp, 1, 1) if tp > 1 else (0, 0, 0))
    assert built.calls == 0
    assert 0 < built.registers <= (REGISTER_BUDGET if legacy else ROLES_BUDGET)
    assert built.ldg128 > 0, "the weight streams lost their 128-bit loads"
    # Waits end with an acquire load (strong load + L1 invalidate); signals
    # are a GPU-scope fence then a strong atomic add.
    assert built.acquire_loads >= 1
    assert built.release_fences >= 1 and built.release_atomics >= 1
    assert built.l2_prefetches >= 1, "weight tiles are no longer prefetched"
    # No trap: an expired wait records the abort (a CAS claims the record)
    # and the step ends, the CUDA context alive (sync.py).
    assert built.traps == 0 and built.abort_records >= 1
    if legacy:
        # No roles: barriers of all 256 threads (the consumers' barrier is
        # then the CTA's) around each instruction, no register split.
        assert built.setmaxnreg == 0
        assert built.cta_barriers + built.consumer_barriers >= 2
    else:
        check_roles(built)


def check_roles(built: BuildResult) -> None:
    """The warp roles' SASS: one CTA-wide barrier (start-up), the rest
    consumer-only; the register split (one decrease, one increase); the
    rings' mbarrier tests and arrivals (ready, empty, full)."""
    assert built.cta_barriers == 1, "a CTA-wide barrier past start-up"
    assert built.consumer_barriers >= 1
    assert built.setmaxnreg == 2
    assert built.page_waits >= 2 and built.mbarrier_arrives >= 2
    # The code fits the consumers' share after setmaxnreg.
    assert built.max_register <= CONSUMER_REGS


# The dense demo architectures; the mixtures of experts compile on real
# shapes in test_moe_kernel_aot.py, the latent attention (deepseek_v3's
# dense MLPs too) in test_mla_kernel_aot.py (CI time: one build set each).
DENSE = [
    a
    for a in sorted(DEMO_ARCHS)
    if (s := ModelSpec.from_hf_config(hf_config(a), torch.bfloat16)).moe is None
    and s.mla is None
]


# Each dense demo architecture on one arch, alternating (CI time; both archs
# build every shape in scripts/compile_grid.py).
@pytest.fixture(scope="module", params=[(a, ARCHS[i % len(ARCHS)])
                                        for i, a in enumerate(DENSE)],
                ids=str)  # fmt: skip
def built(request, tmp_path_factory):
    model, gpu = request.param
    return build(gpu, tmp_path_factory.mktemp(f"{model}-{gpu}"), demo_shape(model, 4))


def test_demo_shapes_compile_clean(built):
    check_sass(built)
    # The paged GEMVs' bulk copies; batch 4 runs them on tensor cores.
    assert built.bulk_copies > 0 and built.async_copies == 0 and built.mma_ops > 0


@pytest.mark.parametrize("batch", [1, 8, 16, 64])
@pytest.mark.parametrize("config", ["llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
def test_rings_fit_shared_memory(config, batch):
    spec = spec_or_exit("test", config, "bfloat16", batch)
    program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
    for flags in ({}, {"legacy_control": True}):
        shape = KernelShape.from_program(program, 16, **flags)
        assert shape.mma_gemv == (batch > 1 and not flags)
        assert shared_bytes(shape) <= SMEM_LIMIT
        if not shape.legacy_control:
            assert ring_slots(shape) >= MIN_SLOTS
            # Every projection of these models reads pages.
            assert len(geometry(shape)) == 5
    assert ring_slots(KernelShape.from_program(program, 16, legacy_control=True)) == 0


def test_a_kernel_over_the_shared_memory_limit_is_refused():
    # 64 q heads per kv head: the attention merge scratch alone is 256 KiB.
    big = dataclasses.replace(demo_shape("llama", 4), head_dim=128, q_heads=64,
                              kv_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="shared memory"):
        Megakernel(big)


def real_shape(config: str, batch: int, **flags) -> KernelShape:
    spec = spec_or_exit("test", config, "bfloat16", batch)
    program = plan(spec.with_layers(2), batch, DEVICES["h200"], with_lm_head=True)
    return KernelShape.from_program(program, 16, **flags)


@pytest.mark.parametrize("gpu", ARCHS)
def test_warp_roles_in_the_sass(gpu, tmp_path):
    """Llama-3.2-1B at batch 1, the default kernel: exactly one CTA-wide
    barrier (start-up), the consumers' named barrier per instruction and
    around the ops' shared buffers, one setmaxnreg each way, the rings'
    mbarrier tests and arrivals, the bulk copies, one acquire load (the
    controller) and one release atomic (the signal), no spill. (The
    mixture's shapes: test_moe_kernel_aot.py, through check_sass.)"""
    built = build(gpu, tmp_path, real_shape("llama-3.2-1b", 1))
    check_sass(built)
    assert built.cta_barriers == 1 and built.setmaxnreg == 2
    assert built.consumer_barriers >= 4
    assert built.acquire_loads == 1 and built.release_atomics == 1
    # Tests: ready, full (several GEMV paths), empty (controller, producer).
    assert built.page_waits >= 4 and built.mbarrier_arrives >= 4
    assert built.bulk_copies > 0 and built.local_loads == 0
    print(f"{gpu}: {built.registers} at launch, {built.max_register} used")


# The variants compile for one arch each here, the other in
# test_build_cli.py's real-shape grid or the GPU check's bundle (CI time).
@pytest.mark.parametrize("gpu", ["sm_90a"])
def test_legacy_control_compiles_clean(gpu, tmp_path):
    """The previous control, kept for the side-by-side GPU comparison:
    thread 0 waits between CTA barriers, the GEMVs read global memory (no
    bulk copies, no mbarriers), 256 threads with no register split."""
    built = build(gpu, tmp_path, demo_shape("qwen3", 4, legacy_control=True))
    check_sass(built, legacy=True)
    assert built.bulk_copies == 0 and built.page_waits == 0


def test_rows_wider_than_a_page_read_global_memory():
    # A 20480-wide DOWN row (40 KiB) does not fit a page: DOWN has no pages
    # (the producer skips it, its GEMV reads global memory), the rest keep
    # theirs.
    # (Batch 1: the CUDA-core GEMV's pages of whole rows; the tensor-core
    # GEMV's pages are k chunks, so every row fits.)
    shape = dataclasses.replace(demo_shape("llama", 1), intermediate=20480)
    assert Op.DOWN not in geometry(shape) and Op.GATE_UP in geometry(shape)
    assert Op.DOWN in geometry(dataclasses.replace(shape, batch=4))


@pytest.mark.parametrize("gpu", ["sm_90a"])
def test_split_rows_compile_clean(gpu, tmp_path):
    """The weight pipeline read by the batch-1 CUDA-core GEMV with split
    rows: Qwen2 has the QKV bias; an 8192-wide MLP (compiled, never run)
    puts two rows of DOWN on a page, so warps split each row as well. (The
    tensor-core GEMV's k-chunk pages: the demo shapes above, at batch 4, and
    test_gemv_mma_aot.py.)"""
    shape = dataclasses.replace(demo_shape("qwen2", 1), intermediate=8192)
    assert warps_per_row(page_rows(shape.intermediate)) > 1
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    assert built.bulk_copies > 0
    assert built.async_copies == 0 and built.mma_ops == 0


# Real shapes at the smallest and largest buckets, one on each arch (the
# whole grid, every dense config at batches 4, 16 and 64 on both archs:
# scripts/compile_grid.py --wide-attn, docs/perf.md).
@pytest.mark.parametrize("config, batch, gpu",
                         [("mistral-7b-v0.3", 4, "sm_90a"),
                          ("llama-3.1-8b", 64, "sm_100a")])  # fmt: skip
def test_wide_attention_variant_compiles_clean(config, batch, gpu, tmp_path):
    """The experimental wide attention for many requests in flight, with the
    tensor-core GEMV it runs beside: at batch 4 (two warps per request) and
    at 64 (8 requests at a time, a warp each)."""
    shape = real_shape(config, batch, wide_attn=True)
    assert shape.wide_attn and shape.mma_gemv
    built = build(gpu, tmp_path, shape)
    check_sass(built)
    assert built.spill_bytes == 0 and built.local_loads == 0
    assert built.async_copies == 0 and built.mma_ops > 0


@pytest.mark.parametrize("gpu", ["sm_90a"])
def test_qk_norm_over_head_parts_compiles_clean(gpu, tmp_path):
    """Qwen3's heads in parts (the planner's): QKV stores q and
    the new K as projected, and the wide attention finishes them (QK-norm
    and RoPE across a token group's lanes; the new K in place, then one
    more consumers' barrier). At batch 16, with the wide attention (the
    default attention's path: test_moe_kernel_aot.py's Qwen3-30B-A3B)."""
    spec = ModelSpec.from_hf_config(hf_config("qwen3"), torch.bfloat16)
    program = plan(spec, 16, DEVICES["h200"], with_lm_head=True, qkv_parts=2)
    shape = KernelShape.from_program(program, 16, wide_attn=True)
    # (On 132 SMs the planner's parts are 4; 2 make the parts as wide as
    # Qwen3-8B's, the widest on real shapes.)
    assert shape.qk_in_attn and shape.qkv_parts == 2
    check_sass(build(gpu, tmp_path, shape))


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
