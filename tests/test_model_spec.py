# SPDX-License-Identifier: Apache-2.0
"""Which models the megakernel takes, and the message for those it refuses."""

import math

import pytest
import torch
from transformers import AutoConfig

from vllm_ext import configs
from vllm_ext.model_spec import ModelSpec, UnsupportedModelError
from vllm_ext.quant import FP8_BLOCK, quant_format

# Checkpoint formats the backend takes on dense models.
_PACK_QUANTIZED = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4,
                                              "strategy": "group",
                                              "group_size": 32}}},
}  # fmt: skip
_FP8 = {"type": "float", "num_bits": 8}
_FP8_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {
        "weights": _FP8 | {"strategy": "channel"},
        "input_activations": _FP8 | {"strategy": "token", "dynamic": True},
    }},
}  # fmt: skip


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama-3.2-1b", dict(head_dim=64, num_kv_heads=8, tie_word_embeddings=True)),
        ("llama-3.1-8b", dict(head_dim=128, num_kv_heads=8, qkv_bias=False)),
        ("qwen3-8b", dict(head_dim=128, qk_norm=True, qkv_bias=False)),
        ("qwen2.5-0.5b", dict(head_dim=64, num_kv_heads=2, qkv_bias=True)),
        ("mistral-7b-v0.3", dict(head_dim=128, tie_word_embeddings=False)),
    ],
)
def test_real_configs(name, expected):
    spec = ModelSpec.from_hf_config(configs.hf_config(name), torch.bfloat16, 4096)
    for field, value in expected.items():
        assert getattr(spec, field) == value, field
    assert spec.q_size == spec.num_q_heads * spec.head_dim


def _config(**changes):
    data = {**configs.load("llama-3.2-1b"), **changes}
    return AutoConfig.for_model(data.pop("model_type"), **data)


@pytest.mark.parametrize(
    "changes, dtype, message",
    [
        (dict(architectures=["GPT2LMHeadModel"]), torch.bfloat16, "GPT2LMHeadModel"),
        ({}, torch.float16, "dtype torch.float16"),
        (dict(head_dim=96), torch.bfloat16, "head dim 96"),
        (dict(hidden_act="gelu"), torch.bfloat16, "activation 'gelu'"),
        (dict(attention_bias=True), torch.bfloat16, "attention bias"),
        (dict(mlp_bias=True), torch.bfloat16, "MLP bias"),
        (dict(sliding_window=256), torch.bfloat16, "sliding-window"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            torch.bfloat16,
            "rope type 'yarn'",
        ),
    ],
)
def test_unsupported_is_named(changes, dtype, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_hf_config(_config(**changes), dtype, 4096)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("qwen3-30b-a3b", dict(num_experts=128, top_k=8, expert_intermediate=768,
                               renormalize=True, sparse_layers=(True,) * 48)),
        ("mixtral-8x7b", dict(num_experts=8, top_k=2, expert_intermediate=14336,
                              renormalize=True, sparse_layers=(True,) * 32)),
    ],
)  # fmt: skip
def test_real_moe_configs(name, expected):
    spec = ModelSpec.from_hf_config(configs.hf_config(name), torch.bfloat16, 4096)
    for field, value in expected.items():
        assert getattr(spec.moe, field) == value, field
    assert (spec.moe.scoring, spec.moe.grouped, spec.moe.correction_bias) == (
        "softmax", False, False)  # fmt: skip


def _moe_config(**changes):
    data = {**configs.load("qwen3-30b-a3b"), "num_hidden_layers": 6, **changes}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def test_sparse_layers_are_vllms():
    """vLLM's rule (qwen3_moe.py): a layer is sparse unless it is in
    mlp_only_layers, and only every decoder_sparse_step-th one."""
    config = _moe_config(mlp_only_layers=[0, 3], decoder_sparse_step=2)
    spec = ModelSpec.from_hf_config(config, torch.float32, 4096)
    assert spec.moe.sparse_layers == (False, True, False, False, False, True)
    config = _moe_config(norm_topk_prob=False, mlp_only_layers=[0, 1, 2, 3, 4])
    spec = ModelSpec.from_hf_config(config, torch.float32, 4096)
    assert not spec.moe.renormalize


def test_a_gated_shared_expert_is_refused():
    with pytest.raises(UnsupportedModelError, match="a gated shared expert"):
        ModelSpec.from_hf_config(
            _moe_config(shared_expert_intermediate_size=512), torch.float32, 4096
        )


