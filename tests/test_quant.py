# SPDX-License-Identifier: Apache-2.0
"""Quantized checkpoints (vllm_ext/quant.py): which formats are taken and
which refused by name, the INT4 dequantization against the formats' own
libraries, and the demo checkpoints against vLLM's unpacking."""

import dataclasses

import pytest
import torch

from vllm_ext.demo_quant import (
    EXPERTS_ONLY_IGNORE,
    ROUTER,
    _gptq,
    _pack_quantized,
    quantization_config,
    quantize_int4,
)
from vllm_ext.quant import (
    ATTENTION,
    DENSE_MLP,
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    ROUTED_EXPERTS,
    SHARED_EXPERTS,
    Int4Weight,
    for_model,
    quant_format,
    quantize_input,
)

FP8_CHANNEL = dict(type="float", num_bits=8, strategy="channel", group_size=None)
FP8_TOKEN = dict(type="float", num_bits=8, strategy="token", dynamic=True)


def _ct(weights: dict, acts: dict | None = None, fmt: str = "pack-quantized"):
    weights = {"num_bits": 4, "type": "int", "symmetric": True,
               "strategy": "group", "group_size": 128} | weights  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights,
                                    "input_activations": acts}}}  # fmt: skip


@pytest.mark.parametrize(
    "config, checkpoint, group",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True,
          "desc_act": False}, "gptq", 64),
        # Kimi-K2-Thinking's experts: group 32.
        (_ct({"group_size": 32}), "compressed-tensors pack-quantized", 32),
        (_ct({"strategy": "channel", "group_size": None}),
         "compressed-tensors pack-quantized", -1),
    ],
)  # fmt: skip
def test_int4_w4a16_is_taken(config, checkpoint, group):
    fmt = quant_format(config)
    assert (fmt.name, fmt.checkpoint, fmt.bits, fmt.group_size) == (
        INT4_W4A16,
        checkpoint,
        4,
        group,
    )


@pytest.mark.parametrize(
    "config, name",
    [
        ({"quant_method": "fp8", "weight_block_size": [64, 64]},
         "FP8 with \\[64, 64\\] weight blocks"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128],
          "activation_scheme": "static"}, "static activation scales"),
        ({"quant_method": "fp8"}, "FP8 with per-tensor scales"),
        ({"quant_method": "awq", "bits": 4}, "AWQ"),
        ({"quant_method": "mxfp4"}, "MXFP4"),
        ({"quant_method": "modelopt_fp4"}, "NVFP4"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
        ({"quant_method": "squeezellm"}, "quant_method 'squeezellm'"),
        ({"quant_method": "gptq", "bits": 8, "sym": True}, "GPTQ with 8-bit"),
        ({"quant_method": "gptq", "bits": 4, "sym": False}, "zero points"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "act-order"),
        (_ct({"type": "float", "num_bits": 8, "strategy": "channel"}, None,
             "float-quantized"), "FP8 weight-only"),
        (_ct({"type": "float", "num_bits": 8, "strategy": "block"},
             {"num_bits": 8, "type": "float", "strategy": "group",
              "dynamic": True}, "float-quantized"), "FP8 with block weight"),
        (_ct({"type": "float", "num_bits": 8, "strategy": "tensor"},
             {"num_bits": 8, "type": "float", "strategy": "tensor",
              "dynamic": False}, "float-quantized"), "FP8 with tensor weight"),
        (_ct({"type": "float", "num_bits": 8, "strategy": "channel"},
             {"num_bits": 8, "type": "float", "strategy": "tensor",
              "dynamic": False}, "float-quantized"), "'tensor'\\) activations"),
        (_ct({"type": "float", "num_bits": 4, "group_size": 16},
             {"num_bits": 4, "type": "float"}, "nvfp4-pack-quantized"),
         "NVFP4/MXFP4"),
        (_ct({"type": "int", "num_bits": 8, "strategy": "channel"},
             {"num_bits": 8, "type": "int"}, "int-quantized"), "INT8"),
        (_ct({"symmetric": False}), "zero points"),
        (_ct({"actorder": "group"}), "act-order"),
        (_ct({"strategy": "tensor"}), "strategy 'tensor'"),
        (_ct({}, {"num_bits": 8, "type": "int"}), "pack-quantized"),
    ],
)  # fmt: skip
def test_other_formats_are_refused_by_name(config, name):
    with pytest.raises(ValueError, match=f"^quantization .*{name}"):
        quant_format(config)


