# SPDX-License-Identifier: Apache-2.0
"""Shapes and features of a model, read from its Hugging Face config.

This is the one place that decides which models the megakernel runs. Anything
it does not know is refused here, at start-up, with the feature named, never
discovered as wrong tokens later.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ext.quant import (
    ATTENTION,
    DENSE_MLP,
    FP8_BLOCK,
    ROUTED_EXPERTS,
    SHARED_EXPERTS,
    QuantFormat,
    for_model,
    quant_format,
)

# Architecture -> (has QKV bias, has per-head QK RMSNorm).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    # Mixture-of-experts MLPs (MoeSpec): the reference forward, the program
    # and reference mode run them; the GPU kernel has their device functions
    # (compiled, not yet run on a GPU).
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    # Multi-head latent attention (MlaSpec) and DeepSeek's MoE (Kimi-K2
    # loads as DeepSeek-V3): the reference forward and the program run them;
    # the GPU kernel has their device functions (compiled, not yet run on a
    # GPU), over the latent cache of vLLM's MLA backend (backend.py).
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


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


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), as vLLM's
    ``DeepseekV2MLAAttention`` runs it in the absorbed form: the cache holds
    one latent row ``[kv_c | k_pe]`` per token (``latent_width`` wide), every
    head attends to it (``reference.mla_attention``)."""

    num_heads: int
    q_lora_rank: int | None  # None: one q_proj instead of q_a/q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # (q_nope . k_nope + q_pe . k_pe) * softmax_scale: qk_head_dim ** -0.5,
    # times mscale ** 2 under DeepSeek's YaRN (vLLM's ``self.scaling``).
    softmax_scale: float
    # vLLM rotates q_pe/k_pe GPT-J style (``is_neox_style=False``): pairs
    # (2i, 2i + 1) share a frequency.
    rope_interleaved: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One cache row: vLLM's MLA ``head_size`` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


SUPPORTED_HEAD_DIMS = (64, 128)
# vLLM pads a vocab-parallel embedding or LM head to a multiple of this
# before splitting it (``DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def _projection_kinds(moe: MoeSpec | None) -> set[str]:
    """The kinds of projections a model's decoder layers hold (quant.py)."""
    kinds = {ATTENTION}
    if moe is None or not all(moe.sparse_layers):
        kinds.add(DENSE_MLP)
    if moe is not None:
        kinds.add(ROUTED_EXPERTS)
        if moe.shared_intermediate:
            kinds.add(SHARED_EXPERTS)
    return kinds


def _quant_format(hf_config: Any, need) -> QuantFormat | None:
    try:
        return quant_format(getattr(hf_config, "quantization_config", None))
    except ValueError as refused:
        need(False, str(refused))
        raise


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
    # Multi-head latent attention. Then the grouped-query fields describe
    # vLLM's latent cache (MLAAttentionSpec): num_kv_heads 1, head_dim the
    # latent row width; num_q_heads the attention heads; no QKV bias/QK norm.
    mla: MlaSpec | None = None
    # A quantized checkpoint's format (quant.py); None: the model dtype.
    quant: QuantFormat | None = None
    # Tensor-parallel ranks: then the shapes above are one rank's
    # (parallel.shard_spec), and the program all-reduces partial sums.
    tp_size: int = 1
    # Pipeline parallel: the layers above are one stage's
    # (parallel.stage_spec); only the first stage embeds the tokens (the
    # others start from the previous stage's hidden states), only the last
    # applies the final norm (the others hand on the residual stream).
    pp_first: bool = True
    pp_last: bool = True

    def with_layers(self, n: int) -> ModelSpec:
        """The first ``n`` layers of the model (shorter programs for checks:
        layers are data to the program and the kernel)."""
        moe = self.moe
        if moe is not None:
            moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers[:n])
        return dataclasses.replace(self, num_layers=n, moe=moe)

    @property
    def lm_head_rows(self) -> int:
        """The LM head's rows this rank holds: the vocabulary, or with tensor
        parallel a rank's share of it padded as vLLM's ``ParallelLMHead``
        pads it (to a multiple of 64, zero rows past the vocabulary)."""
        if self.tp_size == 1:
            return self.vocab_size
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // self.tp_size

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

        if arch in MLA_ARCHITECTURES:
            return _deepseek_spec(cls, arch, hf_config, dtype, need)
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
        quant = _quant_format(hf_config, need)
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        need(rope_type in ("default", "linear", "llama3"), f"rope type {rope_type!r}")
        need(
            float(rope.get("partial_rotary_factor", 1.0)) == 1.0,
            "partial rotary embedding",
        )
        moe = _moe_spec(arch, hf_config, need) if arch in MOE_ARCHITECTURES else None
        quant = for_model(quant, _projection_kinds(moe))
        # (weights.from_vllm_model reads a grouped-query model's projections
        # all as codes, or with the routed experts alone quantized, all bf16.)
        need(
            quant is None or not quant.unquantized or quant.experts_only,
            f"{quant and quant.name} checkpoints leaving "
            f"{', '.join(sorted(quant.unquantized)) if quant else ''} in the model "
            "dtype beside quantized projections (not the routed experts alone)",
        )
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
            quant=quant,
        )


