# SPDX-License-Identifier: Apache-2.0
"""Multi-head latent attention: the reference executor against HF
transformers' DeepSeek-V3 and DeepSeek-V2 run in float64.

HF runs MLA unabsorbed (kv_b_proj expands the cached latent into per-head
keys and values); the reference runs it absorbed, as vLLM's MLA decode does
(the query taken into the latent space through W_UK, the latent output out
through W_UV), over vLLM's paged latent cache. Agreement is the proof of the
absorption. Every token of several sequences (1 to 37 tokens: across blocks
of 16, in shuffled physical blocks) is a decode step of the reference; HF
runs each whole sequence at once; the final hidden states and the logits of
every position are compared, and the latent rows the reference appended are
compared with HF's own kv_c and rotated k_pe.

The models: 3 layers (a dense MLP first, first_k_dense_replace=1, then MoE
layers: grouped sigmoid routing with correction bias and a shared expert for
V3, grouped softmax for V2), kv_lora_rank 512 and qk_rope_head_dim 64 (vLLM's
CPU MLA kernel: a 576-wide cache row), a q LoRA or one q_proj, YaRN rope with
DeepSeek's mscale or the default rope.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import random_block_tables, slots_of
from vllm_ext import reference as reference_module
from vllm_ext.model_spec import ModelSpec
from vllm_ext.moe import route
from vllm_ext.reference import ReferenceExecutor, linear
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights, LayerWeights, MlaWeights, MoeWeights

BLOCK_SIZE = 16
NUM_BLOCKS = 12
SEQ_LENS = [1, 7, BLOCK_SIZE, BLOCK_SIZE + 3, 2 * BLOCK_SIZE + 5]

# original_max_position_embeddings * factor = the positions vLLM's YaRN
# cache covers; mscale != mscale_all_dim puts a magnitude on cos/sin as well
# as on the softmax scale (DeepSeek-V3 itself: factor 40, both 1.0).
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: a second intra-op thread only adds spin-waits
    on a shared 2-core runner (measured: a case 0.4 s on one thread, up to
    25 s on two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _v3_config(q_lora_rank: int | None, rope: dict, **changes):
    from transformers import DeepseekV3Config

    # What DeepSeek-V3's and Kimi-K2's config.json say (vLLM reads
    # topk_method and scoring_func; HF's V3 always routes this way).
    data = dict(
        _COMMON,
        architectures=["DeepseekV3ForCausalLM"],
        q_lora_rank=q_lora_rank,
        rope_parameters=dict(rope),
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    return DeepseekV3Config(**{**data, **changes})


def _v2_config(q_lora_rank: int | None, rope: dict):
    from transformers import DeepseekV2Config

    # HF's V2 router never renormalises: norm_topk_prob False as in
    # DeepSeek-V2's config.json, which is what vLLM reads.
    return DeepseekV2Config(
        **_COMMON,
        architectures=["DeepseekV2ForCausalLM"],
        q_lora_rank=q_lora_rank,
        rope_parameters=dict(rope),
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        routed_scaling_factor=2.0,
        norm_topk_prob=False,
    )


def _hf_model(config, seed: int):
    """HF's model with weights drawn to keep activations O(1) (HF's own init
    is too small to exercise attention or routing), in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        config, experts_implementation="eager", attn_implementation="eager"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:  # RMSNorm weights
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.double().eval()


def _independent_cos_sin(hf, max_pos: int) -> torch.Tensor:
    """cos/sin of the rope dims from HF's inverse frequencies and YaRN
    magnitude, in float64 (not vLLM's cache; see test_vllm_rope_is_hfs)."""
    rotary = hf.model.rotary_emb
    pos = torch.arange(max_pos, dtype=torch.float64)
    freqs = torch.outer(pos, rotary.inv_freq.double())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rotary.attention_scaling


