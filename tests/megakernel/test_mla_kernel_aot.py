# SPDX-License-Identifier: Apache-2.0
"""The kernel's multi-head latent attention instructions (MLA_QKV_A,
MLA_Q, MLA_APPEND, MLA_ATTN, MLA_COMBINE; kernel/ops/mla_*.py).

* Compiled ahead of time here, for Hopper and Blackwell, on the demo
  latent-attention models' shapes (q LoRA, latent 512 + rope 64 as the
  device functions need them): no spill in running code, within the
  consumers' register share, the SASS facts of test_kernel_aot.py (the
  warp roles' too), and MLA_ATTN's tensor-core MMAs, online softmax and
  quad reductions. Two builds (made at once; CI time): the DeepSeek-V3
  mixture demo (a dense layer, then a sparse one with every DeepSeek
  routing path: the MLA and mixture-of-experts opcodes in one kernel) at
  batch 1 on sm_90a, the dense DeepSeek-V3 demo at batch 16 on sm_100a;
  each at the latent blocks the GPU route binds there by default: 16 on
  sm_90a (FLASH_ATTN_MLA), 32 on sm_100a (FLASHINFER_MLA). Real shapes
  (DeepSeek-V3 and Kimi-K2, every bucket, both archs) and these op facts:
  scripts/compile_grid.py.
* ``KernelShape.from_program`` takes an MLA program's constants, and
  refuses them beside any experimental variant.
* The address table of an MLA program round-trips through the CPU
  stand-in (kernel_standin.py): the latent attention's weights are read
  through the table, its buffers written where the table says, bit for
  bit the interpreter's; a swapped entry fails.

Nothing here has run on a GPU.
"""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kernel_standin import KernelStandIn, register_executor
from test_kernel_aot import check_sass
from test_mla_program import mla_spec

from vllm_ext.backend import GPU_LATENT
from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import ProgramInterpreter, pad_inputs
from vllm_ext.megakernel.kernel.aot import BuildResult, build
from vllm_ext.megakernel.kernel.launcher import KernelExecutor
from vllm_ext.megakernel.kernel.ops.mla_attn import PV_UNROLL
from vllm_ext.megakernel.kernel.ops.weight_pipe import MIN_SLOTS
from vllm_ext.megakernel.kernel.persistent import (
    SMEM_LIMIT,
    mla_buffers,
    mla_union_parts,
    ring_slots,
    shared_bytes,
)
from vllm_ext.megakernel.kernel.shape import (
    MLA_SLOTS,
    QUANT_MOE_SLOTS,
    GlobalSlot,
    KernelShape,
    LayerSlot,
    table_width,
    workspace_sizes,
)
from vllm_ext.megakernel.plan import spec_or_exit
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.variants import KERNEL
from vllm_ext.model_spec import ModelSpec
from vllm_ext.quant import (
    ATTENTION,
    DENSE_MLP,
    FP8_BLOCK,
    INT4_W4A16,
    PACK_QUANTIZED,
    PER_TOKEN_GROUP,
    SHARED_EXPERTS,
    QuantFormat,
)
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import (
    BLOCK_SIZE,
    random_decode_inputs,
    random_verify_inputs,
    random_weights,
)

H200 = DEVICES["h200"]
SMALL = dataclasses.replace(H200, num_sms=16)


def real_spec(model: str, batch: int, layers: int = 2) -> ModelSpec:
    return spec_or_exit("test", model, "bfloat16", batch).with_layers(layers)


def real_shape(model: str, batch: int, layers: int = 2,
               block_size: int = 16) -> KernelShape:  # fmt: skip
    program = plan(real_spec(model, batch, layers), batch, H200, with_lm_head=True)
    return KernelShape.from_program(program, block_size)


# The latent cache's blocks the GPU route binds by default on each arch:
# FLASH_ATTN_MLA's 16 (Hopper), FLASHINFER_MLA's 32 (Blackwell).
LATENT_BLOCK = {"sm_90a": GPU_LATENT[9].blocks[0], "sm_100a": GPU_LATENT[10].blocks[0]}


