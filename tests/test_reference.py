# SPDX-License-Identifier: Apache-2.0
"""The reference executor against HF transformers run in float64.

The executor decodes several sequences of different lengths one token per
step, through a shuffled paged cache, from weights taken out of the HF
model; HF runs each whole sequence at once. Independent code, independent
precision: they must agree to the rounding of the executor's dtype.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.utils import make_kv_cache, random_block_tables, slots_of
from vllm_ext import reference as reference_module
from vllm_ext.model_spec import ModelSpec
from vllm_ext.moe import route
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights, LayerWeights, MoeWeights

BLOCK_SIZE = 16


def weights_from_hf(model, spec: ModelSpec, dtype, max_pos: int) -> DecodeWeights:
    """vLLM's fused layout (QKV, gate/up) built from an HF model's modules."""
    inner = model.model

    def w(t):
        return t.detach().to(dtype)

    layers = []
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        bias = None
        if spec.qkv_bias:
            bias = w(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        moe = gate_up = down = None
        if hasattr(m, "experts"):  # a sparse layer: HF keeps vLLM's w13/w2 layout
            moe = MoeWeights(router=w(m.gate.weight), correction_bias=None,
                             w13=w(m.experts.gate_up_proj),
                             w2=w(m.experts.down_proj))  # fmt: skip
        else:
            gate_up = w(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            down = w(m.down_proj.weight)
        layers.append(
            LayerWeights(
                input_norm=w(layer.input_layernorm.weight),
                qkv=w(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                qkv_bias=bias,
                q_norm=w(a.q_norm.weight) if spec.qk_norm else None,
                k_norm=w(a.k_norm.weight) if spec.qk_norm else None,
                o_proj=w(a.o_proj.weight),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate_up=gate_up,
                down=down,
                moe=moe,
            )
        )
    rotary = inner.rotary_emb
    freqs = torch.outer(torch.arange(max_pos).double(), rotary.inv_freq.double())
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rotary.attention_scaling
    return DecodeWeights(
        embed=w(inner.embed_tokens.weight),
        layers=tuple(layers),
        final_norm=w(inner.norm.weight),
        lm_head=w(model.lm_head.weight),
        cos_sin=cos_sin.float(),
        attn_scale=spec.head_dim**-0.5,
    )


# fp32: 1e-4 covers fp32 sums over the hidden size. bf16: the executor rounds
# activations to bf16 (8 mantissa bits) at each of ~10 hand-offs per layer;
# the reference gets the same bf16 weights, so the gap is that rounding.
# (qwen3_moe: a dense layer, then 8 experts top 2; mixtral: 4 experts top 2
# in both layers.)
@pytest.mark.parametrize(
    "arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_decode_matches_hf_float64(demo_model, monkeypatch, arch, dtype, atol):
    gen = torch.Generator().manual_seed(2)
    # (The experts' eager loop: the default grouped GEMM has no float64.)
    hf = AutoModelForCausalLM.from_pretrained(
        demo_model(arch), experts_implementation="eager"
    )
    spec = ModelSpec.from_hf_config(hf.config, dtype, 512)
    weights = weights_from_hf(hf, spec, dtype, 512)
    hf = hf.to(dtype).double()  # the same (rounded) weights, float64 math
    executor = ReferenceExecutor(spec, weights)

    seq_lens = [1, 7, BLOCK_SIZE, BLOCK_SIZE + 3, 2 * BLOCK_SIZE + 5]
    tokens = [torch.randint(3, spec.vocab_size, (n,), generator=gen) for n in seq_lens]
    table = random_block_tables(seq_lens, BLOCK_SIZE, 12, gen)
    caches = tuple(
        make_kv_cache(12, spec.num_kv_heads, BLOCK_SIZE, spec.head_dim, dtype)
        for _ in range(spec.num_layers)
    )
    got = [torch.empty(n, spec.hidden_size, dtype=torch.float64) for n in seq_lens]
    # The experts the executor chose: (sequence, position) -> per sparse layer.
    routed: dict[tuple[int, int], list[list[int]]] = {}
    live: list[int] = []

    def recording_route(logits, moe, bias=None):
        weights, ids = route(logits, moe, bias)
        for row, i in enumerate(live):
            routed.setdefault((i, t), []).append(ids[row].tolist())
        return weights, ids

    monkeypatch.setattr(reference_module, "route", recording_route)
    for t in range(max(seq_lens)):
        live = [i for i, n in enumerate(seq_lens) if t < n]
        inputs = DecodeInputs(
            input_ids=torch.stack([tokens[i][t] for i in live]),
            positions=torch.full((len(live),), t),
            block_table=table[live],
            seq_lens=torch.full((len(live),), t + 1, dtype=torch.int32),
            slot_mapping=slots_of(table[live], [t] * len(live), BLOCK_SIZE),
            kv_caches=caches,
        )
        hidden = executor.step(inputs)
        assert hidden.dtype == dtype and not hidden.isnan().any()
        for row, i in enumerate(live):
            got[i][t] = hidden[row].double()

    compared = 0
    with torch.no_grad():
        for i, ids in enumerate(tokens):
            out = hf.model(ids[None], output_router_logits=spec.moe is not None)
            n = _same_routing(spec, out, routed, i) if spec.moe else seq_lens[i]
            compared += n
            expected = out.last_hidden_state[0]
            torch.testing.assert_close(got[i][:n], expected[:n], rtol=0, atol=atol)
    assert compared >= 0.5 * sum(seq_lens)


# A routing difference between the precisions must be a near tie in float64:
# the top_k-th and next logits within this (bf16 rounds each activation the
# router reads; a few tenths of a logit over a 256-wide dot product).
NEAR_TIE = 0.25


def _same_routing(spec: ModelSpec, hf_out, routed: dict, seq: int) -> int:
    """How many leading tokens of sequence ``seq`` both sides routed to the
    same experts in every sparse layer. fp32 must route every token as
    float64 does (no excuse). In bf16 a difference must be a near tie,
    checked; after it the two compute different functions: that token and
    every later one, whose attention reads its K/V, are not compared."""
    k = spec.moe.top_k
    tokens = hf_out.last_hidden_state.shape[1]
    for layer, logits in enumerate(hf_out.router_logits):
        logits = logits.reshape(tokens, -1)
        _, want = route(logits, spec.moe)
        for t in range(tokens):
            if set(routed[seq, t][layer]) != set(want[t].tolist()):
                assert spec.dtype != torch.float32, (
                    f"fp32 routes sequence {seq} token {t} layer {layer} unlike float64"
                )
                top = logits[t].topk(k + 1).values
                assert top[k - 1] - top[k] < NEAR_TIE, (seq, t, layer)
                tokens = t
                break
    return tokens