def test_dequantize_matches_compressed_tensors():
    """The demo's pack-quantized checkpoint, unpacked and dequantized by
    compressed-tensors itself, equals Int4Weight.dequantize bit for bit
    (bf16 scales: one rounding of q * s)."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        unpack_from_int32,
    )

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    t = _pack_quantized("w.weight", weight)
    codes = unpack_from_int32(t["w.weight_packed"], 4, torch.Size(weight.shape))
    scales = t["w.weight_scale"]
    theirs = codes.to(torch.bfloat16) * scales.repeat_interleave(32, dim=1)
    ours = Int4Weight((codes.to(torch.int16) + 8).to(torch.uint8), scales)
    assert torch.equal(ours.dequantize(), theirs)
    # Close to the weight it quantizes: half a step, plus the bf16 rounding
    # of q * s (|q| <= 8: 8 * 2^-9 of a step).
    step = scales.float().repeat_interleave(32, dim=1)
    error = (ours.dequantize().float() - weight).abs()
    assert (error <= step * (0.5 + 2**-6)).all()


def test_gptq_checkpoint_unpacks_as_vllm_reads_it():
    """The demo's GPTQ tensors, unpacked with vLLM's own helper (uint4b8,
    packed along K), give the same codes and scales as the quantizer."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize_int4(weight, 64)
    t = _gptq("w.weight", weight)
    unpacked = unpack_quantized_values_into_int32(
        t["w.qweight"], scalar_types.uint4b8, 0
    )
    assert torch.equal(unpacked.t(), codes.to(torch.int32) + 8)
    assert torch.equal(t["w.scales"].t().to(torch.bfloat16), scales)
    assert torch.equal(t["w.g_idx"], torch.arange(128, dtype=torch.int32) // 64)


def test_cpu_layout_stand_in_unpacks_vllm_repack():
    """tests/cpu_quant_ops.py reads vLLM's CPU W4A16 layout: repack codes
    as CPUWNA16LinearKernel does and unpack them back."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    from tests.cpu_quant_ops import unpack_cpu_wna16

    k, n = 64, 32
    codes = torch.randint(0, 16, (k, n), dtype=torch.int32)
    packed = pack_quantized_values_into_int32(codes, scalar_types.uint4b8, 1)
    # CPUWNA16LinearKernel._process_gptq_weights_w4a16's block order.
    blocked = packed.view(k, -1, 2).permute(1, 0, 2).reshape(-1, k * 2)
    assert torch.equal(unpack_cpu_wna16(blocked, k), codes)


def _llama_spec(quantization_config: dict):
    from vllm_ext.demo_models import hf_config
    from vllm_ext.model_spec import ModelSpec

    config = hf_config("llama")
    config.quantization_config = quantization_config
    return ModelSpec.from_hf_config(config, torch.bfloat16, 512)


def test_per_channel_int4_runs_in_reference_mode_only():
    """A dense INT4 model's spec carries its format; the GPU kernel takes
    groups of 32 to 128 (it then needs a GPU: refused here for the missing
    one) and refuses a scale a whole row at start-up (no device function
    for it), pointing at reference mode."""
    from vllm_ext import backend

    spec = _llama_spec(_ct({"group_size": 32}))
    assert spec.quant == quant_format(_ct({"group_size": 32}))
    with pytest.raises(ValueError, match="needs .*GPU"):
        backend._check_gpu_kernel(None, spec)
    rows = _llama_spec(_ct({"strategy": "channel", "group_size": None}))
    with pytest.raises(ValueError, match="reference mode only.*INTERPRET=1"):
        backend._check_gpu_kernel(None, rows)


def test_quantized_kernels_take_at_most_16_requests(monkeypatch):
    """VLLM_MEGAKERNEL_MAX_BATCH above the quantized kernels' largest
    bucket is capped to it, naming why; a bf16 model takes what is asked."""
    from vllm_ext import backend

    monkeypatch.delenv("VLLM_MEGAKERNEL_INTERPRET", raising=False)
    monkeypatch.setenv("VLLM_MEGAKERNEL_MAX_BATCH", "64")
    fp8 = _llama_spec(_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized"))
    taken, why = backend.decode_batches(fp8, torch.device("cpu"))
    assert taken == 16 and "quantized kernels' largest bucket" in why
    plain = dataclasses.replace(fp8, quant=None)
    assert backend.decode_batches(plain, torch.device("cpu"))[0] == 64


def test_the_gpu_kernel_takes_fp8_on_dense_models():
    """Per-channel FP8 W8A8 and FP8 blocks on a dense model pass the
    kernel's format check (it then needs a GPU: refused here for the
    missing one, not for the format); INT4 does not
    (test_int4_runs_in_reference_mode_only)."""
    from vllm_ext import backend

    channel = _llama_spec(_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized"))
    blocks = _llama_spec({"quant_method": "fp8", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]})  # fmt: skip
    for spec in (channel, blocks):
        with pytest.raises(ValueError, match="needs .*GPU"):
            backend._check_gpu_kernel(None, spec)


@pytest.mark.parametrize(
    "config, refused",
    [
        (_ct({"group_size": 32}), None),  # Kimi-K2-Thinking's experts' format
        ({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True,
          "desc_act": False}, None),
        # The router left in the model dtype (RedHat's FP8-dynamic Qwen3-MoE).
        (quantization_config("fp8-channel", 2, mixture=True), None),
        (_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized") | {
            "ignore": ["lm_head", "re:.*mlp.experts.*"]},
         "FP8 leaving .*experts.* unquantized"),
        # DeepSeek-V3's and Qwen3's FP8 experts.
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None),
    ],
    ids=["pack-quantized", "gptq", "fp8-channel", "fp8-channel-experts-left",
         "fp8-block"],
)  # fmt: skip
def test_quantized_mixtures_taken_and_refused_by_name(config, refused):
    """A quantized Qwen3-MoE's spec carries its format, and the GPU kernel
    takes it (quantized experts: ops/expert_up.py, expert_down.py; it then
    needs a GPU, refused here for the missing one)."""
    from vllm_ext import backend
    from vllm_ext.demo_models import hf_config
    from vllm_ext.model_spec import ModelSpec, UnsupportedModelError

    hf = hf_config("qwen3_moe")
    hf.quantization_config = config
    if refused is not None:
        with pytest.raises(UnsupportedModelError, match=refused):
            ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
        return
    spec = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    assert spec.moe is not None and spec.quant == quant_format(config)
    with pytest.raises(ValueError, match="needs .*GPU"):
        backend._check_gpu_kernel(None, spec)


def test_the_gpu_kernel_takes_fp8_or_bf16_latent_attention():
    """DeepSeek-V3 in FP8 blocks (latent attention, a shared expert) and
    with Kimi-K2-Thinking's INT4 routed experts (the rest bf16) pass the
    kernel's format check (it then needs a GPU: refused here for the
    missing one). INT4 latent attention has no reference either: refused
    with the spec, by name. INT4 leaving the attention alone in bf16 runs
    in reference mode (each layer read as vLLM loaded it), and the kernel
    refuses it at start-up by name."""
    from vllm_ext import backend
    from vllm_ext.demo_models import hf_config
    from vllm_ext.model_spec import ModelSpec, UnsupportedModelError

    hf = hf_config("deepseek_v3_fp8")
    hf.quantization_config = DEEPSEEK_FP8
    spec = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    assert spec.mla is not None and spec.moe.shared_intermediate
    with pytest.raises(ValueError, match="needs .*GPU"):
        backend._check_gpu_kernel(None, spec)
    hf.quantization_config = _ct({"group_size": 32}) | {"ignore": EXPERTS_ONLY_IGNORE}
    thinking = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    assert thinking.quant.experts_only
    with pytest.raises(ValueError, match="needs .*GPU"):
        backend._check_gpu_kernel(None, thinking)
    hf.quantization_config = _ct({"group_size": 32})
    with pytest.raises(UnsupportedModelError, match="int4-w4a16 .* latent attention"):
        ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    hf.quantization_config = _ct({"group_size": 32}) | {"ignore": ["re:.*self_attn.*"]}
    mixed = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    assert not mixed.quant.experts_only
    with pytest.raises(ValueError, match="leaving attention in the model dtype"):
        backend._check_gpu_kernel(None, mixed)


def test_a_grouped_query_mix_of_quantized_and_bf16_is_refused_by_name():
    """An INT4 checkpoint leaving its attention bf16 beside INT4 MLPs (a
    Llama; the Qwen3-MoE demo, whose first layer's MLP is dense) is refused
    at start-up, by name, on both routes: a grouped-query model's layers
    are read all as codes, or all bf16 with the routed experts alone
    quantized (test_experts_only_is_judged_in_the_model)."""
    from vllm_ext.demo_models import hf_config
    from vllm_ext.model_spec import ModelSpec, UnsupportedModelError

    mixed = _ct({"group_size": 32}) | {"ignore": ["re:.*self_attn.*"]}
    with pytest.raises(UnsupportedModelError, match="leaving attention in the model"):
        _llama_spec(mixed)
    hf = hf_config("qwen3_moe")
    hf.quantization_config = mixed
    with pytest.raises(UnsupportedModelError, match="not the routed experts alone"):
        ModelSpec.from_hf_config(hf, torch.bfloat16, 512)


@pytest.mark.parametrize(
    "ignore, left",
    [
        (["lm_head", ROUTER], set()),
        (EXPERTS_ONLY_IGNORE, {ATTENTION, DENSE_MLP, SHARED_EXPERTS}),
        (["re:.*self_attn.*"], {ATTENTION}),
        (["model.layers.0.self_attn.q_proj"], {f"some {ATTENTION}"}),
        (["re:.*self_attn[.]o_proj$"], {f"some {ATTENTION}"}),
        (["re:model[.]layers[.]0[.].*"], {f"some {k}" for k in (
            ATTENTION, DENSE_MLP, SHARED_EXPERTS, ROUTED_EXPERTS)}),
        (["re:.*experts.*"], {SHARED_EXPERTS, ROUTED_EXPERTS}),
    ],
    ids=["none", "kimi-k2-thinking", "attention", "one-layer", "one-module",
         "first-layer", "all-experts"],
)  # fmt: skip
def test_ignore_lists_name_the_projections_left_unquantized(ignore, left):
    """compressed-tensors' ``ignore`` as it matches vLLM's module names (a
    ``re:`` pattern by ``re.match``, a name by equality): the kinds it
    leaves in the model dtype, "some" where it names part of a kind."""
    fmt = quant_format(_ct({"group_size": 32}) | {"ignore": ignore})
    assert fmt.unquantized == left and not fmt.experts_only


@pytest.mark.parametrize(
    "ignore, kinds, experts_only",
    [
        (EXPERTS_ONLY_IGNORE, {ATTENTION, DENSE_MLP, SHARED_EXPERTS, ROUTED_EXPERTS},
         True),
        # Qwen3-MoE: no dense MLP, no shared expert.
        (["re:.*self_attn.*"], {ATTENTION, ROUTED_EXPERTS}, True),
        (["re:.*self_attn.*"], {ATTENTION, DENSE_MLP, ROUTED_EXPERTS}, False),
        # A dense model: nothing but the routed experts' to keep.
        (EXPERTS_ONLY_IGNORE, {ATTENTION, DENSE_MLP}, False),
        (["lm_head"], {ATTENTION, ROUTED_EXPERTS}, False),
    ],
)  # fmt: skip
def test_experts_only_is_judged_in_the_model(ignore, kinds, experts_only):
    """``for_model``: the routed experts the one kind quantized among the
    kinds the model has (a kind it lacks is no concern)."""
    fmt = for_model(quant_format(_ct({"group_size": 32}) | {"ignore": ignore}), kinds)
    assert fmt.experts_only == experts_only
    assert fmt.unquantized <= kinds


def _int4_experts(e: int, n: int, k: int, group: int = 32):
    """Random experts packed as compressed-tensors packs them, and their
    weights ``[E, N, K]`` dequantized by compressed-tensors' own unpacking
    (tests/cpu_quant_ops.py)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tests.cpu_quant_ops import unpack_int4_experts

    torch.manual_seed(0)
    drawn = [quantize_int4(torch.randn(n, k), group) for _ in range(e)]
    packed = torch.stack([pack_to_int32(codes, 4) for codes, _ in drawn])
    scales = torch.stack([s for _, s in drawn])
    return packed, scales, unpack_int4_experts(packed, scales)


def test_int4_experts_read_as_compressed_tensors_unpacks_them():
    """The backend's reading of vLLM's loaded INT4 experts (its own
    unpacking) equals compressed-tensors' dequantization bit for bit, for
    gate/up and down alike; a layout vLLM repacked is refused by name."""
    from types import SimpleNamespace

    from vllm_ext.quant import int4_experts

    e, h, inter = 3, 64, 96
    w13p, w13s, w13 = _int4_experts(e, 2 * inter, h)
    w2p, w2s, w2 = _int4_experts(e, h, inter)
    experts = SimpleNamespace(
        w13_weight_packed=w13p, w13_weight_scale=w13s,
        w2_weight_packed=w2p, w2_weight_scale=w2s, quant_method=object(),
    )  # fmt: skip
    up, down = int4_experts(experts, e, h, inter)
    assert torch.equal(up.dequantize().view(e, 2 * inter, h), w13)
    assert torch.equal(down.dequantize().view(e, h, inter), w2)
    # Read in place: the words' bytes, no copy.
    assert up.codes.data_ptr() == w13p.data_ptr()
    experts.w2_weight_packed = w2p.transpose(1, 2).contiguous()  # K-first
    with pytest.raises(ValueError, match="INT4 w2 experts are held as.*triton"):
        int4_experts(experts, e, h, inter)


def test_int4_experts_read_as_vllms_triton_experts_keep_them():
    """vLLM's Triton WNA16 experts (``--moe-backend triton``; on a GPU vLLM
    otherwise repacks them for Marlin) keep the words as bytes: its own
    conversion (``convert_to_wna16_moe_kernel_format``) run here, read in
    place, dequantizes to compressed-tensors' weights bit for bit."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
        WNA16MoEBackend,
        convert_to_wna16_moe_kernel_format,
    )

    from vllm_ext.quant import int4_experts

    e, h, inter = 3, 64, 96
    w13p, w13s, w13 = _int4_experts(e, 2 * inter, h)
    w2p, w2s, w2 = _int4_experts(e, h, inter)
    w13b, w2b, w13s, w2s, *_ = convert_to_wna16_moe_kernel_format(
        WNA16MoEBackend.TRITON, None, None, torch.bfloat16, w13p, w2p, w13s, w2s
    )
    assert w13b.dtype == torch.uint8 and w13b.shape == (e, 2 * inter, h // 2)
    experts = SimpleNamespace(
        w13_weight_packed=w13b, w13_weight_scale=w13s,
        w2_weight_packed=w2b, w2_weight_scale=w2s, quant_method=object(),
    )  # fmt: skip
    up, down = int4_experts(experts, e, h, inter)
    assert up.codes.data_ptr() == w13b.data_ptr()
    assert torch.equal(up.dequantize().view(e, 2 * inter, h), w13)
    assert torch.equal(down.dequantize().view(e, h, inter), w2)


def _gptq_experts(e: int, n: int, k: int):
    """Random experts written as GPTQ writes them (demo_quant), held as
    vLLM's AutoGPTQMoEMethod holds them once it transposed them N-first
    (``[E, N, K / 8]`` words, ``[E, N, K / 64]`` scales in the model dtype),
    and their weights ``[E, N, K]`` as vLLM's own unpacking gives them."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    drawn = [_gptq("w.weight", torch.randn(n, k)) for _ in range(e)]
    qweight = torch.stack([t["w.qweight"] for t in drawn])  # [E, K / 8, N]
    scales = torch.stack([t["w.scales"] for t in drawn]).to(torch.bfloat16)
    codes = torch.stack(
        [unpack_quantized_values_into_int32(q, scalar_types.uint4b8, 0)
         for q in qweight]
    )  # fmt: skip
    full = scales.repeat_interleave(k // scales.shape[1], dim=1)
    weights = ((codes - 8).to(torch.bfloat16) * full).transpose(1, 2)
    n_first = (qweight.transpose(1, 2).contiguous(), scales.transpose(1, 2))
    return *n_first, weights


def test_gptq_experts_read_as_vllm_unpacks_them():
    """GPTQ experts read as vLLM's AutoGPTQMoEMethod holds them (``qweight``
    and ``scales``, transposed N-first before its kernel's repack) equal
    vLLM's own unpacking of the checkpoint's words bit for bit, and so does
    the INT4 mixture's stand-in reading them (tests/cpu_quant_ops.py); an
    expert bias, which the backend would drop, is refused by name."""
    from types import SimpleNamespace

    from tests.cpu_quant_ops import unpack_int4_experts
    from vllm_ext.quant import int4_experts

    torch.manual_seed(1)
    e, h, inter = 3, 128, 64
    w13q, w13s, w13 = _gptq_experts(e, 2 * inter, h)
    w2q, w2s, w2 = _gptq_experts(e, h, inter)
    experts = SimpleNamespace(
        w13_qweight=w13q, w13_scales=w13s, w2_qweight=w2q, w2_scales=w2s,
        w13_bias=None, w2_bias=None, quant_method=object(),
    )  # fmt: skip
    up, down = int4_experts(experts, e, h, inter)
    assert torch.equal(up.dequantize().view(e, 2 * inter, h), w13)
    assert torch.equal(down.dequantize().view(e, h, inter), w2)
    assert torch.equal(unpack_int4_experts(w13q, w13s), w13)
    experts.w13_bias = torch.zeros(e, 2 * inter)
    with pytest.raises(ValueError, match="w13 experts have biases"):
        int4_experts(experts, e, h, inter)


def test_fp8_channel_experts_are_the_gpu_fused_moe():
    """Per-channel FP8 experts read as vLLM loads them (``fp8_experts``:
    each code times its output channel's scale, equal to vLLM's
    ``scaled_dequantize``), and the reference's expert MLP on them (inputs
    quantized per token as they enter each GEMM) against the GPU's
    per-channel fused MoE (tests/cpu_quant_ops.py) with every token routed
    to that expert: the same quantized operands, apart only by fp32 and
    bf16 rounding. A transposed layout is refused by name."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
    )

    from tests.cpu_quant_ops import fp8_channel_fused_experts
    from vllm_ext.demo_quant import _fp8_channel
    from vllm_ext.quant import fp8_experts
    from vllm_ext.reference import swiglu_mlp

    e, h, inter = 2, 256, 96
    gen = torch.Generator().manual_seed(7)
    held = {}
    for name, shape in (("w13", (2 * inter, h)), ("w2", (h, inter))):
        drawn = [_fp8_channel("w.weight", torch.randn(*shape, generator=gen) * 0.05)
                 for _ in range(e)]  # fmt: skip
        held[f"{name}_weight"] = torch.stack([t["w.weight"] for t in drawn])
        held[f"{name}_weight_scale"] = torch.stack([t["w.weight_scale"] for t in drawn])
    experts = SimpleNamespace(**held)
    w13, w2 = (w.dequantize() for w in fp8_experts(experts, e, h, inter))
    for ours, name in ((w13, "w13"), (w2, "w2")):
        codes, scale = held[f"{name}_weight"], held[f"{name}_weight_scale"]
        group = GroupShape(1, codes.shape[-1])
        theirs = [
            scaled_dequantize(c, s, group) for c, s in zip(codes, scale, strict=True)
        ]
        assert torch.equal(ours, torch.stack(theirs))
    x = torch.randn(5, h, generator=gen).to(torch.bfloat16)
    quant = quant_format(quantization_config("fp8-channel", 2, mixture=True))
    for expert in range(e):
        ours = swiglu_mlp(x, w13[expert], w2[expert], quant).to(torch.bfloat16)
        gpu = fp8_channel_fused_experts(
            x, held["w13_weight"], held["w2_weight"], held["w13_weight_scale"],
            held["w2_weight_scale"], torch.ones(5, 1), torch.full((5, 1), expert),
        )  # fmt: skip
        assert (ours.float() - gpu.float()).abs().max() <= 2**-6 * gpu.abs().max()
    experts.w2_weight = experts.w2_weight.transpose(1, 2)  # a kernel's layout
    with pytest.raises(ValueError, match="FP8 w2 experts are held as"):
        fp8_experts(experts, e, h, inter)


def test_fp8_per_channel_is_taken():
    fmt = quant_format(_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized"))
    assert (fmt.name, fmt.bits, fmt.activations) == (FP8_W8A8, 8, "fp8-per-token")
    # Layers the program would quantize alike, but the checkpoint leaves.
    config = _ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized")
    config["ignore"] = ["lm_head", "re:.*down_proj"]
    with pytest.raises(ValueError, match="leaving"):
        quant_format(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_input_is_vllm_quant_fp8(dtype):
    """Per-token FP8 input quantization equals vLLM's own (QuantFP8's
    PyTorch path) dequantized, bit for bit, zero rows included."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from tests.cpu_quant_ops import quantize_tokens

    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2)) * 3
    x[1] *= 1e-3
    x[2] = 0
    x = x.to(dtype)
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        quant_fp8 = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        q, scale = quant_fp8.forward_native(x)
    fmt = quant_format(_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized"))
    assert torch.equal(quantize_input(x, fmt), q.float() * scale)
    assert quantize_input(x, None) is x
    # And the per-channel fused MoE's stand-in (tests/cpu_quant_ops.py).
    stand_in_q, stand_in_scale = quantize_tokens(x)
    assert torch.equal(stand_in_q, q) and torch.equal(stand_in_scale, scale)


# DeepSeek-V3's and Kimi-K2's quantization_config.
DEEPSEEK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}  # fmt: skip