# (demo architecture, batch, arch): see the module docstring.
GRID = [("deepseek_v3_moe", 1, "sm_90a"), ("deepseek_v3", 16, "sm_100a")]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[tuple, BuildResult]:
    """The grid's builds, two compiler processes at once."""
    root = tmp_path_factory.mktemp("mla")

    def one(case):
        model, batch, arch = case
        spec = ModelSpec.from_hf_config(hf_config(model), torch.bfloat16)
        program = plan(spec, batch, H200, with_lm_head=True)
        shape = KernelShape.from_program(program, LATENT_BLOCK[arch])
        return build(arch, root / f"{model}-{batch}-{arch}", shape)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(GRID, pool.map(one, GRID), strict=True))


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c)))
def test_latent_attention_compiles_clean(builds, case):
    built = builds[case]
    check_sass(built)  # (the warp roles' SASS facts too: check_roles)
    # The dense projections read the ring's pages; the MLA ops do not.
    # MLA_ATTN runs on tensor cores: 36 MMAs a block's scores (18 k blocks
    # of 32), 32 its P @ V (4 token steps x 8 dim blocks), unrolled.
    assert built.async_copies == 0 and built.bulk_copies > 0
    assert built.mma_ops == 68
    # MLA_ATTN's online softmax (exp2 on the SFU) and its quad reductions.
    assert built.exp2 and built.butterflies
    # The sparse layer's TOPK (DeepSeek's grouped routing) in the same kernel.
    assert bool(built.ballots and built.popcounts) == (case[0] == "deepseek_v3_moe")


def test_a_verify_steps_shared_pass_compiles_clean(tmp_path):
    """MLA_ATTN's shared pass (``query_rows`` 2): DeepSeek-V3's real group
    of 16 heads x 2 rows, two M tiles in one pass (each latent fragment
    feeds both), one layer at batch 16 on sm_100a, where P @ V fully
    unrolled kept five words in local memory: no spill, within the
    consumers' register share. The scores' 36 MMAs a tile unrolled, P @ V
    rolled ``PV_UNROLL`` steps at a time (8 dim blocks x 2 tiles a step).
    Every bucket at 2, 4 and 8 rows, both models and archs: docs/design.md."""
    program = plan(real_spec("deepseek-v3", 16, layers=1), 16, H200,
                   with_lm_head=True, query_rows=2)  # fmt: skip
    shape = KernelShape.from_program(program, LATENT_BLOCK["sm_100a"])
    assert shape.query_rows == 2 and shape.mla_per_group == 16
    built = build("sm_100a", tmp_path / "verify", shape)
    check_sass(built)
    assert built.mma_ops == 2 * 36 + PV_UNROLL * 8 * 2
    assert shared_bytes(shape) <= SMEM_LIMIT


@pytest.mark.parametrize(
    "model, batch, slots",
    [("deepseek-v3", 16, MIN_SLOTS + 1), ("deepseek-v3", 64, MIN_SLOTS),
     ("deepseek-v3-fp8", 16, MIN_SLOTS)],
)  # fmt: skip
def test_latent_attention_leaves_the_weight_ring_room(model, batch, slots):
    # No grouped-query scratch in a latent attention kernel, and MLA_COMBINE's
    # latent rows and x_stage laid over MLA_Q's buffers: DeepSeek-V3 at batch
    # 64 keeps a ring (it had none), at 16 a fourth page (it had three); the
    # FP8 model at 16 (its tensor-core projections' 27 KiB stage) a ring of
    # three (it had none with x_stage apart).
    shape = real_shape(model, batch)
    assert ring_slots(shape) >= slots
    assert shared_bytes(shape) <= SMEM_LIMIT
    q_part, combine_part, stage_part = mla_union_parts(shape)
    # (Shared: MLA_Q's, MLA_COMBINE's and x_stage's.)
    assert mla_buffers(shape)[1] < sum(q_part) + sum(combine_part) + sum(stage_part)


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_from_program_takes_mla(model):
    spec = real_spec(model, 16)
    shape = real_shape(model, 16)
    m = spec.mla
    assert shape.mla and table_width(shape) == MLA_SLOTS
    assert (shape.mla_heads, shape.q_lora_rank, shape.kv_lora_rank) == (
        m.num_heads, 1536, 512)  # fmt: skip
    assert (shape.qk_nope, shape.qk_rope, shape.v_head_dim) == (128, 64, 128)
    assert shape.mla_scale == m.softmax_scale
    # O_PROJ reads heads x v_head_dim columns.
    assert shape.q_size == m.num_heads * m.v_head_dim
    assert (shape.mla_groups, shape.attn_chunks) == (8, 16)
    assert shape.mla_v_parts == (2 if model == "kimi-k2" else 1)
    assert shape.moe == (model == "kimi-k2")  # Kimi-K2's layer 1 is sparse
    sizes = workspace_sizes(shape, 2)
    per = m.num_heads // 8
    assert "q" not in sizes and sizes["qkv_a"] == (2, 16, 1536 + 576)
    assert sizes["q_lat"] == (2, 16, m.num_heads, 512)
    assert sizes["q_pe"] == (2, 16, m.num_heads, 64)
    assert sizes["part_o"] == (2, 16, 8, 16, per, 512)
    assert sizes["part_lse"] == (2, 16, 8, 16, per)
    assert sizes["attn"] == (2, 16, m.num_heads, 128)


