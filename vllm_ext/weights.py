# SPDX-License-Identifier: Apache-2.0
"""The weights one decode step reads, taken from vLLM's loaded model.

No copies on a GPU: the tensors are vLLM's own parameters (fused QKV and
gate/up as vLLM stores them). On a CPU, vLLM prepacks each linear layer's
weight for its GEMM library and empties ``weight``; the reference executor
then reads the weights back through that packed GEMM, once, at start-up (a
second copy of the linear weights: reference mode's memory cost).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_ext.model_spec import ModelSpec, UnsupportedModelError
from vllm_ext.quant import (
    BLOCK,
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    Fp8Weight,
    Int4Weight,
    PackedInt4,
    fp8_codes,
    fp8_experts,
    fp8_weight,
    int4_experts,
    int4_scales,
    int4_weight,
    pack_int4,
)


@dataclass(frozen=True)
class MoeWeights:
    """A sparse layer's mixture, in vLLM's ``FusedMoE`` layout."""

    router: torch.Tensor  # [experts, hidden]
    correction_bias: torch.Tensor | None  # [experts], selection only
    # (None where ``quant`` holds the experts and DecodeWeights was read for
    # the GPU route: from_vllm_model.)
    w13: torch.Tensor | None  # [experts, 2 * expert_intermediate, hidden]: gate, up
    w2: torch.Tensor | None  # [experts, hidden, expert_intermediate]
    shared_gate_up: torch.Tensor | None = None  # [2 * shared, hidden]
    shared_down: torch.Tensor | None = None  # [hidden, shared]
    quant: QuantExperts | None = None  # the kernel's operands (quantized)


@dataclass(frozen=True)
class QuantExperts:
    """A quantized mixture's experts as the kernel reads them: ``w13``
    (gate rows, then up rows) and ``w2``, FP8 codes ``[E, N, K]`` in place
    with their scales (``Fp8Weight``: a 128 x 128 block's or an output
    row's) or INT4 codes packed two a byte ``[E, N, K / 2]`` with bf16
    group scales (``PackedInt4``: a copy). ``MoeWeights.w13`` / ``w2``
    hold their dequantization, which reference mode reads."""

    w13: Fp8Weight | PackedInt4
    w2: Fp8Weight | PackedInt4
    # The shared expert's gate/up ([2 * shared, hidden]) and down, if any.
    shared_gate_up: Fp8Weight | PackedInt4 | None = None
    shared_down: Fp8Weight | PackedInt4 | None = None


@dataclass(frozen=True)
class MlaWeights:
    """A layer's multi-head latent attention, as vLLM's
    ``DeepseekV2MLAAttention`` holds it (``o_proj`` is
    ``LayerWeights.o_proj``, ``[hidden, heads * v_head_dim]``)."""

    # (q_a, q_b and kv_a None where ``quant`` holds them and DecodeWeights
    # was read for the GPU route: from_vllm_model.)
    q_a: torch.Tensor | None  # [q_lora_rank, hidden]; None: q_b is q_proj
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor | None  # [heads * qk_head_dim, q_lora_rank or hidden]
    kv_a: torch.Tensor | None  # [kv_lora_rank + qk_rope_head_dim, hidden]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    # [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]: per head its
    # W_UK rows, then its W_UV rows (vLLM splits it the same way).
    kv_b: torch.Tensor
    quant: QuantMla | None = None  # the kernel's operands (FP8)

    def w_uk(self, num_heads: int, nope: int) -> torch.Tensor:
        """``[heads, qk_nope_head_dim, kv_lora_rank]``: a head's q_nope times
        it is the query in the latent space (absorbed k up-projection)."""
        return self.kv_b.view(num_heads, -1, self.kv_b.shape[-1])[:, :nope]

    def w_uv(self, num_heads: int, nope: int) -> torch.Tensor:
        """``[heads, v_head_dim, kv_lora_rank]``: a head's latent output
        times its transpose is the head's value output."""
        return self.kv_b.view(num_heads, -1, self.kv_b.shape[-1])[:, nope:]


@dataclass(frozen=True)
class QuantMla:
    """An FP8 latent attention's projections as the kernel reads them, in
    place: q_a and kv_a (views of the fused down projection's codes and
    scales; q_a None without a q LoRA) and q_b (or q_proj). kv_b is not
    among them: vLLM's MLA decode dequantizes it once (``MlaWeights.kv_b``
    holds it in the model dtype)."""

    q_a: Fp8Weight | None
    kv_a: Fp8Weight
    q_b: Fp8Weight


# The linear weights a quantized layer holds as codes (QuantLinears'
# fields, LayerWeights' dense ones).
QUANT_LINEARS = ("qkv", "o_proj", "gate_up", "down")


@dataclass(frozen=True)
class QuantLinears:
    """A quantized layer's linear weights as the kernel reads them
    (``KernelShape.quantized``): QKV, O_PROJ, the fused gate and up (gate
    rows, then up rows) and DOWN, codes with scales: FP8 (``Fp8Weight``) or
    INT4 (``PackedInt4``), each with ``codes``, ``scale`` and
    ``dequantize()``. The layer's dense fields hold their dequantization,
    which reference mode and the program interpreter read."""

    # (None in a latent attention layer, whose projections are MlaWeights.quant.)
    qkv: Fp8Weight | PackedInt4 | None
    o_proj: Fp8Weight | PackedInt4
    # (None in a sparse layer, whose MLP is its mixture's: MoeWeights.quant.)
    gate_up: Fp8Weight | PackedInt4 | None
    down: Fp8Weight | PackedInt4 | None


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # Grouped-query attention; None in an MLA layer, whose attention is `mla`.
    qkv: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    # (The dense linear weights are None where ``quant`` holds the layer's
    # codes and DecodeWeights was read for the GPU route: from_vllm_model.)
    o_proj: torch.Tensor | None  # [hidden, q_size] ([hidden, heads * v_head_dim]: MLA)
    post_norm: torch.Tensor  # [hidden]
    # The dense MLP; None in a sparse layer, whose MLP is ``moe``.
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]
    down: torch.Tensor | None  # [hidden, intermediate]
    moe: MoeWeights | None = None
    mla: MlaWeights | None = None
    quant: QuantLinears | None = None  # the kernel's operands (quantized)


