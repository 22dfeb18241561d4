# SPDX-License-Identifier: Apache-2.0
"""VLLM_MEGAKERNEL_VARIANTS: names to planner options and kernel flags."""

import argparse

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
    v = Variants.parse(" legacy_control, fused_combine ,wide_attn")
    assert str(v) == "legacy_control,wide_attn,fused_combine"
    program = plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"], **v.plan_options())
    # (Head parts are the planner's, with or without variants.)
    assert program.fuse_combine and program.qkv_parts == 2
    shape = KernelShape.from_program(program, 16, **v.kernel_flags())
    # (The legacy control keeps the CUDA-core GEMV at any batch.)
    assert shape.legacy_control and shape.wide_attn and not shape.mma_gemv
    assert "mma_gemv" not in KERNEL and "mma_gemv" not in shape.as_dict()
    assert shape.fused_combine and shape.qkv_parts == 2
    # Head parts are no variant any more: the name is refused.
    with pytest.raises(ValueError, match="unknown variant 'split_qkv'"):
        Variants.parse("split_qkv")
    flags = argparse.Namespace(fused_combine=True, wide_attn=True, legacy_control=False)
    assert Variants.from_flags(flags) == Variants.parse("wide_attn,fused_combine")
    assert Variants.parse("").plan_options() == {"fuse_combine": False}
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