@pytest.mark.parametrize("flag", ("legacy_control", *KERNEL))
def test_variants_refuse_mla(flag):
    shape = real_shape("deepseek-v3", 1)
    with pytest.raises(ValueError, match="latent attention .* default kernel only"):
        dataclasses.replace(shape, **{flag: True})
    for parts in ("qkv_parts", "combine_parts"):
        with pytest.raises(ValueError, match="no QKV or COMBINE to split"):
            dataclasses.replace(shape, **{parts: 2})


def test_shape_refuses_what_the_device_functions_cannot_run():
    good = real_shape("deepseek-v3", 1)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        dataclasses.replace(good, kv_lora_rank=384)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        dataclasses.replace(good, qk_rope=40)
    with pytest.raises(ValueError, match="head groups"):
        dataclasses.replace(good, mla_groups=3)
    with pytest.raises(ValueError, match="heads per group"):
        dataclasses.replace(good, mla_groups=2)  # 64 heads a group
    with pytest.raises(ValueError, match="O_PROJ"):
        dataclasses.replace(good, head_dim=64)
    # FP8: MLA_Q quantizes q_b's input in its stage, so without a q LoRA
    # (q_proj on the hidden size) every request's row must fit it, and the
    # fused q_a / kv_a's blocks must break at q_a's rows.
    fp8 = dataclasses.replace(good, fp8=True, fp8_block=True)
    assert dataclasses.replace(fp8, batch=16).quantized
    with pytest.raises(ValueError, match="stages q_b's 7168-wide input"):
        dataclasses.replace(fp8, q_lora_rank=0, batch=16)
    with pytest.raises(ValueError, match="q_lora_rank 1472"):
        dataclasses.replace(fp8, q_lora_rank=1472)


# ------------------------------------------------------------ the table


def mla_executor(q_lora_rank: int | None, bucket: int = 4, query_rows: int = 1):
    """A tiny DeepSeek-V3 (test_mla_program.py): layer 0 dense, layer 1 a
    grouped-sigmoid mixture with a shared expert, both MLA."""
    spec = mla_spec(torch.bfloat16, q_lora_rank)
    weights = random_weights(spec, seed=1)
    program = plan(spec, bucket, SMALL, with_lm_head=True, query_rows=query_rows)
    standin = KernelStandIn(program, weights)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=4)  # fmt: skip
    return spec, weights, program, ex, standin


def run_both(spec, weights, program, ex, standin, n: int, seed: int,
             tokens: int = 1):  # fmt: skip
    """A step through the executor and the stand-in, and the same step
    straight through the interpreter (its own copy of the caches);
    ``tokens``: a verify step's rows a request."""
    inputs = random_verify_inputs(spec, n, tokens, seed=seed)
    mine = dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )
    register_executor(standin, ex, mine.kv_caches)
    got = ex.step(mine).clone()
    interp = ProgramInterpreter(program, weights, seed=9)
    want = interp.step(pad_inputs(inputs, program.batch))[:n]
    return got, want, interp, mine, inputs


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8),
                       b.contiguous().view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("q_lora_rank", [96, None], ids=["q_lora", "q_proj"])