@dataclass(frozen=True)
class DecodeWeights:
    # (A pipeline stage holds the embedding only if first, the final norm
    # and LM head only if last: None elsewhere.)
    embed: torch.Tensor | None  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]  # the stage's
    final_norm: torch.Tensor | None  # [hidden]
    lm_head: torch.Tensor | None  # [vocab, hidden]; the embedding when tied
    # [max_position, rotary dim] (head_dim; MLA: qk_rope_head_dim), cos half
    # then sin half (vLLM's ``cos_sin_cache``, YaRN's mscale included).
    cos_sin: torch.Tensor
    attn_scale: float
    # Tensor parallel: the token ids [start, end) of ``embed``'s first rows
    # (a rank's vocabulary shard; parallel.py); None: the whole vocabulary.
    vocab_range: tuple[int, int] | None = None

    @classmethod
    def from_vllm_model(
        cls, model: torch.nn.Module, spec: ModelSpec, dense: bool = True
    ) -> DecodeWeights:
        """The weights vLLM loaded. A quantized layer also gives the
        kernel's operands (``LayerWeights.quant``): an FP8 layer's codes and
        scales in place, an INT4 layer's codes packed two a byte (a copy:
        on a GPU vLLM keeps Marlin's tiles) with its group scales;
        ``dense=False`` (the GPU route) leaves its dense fields None instead
        of dequantized copies (FP8's fp32: 4 bytes a weight)."""
        if spec.mla is not None:
            return _from_vllm_mla_model(cls, model, spec, dense)
        fp8 = spec.quant is not None and spec.quant.name in (FP8_W8A8, FP8_BLOCK)
        int4 = spec.quant is not None and spec.quant.name == INT4_W4A16
        read = fp8_codes if fp8 else lambda m, dims: pack_int4(int4_linear(m, dims))
        # (Routed experts only: attention and dense MLPs in the model dtype.)
        codes_of_layers = (fp8 or int4) and not spec.quant.experts_only
        layers = []
        for i, layer in enumerate(stage_layers(model)):
            attn = layer.self_attn
            # (Mixtral names its MLP block_sparse_moe.)
            mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe
            h, q, inter = spec.hidden_size, spec.q_size, spec.intermediate_size
            sparse = spec.moe is not None and spec.moe.sparse_layers[i]
            shapes = {"qkv": (q + 2 * spec.kv_size, h), "o_proj": (h, q),
                      "gate_up": (2 * inter, h), "down": (h, inter)}  # fmt: skip
            modules = {"qkv": attn.qkv_proj, "o_proj": attn.o_proj}
            if not sparse:
                modules |= {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            codes = None
            if codes_of_layers:
                # Read once: the kernel's operands, and reference mode's dense
                # weights their dequantization (what linear_weight reads).
                codes = QuantLinears(
                    *(read(modules[n], shapes[n]) if n in modules else None
                      for n in QUANT_LINEARS)
                )  # fmt: skip
                linear = {
                    n: getattr(codes, n).dequantize() if dense else None
                    for n in modules
                }
            else:
                linear = {n: linear_weight(m, shapes[n]) for n, m in modules.items()}
            weights = LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv=linear["qkv"],
                qkv_bias=attn.qkv_proj.bias if spec.qkv_bias else None,
                q_norm=attn.q_norm.weight if spec.qk_norm else None,
                k_norm=attn.k_norm.weight if spec.qk_norm else None,
                o_proj=linear["o_proj"],
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=linear.get("gate_up"),
                down=linear.get("down"),
                moe=moe_weights(mlp, spec, dense) if sparse else None,
                quant=codes,
            )
            _check_layer(i, weights, spec)
            layers.append(weights)
        rotary = stage_layers(model)[0].self_attn.rotary_emb
        if not rotary.is_neox_style or rotary.rotary_dim != spec.head_dim:
            raise ValueError("megakernel: only full NeoX-style rotary embedding")
        return _model_weights(cls, model, spec, layers)


