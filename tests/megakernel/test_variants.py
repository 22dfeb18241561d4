# SPDX-License-Identifier: Apache-2.0
"""VLLM_MEGAKERNEL_VARIANTS: names to planner options and kernel flags."""

import argparse
import dataclasses

import pytest
import torch

from vllm_ext import configs, envs
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.variants import KERNEL, Variants
from vllm_ext.model_spec import ModelSpec


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(configs.hf_config(name), torch.bfloat16, 4096)


def test_names_to_options_and_flags():
    v = Variants.parse(" legacy_control, fused_combine,split_qkv ,wide_attn")
    assert str(v) == "legacy_control,wide_attn,fused_combine,split_qkv"
    program = plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"],
                   **v.plan_options(spec_of("llama-3.2-1b"), 132))  # fmt: skip
    assert program.fuse_combine and program.qkv_parts == 2
    shape = KernelShape.from_program(program, 16, **v.kernel_flags())
    # (The legacy control keeps the CUDA-core GEMV at any batch.)
    assert shape.legacy_control and shape.wide_attn and not shape.mma_gemv
    assert "mma_gemv" not in KERNEL and "mma_gemv" not in shape.as_dict()
    assert shape.fused_combine and shape.qkv_parts == 2
    # QK-norm heads split too (ATTN finishes them). Heads that already fill
    # the SMs stay whole (a build that asked for parts is refused); no
    # names, no change.
    assert v.plan_options(spec_of("qwen3-8b"), 132)["qkv_parts"] == 2
    wide = dataclasses.replace(spec_of("qwen3-8b"), num_q_heads=64)
    assert v.plan_options(wide, 132)["qkv_parts"] == 1
    with pytest.raises(ValueError, match="cannot be split"):
        v.plan_options(wide, 132, strict=True)
    flags = argparse.Namespace(split_qkv=True, wide_attn=True, legacy_control=False)
    assert Variants.from_flags(flags) == Variants.parse("wide_attn,split_qkv")
    assert Variants.parse("").plan_options(spec_of("llama-3.2-1b"), 132) == {
        "fuse_combine": False, "qkv_parts": 1}  # fmt: skip
    assert Variants.parse("").kernel_flags() == dict.fromkeys(KERNEL, False)


def test_unknown_name_is_refused_through_envs(monkeypatch):
    monkeypatch.setenv("VLLM_MEGAKERNEL_VARIANTS", "wide_attn,turbo")
    with pytest.raises(ValueError, match="VLLM_MEGAKERNEL_VARIANTS: unknown "
                       "variant 'turbo'; choose from legacy_control"):  # fmt: skip
        _ = envs.VLLM_MEGAKERNEL_VARIANTS
    # The variants the warp roles subsumed are gone (their kernels with them),
    # and the tensor-core GEMV is no variant: it is the GEMV of every batch
    # above 1 (KernelShape.mma_gemv).
    for gone in ("weight_pipe", "mma_gemv"):
        monkeypatch.setenv("VLLM_MEGAKERNEL_VARIANTS", gone)
        with pytest.raises(ValueError, match=f"unknown variant '{gone}'"):
            _ = envs.VLLM_MEGAKERNEL_VARIANTS
    monkeypatch.delenv("VLLM_MEGAKERNEL_VARIANTS")
    assert Variants() == envs.VLLM_MEGAKERNEL_VARIANTS