def test_mla_table_round_trips_through_the_standin(q_lora_rank):
    """3 real requests in a bucket of 4: the output, the latent caches and
    every MLA buffer in the executor's workspace are bit for bit the
    interpreter's (NaN where neither wrote)."""
    spec, weights, program, ex, standin = mla_executor(q_lora_rank)
    assert ex.shape.mla and ex.ptrs_host.shape[1] == MLA_SLOTS
    got, want, interp, mine, theirs = run_both(spec, weights, program, ex, standin,
                                               3, seed=5)  # fmt: skip
    assert not got.isnan().any() and bits_equal(got, want)
    for a, b in zip(mine.kv_caches, theirs.kv_caches, strict=True):
        assert bits_equal(a, b)
    for name in ("qkv_a", "q_lat", "q_pe", "part_o", "part_lse", "attn"):
        for layer in range(spec.num_layers):
            torch.testing.assert_close(ex.ws[name][layer], interp.buf[name][layer],
                                       rtol=0, atol=0, equal_nan=True)  # fmt: skip
    row = ex.ptrs_host[0]
    assert row[LayerSlot.Q] == 0 and row[LayerSlot.QKV] == 0
    assert (row[LayerSlot.MLA_Q_A] != 0) == (q_lora_rank is not None)
    nope, rank = spec.mla.qk_nope_head_dim, spec.mla.kv_lora_rank
    assert row[LayerSlot.MLA_W_UV] - row[LayerSlot.MLA_W_UK] == nope * rank * 2


@pytest.mark.parametrize(
    "slot",
    [LayerSlot.MLA_KV_A, LayerSlot.MLA_W_UK, LayerSlot.MLA_W_UV, LayerSlot.Q_LAT],
    ids=lambda s: s.name,
)  # fmt: skip
def test_a_swapped_mla_entry_fails(slot):
    """The two layers' entries of one column swapped (a weight, or a
    buffer): the step or a layer's buffer is wrong."""
    spec, weights, program, ex, standin = mla_executor(96)
    ex.ptrs_host[[0, 1], slot] = ex.ptrs_host[[1, 0], slot]
    ex.ptrs.copy_(ex.ptrs_host)
    got, want, interp, _, _ = run_both(spec, weights, program, ex, standin, 4, seed=6)
    if slot == LayerSlot.Q_LAT:
        assert not bits_equal(ex.ws["q_lat"][0], interp.buf["q_lat"][0])
    else:
        assert not bits_equal(got, want)


def test_the_query_map_reaches_the_shared_pass():
    """A verify step (requests of 3 rows, the last of 2) in a bucket of 8
    built for 3 rows a request: the table's QUERY_MAP holds each row's
    request, the stand-in reads it and the step (output, latent caches,
    MLA_ATTN's partials, chunked by each request's longest row) is bit for
    bit the interpreter's on the same map; a map that makes each row a
    request of its own changes the partials (the chunks are then each
    row's), and a kernel without the shared pass has no map in its table."""
    spec, weights, program, ex, standin = mla_executor(96, bucket=8, query_rows=3)
    assert ex.shape.query_rows == 3 and program.query_rows == 3
    glob = ex.ptrs_host[-1]
    assert glob[GlobalSlot.QUERY_MAP] == ex.query_map.data_ptr() != 0
    got, want, interp, mine, theirs = run_both(spec, weights, program, ex, standin,
                                               8, seed=5, tokens=3)  # fmt: skip
    assert theirs.query_map[:, 1].tolist() == [3] * 6 + [2] * 2
    # (Lengths 48, 49, 50: the request's chunks of 7 tokens, row 48's own 6.)
    assert theirs.seq_lens[:3].tolist() == [48, 49, 50] and program.attn_chunks == 8
    assert ex.query_map.tolist() == theirs.query_map.tolist()
    assert not got.isnan().any() and bits_equal(got, want)
    for a, b in zip(mine.kv_caches, theirs.kv_caches, strict=True):
        assert bits_equal(a, b)
    for name in ("part_o", "part_lse"):
        torch.testing.assert_close(ex.ws[name][0], interp.buf[name][0],
                                   rtol=0, atol=0, equal_nan=True)  # fmt: skip
    # The same step with each row its own request: other partials.
    solo = ProgramInterpreter(program, weights, seed=9)
    inputs = dataclasses.replace(theirs, query_map=None)
    solo.step(inputs)
    assert not torch.equal(solo.buf["part_lse"][0], interp.buf["part_lse"][0])
    plain = mla_executor(96, bucket=8)[3]
    assert plain.query_map is None and plain.ptrs_host[-1, GlobalSlot.QUERY_MAP] == 0