def _from_vllm_mla_model(
    cls, model: torch.nn.Module, spec: ModelSpec, dense: bool = True
):
    """DeepSeek-V2/V3 as vLLM loaded them (``deepseek_v2.py``). With a q LoRA
    vLLM fuses q_a_proj and kv_a_proj_with_mqa into ``fused_qkv_a_proj``
    (q_a rows first): q_a and kv_a are views of it. An FP8 model's layers
    also give the kernel's operands in place (``_mla_codes``); ``dense=False``
    (the GPU route) leaves their dequantized fields None."""
    mla = spec.mla
    assert mla is not None
    h, lat = spec.hidden_size, mla.latent_width
    q_rows = mla.num_heads * mla.qk_head_dim
    fp8 = spec.quant is not None and spec.quant.name in (FP8_W8A8, FP8_BLOCK)
    # (The GPU route of an FP8 model reads codes only: no dequantized copy.)
    linear = (lambda m, dims: None) if fp8 and not dense else linear_weight
    layers = []
    for i, layer in enumerate(stage_layers(model)):
        attn = layer.self_attn
        if mla.q_lora_rank is not None:
            r = mla.q_lora_rank
            fused = linear(attn.fused_qkv_a_proj, (r + lat, h))
            q_a, kv_a = (None, None) if fused is None else (fused[:r], fused[r:])
            q_a_norm = attn.q_a_layernorm.weight
            q_b = linear(attn.q_b_proj, (q_rows, r))
        else:
            q_a = q_a_norm = None
            kv_a = linear(attn.kv_a_proj_with_mqa, (lat, h))
            q_b = linear(attn.q_proj, (q_rows, h))
        kv_b_rows = mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        sparse = spec.moe is not None and spec.moe.sparse_layers[i]
        mlp = layer.mlp
        inter = spec.intermediate_size
        moe = None
        if sparse:
            moe = moe_weights(mlp, spec, dense)
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:
                width = spec.moe.shared_intermediate
                moe = dataclasses.replace(
                    moe,
                    shared_gate_up=linear(shared.gate_up_proj, (2 * width, h)),
                    shared_down=linear(shared.down_proj, (h, width)),
                )
        weights = LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=None,
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=linear(attn.o_proj, (h, mla.num_heads * mla.v_head_dim)),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=None if sparse else linear(mlp.gate_up_proj, (2 * inter, h)),
            down=None if sparse else linear(mlp.down_proj, (h, inter)),
            moe=moe,
            mla=MlaWeights(
                q_a=q_a,
                q_a_norm=q_a_norm,
                q_b=q_b,
                kv_a=kv_a,
                kv_a_norm=attn.kv_a_layernorm.weight,
                kv_b=_kv_b(attn.kv_b_proj, (kv_b_rows, mla.kv_lora_rank), spec),
            ),
        )
        if fp8:
            weights = _mla_codes(weights, layer, spec)
        layers.append(weights)
    rotary = stage_layers(model)[0].self_attn.rotary_emb
    if rotary.is_neox_style or rotary.rotary_dim != mla.qk_rope_head_dim:
        raise ValueError("megakernel: MLA expects GPT-J-style rotary on the rope dims")
    return _model_weights(cls, model, spec, layers)


