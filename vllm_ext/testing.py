# SPDX-License-Identifier: Apache-2.0
"""Random weights, caches and decode inputs of a given model shape, for the
plan command's interleaving check and the tests (no checkpoint needed)."""

from __future__ import annotations

import dataclasses

import torch

from vllm_ext.model_spec import ModelSpec
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    Fp8Weight,
    quantize_blocks,
    quantize_int4,
    quantize_rows,
)
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import (
    QUANT_LINEARS,
    DecodeWeights,
    LayerWeights,
    MlaWeights,
    MoeWeights,
    QuantExperts,
    QuantLinears,
    QuantMla,
)

BLOCK_SIZE = 16
MAX_POSITION = 4096


def random_weights(
    spec: ModelSpec, seed: int = 0, device: str | torch.device = "cpu"
) -> DecodeWeights:
    """Drawn on ``device`` (fast for real shapes on a GPU)."""
    gen = torch.Generator(device).manual_seed(seed)
    dt, h, d = spec.dtype, spec.hidden_size, spec.head_dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        # std 1/sqrt(cols) keeps activations O(1) through the layers.
        w = torch.randn(rows, cols, generator=gen, device=device, dtype=dt)
        return w.mul_(cols**-0.5)

    def norm(n: int) -> torch.Tensor:
        return (0.5 + torch.rand(n, generator=gen, device=device)).to(dt)

    def experts(moe) -> MoeWeights:
        e, inter = moe.num_experts, moe.expert_intermediate
        bias = None
        if moe.correction_bias:
            bias = 0.01 * torch.randn(e, generator=gen, device=device)
        shared = moe.shared_intermediate
        return MoeWeights(
            router=mat(e, h),
            correction_bias=bias,
            w13=torch.stack([mat(2 * inter, h) for _ in range(e)]),
            w2=torch.stack([mat(h, inter) for _ in range(e)]),
            shared_gate_up=mat(2 * shared, h) if shared else None,
            shared_down=mat(h, shared) if shared else None,
        )

    def latent_attention() -> MlaWeights:
        mla = spec.mla
        r, rank = mla.q_lora_rank, mla.kv_lora_rank
        q_rows = mla.num_heads * mla.qk_head_dim
        return MlaWeights(
            q_a=mat(r, h) if r else None,
            q_a_norm=norm(r) if r else None,
            q_b=mat(q_rows, r or h),
            kv_a=mat(mla.latent_width, h),
            kv_a_norm=norm(rank),
            kv_b=mat(mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), rank),
        )

    mla = spec.mla
    qkv_rows = spec.q_size + 2 * spec.kv_size
    sparse = spec.moe.sparse_layers if spec.moe else (False,) * spec.num_layers
    layers = tuple(
        LayerWeights(
            input_norm=norm(h),
            qkv=None if mla else mat(qkv_rows, h),
            qkv_bias=(0.1 * torch.randn(qkv_rows, generator=gen, device=device)).to(dt)
            if spec.qkv_bias
            else None,
            q_norm=norm(d) if spec.qk_norm else None,
            k_norm=norm(d) if spec.qk_norm else None,
            o_proj=mat(h, mla.num_heads * mla.v_head_dim if mla else spec.q_size),
            post_norm=norm(h),
            gate_up=None if is_sparse else mat(2 * spec.intermediate_size, h),
            down=None if is_sparse else mat(h, spec.intermediate_size),
            moe=experts(spec.moe) if is_sparse else None,
            mla=latent_attention() if mla else None,
        )
        for is_sparse in sparse
    )
    if spec.quant is not None:
        layers = tuple(quantized_layer(lw, spec) for lw in layers)
    if mla is not None:  # rotary on the rope dims only
        d = mla.qk_rope_head_dim
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float64), inv_freq)
    embed = mat(spec.vocab_size, h)
    return DecodeWeights(
        embed=embed,
        layers=layers,
        final_norm=norm(h),
        lm_head=embed,
        cos_sin=torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device),
        attn_scale=mla.softmax_scale if mla else d**-0.5,
    )