def test_fp8_blocks_are_taken():
    fmt = quant_format(DEEPSEEK_FP8)
    assert (fmt.name, fmt.group_size, fmt.activations) == (
        FP8_BLOCK,
        128,
        "fp8-per-token-group-128",
    )


@pytest.mark.parametrize("k", [384, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_input_quantization_is_vllm_quant_fp8(dtype, k):
    """Per-token groups of 128 (FP8 blocks' activations) equal vLLM's
    QuantFP8 group path dequantized, bit for bit; a K not a multiple of 128
    ends in a partial group, scaled by its own elements (vLLM pads it with
    zeros), in the GPU block GEMM's stand-in too."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from tests.cpu_quant_ops import quantize_groups

    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)) * 2
    x[0, :128] *= 1e-3
    x[1, 128:256] = 0
    x[2, -1] = 100.0  # the last (partial) group's scale
    x = x.to(dtype)
    with set_current_vllm_config(VllmConfig()):
        quant_fp8 = QuantFP8(static=False, group_shape=GroupShape(1, 128))
        q, scale = quant_fp8.forward_native(x)
    theirs = q.float() * scale.repeat_interleave(128, -1)[:, :k]
    assert torch.equal(quantize_input(x, quant_format(DEEPSEEK_FP8)), theirs)
    stand_in_q, stand_in_scale = quantize_groups(x)
    assert torch.equal(stand_in_q, q) and torch.equal(stand_in_scale, scale)


@pytest.mark.parametrize("n, k", [(256, 384), (576, 200)])
def test_fp8_block_reference_is_the_gpu_block_gemm(n, k):
    """The reference's FP8-block projection (inputs quantized by
    quantize_input, the weight read back by fp8_weight) against the GPU's
    block GEMM (tests/cpu_quant_ops.py: per K block, e4m3 products summed,
    then both scales): the same quantized operands, so only fp32 rounding
    apart; the weight read back equals the checkpoint's blocks. A partial
    last block (N, K not multiples of 128) is its own block, in both."""
    from types import SimpleNamespace

    from tests.cpu_quant_ops import block_fp8_matmul
    from vllm_ext.demo_quant import _fp8_block
    from vllm_ext.quant import fp8_weight
    from vllm_ext.reference import linear

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(n, k, generator=gen) * 0.05
    t = _fp8_block("w.weight", weight)
    layer = SimpleNamespace(
        weight=t["w.weight"], weight_scale_inv=t["w.weight_scale_inv"]
    )
    w_eff = fp8_weight(layer, (n, k))
    blocks = t["w.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(w_eff, t["w.weight"].float() * blocks[:n, :k])
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16)
    ours = linear(quantize_input(x, quant_format(DEEPSEEK_FP8)), w_eff)
    gpu = block_fp8_matmul(x, t["w.weight"], t["w.weight_scale_inv"], torch.float32)
    assert torch.allclose(ours, gpu, rtol=1e-5, atol=1e-6)


def test_fp8_block_experts_are_the_gpu_fused_moe():
    """FP8-block experts read as vLLM loads them (``fp8_experts``:
    each code times its block's scale, equal to the writer's blocks), and
    the reference's expert MLP on them (inputs quantized per token group as
    they enter each GEMM) against the GPU's block-FP8 fused MoE
    (tests/cpu_quant_ops.py) with every token routed to that expert: the
    same quantized operands, apart only by fp32 and bf16 rounding. A
    repacked layout is refused by name."""
    from types import SimpleNamespace

    from tests.cpu_quant_ops import fp8_block_fused_experts
    from vllm_ext.demo_quant import _fp8_block
    from vllm_ext.quant import fp8_experts
    from vllm_ext.reference import swiglu_mlp

    e, h, inter = 2, 256, 128
    gen = torch.Generator().manual_seed(5)
    packed = {}
    for name, shape in (("w13", (2 * inter, h)), ("w2", (h, inter))):
        drawn = [_fp8_block("w.weight", torch.randn(*shape, generator=gen) * 0.05)
                 for _ in range(e)]  # fmt: skip
        packed[f"{name}_weight"] = torch.stack([t["w.weight"] for t in drawn])
        packed[f"{name}_weight_scale_inv"] = torch.stack(
            [t["w.weight_scale_inv"] for t in drawn]
        )
    experts = SimpleNamespace(**packed)
    w13, w2 = (w.dequantize() for w in fp8_experts(experts, e, h, inter))
    blocks = packed["w2_weight_scale_inv"].repeat_interleave(128, 1)
    assert torch.equal(w2, packed["w2_weight"].float() * blocks)
    x = torch.randn(5, h, generator=gen).to(torch.bfloat16)
    quant = quant_format(DEEPSEEK_FP8)
    for expert in range(e):
        ours = swiglu_mlp(x, w13[expert], w2[expert], quant).to(torch.bfloat16)
        ids = torch.full((5, 1), expert)
        gpu = fp8_block_fused_experts(
            x, packed["w13_weight"], packed["w2_weight"],
            packed["w13_weight_scale_inv"], packed["w2_weight_scale_inv"],
            torch.ones(5, 1), ids,
        )  # fmt: skip
        assert (ours.float() - gpu.float()).abs().max() <= 2**-6 * gpu.abs().max()
    experts.w2_weight = experts.w2_weight.transpose(1, 2)  # a kernel's layout
    with pytest.raises(ValueError, match="FP8 w2 experts are held as"):
        fp8_experts(experts, e, h, inter)


def test_weight_bytes_count_codes_and_scales():
    """What the planner counts a projection at (``QuantFormat.weight_bytes``),
    a 4096 x 14336 one: the codes, and each format's scales."""
    rows, cols = 4096, 14336
    int4 = quant_format(_ct({"group_size": 128}))
    channel = quant_format(_ct(FP8_CHANNEL, FP8_TOKEN, "float-quantized"))
    blocks = quant_format(DEEPSEEK_FP8)
    assert int4.weight_bytes(rows, cols, 2) == rows * cols // 2 + rows * 112 * 2
    assert channel.weight_bytes(rows, cols, 2) == rows * cols + rows * 4
    assert blocks.weight_bytes(rows, cols, 2) == rows * cols + 32 * 112 * 4


