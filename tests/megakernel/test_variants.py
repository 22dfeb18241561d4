# SPDX-License-Identifier: Apache-2.0
"""VLLM_MEGAKERNEL_VARIANTS: the one experimental variant's name to its
kernel flag."""

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


def test_names_to_flags():
    assert KERNEL == ("wide_attn",)
    v = Variants.parse(" wide_attn ,")
    assert str(v) == "wide_attn" and str(Variants()) == "none"
    program = plan(spec_of("llama-3.2-1b"), 1, DEVICES["h200"])
    shape = KernelShape.from_program(program, 16, **v.kernel_flags())
    assert shape.wide_attn and not shape.legacy_control
    assert "mma_gemv" not in KERNEL and "mma_gemv" not in shape.as_dict()
    flags = argparse.Namespace(wide_attn=True, legacy_control=True)
    assert Variants.from_flags(flags) == v
    assert Variants.parse("").kernel_flags() == {"wide_attn": False}


def test_unknown_name_is_refused_through_envs(monkeypatch):
    monkeypatch.setenv("VLLM_MEGAKERNEL_VARIANTS", "wide_attn,turbo")
    with pytest.raises(ValueError, match="VLLM_MEGAKERNEL_VARIANTS: unknown "
                       "variant 'turbo'; choose from wide_attn$"):  # fmt: skip
        _ = envs.VLLM_MEGAKERNEL_VARIANTS
    # Gone: the variants the warp roles subsumed (weight_pipe), the ones the
    # cost model decided (split_qkv became the planner's default, the fused
    # COMBINE was deleted, 2026-12-02), the tensor-core GEMV (the GEMV of
    # every batch above 1) and the legacy control (a build flag of the GPU
    # check, not served).
    for gone in ("weight_pipe", "mma_gemv", "split_qkv", "fused_combine",
                 "legacy_control"):  # fmt: skip
        monkeypatch.setenv("VLLM_MEGAKERNEL_VARIANTS", gone)
        with pytest.raises(ValueError, match=f"unknown variant '{gone}'"):
            _ = envs.VLLM_MEGAKERNEL_VARIANTS
    monkeypatch.delenv("VLLM_MEGAKERNEL_VARIANTS")
    assert Variants() == envs.VLLM_MEGAKERNEL_VARIANTS