def quantized_layer(lw: LayerWeights, spec: ModelSpec) -> LayerWeights:
    """A layer of ``random_weights`` as a quantized checkpoint holds it:
    each linear weight's rows (FP8 W8A8, ``quant.quantize_rows``), 128 x
    128 blocks (``quant.quantize_blocks``) or groups (INT4 W4A16,
    ``quant.quantize_int4``) quantized, a mixture's experts each alike
    (the router left in the model dtype), the dense fields their
    dequantization (what reference mode reads). ``experts_only``: the
    routed experts alone."""
    group = spec.quant.group_size
    experts_only = spec.quant.experts_only
    formats = {FP8_W8A8: quantize_rows, FP8_BLOCK: quantize_blocks,
               INT4_W4A16: lambda w: quantize_int4(w, group)}  # fmt: skip
    if spec.quant.name not in formats:
        raise ValueError(f"random {spec.quant.name} weights")
    quantize = formats[spec.quant.name]
    mla = lw.mla
    if mla is not None and not experts_only:
        if spec.quant.name == INT4_W4A16:
            raise ValueError("random INT4 weights: no latent attention")
        # q_a and kv_a: views of one fused layer's codes and scales, as vLLM
        # holds them (weights._mla_codes).
        r = 0 if mla.q_a is None else mla.q_a.shape[0]
        fused = quantize(mla.kv_a if not r else torch.cat([mla.q_a, mla.kv_a]))
        cut = r // 128 if fused.scale.dim() == 2 else r
        q_a = Fp8Weight(fused.codes[:r], fused.scale[:cut]) if r else None
        kv_a = Fp8Weight(fused.codes[r:], fused.scale[cut:].clone())
        q = QuantMla(q_a, kv_a, quantize(mla.q_b))
        mla = dataclasses.replace(
            mla, q_a=None if q_a is None else q_a.dequantize(),
            kv_a=kv_a.dequantize(), q_b=q.q_b.dequantize(), quant=q,
        )  # fmt: skip
    names = [n for n in QUANT_LINEARS if getattr(lw, n) is not None]
    codes, dense = None, {}
    if not experts_only:
        codes = QuantLinears(
            *(quantize(getattr(lw, n)) if n in names else None for n in QUANT_LINEARS)
        )
        dense = {n: getattr(codes, n).dequantize() for n in names}
    moe = lw.moe
    if moe is not None:

        def stacked(w: torch.Tensor):
            each = [quantize(e) for e in w]
            return type(each[0])(torch.stack([q.codes for q in each]),
                                 torch.stack([q.scale for q in each]))  # fmt: skip

        shared = {}
        if moe.shared_gate_up is not None and not experts_only:
            shared = {n: quantize(getattr(moe, n))
                      for n in ("shared_gate_up", "shared_down")}  # fmt: skip
        e = QuantExperts(stacked(moe.w13), stacked(moe.w2), **shared)
        moe = dataclasses.replace(
            moe, w13=e.w13.dequantize(), w2=e.w2.dequantize(), quant=e,
            **{n: w.dequantize() for n, w in shared.items()},
        )  # fmt: skip
    return dataclasses.replace(lw, quant=codes, moe=moe, mla=mla, **dense)


def random_decode_inputs(
    spec: ModelSpec, batch: int, seed: int = 0, max_len: int = 3 * BLOCK_SIZE + 5
) -> DecodeInputs:
    """A decode step over fresh caches: each request has a random history of
    1..max_len tokens (crossing blocks), in shuffled physical blocks."""
    # (A verify step of one token a request: the same draws.)
    return random_verify_inputs(spec, batch, 1, seed, max_len)


def random_verify_inputs(
    spec: ModelSpec, rows: int, tokens: int, seed: int = 0,
    max_len: int = 3 * BLOCK_SIZE + 5,
) -> DecodeInputs:  # fmt: skip
    """A speculative verify step over fresh caches, as ``runner.decode_inputs``
    lays it out: requests of ``tokens`` rows (the last one fewer where
    ``rows`` is not a multiple), a row per new token at consecutive
    positions after a random history (up to ``max_len`` tokens in all), each
    row on its request's block table with seq_len = position + 1 (causal
    among the new tokens, whose entries the step writes)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [tokens] * (rows // tokens) + ([rows % tokens] if rows % tokens else [])
    reqs = len(counts)
    history = torch.randint(0, max_len - tokens + 1, (reqs,), generator=gen)
    blocks_per_seq = (max_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = reqs * blocks_per_seq
    table = torch.randperm(num_blocks, generator=gen).view(reqs, blocks_per_seq)
    owner = torch.repeat_interleave(torch.arange(reqs), torch.tensor(counts))
    offset = torch.cat([torch.arange(c) for c in counts])
    positions = history[owner] + offset
    block_table = table[owner].to(torch.int32)
    slots = block_table[torch.arange(rows), positions // BLOCK_SIZE].long() * BLOCK_SIZE
    slots += positions % BLOCK_SIZE
    caches = _random_caches(spec, num_blocks, gen)
    count = torch.tensor(counts)[owner]
    return DecodeInputs(
        input_ids=torch.randint(0, spec.vocab_size, (rows,), generator=gen),
        positions=positions,
        block_table=block_table,
        seq_lens=(positions + 1).to(torch.int32),
        slot_mapping=slots,
        kv_caches=caches,
        query_map=torch.stack([torch.arange(rows) - offset, count], 1).int(),
    )


def _random_caches(
    spec: ModelSpec, num_blocks: int, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    caches = []
    for _ in range(spec.num_layers):
        if spec.mla is not None:  # one latent row per token
            shape = (num_blocks, BLOCK_SIZE, spec.mla.latent_width)
            caches.append(torch.randn(shape, generator=gen).to(spec.dtype))
            continue
        # LBNHC: memory [block, token, head, K|V], viewed as vLLM does.
        phys = torch.randn(
            num_blocks, BLOCK_SIZE, spec.num_kv_heads, 2 * spec.head_dim, generator=gen
        ).to(spec.dtype)
        caches.append(phys.permute(0, 2, 1, 3))
    return tuple(caches)