def _mla_codes(
    w: LayerWeights, layer: torch.nn.Module, spec: ModelSpec
) -> LayerWeights:
    """An FP8 latent attention layer's kernel operands, read in place
    (``quant.fp8_codes``): q_a and kv_a as views of the fused down
    projection's codes and scales (q_a's rows whole 128-row blocks, so
    kv_a's scales start at a block row), q_b, o_proj, the dense MLP's or the
    shared expert's."""
    mla, attn, h = spec.mla, layer.self_attn, spec.hidden_size
    lat, q_rows = mla.latent_width, mla.num_heads * mla.qk_head_dim
    r = mla.q_lora_rank
    if r is not None:
        fused = fp8_codes(attn.fused_qkv_a_proj, (r + lat, h))
        cut = r // BLOCK if fused.scale.dim() == 2 else r
        # (kv_a's scales a copy, a few KiB: the table's entries are 16-byte
        # aligned, and a view at q_a's last block row need not be.)
        q_a = Fp8Weight(fused.codes[:r], fused.scale[:cut])
        kv_a = Fp8Weight(fused.codes[r:], fused.scale[cut:].clone())
        q_b = fp8_codes(attn.q_b_proj, (q_rows, r))
    else:
        q_a = None
        kv_a = fp8_codes(attn.kv_a_proj_with_mqa, (lat, h))
        q_b = fp8_codes(attn.q_proj, (q_rows, h))
    mlp, inter = layer.mlp, spec.intermediate_size
    o_proj = fp8_codes(attn.o_proj, (h, mla.num_heads * mla.v_head_dim))
    gate_up = down = None
    moe = w.moe
    if moe is None:
        gate_up = fp8_codes(mlp.gate_up_proj, (2 * inter, h))
        down = fp8_codes(mlp.down_proj, (h, inter))
    elif getattr(mlp, "shared_experts", None) is not None:
        width = spec.moe.shared_intermediate
        shared = mlp.shared_experts
        codes = dataclasses.replace(
            moe.quant,
            shared_gate_up=fp8_codes(shared.gate_up_proj, (2 * width, h)),
            shared_down=fp8_codes(shared.down_proj, (h, width)),
        )
        moe = dataclasses.replace(moe, quant=codes)
    m = dataclasses.replace(w.mla, quant=QuantMla(q_a, kv_a, q_b))
    return dataclasses.replace(
        w, mla=m, moe=moe, quant=QuantLinears(None, o_proj, gate_up, down)
    )