def test_planner_counts_int4_experts():
    """A pack-quantized Qwen3-MoE's step: the experts' bytes in the floor
    are their codes and group scales (the embedding, norms and router stay
    bf16)."""
    from vllm_ext.demo_models import hf_config
    from vllm_ext.megakernel.cost import DEVICES
    from vllm_ext.megakernel.isa import Op
    from vllm_ext.megakernel.planner import plan
    from vllm_ext.model_spec import ModelSpec

    hf = hf_config("qwen3_moe")
    dense = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    hf.quantization_config = _ct({"group_size": 32})
    int4 = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    bf16_plan, int4_plan = (plan(s, 1, DEVICES["h200"]) for s in (dense, int4))

    def experts(p, op: Op) -> int:
        """The routed experts' weight bytes of ``op``, less the RMSNorm
        weight each EXPERT_UP tile reads in the model dtype."""
        tiles = [i for q in p.queues for i in q if i.op == op]
        norms = len(tiles) * dense.hidden_size * 2 if op == Op.EXPERT_UP else 0
        return sum(p.routed_weight_bytes(i) for i in tiles) - norms

    # Half a byte a weight plus a bf16 scale a group of 32: 9/32 of bf16's 2.
    for op in (Op.EXPERT_UP, Op.EXPERT_DOWN):
        assert experts(bf16_plan, op) > 0
        assert experts(int4_plan, op) * 32 == experts(bf16_plan, op) * 9
    assert int4_plan.weight_bytes() < bf16_plan.weight_bytes()
    # The routed experts alone quantized: the rest counted as bf16's.
    hf.quantization_config = _ct({"group_size": 32}) | {"ignore": EXPERTS_ONLY_IGNORE}
    experts_only = ModelSpec.from_hf_config(hf, torch.bfloat16, 512)
    assert experts_only.quant.experts_only
    ours = plan(experts_only, 1, DEVICES["h200"])
    for op in (Op.EXPERT_UP, Op.EXPERT_DOWN):
        assert experts(ours, op) == experts(int4_plan, op)
    rest = [
        (bf16_plan.cost(i), ours.cost(i))
        for i in (i for q in ours.queues for i in q)
        if i.op in (Op.QKV, Op.O_PROJ, Op.GATE_UP, Op.DOWN)
    ]
    assert rest and all(a == b for a, b in rest)