def test_sliding_window_wider_than_context_is_fine():
    spec = ModelSpec.from_hf_config(_config(sliding_window=8192), torch.float32, 4096)
    assert spec.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "window, refused", [(None, False), (512, False), (8192, False), (511, True)]
)
def test_one_sliding_window_rule(monkeypatch, window, refused):
    """The model's config at start-up and each attention layer vLLM builds
    (the MEGAKERNEL attention backend) are judged by the same rule: a window
    that covers max_model_len is full attention."""
    from types import SimpleNamespace

    from vllm_ext import attention

    max_model_len = 512
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512))
    monkeypatch.setattr(attention, "get_current_vllm_config", lambda: vllm_config)

    def spec():
        config = _config(sliding_window=window)
        ModelSpec.from_hf_config(config, torch.float32, max_model_len)

    def layer():
        attention.MegakernelAttentionImpl(4, 64, 0.125, 2, sliding_window=window)

    if refused:
        with pytest.raises(UnsupportedModelError, match="sliding-window"):
            spec()
        with pytest.raises(NotImplementedError, match="sliding-window"):
            layer()
    else:
        spec()
        layer()


# DeepSeek-V3's, Kimi-K2's and DeepSeek-V2-Lite's config.json (shapes and
# features; DeepSeek-V3's quantization_config left out: the bf16 copies).
_DEEPSEEK_COMMON = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_layer_freq=1,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    rms_norm_eps=1e-6,
    rope_theta=10000,
)
DEEPSEEK_CONFIGS = {
    "deepseek-v3": dict(
        _DEEPSEEK_COMMON,
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=129280,
        num_attention_heads=128,
        n_routed_experts=256,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        max_position_embeddings=163840,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                      "type": "yarn"},
    ),
    "kimi-k2": dict(
        _DEEPSEEK_COMMON,
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=163840,
        num_attention_heads=64,
        n_routed_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        max_position_embeddings=131072,
        rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                      "type": "yarn"},
    ),
    "deepseek-v2-lite": dict(
        _DEEPSEEK_COMMON,
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        q_lora_rank=None,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                      "type": "yarn"},
    ),
}  # fmt: skip


def _deepseek_config(name: str, **changes):
    data = {**DEEPSEEK_CONFIGS[name], **changes}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _mscale(factor: float, m: float) -> float:  # DeepSeek's YaRN correction
    return 0.1 * m * math.log(factor) + 1.0