# DeepSeek-V3 as shipped, in small: FP8 128 x 128 blocks in every linear
# layer but kv_b (vLLM dequantizes it), experts and the shared expert 128
# wide (whole blocks), a q LoRA of 128 (q_a's rows whole blocks of the
# fused layer, kv_a's 576 ending in half a block).
FP8_BLOCKS = QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP)


def fp8_mla_spec() -> ModelSpec:
    spec = mla_spec(torch.bfloat16, 128)
    moe = dataclasses.replace(spec.moe, expert_intermediate=128,
                              shared_intermediate=128)  # fmt: skip
    return dataclasses.replace(spec, moe=moe, quant=FP8_BLOCKS)


def test_fp8_latent_attention_through_the_table():
    """The FP8 DeepSeek-V3 (a dense layer, then a mixture with a shared
    expert): the table holds q_a's, kv_a's and q_b's codes where their
    bf16 weights would be and their scales in MLA_Q_A_SCALE ..
    MLA_Q_B_SCALE (kv_a's scales from the fused layer's block row past
    q_a's), the shared expert's in SHARED_GATE_UP_SCALE / _DOWN_SCALE;
    the stand-in reads the codes only (no dense copy registered), and a
    step of 3 requests in a bucket of 4 equals reference mode's."""
    spec = fp8_mla_spec()
    weights = random_weights(spec, seed=1)
    program = plan(spec, 4, SMALL, with_lm_head=True)
    standin = KernelStandIn(program, weights)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=4)  # fmt: skip
    assert ex.shape.mla and ex.shape.fp8_block
    assert ex.ptrs_host.shape[1] == QUANT_MOE_SLOTS
    for i, lw in enumerate(weights.layers):
        row, q = ex.ptrs_host[i], lw.mla.quant
        for slot, scale, w in (
            (LayerSlot.MLA_Q_A, LayerSlot.MLA_Q_A_SCALE, q.q_a),
            (LayerSlot.MLA_KV_A, LayerSlot.MLA_KV_A_SCALE, q.kv_a),
            (LayerSlot.MLA_Q_B, LayerSlot.MLA_Q_B_SCALE, q.q_b),
        ):
            assert row[slot] == w.codes.data_ptr()
            assert row[scale] == w.scale.data_ptr()
        assert (
            row[LayerSlot.MLA_KV_A] - row[LayerSlot.MLA_Q_A] == 128 * spec.hidden_size
        )
        assert q.kv_a.scale.shape[0] == 5  # 576 rows: 4.5 blocks
        if lw.moe is not None:
            e = lw.moe.quant
            assert row[LayerSlot.SHARED_DOWN] == e.shared_down.codes.data_ptr()
            assert (
                row[LayerSlot.SHARED_GATE_UP_SCALE] == e.shared_gate_up.scale.data_ptr()
            )
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref_inputs = dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )
    register_executor(standin, ex, inputs.kv_caches)
    for lw in weights.layers:  # (a table entry pointing at one fails)
        m = lw.mla
        dense = (m.q_a, m.kv_a, m.q_b, lw.o_proj, lw.gate_up, lw.down)
        if lw.moe is not None:
            dense += (lw.moe.w13, lw.moe.w2, lw.moe.shared_gate_up, lw.moe.shared_down)
        for t in dense:
            if t is not None:
                standin.tensors.pop(t.data_ptr(), None)
    got = ex.step(inputs)
    want = ReferenceExecutor(spec, weights).step(ref_inputs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0.0625)