def _moe_spec(arch: str, hf_config: Any, need) -> MoeSpec | None:
    """The sparse layers and routing of a MoE architecture, read as vLLM's
    model classes read them (``qwen3_moe.py``, ``mixtral.py``). The mixture's
    fields are judged only where some layer runs it: without one, None (a
    dense model; vLLM's Qwen3-MoE class itself then refuses to load)."""
    layers = hf_config.num_hidden_layers
    if arch == "MixtralForCausalLM":
        return MoeSpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_intermediate=hf_config.intermediate_size,
            sparse_layers=(True,) * layers,
        )
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = hf_config.decoder_sparse_step
    experts = hf_config.num_experts
    sparse_layers = tuple(
        i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
    )
    if not any(sparse_layers):
        return None
    need(
        not getattr(hf_config, "shared_expert_intermediate_size", 0),
        "a gated shared expert",
    )
    return MoeSpec(
        num_experts=experts,
        top_k=hf_config.num_experts_per_tok,
        expert_intermediate=hf_config.moe_intermediate_size,
        sparse_layers=sparse_layers,
        renormalize=bool(hf_config.norm_topk_prob),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    # DeepSeek's YaRN magnitude correction (vLLM's ``yarn_get_mscale``).
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deepseek_spec(cls, arch: str, hf_config: Any, dtype: torch.dtype, need):
    """DeepSeek-V2/V3 (and Kimi-K2) read as vLLM's ``deepseek_v2.py`` reads
    them: MLA attention in every layer, the first ``first_k_dense_replace``
    layers' MLP dense, then a MoE every ``moe_layer_freq``-th layer."""
    c = hf_config
    nope = getattr(c, "qk_nope_head_dim", 0) or 0
    rope_dim = getattr(c, "qk_rope_head_dim", 0) or 0
    need(nope > 0 and rope_dim > 0, "DeepSeek attention without latent dims (MHA)")
    need(rope_dim % 2 == 0, f"odd rope dim {rope_dim}")
    need(getattr(c, "index_topk", None) is None, "sparse attention (index_topk)")
    need(getattr(c, "llama_4_scaling", None) is None, "llama 4 attention scaling")
    need(not getattr(c, "attention_bias", False), "attention bias")
    act = getattr(c, "hidden_act", "silu")
    need(act == "silu", f"activation {act!r}")
    moe = _deepseek_moe(c, need)
    quant = for_model(_quant_format(c, need), _projection_kinds(moe))
    # DeepSeek-V3's and Kimi-K2's FP8 blocks, or latent attention left in
    # the model dtype (Kimi-K2-Thinking's INT4 experts); INT4 and
    # per-channel FP8 latent attention not yet.
    need(
        quant is None or quant.name == FP8_BLOCK or ATTENTION in quant.unquantized,
        f"{quant and quant.name} ({quant and quant.checkpoint}) latent attention (yet)",
    )
    scale = (nope + rope_dim) ** -0.5
    rope = _rope_parameters(c)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # vLLM renames a non-default rope in the config it loads (so a spec read
    # after loading sees it): "deepseek_llama_scaling" where attention_factor
    # is 1.0, else "deepseek_yarn", whose softmax scale gains mscale ** 2.
    yarn_types = ("yarn", "deepseek_yarn", "deepseek_llama_scaling")
    need(rope_type in ("default", *yarn_types), f"rope type {rope_type!r}")
    if rope_type != "default" and rope.get("attention_factor") != 1.0:
        mscale = _yarn_mscale(rope["factor"], float(rope.get("mscale_all_dim", 0)))
        scale *= mscale * mscale
    mla = MlaSpec(
        num_heads=c.num_attention_heads,
        q_lora_rank=getattr(c, "q_lora_rank", None),
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=c.v_head_dim,
        softmax_scale=scale,
    )
    return cls(
        architecture=arch,
        dtype=dtype,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_q_heads=mla.num_heads,
        num_kv_heads=1,
        head_dim=mla.latent_width,
        rms_norm_eps=c.rms_norm_eps,
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        moe=moe,
        mla=mla,
        quant=quant,
    )


def _deepseek_moe(c: Any, need) -> MoeSpec | None:
    """vLLM's ``DeepseekV2MoE``: always grouped top-k (``n_group`` and
    ``topk_group``; one group is plain top-k), the correction bias only
    for ``topk_method == "noaux_tc"``, shared experts one MLP of
    ``n_shared_experts * moe_intermediate_size``.

    vLLM's ``DeepseekV2DecoderLayer`` makes layer i a mixture where
    ``n_routed_experts`` is set, ``i >= first_k_dense_replace`` and
    ``i % moe_layer_freq == 0``; the mixture's fields are judged only where
    some layer is one. Without one, None: every layer's MLP dense."""
    experts = getattr(c, "n_routed_experts", None)
    first_dense = getattr(c, "first_k_dense_replace", 0) or 0
    freq = getattr(c, "moe_layer_freq", 1)
    sparse_layers = tuple(
        experts is not None and i >= first_dense and i % freq == 0
        for i in range(c.num_hidden_layers)
    )
    if not any(sparse_layers):
        return None
    groups, topk_groups = getattr(c, "n_group", 1), getattr(c, "topk_group", 1)
    # (vLLM itself fails on them unset: its grouped router needs both.)
    need(groups is not None and topk_groups is not None, "MoE without n_group")
    need(experts % groups == 0, f"{experts} experts in {groups} groups")
    scoring = getattr(c, "scoring_func", "softmax")
    need(scoring in ("softmax", "sigmoid"), f"MoE scoring {scoring!r}")
    # (An fp32 router GEMM: the reference rounds router logits to the dtype.)
    need(getattr(c, "moe_router_dtype", None) != "float32", "an fp32 MoE router")
    return MoeSpec(
        num_experts=experts,
        top_k=c.num_experts_per_tok,
        expert_intermediate=c.moe_intermediate_size,
        sparse_layers=sparse_layers,
        renormalize=bool(c.norm_topk_prob),
        scoring=scoring,
        grouped=True,
        num_groups=groups,
        topk_groups=topk_groups,
        correction_bias=getattr(c, "topk_method", None) == "noaux_tc",
        routed_scaling=float(getattr(c, "routed_scaling_factor", 1.0)),
        shared_intermediate=(getattr(c, "n_shared_experts", None) or 0)
        * c.moe_intermediate_size,
    )


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