def _kv_b(
    layer: torch.nn.Module, shape: tuple[int, int], spec: ModelSpec
) -> torch.Tensor:
    """kv_b as vLLM's MLA decode multiplies by it: a quantized one
    dequantized once and rounded to the model dtype (``split_kv_b_proj``:
    ``get_and_maybe_dequant_weights(kv_b_proj, out_dtype=act_dtype)``, the
    W_UK / W_UV of its bf16 GEMMs; no input quantization)."""
    return linear_weight(layer, shape).to(spec.dtype)


def stage_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers this rank holds: a pipeline stage's range
    (vLLM's ``start_layer``/``end_layer``; the others are placeholders)."""
    inner = model.model
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", len(inner.layers))
    return list(inner.layers)[start:end]


def _model_weights(cls, model: torch.nn.Module, spec: ModelSpec, layers):
    """The model-wide tensors around ``layers``, in place (those the
    pipeline stage holds)."""
    inner = model.model
    embed = inner.embed_tokens.weight if spec.pp_first else None
    lm_head = None  # (vLLM's compute_logits applies it: the program never)
    if spec.pp_last:
        tied = spec.tie_word_embeddings and spec.pp_first
        head = inner.embed_tokens if tied else model.lm_head
        lm_head = getattr(head, "weight", None)
    vocab_range = None
    if spec.tp_size > 1 and spec.pp_first:
        shard = inner.embed_tokens.shard_indices
        vocab_range = (shard.org_vocab_start_index, shard.org_vocab_end_index)
    first = stage_layers(model)[0].self_attn
    return cls(
        embed=embed,
        layers=tuple(layers),
        final_norm=inner.norm.weight if spec.pp_last else None,
        lm_head=lm_head,
        cos_sin=first.rotary_emb.cos_sin_cache,
        attn_scale=float(first.scaling),
        vocab_range=vocab_range,
    )


# Rows of the identity pushed through a packed GEMM at a time (bounds the
# scratch memory of reading a weight back to chunk * (K + N) elements).
_READBACK_CHUNK = 1024


def linear_weight(layer: torch.nn.Module, shape: tuple[int, int]) -> torch.Tensor:
    """A linear layer's ``[N, K]`` weight. Where vLLM's CPU path emptied it
    after prepacking (``layer.cpu_linear`` computes ``x @ W.T`` from the
    packed copy), it is read back by multiplying the identity: each output
    element is one weight times 1 plus zeros, so the copy is exact in any
    dtype. A quantized layer's: its dequantized weight (``quant.py``)."""
    n, k = shape
    if _quantized(layer):
        # Reference mode reads the codes and scales the kernel will read.
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.dtype == torch.float8_e4m3fn:
            return fp8_weight(layer, shape)
        return int4_linear(layer, shape).dequantize()
    weight = layer.weight
    if weight.numel() or not hasattr(layer, "cpu_linear"):
        return weight
    return _read_back(lambda x: layer.cpu_linear(x, weight, None), k, weight.dtype)


def int4_linear(layer: torch.nn.Module, shape: tuple[int, int]) -> Int4Weight:
    """A W4A16 layer's codes and group scales, whatever layout vLLM's kernel
    repacked them into: the weight read back through the layer's own
    ``quant_method.apply`` on the identity (exact), and its scales."""
    n, k = shape
    if getattr(layer, "use_w4a8", False):
        # vLLM's CPU INT4 kernel on an AMX CPU in bf16: int8 activations.
        raise UnsupportedModelError(
            "vLLM runs this INT4 checkpoint W4A8 on this CPU (AMX, bf16), "
            "where a GPU runs W4A16, the numerics reference mode follows; "
            "set VLLM_CPU_INT4_W4A8=0"
        )
    scales = int4_scales(layer, n)
    if scales.device.type == "cpu" and torch.cpu._is_amx_tile_supported():
        # vLLM's CPU INT4 kernel runs AMX tiles in bf16 without asking the
        # kernel for them (oneDNN asks at its first bf16 GEMM): read back
        # before vLLM's first forward, it faults (SIGILL) unless asked here.
        torch.cpu._init_amx()
    dense = _read_back(
        lambda x: layer.quant_method.apply(layer, x), k, scales.dtype,
        scales.device,
    )  # fmt: skip
    return int4_weight(layer, dense, scales)


def _read_back(multiply, k: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``[N, K]``: the weight ``multiply`` (``x -> x @ W.T``) applies, from
    the identity pushed through it a chunk of rows at a time."""
    rows = []
    for start in range(0, k, _READBACK_CHUNK):
        stop = min(start + _READBACK_CHUNK, k)
        eye = torch.zeros(stop - start, k, dtype=dtype, device=device)
        eye[:, start:stop].fill_diagonal_(1)
        rows.append(multiply(eye).to(dtype))
    return torch.cat(rows).t().contiguous()


def _quantized(layer: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = getattr(layer, "quant_method", None)
    return method is not None and not isinstance(method, UnquantizedLinearMethod)


def moe_weights(
    block: torch.nn.Module, spec: ModelSpec, dense: bool = True
) -> MoeWeights:
    """A sparse layer's mixture as vLLM holds it: its router (``GateLinear``)
    and its experts' ``w13_weight``/``w2_weight`` (``FusedMoE``), in place.
    On a CPU, vLLM pads the experts' width and permutes their elements into
    its kernel's tile order after loading; the reference reads them back
    once, at start-up (another copy: reference mode's memory cost).
    Quantized experts also give the kernel's operands (``QuantExperts``);
    ``dense=False`` (the GPU route) leaves ``w13``/``w2`` None instead of
    their dequantization."""
    moe = spec.moe
    assert moe is not None
    h, inter = spec.hidden_size, moe.expert_intermediate
    router = linear_weight(block.gate, (moe.num_experts, h))
    experts = getattr(block.experts, "routed_experts", block.experts)
    if spec.quant is not None:
        # Reference mode multiplies by the dequantized experts (quant.py).
        e = moe.num_experts
        read = fp8_experts if spec.quant.name != INT4_W4A16 else int4_experts
        codes = QuantExperts(*read(experts, e, h, inter))
        return MoeWeights(
            router=router,
            correction_bias=getattr(block.gate, "e_score_correction_bias", None),
            w13=codes.w13.dequantize() if dense else None,
            w2=codes.w2.dequantize() if dense else None,
            quant=codes,
        )
    if (refusal := moe_layout_refusal(experts)) is not None:
        raise UnsupportedModelError(refusal)
    w13, w2 = experts.w13_weight, experts.w2_weight
    isa = _cpu_prepack_isa(experts)
    if isa is not None:
        w13, w2 = _unpack_moe_weight(w13, isa), _unpack_moe_weight(w2, isa)
    padded = w13.shape[1] // 2
    if padded != inter:  # gate rows, then up rows, each padded to `padded`
        w13 = torch.cat([w13[:, :inter], w13[:, padded : padded + inter]], dim=1)
        w2 = w2[:, :, :inter].contiguous()
    return MoeWeights(
        router=router,
        correction_bias=getattr(block.gate, "e_score_correction_bias", None),
        w13=w13,
        w2=w2,
    )


# vLLM's unquantized MoE backends (fused_moe/oracle/unquantized.py) that
# leave ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight``
# [E, H, I] as loaded, the layout the kernel reads in place; the CPU's
# prepacked tiles are read back below. The others reorder them after
# loading (FlashInfer swaps gate and up and retiles, ROCm's AITER shuffles).
PLAIN_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON", "CPU")


def moe_layout_refusal(experts: torch.nn.Module) -> str | None:
    """Why the experts' weights are not in a layout the backend reads, or
    None: quantized experts, or a backend that reorders them."""
    method = getattr(experts, "quant_method", None)
    backend = getattr(method, "unquantized_backend", None)
    if backend is None:
        return (
            f"mixture-of-experts layers with {type(method).__name__} (quantized "
            "or of an unknown layout) are not supported by the megakernel "
            "decode backend"
        )
    if backend.name not in PLAIN_MOE_BACKENDS:
        return (
            f"vLLM's {backend.value} MoE backend reorders the expert weights "
            "after loading, which the megakernel decode backend reads in "
            "place; pass --moe-backend triton"
        )
    return None


def _cpu_prepack_isa(experts: torch.nn.Module) -> str | None:
    """The ISA whose tile order vLLM's CPU MoE experts permuted their
    weights into, or None where they are as loaded."""
    if experts.w13_weight.device.type != "cpu":
        return None
    experts_cls = getattr(getattr(experts, "quant_method", None), "experts_cls", None)
    isa = getattr(experts_cls, "isa", None)
    if isa is None:
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        is_zentorch_moe_supported,
    )

    return None if is_zentorch_moe_supported(experts) else isa


# Bits of an element's index carried by one prepacked code tensor: integers
# up to 2^8 are exact in bf16 (and fp32).
_CODE_BITS = 8


def _unpack_moe_weight(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """Undo vLLM's CPU MoE weight prepack, a permutation of the elements
    (same shape, ``prepack_moe_weight``): prepack each element's index, a
    byte at a time (exact in any float dtype), to learn where every element
    went, and gather them back."""
    from vllm import _custom_ops as ops

    total = packed.numel()
    index = torch.arange(total)
    source = torch.zeros(total, dtype=torch.int64)
    for shift in range(0, max(total - 1, 1).bit_length(), _CODE_BITS):
        code = ((index >> shift) & ((1 << _CODE_BITS) - 1)).to(packed.dtype)
        moved = ops.cpu_prepack_moe_weight(code.view(packed.shape), isa)
        source |= moved.flatten().to(torch.int64) << shift
    if not torch.equal(source.sort().values, index):
        raise ValueError(
            f"megakernel: vLLM's CPU MoE weight layout ({isa}) is not a "
            "permutation of the loaded weight; reference mode cannot read it"
        )
    unpacked = torch.empty_like(packed).flatten()
    unpacked[source] = packed.flatten()
    return unpacked.view(packed.shape)


def _check_layer(index: int, w: LayerWeights, spec: ModelSpec) -> None:
    """Fail loudly if vLLM handed us weights of an unexpected shape (e.g. a
    CPU layer whose weight was emptied by prepacking)."""
    h, qkv = spec.hidden_size, spec.q_size + 2 * spec.kv_size
    expected = {
        "qkv": (w.qkv, (qkv, h)),
        "o_proj": (w.o_proj, (h, spec.q_size)),
    }
    if w.moe is None:
        expected["gate_up"] = (w.gate_up, (2 * spec.intermediate_size, h))
        expected["down"] = (w.down, (h, spec.intermediate_size))
    else:
        moe = spec.moe
        e, inter = moe.num_experts, moe.expert_intermediate
        expected["router"] = (w.moe.router, (e, h))
        expected["w13"] = (w.moe.w13, (e, 2 * inter, h))
        expected["w2"] = (w.moe.w2, (e, h, inter))
    for name, (tensor, shape) in expected.items():
        # (The GPU route's quantized layer has no dense weight: its codes'.)
        codes = w.moe.quant if name in ("w13", "w2") else w.quant
        got = getattr(codes, name).shape if tensor is None else tuple(tensor.shape)
        if got != shape:
            raise ValueError(
                f"megakernel: layer {index} {name} weight has shape {got}, "
                f"expected {shape}"
            )
