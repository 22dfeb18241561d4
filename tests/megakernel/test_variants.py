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
    v = Variants.parse(" weight_pipe, fused_combine,split_qkv ,stage_queue")
    assert str(v) == "stage_queue,weight_pipe,fused_combine,split_qkv"
    program = plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"],
                   **v.plan_options(spec_of("llama-3.2-1b"), 132))  # fmt: skip
    assert program.fuse_combine and program.qkv_parts == 2
    shape = KernelShape.from_program(program, 16, **v.kernel_flags())
    assert shape.weight_pipe and shape.stage_queue and not shape.mma_gemv
    assert shape.fused_combine and shape.qkv_parts == 2
    # QK-norm heads stay whole (a build that asked for parts is refused);
    # no names, no change.
    assert v.plan_options(spec_of("qwen3-8b"), 132)["qkv_parts"] == 1
    with pytest.raises(ValueError, match="cannot be split"):
        v.plan_options(spec_of("qwen3-8b"), 132, strict=True)
    flags = argparse.Namespace(split_qkv=True, wide_attn=True, stage_queue=False)
    assert Variants.from_flags(flags) == Variants.parse("wide_attn,split_qkv")
    assert Variants.parse("").plan_options(spec_of("llama-3.2-1b"), 132) == {
        "fuse_combine": False, "qkv_parts": 1}  # fmt: skip
    assert Variants.parse("").kernel_flags() == dict.fromkeys(KERNEL, False)


def test_unknown_name_is_refused_through_envs(monkeypatch):
    monkeypatch.setenv("VLLM_MEGAKERNEL_VARIANTS", "weight_pipe,turbo")
    with pytest.raises(ValueError, match="VLLM_MEGAKERNEL_VARIANTS: unknown "
                       "variant 'turbo'; choose from stage_queue"):  # fmt: skip
        _ = envs.VLLM_MEGAKERNEL_VARIANTS
    monkeypatch.delenv("VLLM_MEGAKERNEL_VARIANTS")
    assert Variants() == envs.VLLM_MEGAKERNEL_VARIANTS