@pytest.mark.parametrize("batch, arch", [(4, "sm_90a")])
def test_fp8_latent_attention_compiles_clean(batch, arch, tmp_path):
    """FP8 latent attention (MLA_QKV_A's and MLA_Q's codes by
    ``gemv_quant``, their inputs quantized in staged passes) beside the
    quantized experts, shared expert and projections, on the demo shape:
    clean SASS within the register share. (Real shapes:
    scripts/compile_grid.py.)"""
    spec = fp8_mla_spec()
    shape = KernelShape.from_program(plan(spec, batch, H200, with_lm_head=True),
                                     BLOCK_SIZE)  # fmt: skip
    assert shape.mla and shape.fp8_block and shape.shared_intermediate
    built = build(arch, tmp_path, shape)
    check_sass(built)
    assert built.e4m3_converts > 0
    print(f"fp8 mla b{batch} {arch}: {built.registers} at launch, "
          f"{built.max_register} used")  # fmt: skip


# Kimi-K2-Thinking's format: INT4 in groups of 32, the routed experts alone.
INT4_EXPERTS = QuantFormat(
    INT4_W4A16, PACK_QUANTIZED, 4, 32,
    unquantized=frozenset({ATTENTION, DENSE_MLP, SHARED_EXPERTS}), experts_only=True,
)  # fmt: skip


def test_int4_experts_beside_bf16_latent_attention():
    """Kimi-K2-Thinking's layout on the DeepSeek-V3 demo (a dense layer,
    then a mixture with a shared expert): the table holds the routed
    experts' packed codes in W13 / W2 and their scales in W13_SCALE /
    W2_SCALE; the latent attention's, the dense MLP's and the shared
    expert's weights are bf16, with no scale; the stand-in reads the
    experts' codes only, and a step of 3 requests in a bucket of 4 equals
    reference mode's."""
    spec = dataclasses.replace(mla_spec(torch.bfloat16, 96), quant=INT4_EXPERTS)
    weights = random_weights(spec, seed=1)
    program = plan(spec, 4, SMALL, with_lm_head=True)
    standin = KernelStandIn(program, weights)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=4)  # fmt: skip
    shape = ex.shape
    assert shape.mla and shape.quantized and not shape.dense_quantized
    assert shape.int4_group == 32 and ex.ptrs_host.shape[1] == QUANT_MOE_SLOTS
    for i, lw in enumerate(weights.layers):
        row = ex.ptrs_host[i]
        assert lw.quant is None and lw.mla.quant is None
        assert row[LayerSlot.MLA_Q_B] == lw.mla.q_b.data_ptr()
        assert not row[LayerSlot.MLA_Q_A_SCALE : LayerSlot.MLA_Q_B_SCALE + 1].any()
        if lw.moe is not None:
            e = lw.moe.quant
            assert e.shared_gate_up is None and e.w13.codes.dtype == torch.uint8
            assert row[LayerSlot.W13] == e.w13.codes.data_ptr()
            assert row[LayerSlot.W2_SCALE] == e.w2.scale.data_ptr()
            assert row[LayerSlot.SHARED_DOWN] == lw.moe.shared_down.data_ptr()
            assert not row[LayerSlot.SHARED_GATE_UP_SCALE]
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref_inputs = dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )
    register_executor(standin, ex, inputs.kv_caches)
    for lw in weights.layers:  # (a table entry pointing at one fails)
        if lw.moe is not None:
            for t in (lw.moe.w13, lw.moe.w2):
                standin.tensors.pop(t.data_ptr(), None)
    got = ex.step(inputs)
    want = ReferenceExecutor(spec, weights).step(ref_inputs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0.0625)


def test_int4_experts_beside_bf16_latent_attention_compile_clean(tmp_path):
    """The same on Blackwell at 4 requests: the experts' INT4 GEMV on CUDA
    cores beside the bf16 latent attention, clean SASS within the register
    share. (Real shapes, Kimi-K2-Thinking: scripts/compile_grid.py.)"""
    spec = dataclasses.replace(mla_spec(torch.bfloat16, 96), quant=INT4_EXPERTS)
    shape = KernelShape.from_program(plan(spec, 4, H200, with_lm_head=True),
                                     BLOCK_SIZE)  # fmt: skip
    assert shape.mla and shape.experts_only and ring_slots(shape) > 0
    built = build("sm_100a", tmp_path, shape)
    check_sass(built)
    print(f"int4 experts mla b4 sm_100a: {built.registers} at launch, "
          f"{built.max_register} used")  # fmt: skip
