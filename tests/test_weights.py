# SPDX-License-Identifier: Apache-2.0
"""On a CPU vLLM prepacks every linear layer's weight and empties it, and
permutes its MoE experts' weights into its kernel's tile order; the
reference executor reads them back. They must be the checkpoint's, bit for
bit."""

import contextlib
import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def read_back(model: str, dtype: str, monkeypatch):
    """(vLLM's layers, the weights the backend read, the checkpoint in
    ``dtype``) of ``model`` loaded by vLLM in reference mode."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    monkeypatch.setenv("VLLM_MEGAKERNEL_INTERPRET", "1")
    llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=512,
              decode_backend="megakernel")  # fmt: skip
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        checkpoint = {
            name: tensor.to(getattr(torch, dtype))
            for file in sorted(Path(model).glob("*.safetensors"))
            for name, tensor in load_file(file).items()
        }
        yield (
            runner.model.model.layers,
            runner.decode_backend.executor.weights.layers,
            checkpoint,
        )
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_weights_read_back_exactly(demo_model, monkeypatch, dtype):
    # qwen2: QKV bias too.
    with read_back(demo_model("qwen2"), dtype, monkeypatch) as (layers, reads, ckpt):
        for i, (layer, read) in enumerate(zip(layers, reads, strict=True)):
            if dtype == "float32":
                # oneDNN prepacked and emptied them: the read-back is tested.
                # (bf16 is prepacked only on CPUs with bf16 instructions.)
                assert layer.self_attn.qkv_proj.weight.numel() == 0
            pre = f"model.layers.{i}."
            expected = {
                "qkv": torch.cat(
                    [ckpt[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]
                ),
                "o_proj": ckpt[pre + "self_attn.o_proj.weight"],
                "gate_up": torch.cat(
                    [ckpt[pre + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
                ),
                "down": ckpt[pre + "mlp.down_proj.weight"],
            }
            for name, tensor in expected.items():
                assert torch.equal(getattr(read, name), tensor), (i, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_back_crosses_chunks(dtype):
    """Weights wider than one identity chunk (the real models' are) are read
    back whole: each chunk's rows land in their own columns."""
    from vllm_ext import weights as w

    n, k = 96, 2 * w._READBACK_CHUNK + 37
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    # As vLLM leaves a prepacked CPU layer: an empty weight, a packed GEMM.
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), False)
    layer.cpu_linear = lambda x, _, bias: torch.nn.functional.linear(x, weight)
    assert torch.equal(w.linear_weight(layer, (n, k)), weight)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_weights_read_back_exactly(demo_model, monkeypatch, dtype):
    """Mixtral's experts (w1 gate, w3 up, w2 down), still permuted in
    vLLM's layers, read back as the checkpoint holds them."""
    with read_back(demo_model("mixtral"), dtype, monkeypatch) as (layers, reads, ckpt):
        for i, (layer, read) in enumerate(zip(layers, reads, strict=True)):
            routed = layer.block_sparse_moe.experts.routed_experts
            pre = f"model.layers.{i}.block_sparse_moe."
            w1 = ckpt[pre + "experts.0.w1.weight"]
            assert not torch.equal(routed.w13_weight[0, : w1.shape[0]], w1)
            assert torch.equal(read.moe.router, ckpt[pre + "gate.weight"])
            for e in range(read.moe.w13.shape[0]):
                expert = f"{pre}experts.{e}."
                gate, up = (ckpt[expert + n] for n in ("w1.weight", "w3.weight"))
                assert torch.equal(read.moe.w13[e], torch.cat([gate, up])), (i, e)
                assert torch.equal(read.moe.w2[e], ckpt[expert + "w2.weight"])


@pytest.mark.parametrize(
    "backend, refused",
    [("TRITON", False), ("BATCHED_TRITON", False), ("CPU", False),
     ("FLASHINFER_CUTLASS", True), ("FLASHINFER_TRTLLM", True), ("AITER", True)],
)  # fmt: skip
def test_experts_in_a_reordered_layout_are_refused(backend, refused):
    """The backend reads vLLM's expert weights in place: a backend that
    reorders them after loading, or quantized experts, is refused at
    start-up, naming the way out."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
    )

    from vllm_ext.weights import moe_layout_refusal

    method = SimpleNamespace(unquantized_backend=UnquantizedMoeBackend[backend])
    refusal = moe_layout_refusal(SimpleNamespace(quant_method=method))
    assert (refusal is not None) == refused
    if refused:
        assert "--moe-backend triton" in refusal
    quantized = SimpleNamespace(quant_method=object())
    assert "quantized" in moe_layout_refusal(quantized)


def test_an_int4_layer_vllm_runs_w4a8_is_refused_by_name():
    """On an AMX CPU in bf16 vLLM's INT4 kernel quantizes the activations to
    int8 (W4A8), where a GPU runs W4A16: reading that layer's weight back
    through it would be inexact, so start-up names the variable instead."""
    from types import SimpleNamespace

    from vllm_ext.model_spec import UnsupportedModelError
    from vllm_ext.weights import linear_weight

    layer = SimpleNamespace(quant_method=object(), use_w4a8=True)
    with pytest.raises(UnsupportedModelError, match="VLLM_CPU_INT4_W4A8=0"):
        linear_weight(layer, (64, 64))
