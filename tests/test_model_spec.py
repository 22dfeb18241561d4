# SPDX-License-Identifier: Apache-2.0
"""Which models the megakernel takes, and the message for those it refuses."""

import pytest
import torch
from transformers import AutoConfig

from vllm_ext import configs
from vllm_ext.model_spec import ModelSpec, UnsupportedModelError, backend_refusal


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
    assert backend_refusal(spec, interpret=False) == "mixture-of-experts layers"
    assert backend_refusal(spec, interpret=True) is None


def _moe_config(**changes):
    data = {**configs.load("qwen3-30b-a3b"), "num_hidden_layers": 6, **changes}
    return AutoConfig.for_model(data.pop("model_type"), **data)


def test_sparse_layers_are_vllms():
    """vLLM's rule (qwen3_moe.py): a layer is sparse unless it is in
    mlp_only_layers, and only every decoder_sparse_step-th one."""
    config = _moe_config(mlp_only_layers=[0, 3], decoder_sparse_step=2)
    spec = ModelSpec.from_hf_config(config, torch.float32, 4096)
    assert spec.moe.sparse_layers == (False, True, False, False, False, True)
    config = _moe_config(norm_topk_prob=False, mlp_only_layers=[0, 1, 2, 3, 4, 5])
    spec = ModelSpec.from_hf_config(config, torch.float32, 4096)
    assert not spec.moe.renormalize and backend_refusal(spec, False) is None


def test_a_gated_shared_expert_is_refused():
    with pytest.raises(UnsupportedModelError, match="a gated shared expert"):
        ModelSpec.from_hf_config(
            _moe_config(shared_expert_intermediate_size=512), torch.float32, 4096
        )


def test_the_backend_refuses_what_the_program_cannot_run():
    from types import SimpleNamespace

    from vllm_ext.backend import model_spec

    hf_config = configs.hf_config("mixtral-8x7b")
    model_config = SimpleNamespace(
        hf_text_config=hf_config, dtype=torch.bfloat16, max_model_len=4096
    )
    message = (
        "MixtralForCausalLM: mixture-of-experts layers are not yet supported by "
        r"the megakernel's GPU kernel \(reference mode"
    )
    with pytest.raises(UnsupportedModelError, match=message):
        model_spec(SimpleNamespace(model_config=model_config))


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
