# SPDX-License-Identifier: Apache-2.0
"""Shapes and features of a model, read from its Hugging Face config.

This is the one place that decides which models the megakernel runs. Anything
it does not know is refused here, at start-up, with the feature named, never
discovered as wrong tokens later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

# Architecture -> (has QKV bias, has per-head QK RMSNorm).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    # Mixture-of-experts MLPs (MoeSpec): the reference forward, the program
    # and reference mode run them; the GPU kernel not yet (backend_refusal).
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts MLP of a model's sparse layers and its routing
    rule, as vLLM runs it (``FusedMoE`` with its router)."""

    num_experts: int
    top_k: int
    expert_intermediate: int  # each expert's gate/up width
    # Per layer: whether its MLP is the mixture (else the dense MLP of
    # ``ModelSpec.intermediate_size``).
    sparse_layers: tuple[bool, ...]
    renormalize: bool = True  # the selected weights rescaled to sum to 1
    scoring: str = "softmax"  # or "sigmoid"
    # Grouped top-k (DeepSeek-V3 / Kimi-K2): the experts in num_groups
    # groups, the best topk_groups groups kept, then top_k within them.
    grouped: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    # A per-expert bias added to the scores for selection only.
    correction_bias: bool = False
    routed_scaling: float = 1.0
    # Shared experts beside the routed ones (one MLP of this width; 0: none).
    shared_intermediate: int = 0


SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


class UnsupportedModelError(ValueError):
    """The model (or a feature of it) is outside what the megakernel runs."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    moe: MoeSpec | None = None

    def with_layers(self, n: int) -> ModelSpec:
        """The first ``n`` layers of the model (shorter programs for checks:
        layers are data to the program and the kernel)."""
        moe = self.moe
        if moe is not None:
            moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers[:n])
        return dataclasses.replace(self, num_layers=n, moe=moe)

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, dtype: torch.dtype, max_model_len: int | None = None
    ) -> ModelSpec:
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or '(none)'} is not supported by the "
                f"megakernel decode backend; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise UnsupportedModelError(
                f"dtype {dtype} is not supported by the megakernel decode "
                "backend; use --dtype bfloat16 or --dtype float32"
            )

        def need(cond: bool, feature: str) -> None:
            if not cond:
                raise UnsupportedModelError(
                    f"{arch}: {feature} is not supported by the megakernel "
                    "decode backend"
                )

        hidden = hf_config.hidden_size
        num_q = hf_config.num_attention_heads
        num_kv = getattr(hf_config, "num_key_value_heads", None) or num_q
        head_dim = getattr(hf_config, "head_dim", None) or hidden // num_q
        need(
            head_dim in SUPPORTED_HEAD_DIMS,
            f"head dim {head_dim} (supported: {SUPPORTED_HEAD_DIMS})",
        )
        need(num_q % num_kv == 0, f"{num_q} q heads over {num_kv} kv heads")
        act = getattr(hf_config, "hidden_act", "silu")
        need(act == "silu", f"activation {act!r}")
        need(not getattr(hf_config, "mlp_bias", False), "MLP bias")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if arch in ("LlamaForCausalLM", "MistralForCausalLM"):
            need(not getattr(hf_config, "attention_bias", False), "attention bias")
        if getattr(hf_config, "use_sliding_window", True):
            window = getattr(hf_config, "sliding_window", None)
            refusal = sliding_window_refusal(window, max_model_len)
            need(refusal is None, refusal or "")
        need(getattr(hf_config, "quantization_config", None) is None, "quantization")
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        need(rope_type in ("default", "linear", "llama3"), f"rope type {rope_type!r}")
        need(
            float(rope.get("partial_rotary_factor", 1.0)) == 1.0,
            "partial rotary embedding",
        )
        moe = _moe_spec(arch, hf_config, need) if arch in MOE_ARCHITECTURES else None
        return cls(
            architecture=arch,
            dtype=dtype,
            vocab_size=hf_config.vocab_size,
            hidden_size=hidden,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            moe=moe,
        )


def _moe_spec(arch: str, hf_config: Any, need) -> MoeSpec:
    """The sparse layers and routing of a MoE architecture, read as vLLM's
    model classes read them (``qwen3_moe.py``, ``mixtral.py``)."""
    layers = hf_config.num_hidden_layers
    if arch == "MixtralForCausalLM":
        return MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_intermediate=hf_config.intermediate_size,
            sparse_layers=(True,) * layers,
        )
    need(
        not getattr(hf_config, "shared_expert_intermediate_size", 0),
        "a gated shared expert",
    )
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = hf_config.decoder_sparse_step
    experts = hf_config.num_experts
    return MoeSpec(
        num_experts=experts,
        top_k=hf_config.num_experts_per_tok,
        expert_intermediate=hf_config.moe_intermediate_size,
        sparse_layers=tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0
            for i in range(layers)
        ),
        renormalize=bool(hf_config.norm_topk_prob),
    )


def backend_refusal(spec: ModelSpec, interpret: bool) -> str | None:
    """What of the model the decode backend cannot serve yet, or None: the
    program and reference mode (``interpret``) run mixtures of experts, the
    GPU kernel has no device functions for them yet."""
    if not interpret and spec.moe is not None and any(spec.moe.sparse_layers):
        return "mixture-of-experts layers"
    return None


def sliding_window_refusal(window: int | None, max_model_len: int | None) -> str | None:
    """The one sliding-window rule, for the model's config here and for each
    attention layer vLLM builds (``attention.py``): a window that covers the
    whole context is full attention, which the kernel runs; a narrower one is
    refused, named."""
    if window is None or (max_model_len is not None and window >= max_model_len):
        return None
    return f"sliding-window attention (window {window} < max model len {max_model_len})"


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    # transformers 5 keeps rope settings in `rope_parameters`; older configs
    # in `rope_scaling`.
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(hf_config, name, None)
        if isinstance(value, dict):
            return value
    return {}