def weights_from_hf(hf, spec: ModelSpec, dtype, max_pos: int) -> DecodeWeights:
    """vLLM's layout (gate/up fused, experts stacked, kv_b_proj whole) from
    an HF DeepSeek model's modules, rounded to ``dtype``."""

    def w(t):
        return t.detach().to(dtype)

    layers = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        moe = gate_up = down = None
        if hasattr(m, "experts"):
            bias = getattr(m.gate, "e_score_correction_bias", None)
            s = m.shared_experts
            moe = MoeWeights(
                router=w(m.gate.weight),
                # vLLM keeps the bias in fp32 whatever the model dtype.
                correction_bias=None
                if not spec.moe.correction_bias
                else bias.detach().float(),
                w13=w(m.experts.gate_up_proj),
                w2=w(m.experts.down_proj),
                shared_gate_up=w(torch.cat([s.gate_proj.weight, s.up_proj.weight])),
                shared_down=w(s.down_proj.weight),
            )
        else:
            gate_up = w(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            down = w(m.down_proj.weight)
        lora = a.q_a_proj is not None
        layers.append(
            LayerWeights(
                input_norm=w(layer.input_layernorm.weight),
                qkv=None,
                qkv_bias=None,
                q_norm=None,
                k_norm=None,
                o_proj=w(a.o_proj.weight),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate_up=gate_up,
                down=down,
                moe=moe,
                mla=MlaWeights(
                    q_a=w(a.q_a_proj.weight) if lora else None,
                    q_a_norm=w(a.q_a_layernorm.weight) if lora else None,
                    q_b=w(a.q_b_proj.weight if lora else a.q_proj.weight),
                    kv_a=w(a.kv_a_proj_with_mqa.weight),
                    kv_a_norm=w(a.kv_a_layernorm.weight),
                    kv_b=w(a.kv_b_proj.weight),
                ),
            )
        )
    return DecodeWeights(
        embed=w(hf.model.embed_tokens.weight),
        layers=tuple(layers),
        final_norm=w(hf.model.norm.weight),
        lm_head=w(hf.lm_head.weight),
        cos_sin=_independent_cos_sin(hf, max_pos).float(),
        attn_scale=spec.mla.softmax_scale,
    )


def _decode_all(spec, weights, tokens, table, dtype, monkeypatch):
    """Every token of every sequence as a decode step of the reference:
    (hidden states per sequence [n, hidden] float64, the latent caches, the
    experts chosen per (sequence, position): a list per sparse layer)."""
    width = spec.mla.latent_width
    caches = tuple(
        torch.full((NUM_BLOCKS, BLOCK_SIZE, width), float("nan"), dtype=dtype)
        for _ in range(spec.num_layers)
    )
    executor = ReferenceExecutor(spec, weights)
    seq_lens = [len(t) for t in tokens]
    got = [torch.empty(n, spec.hidden_size, dtype=torch.float64) for n in seq_lens]
    routed: dict[tuple[int, int], list[torch.Tensor]] = {}
    live: list[int] = []
    t = 0

    def recording_route(logits, moe, bias=None):
        weights_, ids = route(logits, moe, bias)
        for row, i in enumerate(live):
            routed.setdefault((i, t), []).append(ids[row])
        return weights_, ids

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
    return got, caches, routed


def _hf_run(hf, ids, forced: list[torch.Tensor]):
    """HF on one whole sequence: final hidden states; per MoE layer the
    experts HF chose itself; per layer each token's kv_c and (V3) rotated
    k_pe. HF's routers are made to take the experts ``forced`` (the
    reference's, per MoE layer ``[tokens, top_k]``), weighted by HF's own
    rule: in bf16 a rounding can move a near tie, after which the two would
    compute different functions; fp32 asserts no choice was changed."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    chosen, kv_c, k_rot = [], [], []
    config = hf.config
    sigmoid = config.model_type == "deepseek_v3"  # (HF V2: softmax always)

    def force(mod, inp, out):
        logits, _, ids_hf = out
        chosen.append(ids_hf.reshape(len(ids), -1))
        ids_ref = forced[len(chosen) - 1]
        scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
        weights = scores.gather(1, ids_ref)
        if sigmoid and config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights * config.routed_scaling_factor, ids_ref

    hooks = [
        layer.mlp.gate.register_forward_hook(force)
        for layer in hf.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    hooks += [
        layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda mod, inp, out: kv_c.append(out.reshape(len(ids), -1))
        )
        for layer in hf.model.layers
    ]
    rope = modeling_deepseek_v3.apply_rotary_pos_emb_interleave

    def recording_rope(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = rope(q, k, cos, sin, *args, **kwargs)
        k_rot.append(k_embed.reshape(len(ids), -1))
        return q_embed, k_embed

    modeling_deepseek_v3.apply_rotary_pos_emb_interleave = recording_rope
    try:
        with torch.no_grad():
            hidden = hf.model(ids[None]).last_hidden_state[0]
    finally:
        modeling_deepseek_v3.apply_rotary_pos_emb_interleave = rope
        for h in hooks:
            h.remove()
    return hidden, chosen, kv_c, k_rot


@torch.no_grad()
def _compare(hf, spec, weights, dtype, monkeypatch, seed=3):
    """Max |reference - HF| over hidden states, logits and latent rows, and
    the number of (token, MoE layer) where HF alone would have chosen other
    experts."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in SEQ_LENS]
    table = random_block_tables(SEQ_LENS, BLOCK_SIZE, NUM_BLOCKS, gen)
    got, caches, routed = _decode_all(spec, weights, tokens, table, dtype, monkeypatch)
    rank = spec.mla.kv_lora_rank
    err = dict(hidden=0.0, logits=0.0, kv_c=0.0)
    moved = 0

    def worst(a, b):
        # Relative to the value's magnitude (at least 1): bf16's spacing.
        b = b.double()
        return float(((a.double() - b).abs() / b.abs().clamp(min=1)).max())

    for i, ids in enumerate(tokens):
        n = len(ids)
        sparse = len(routed[i, 0])
        forced = [
            torch.stack([routed[i, t][j] for t in range(n)]) for j in range(sparse)
        ]
        expected, chosen, kv_c, k_rot = _hf_run(hf, ids, forced)
        for ref, own in zip(forced, chosen, strict=True):
            moved += sum(
                set(a.tolist()) != set(b.tolist())
                for a, b in zip(ref, own, strict=True)
            )
        err["hidden"] = max(err["hidden"], worst(got[i], expected))
        logits = linear(got[i], weights.lm_head.double())
        err["logits"] = max(
            err["logits"], worst(logits, expected @ hf.lm_head.weight.t())
        )
        pos = torch.arange(n)
        for layer, cache in enumerate(caches):
            rows = cache[table[i, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE]
            err["kv_c"] = max(err["kv_c"], worst(rows[:, :rank], kv_c[layer]))
            if k_rot:  # HF's interleaved rope returns (evens, odds): vLLM's
                # GPT-J rows hold the same numbers pairwise.
                pe = rows[:, rank:]
                pe = torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=-1)
                err["k_pe"] = max(err.get("k_pe", 0.0), worst(pe, k_rot[layer]))
    return err, moved


def _spec(hf, dtype) -> ModelSpec:
    spec = ModelSpec.from_hf_config(hf.config, dtype, 256)
    assert spec.mla is not None
    # The softmax scale (DeepSeek's YaRN mscale) as HF's attention uses it.
    assert spec.mla.softmax_scale == pytest.approx(
        hf.model.layers[0].self_attn.scaling, rel=1e-12
    )
    return spec


# Errors relative to max(|value|, 1). fp32: fp32 sums over at most 576
# terms per dot product through 3 layers (measured <= 1e-5). bf16: the
# reference rounds to bf16 (8 significant bits, 2^-8 relative) at ~15 points
# per layer where vLLM's layers do (reference.mla_attention), from the same
# bf16 weights, while HF computes in float64; those roundings accumulate
# through the residual stream and attention over bf16 latent rows (measured
# 0.07-0.14 over these cases). A wrong formula is O(1) (a wrong rope style:
# 5, test_a_wrong_rope_style_fails), and fp32 pins the formulas tightly.
TOLERANCES = [(torch.float32, 1e-4), (torch.bfloat16, 0.25)]


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
@pytest.mark.parametrize(
    "arch, q_lora_rank, rope",
    [
        ("v3", 96, YARN),
        ("v3", None, YARN),
        ("v3", 96, DEFAULT_ROPE),
        ("v2", None, YARN),
    ],
)
def test_mla_decode_matches_hf_float64(
    monkeypatch, arch, q_lora_rank, rope, dtype, tol
):
    config = (_v3_config if arch == "v3" else _v2_config)(q_lora_rank, rope)
    hf = _hf_model(config, seed=1)
    spec = _spec(hf, dtype)
    # Weights rounded to the dtype for both sides: HF's math in float64.
    weights = weights_from_hf(hf, spec, dtype, 256)
    hf = hf.to(dtype).double()
    err, moved = _compare(hf, spec, weights, dtype, monkeypatch)
    print(f"{arch} q_lora={q_lora_rank} {rope['rope_type']} {dtype}: {err}, "
          f"routing moved at {moved} (token, layer)")  # fmt: skip
    if dtype == torch.float32:
        assert moved == 0  # the reference's routing is HF's
    else:  # bf16 moves only near ties: a few of the (token, MoE layer)
        assert moved <= 0.1 * sum(SEQ_LENS) * sum(spec.moe.sparse_layers)
    for name, value in err.items():
        assert value <= tol, (name, value)


def test_a_wrong_rope_style_fails(monkeypatch):
    """The comparison can fail: HF with rope_interleave=False rotates q_pe
    and k_pe NeoX-style (halves), vLLM and the reference GPT-J-style
    (pairs); the same weights then give other attention scores."""
    hf = _hf_model(_v3_config(96, YARN, rope_interleave=False), seed=1)
    spec = _spec(hf, torch.float32)
    weights = weights_from_hf(hf, spec, torch.float32, 256)
    err, _ = _compare(hf, spec, weights, torch.float32, monkeypatch)
    print(f"NeoX-style HF vs GPT-J-style reference: {err}")
    assert err["hidden"] > 100 * TOLERANCES[0][1], err


def test_vllm_rope_is_hfs():
    """The cos/sin the reference gets from vLLM's rotary embedding (as
    ``DecodeWeights.from_vllm_model`` reads it) are HF's: DeepSeek's YaRN
    inverse frequencies and magnitude, and the default rope."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    for rope, vllm_type in ((YARN, "deepseek_yarn"), (DEFAULT_ROPE, "default")):
        hf = _hf_model(_v3_config(96, rope, num_hidden_layers=1), seed=0)
        # (As deepseek_v2.py builds it; a CustomOp wants a current config.)
        with set_current_vllm_config(VllmConfig()):
            rotary = get_rope(
                64,
                max_position=256,
                is_neox_style=False,
                rope_parameters={**rope, "rope_type": vllm_type},
                dtype=torch.float32,
            )
        assert not rotary.is_neox_style
        cache = rotary.cos_sin_cache.double()
        torch.testing.assert_close(
            cache, _independent_cos_sin(hf, cache.shape[0]), rtol=0, atol=1e-5
        )


def _gpu(major: int):
    from types import SimpleNamespace

    from vllm.platforms.interface import DeviceCapability

    return SimpleNamespace(
        is_cuda=lambda: True, is_cpu=lambda: False, device_name="cuda",
        get_device_capability=lambda: DeviceCapability(major, 0),
    )  # fmt: skip


def _mla_config(block_size=None, attention=None, use_mla=True):
    """A VllmConfig's fields the MLA start-up check reads; ``block_size``:
    given by the user (else CacheConfig's default 16)."""
    from types import SimpleNamespace

    given = block_size is not None
    cache = SimpleNamespace(block_size=block_size or 16,
                            user_specified_block_size=given)  # fmt: skip
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla),
        attention_config=SimpleNamespace(backend=attention),
        cache_config=cache,
    )