@pytest.mark.parametrize(
    "name, mla, moe",
    [
        ("deepseek-v3",
         dict(num_heads=128, q_lora_rank=1536, latent_width=576, qk_head_dim=192,
              v_head_dim=128, softmax_scale=192**-0.5 * _mscale(40, 1.0) ** 2),
         dict(num_experts=256, top_k=8, expert_intermediate=2048, scoring="sigmoid",
              grouped=True, num_groups=8, topk_groups=4, correction_bias=True,
              routed_scaling=2.5, renormalize=True, shared_intermediate=2048,
              sparse_layers=(False,) * 3 + (True,) * 58)),
        ("kimi-k2",
         dict(num_heads=64, q_lora_rank=1536, latent_width=576,
              softmax_scale=192**-0.5 * _mscale(32, 1.0) ** 2),
         dict(num_experts=384, num_groups=1, topk_groups=1, correction_bias=True,
              routed_scaling=2.827, sparse_layers=(False,) + (True,) * 60)),
        ("deepseek-v2-lite",
         dict(num_heads=16, q_lora_rank=None, latent_width=576,
              softmax_scale=192**-0.5 * _mscale(40, 0.707) ** 2),
         dict(num_experts=64, top_k=6, scoring="softmax", correction_bias=False,
              renormalize=False, shared_intermediate=2 * 1408,
              sparse_layers=(False,) + (True,) * 26)),
    ],
)  # fmt: skip
def test_real_deepseek_configs(name, mla, moe):
    """DeepSeek-V2/V3 and Kimi-K2 read as vLLM's deepseek_v2.py reads them."""
    spec = ModelSpec.from_hf_config(_deepseek_config(name), torch.bfloat16, 4096)
    for field, value in mla.items():
        assert getattr(spec.mla, field) == pytest.approx(value), field
    for field, value in moe.items():
        assert getattr(spec.moe, field) == value, field
    # The grouped-query fields describe the latent cache (MLAAttentionSpec).
    assert (spec.num_kv_heads, spec.head_dim) == (1, 576)
    assert spec.num_q_heads == spec.mla.num_heads


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(index_topk=2048), "sparse attention"),
        (dict(attention_bias=True), "attention bias"),
        (dict(hidden_act="gelu"), "activation 'gelu'"),
        (
            dict(quantization_config={"quant_method": "fp8"}),
            "quantization FP8 with per-tensor scales",
        ),
        # Latent attention takes FP8 blocks only, so far (the next test).
        (
            dict(
                quantization_config={
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": 64,
                    "sym": True,
                }
            ),
            "int4-w4a16 \\(gptq\\) latent attention",
        ),
        (
            dict(quantization_config=_PACK_QUANTIZED),
            "int4-w4a16 \\(compressed-tensors pack-quantized\\) latent attention",
        ),
        (
            dict(quantization_config=_FP8_CHANNEL),
            "fp8-w8a8 \\(compressed-tensors float-quantized\\) latent attention",
        ),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear'"),
        (dict(scoring_func="sqrtsoftplus"), "MoE scoring 'sqrtsoftplus'"),
        (dict(n_group=None), "MoE without n_group"),
        (dict(moe_router_dtype="float32"), "an fp32 MoE router"),
        (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "without latent dims"),
    ],
)
def test_unsupported_deepseek_is_named(changes, message):
    config = _deepseek_config("deepseek-v3", **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_hf_config(config, torch.bfloat16, 4096)


def test_deepseek_fp8_blocks_are_taken():
    """DeepSeek-V3 and Kimi-K2 as shipped: FP8 e4m3 with 128x128 block
    scales in every linear layer and expert, latent attention included."""
    config = _deepseek_config(
        "deepseek-v3",
        quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                             "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]},
    )  # fmt: skip
    spec = ModelSpec.from_hf_config(config, torch.bfloat16, 4096)
    assert spec.mla is not None and spec.moe is not None
    assert spec.quant == quant_format(config.quantization_config)
    assert spec.quant.name == FP8_BLOCK


def test_deepseek_without_yarn_and_dense():
    """The default rope keeps the plain softmax scale; no routed experts:
    every layer dense (vLLM: n_routed_experts None; HF's config class does
    not take None, a plain namespace of its fields does)."""
    from types import SimpleNamespace

    config = _deepseek_config("deepseek-v3", rope_scaling=None, num_hidden_layers=4)
    config = SimpleNamespace(**{**config.to_dict(), "n_routed_experts": None})
    spec = ModelSpec.from_hf_config(config, torch.float32, 4096)
    assert spec.mla.softmax_scale == pytest.approx(192**-0.5)
    assert spec.moe is None and spec.with_layers(2).num_layers == 2


def _small(kind: str, **changes):
    if kind == "deepseek-v3":
        return _deepseek_config(kind, num_hidden_layers=4, **changes)
    return _moe_config(**changes)


# A refusal is about what the model runs. vLLM makes layer i a mixture
# (deepseek_v2.py) where n_routed_experts is set, i >= first_k_dense_replace
# and i % moe_layer_freq == 0; (qwen3_moe.py) where i is not in
# mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
# MoE fields the backend would refuse ("odd") in a model none of whose layers
# is a mixture: accepted, the spec dense; the same fields with one layer a
# mixture: refused, named.
@pytest.mark.parametrize(
    "kind, odd, dense, one_sparse, sparse_layers, message",
    [
        pytest.param(
            "deepseek-v3", dict(n_routed_experts=4, n_group=8),
            dict(first_k_dense_replace=4), dict(first_k_dense_replace=3),
            (False, False, False, True), "4 experts in 8 groups",
            id="deepseek-first_k_dense_replace"),
        pytest.param(
            "deepseek-v3", dict(n_routed_experts=4, n_group=8),
            dict(first_k_dense_replace=1, moe_layer_freq=4),
            dict(first_k_dense_replace=1, moe_layer_freq=2),
            (False, False, True, False), "4 experts in 8 groups",
            id="deepseek-moe_layer_freq"),
        pytest.param(
            "deepseek-v3", dict(scoring_func="sqrtsoftplus"),
            dict(first_k_dense_replace=4), dict(first_k_dense_replace=3),
            (False, False, False, True), "MoE scoring 'sqrtsoftplus'",
            id="deepseek-scoring"),
        pytest.param(
            "qwen3-moe", dict(shared_expert_intermediate_size=512),
            dict(mlp_only_layers=[0, 1, 2, 3, 4, 5]),
            dict(mlp_only_layers=[0, 1, 2, 3, 4]),
            (False,) * 5 + (True,), "a gated shared expert",
            id="qwen3-moe-mlp_only_layers"),
        pytest.param(
            "qwen3-moe", dict(shared_expert_intermediate_size=512),
            dict(decoder_sparse_step=7), dict(decoder_sparse_step=6),
            (False,) * 5 + (True,), "a gated shared expert",
            id="qwen3-moe-decoder_sparse_step"),
    ],
)  # fmt: skip
def test_moe_fields_are_judged_only_where_a_layer_is_a_mixture(
    kind, odd, dense, one_sparse, sparse_layers, message
):
    spec = ModelSpec.from_hf_config(_small(kind, **odd, **dense), torch.float32, 4096)
    # Dense: every layer's MLP the one of intermediate_size, as vLLM builds it.
    assert spec.moe is None and spec.num_layers == len(sparse_layers)
    with pytest.raises(UnsupportedModelError, match=message):
        config = _small(kind, **odd, **one_sparse)
        ModelSpec.from_hf_config(config, torch.float32, 4096)
    # Without the odd fields, that one layer is the mixture.
    spec = ModelSpec.from_hf_config(_small(kind, **one_sparse), torch.float32, 4096)
    assert spec.moe.sparse_layers == sparse_layers