@pytest.mark.parametrize("shape", [(576, 256), (96, 200), (256, 512)])
def test_fp8_partial_blocks_dequantize_as_vllm(shape):
    """DeepSeek-V3's FP8 blocks where N or K is not a multiple of 128
    (kv_a's 576 rows: four blocks and a half): the writer's scales
    ``[ceil(N / 128), ceil(K / 128)]``, a partial block scaled by its own
    elements; the backend's dequantization (``_dequantize_blocks``, what
    ``fp8_weight`` and ``fp8_experts`` read) equals vLLM's
    ``block_dequant`` bit for bit, and, where vLLM's MLA dequantizes kv_b
    (``scaled_dequantize``, whole blocks), that too in bf16."""
    from vllm.model_executor.layers.quantization.utils.int8_utils import (
        block_dequant,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
    )

    from vllm_ext.demo_quant import _fp8_block
    from vllm_ext.quant import _dequantize_blocks

    n, k = shape
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(n, k, generator=gen) * 0.05
    weight[-1, -1] = 3.0  # the last block's scale is its own elements'
    t = _fp8_block("w.weight", weight)
    codes, scale = t["w.weight"], t["w.weight_scale_inv"]
    assert codes.shape == (n, k) and scale.shape == (-(-n // 128), -(-k // 128))
    assert scale[-1, -1] == 3.0 / 448
    ours = _dequantize_blocks(codes, scale)
    assert torch.equal(ours, block_dequant(codes, scale, [128, 128]))
    if n % 128 == 0 and k % 128 == 0:
        theirs = scaled_dequantize(codes, scale, GroupShape(128, 128), torch.bfloat16)
        assert torch.equal(ours.to(torch.bfloat16), theirs)


def _quantize_groups_f64(x: torch.Tensor) -> torch.Tensor:
    """Per-token groups of 128 to e4m3 and back, in float64."""
    groups = x.view(x.shape[0], -1, 128)
    scale = (groups.abs().amax(-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
    q = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.double() * scale).view(x.shape)


def _rope_gptj_f64(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)


@pytest.mark.parametrize("quantized_inputs", [True, False])
def test_mla_fp8_reference_layer_against_float64(quantized_inputs):
    """The reference's FP8-block latent attention layer (DeepSeek-V3's
    layout: q_a and kv_a one fused FP8 layer, its 704 rows ending in half a
    block; q_b, kv_b, o_proj FP8) in fp32 against an independent float64
    computation in the unabsorbed form (k_nope and v up-projected from the
    cached kv_c; ``torch.bfloat16`` nowhere): q_a's, kv_a's, q_b's and
    o_proj's inputs quantized per token group, kv_b dequantized alone.
    Without the input quantization (the float64 side's, ``False``) the two
    are far apart: the test sees it."""
    from types import SimpleNamespace

    from vllm_ext.demo_quant import _fp8_block
    from vllm_ext.model_spec import MlaSpec
    from vllm_ext.quant import fp8_weight
    from vllm_ext.reference import mla_attention
    from vllm_ext.runner import DecodeInputs
    from vllm_ext.weights import LayerWeights, MlaWeights

    h, heads, lora, rank, rope, nope, v = 256, 4, 128, 512, 64, 32, 32
    mla = MlaSpec(heads, lora, rank, nope, rope, v, softmax_scale=(nope + rope) ** -0.5)
    gen = torch.Generator().manual_seed(7)

    def fp8(n: int, k: int):
        t = _fp8_block("w.weight", torch.randn(n, k, generator=gen) * 0.05)
        layer = SimpleNamespace(weight=t["w.weight"],
                                weight_scale_inv=t["w.weight_scale_inv"])  # fmt: skip
        exact = (
            t["w.weight"].double()
            * t["w.weight_scale_inv"]
            .double()
            .kron(torch.ones(128, 128, dtype=torch.float64))[:n, :k]
        )
        return fp8_weight(layer, (n, k)), exact

    fused, fused64 = fp8(lora + mla.latent_width, h)
    (q_b, q_b64), (kv_b, kv_b64) = (
        fp8(heads * (nope + rope), lora),
        fp8(heads * (nope + v), rank),
    )
    o_proj, o_proj64 = fp8(h, heads * v)
    q_norm, kv_norm = (torch.rand(n, generator=gen) + 0.5 for n in (lora, rank))
    weights = LayerWeights(
        input_norm=torch.ones(h), qkv=None, qkv_bias=None, q_norm=None,
        k_norm=None, o_proj=o_proj, post_norm=torch.ones(h), gate_up=None,
        down=None,
        mla=MlaWeights(q_a=fused[:lora], q_a_norm=q_norm, q_b=q_b,
                       kv_a=fused[lora:], kv_a_norm=kv_norm, kv_b=kv_b),
    )  # fmt: skip

    batch, history, block = 2, 20, 16
    cache = torch.randn(4, block, mla.latent_width, generator=gen)  # the past rows
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    inputs = DecodeInputs(
        input_ids=torch.zeros(batch, dtype=torch.long),
        positions=torch.full((batch,), history),
        block_table=table,
        seq_lens=torch.full((batch,), history + 1),
        slot_mapping=table[:, history // block] * block + history % block,
        kv_caches=(cache,),
    )
    x = torch.randn(batch, h, generator=gen)
    angles = torch.rand(batch, rope // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    eps = 1e-6
    past = [cache[table[i]].reshape(-1, mla.latent_width)[:history].double()
            for i in range(batch)]  # fmt: skip
    out = mla_attention(x, weights, mla, cos, sin, cache, inputs, mla.softmax_scale,
                        eps, quant_format(DEEPSEEK_FP8))  # fmt: skip

    def enter(t):
        return _quantize_groups_f64(t) if quantized_inputs else t

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    x64 = enter(x.double())
    qkv_a = x64 @ fused64.t()
    q = (enter(norm(qkv_a[:, :lora], q_norm)) @ q_b64.t()).view(batch, heads, -1)
    q_nope, q_pe = (
        q[..., :nope],
        _rope_gptj_f64(q[..., nope:], cos.double(), sin.double()),
    )
    kv_c = norm(qkv_a[:, lora : lora + rank], kv_norm)
    k_pe = _rope_gptj_f64(qkv_a[:, None, lora + rank :], cos.double(), sin.double())[
        :, 0
    ]
    w_kv = kv_b64.view(heads, nope + v, rank)
    attn = torch.empty(batch, heads, v, dtype=torch.float64)
    for i in range(batch):
        rows = torch.cat([past[i], torch.cat([kv_c[i], k_pe[i]])[None]])
        k_nope = torch.einsum("hpl,sl->shp", w_kv[:, :nope], rows[:, :rank])
        values = torch.einsum("hvl,sl->shv", w_kv[:, nope:], rows[:, :rank])
        scores = (
            torch.einsum("hp,shp->hs", q_nope[i], k_nope) + q_pe[i] @ rows[:, rank:].t()
        )
        probs = torch.softmax(scores * mla.softmax_scale, -1)
        attn[i] = torch.einsum("hs,shv->hv", probs, values)
    expected = enter(attn.reshape(batch, -1)) @ o_proj64.t()

    # fp32 sums of a few hundred terms, over four GEMMs and a softmax.
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert out.isfinite().all()
    if quantized_inputs:
        assert err < 1e-5, err
    else:
        assert err > 1e-3, err