@pytest.mark.parametrize(
    "major, backend, default, other",
    [(9, "FLASH_ATTN_MLA", 16, 64), (10, "FLASHINFER_MLA", 32, 64)],
)
def test_mla_pins_vllms_latent_backend_on_each_gpu(monkeypatch, major, backend,
                                                   default, other):  # fmt: skip
    """On a GPU the backend pins what vLLM 0.32.0 picks first there for a
    bf16 latent cache (FLASH_ATTN_MLA on Hopper, FLASHINFER_MLA on
    Blackwell), sets, when no --block-size is given, the block size vLLM
    sets after loading the model (16 if the backend takes it, else its
    smallest: FLASHINFER_MLA does not take CacheConfig's default 16), keeps
    a given one the backend takes, and refuses, named, one it does not,
    another --attention-backend, VLLM_MLA_DISABLE and a GPU it has no
    backend for. (On a CPU: test_e2e_offline's CPU_MLA cases.)"""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import vllm_ext.backend as b

    spec = ModelSpec.from_hf_config(_v3_config(96, YARN), torch.bfloat16, 4096)
    monkeypatch.setattr(b, "current_platform", _gpu(major))
    for interpret in (False, True):
        config = _mla_config()
        got = b._check_mla_attention(config, spec, interpret)
        assert got == AttentionBackendEnum[backend]
        assert config.cache_config.block_size == default
    config = _mla_config(other, AttentionBackendEnum[backend])
    assert b._check_mla_attention(config, spec, False).name == backend
    assert config.cache_config.block_size == other
    refused = {
        "runs blocks of": _mla_config(default + 8),
        f"pass --attention-backend {backend}": _mla_config(
            attention=AttentionBackendEnum.TRITON_MLA),
        "VLLM_MLA_DISABLE": _mla_config(use_mla=False),
    }  # fmt: skip
    for message, config in refused.items():
        with pytest.raises(ValueError, match=message):
            b._check_mla_attention(config, spec, False)
    monkeypatch.setattr(b, "current_platform", _gpu(8))
    with pytest.raises(ValueError, match=r"latent cache.*this GPU has \(8, 0\)"):
        b._check_mla_attention(_mla_config(), spec, False)


def test_random_mla_weights_write_only_their_slots():
    """``testing``'s random MLA weights and latent caches run a step, and
    the step writes the new tokens' rows and nothing else."""
    from vllm_ext.testing import random_decode_inputs, random_weights

    spec = ModelSpec.from_hf_config(_v3_config(96, YARN), torch.float32, 256)
    inputs = random_decode_inputs(spec, batch=4, seed=1)
    before = [c.clone() for c in inputs.kv_caches]
    hidden = ReferenceExecutor(spec, random_weights(spec, seed=1)).step(inputs)
    assert hidden.shape == (4, spec.hidden_size) and hidden.isfinite().all()
    slots = inputs.slot_mapping
    for old, new in zip(before, inputs.kv_caches, strict=True):
        assert new.shape[1:] == (16, 576)
        changed = (old != new).any(dim=-1).flatten().nonzero().flatten()
        assert changed.sort().values.tolist() == slots.sort().values.tolist()
