# SPDX-License-Identifier: Apache-2.0
"""The kernel's mixture-of-experts instructions (ROUTE, TOPK, EXPERT_UP,
EXPERT_DOWN; kernel/ops/{route,topk,expert_up,expert_down}.py).

* Compiled ahead of time here, for Hopper and Blackwell, on the demo
  mixtures' shapes: no spill in running code, within the consumers'
  register share, the SASS facts of test_kernel_aot.py (the warp roles'
  too), plus TOPK's ballot and population counts, and the controller's L2
  prefetch of the routed rows between its acquire and its publish. Two
  builds (made at once; CI time): Qwen3-MoE at batch 16 on sm_90a in whole
  heads (the GPU check's comparison case: QKV finishes them), Mixtral at
  batch 1 on sm_100a in the planner's two head parts (with QK-norm ATTN
  then finishes q and the new K). DeepSeek's mixture (sigmoid, correction
  bias, groups, routed scaling, a shared expert) compiles with its latent
  attention in test_mla_kernel_aot.py. Real shapes (every config, every
  bucket, both archs) and these op facts: scripts/compile_grid.py.
* ``KernelShape.from_program`` takes a mixture's constants from the
  program, and refuses them beside any experimental variant.
* The address table of an MoE program round-trips through the CPU
  stand-in (kernel_standin.py): the mixture's weights are read through
  the table and its buffers written where the table says, bit for bit
  the interpreter's; a swapped entry fails.

Nothing here has run on a GPU.
"""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kernel_standin import KernelStandIn, decode_route, register_executor
from test_interpret import TOL
from test_kernel_aot import check_sass

from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import ProgramInterpreter, pad_inputs
from vllm_ext.megakernel.kernel.aot import BuildResult, build
from vllm_ext.megakernel.kernel.launcher import KernelExecutor
from vllm_ext.megakernel.kernel.ops.expert_down import PREFETCH_SLOTS
from vllm_ext.megakernel.kernel.persistent import ring_slots
from vllm_ext.megakernel.kernel.shape import (
    MOE_SLOTS,
    NUM_SLOTS,
    QUANT_MOE_SLOTS,
    KernelShape,
    LayerSlot,
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
    FP8_W8A8,
    INT4_W4A16,
    PACK_QUANTIZED,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    QuantFormat,
)
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import BLOCK_SIZE, random_decode_inputs, random_weights

H200 = DEVICES["h200"]
SMALL = dataclasses.replace(H200, num_sms=16)


def deepseek_v3_moe(batch: int) -> ModelSpec:
    """DeepSeek-V3's mixture (every routing path: sigmoid, correction bias,
    8 groups keep 4, routed scaling 2.5, a shared expert of 2048) on a plain
    GQA attention: the mixture's constants alone, apart from MLA's."""
    base = spec_or_exit("test", "qwen3-30b-a3b", "bfloat16", batch)
    moe = dataclasses.replace(
        base.moe, num_experts=256, top_k=8, expert_intermediate=2048,
        renormalize=True, scoring="sigmoid", grouped=True, num_groups=8,
        topk_groups=4, correction_bias=True, routed_scaling=2.5,
        shared_intermediate=2048,
    )  # fmt: skip
    return dataclasses.replace(
        base, architecture="DeepseekV3ForCausalLM", hidden_size=7168,
        intermediate_size=18432, num_q_heads=128, num_kv_heads=32, head_dim=128,
        qk_norm=False, moe=moe,
    )  # fmt: skip


def real_spec(model: str, batch: int) -> ModelSpec:
    if model == "deepseek-v3-moe":
        spec = deepseek_v3_moe(batch)
    else:
        spec = spec_or_exit("test", model, "bfloat16", batch)
    return spec.with_layers(2)


def real_shape(model: str, batch: int, qkv_parts: int | None = None) -> KernelShape:
    program = plan(real_spec(model, batch), batch, H200, with_lm_head=True,
                   qkv_parts=qkv_parts)  # fmt: skip
    return KernelShape.from_program(program, 16)


# (demo architecture, batch, arch, qkv_parts; None: the planner's): see the
# module docstring.
GRID = [("qwen3_moe", 16, "sm_90a", 1), ("mixtral", 1, "sm_100a", None)]


def demo_moe_shape(model: str, batch: int, qkv_parts: int | None) -> KernelShape:
    spec = ModelSpec.from_hf_config(hf_config(model), torch.bfloat16)
    program = plan(spec, batch, H200, with_lm_head=True, qkv_parts=qkv_parts)
    return KernelShape.from_program(program, BLOCK_SIZE)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[tuple, BuildResult]:
    """The grid's builds, two compiler processes at once."""
    root = tmp_path_factory.mktemp("moe")

    def one(case):
        model, batch, arch, parts = case
        shape = demo_moe_shape(model, batch, parts)
        return build(arch, root / f"{model}-{batch}-{arch}-{parts}", shape)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(GRID, pool.map(one, GRID), strict=True))


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c)))
def test_mixtures_compile_clean(builds, case):
    built = builds[case]
    check_sass(built)  # (the warp roles' SASS facts too: check_roles)
    # The dense projections read the ring's pages; the experts do not.
    assert built.async_copies == 0 and built.mma_ops == 0 and built.bulk_copies > 0
    # TOPK's distinct-expert prefix count: a ballot and population counts.
    assert built.ballots and built.popcounts
    shape = demo_moe_shape(*case[:2], case[3])
    assert shape.qkv_parts == (case[3] or 2)
    # The controller hints an EXPERT_DOWN tile's rows into L2 between its
    # acquire and its publish (its first slots' experts); a routed
    # EXPERT_UP's consumers hint their tile's two matrices and the following
    # EXPERT_DOWN tiles' (expert_up.hint_routed), outside that window.
    slots = shape.num_slots
    assert built.controller_prefetches >= min(slots, PREFETCH_SLOTS)
    assert built.l2_prefetches >= (
        built.controller_prefetches + 2 + min(slots, PREFETCH_SLOTS)
    )


def test_the_cost_model_knows_the_controllers_reach():
    """cost.py times an EXPERT_DOWN tile's rows from the controller's
    publish, which runs at most control.QUEUE_SLOTS instructions ahead, and
    a routed EXPERT_UP's from the hints of the tile ROUTED_AHEAD before it,
    as far ahead as the controller runs."""
    from vllm_ext.megakernel import cost
    from vllm_ext.megakernel.kernel import control
    from vllm_ext.megakernel.kernel.ops import expert_up

    assert cost.QUEUE_SLOTS == control.QUEUE_SLOTS
    assert cost.ROUTED_AHEAD == expert_up.ROUTED_AHEAD == control.QUEUE_SLOTS - 1


def test_from_program_takes_the_mixture():
    spec = real_spec("deepseek-v3-moe", 16)
    shape = real_shape("deepseek-v3-moe", 16)
    m = spec.moe
    assert (shape.num_experts, shape.top_k, shape.expert_intermediate) == (
        m.num_experts, m.top_k, m.expert_intermediate)  # fmt: skip
    assert shape.num_slots == min(16 * m.top_k, m.num_experts) == 128
    assert shape.moe_sigmoid and shape.correction_bias and shape.grouped
    assert (shape.num_groups, shape.topk_groups) == (8, 4)
    assert shape.routed_scaling == 2.5 and shape.shared_intermediate == 2048
    assert shape.xact_slots == 129
    qwen = real_shape("qwen3-30b-a3b", 1)
    assert not qwen.moe_sigmoid and qwen.renormalize and not qwen.grouped
    assert qwen.xact_slots == qwen.num_slots == 8
    dense = KernelShape.from_program(
        plan(spec_or_exit("test", "llama-3.2-1b", "bfloat16", 1), 1, H200), 16
    )
    assert not dense.moe and dense.num_experts == 0


@pytest.mark.parametrize("flag", ("legacy_control", *KERNEL))
def test_variants_refuse_the_mixture(flag):
    shape = real_shape("qwen3-30b-a3b", 1)
    with pytest.raises(ValueError, match="default kernel"):
        dataclasses.replace(shape, **{flag: True})
    # Head parts (the planner's) change the attention alone: with QK-norm,
    # ATTN finishes q and the new K.
    assert shape.qkv_parts == 2 and shape.qk_in_attn


def test_shape_refuses_what_topk_cannot_run():
    good = real_shape("qwen3-30b-a3b", 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        dataclasses.replace(good, expert_intermediate=764)
    with pytest.raises(ValueError, match="experts"):
        dataclasses.replace(good, num_experts=1024, num_slots=8)
    with pytest.raises(ValueError, match="num_slots"):
        dataclasses.replace(good, num_slots=9)
    with pytest.raises(ValueError, match="grouped"):
        dataclasses.replace(good, grouped=True, num_groups=3, topk_groups=1)


# ------------------------------------------------------------ the table


# qwen3_moe: a dense layer, then a sparse one; mixtral: two sparse layers;
# a DeepSeek-like mixture (sigmoid, bias, groups, shared expert) on mixtral.
def demo_spec(arch: str) -> ModelSpec:
    if arch != "deepseek_like":
        return ModelSpec.from_hf_config(hf_config(arch), torch.bfloat16, 512)
    spec = demo_spec("mixtral")
    moe = dataclasses.replace(
        spec.moe, scoring="sigmoid", correction_bias=True, grouped=True,
        num_groups=2, topk_groups=1, routed_scaling=2.5,
        shared_intermediate=2 * spec.moe.expert_intermediate,
    )  # fmt: skip
    return dataclasses.replace(spec, moe=moe)


def moe_executor(arch: str, bucket: int = 4):
    spec = demo_spec(arch)
    weights = random_weights(spec, seed=1)
    program = plan(spec, bucket, SMALL, with_lm_head=True)
    standin = KernelStandIn(program, weights)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=4)  # fmt: skip
    return spec, weights, program, ex, standin


def run_both(spec, weights, program, ex, standin, n: int, seed: int):
    """A step through the executor and the stand-in, and the same step
    straight through the interpreter."""
    inputs = random_decode_inputs(spec, n, seed=seed)
    mine = dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )
    register_executor(standin, ex, mine.kv_caches)
    got = ex.step(mine).clone()
    interp = ProgramInterpreter(program, weights, seed=9)
    want = interp.step(pad_inputs(inputs, program.batch))[:n]
    return got, want, interp


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8),
                       b.contiguous().view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_like"])
def test_moe_table_round_trips_through_the_standin(arch):
    """3 real requests in a bucket of 4: the output, the router logits, the
    routing (in the kernel's word layout) and every slot's activations in
    the executor's buffers are bit for bit the interpreter's."""
    spec, weights, program, ex, standin = moe_executor(arch)
    shape = ex.shape
    assert shape.moe and ex.ptrs_host.shape[1] == MOE_SLOTS
    got, want, interp = run_both(spec, weights, program, ex, standin, 3, seed=5)
    assert not got.isnan().any() and bits_equal(got, want)
    e = spec.moe.num_experts
    for layer, routing in enumerate(interp.routing):
        row = ex.ptrs_host[layer]
        if routing is None:  # a dense layer: no mixture in its row
            assert row[LayerSlot.ROUTER] == 0 and row[LayerSlot.ROUTE] == 0
            continue
        router = ex.ws["router"][layer][:, :e]
        assert bits_equal(router, interp.buf["router"][layer])
        w, slots, experts = decode_route(ex.ws["route"][layer], shape)
        assert bits_equal(w, routing.weights)
        assert torch.equal(slots.long(), routing.slots)
        assert torch.equal(experts.long(), routing.experts)
        assert slots[3].eq(-1).all()  # the padding row
        torch.testing.assert_close(ex.ws["xact"][layer], interp.buf["xact"][layer],
                                   rtol=0, atol=0, equal_nan=True)  # fmt: skip
    if arch == "deepseek_like":
        assert row[LayerSlot.SHARED_DOWN] != 0 and row[LayerSlot.CORRECTION_BIAS] != 0


# (A weight, W2, and a buffer, XACT; the router's weight is a weight too.
# CI time.)
@pytest.mark.parametrize("slot", [LayerSlot.W2, LayerSlot.XACT], ids=lambda s: s.name)
def test_a_swapped_table_entry_fails(slot):
    """Mixtral's two sparse layers with one of their table entries swapped
    (a weight, or a buffer): the step or a layer's buffer is wrong."""
    spec, weights, program, ex, standin = moe_executor("mixtral")
    ex.ptrs_host[[0, 1], slot] = ex.ptrs_host[[1, 0], slot]
    ex.ptrs.copy_(ex.ptrs_host)
    got, want, interp = run_both(spec, weights, program, ex, standin, 4, seed=6)
    if slot == LayerSlot.XACT:
        assert not bits_equal(ex.ws["xact"][0], interp.buf["xact"][0])
    else:
        assert not bits_equal(got, want)


# FP8 128 x 128 blocks (Qwen3-30B-A3B-FP8's, DeepSeek-V3's format), FP8 per
# channel (W8A8 per token) and INT4 W4A16 in groups of 32, in every
# projection and (Kimi-K2-Thinking's) in the routed experts only.
QUANT_MOE = {
    "fp8-block": QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP),
    "fp8-channel": QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8,
                               -1, PER_TOKEN),
    "int4": QuantFormat(INT4_W4A16, PACK_QUANTIZED, 4, 32),
    "int4-experts": QuantFormat(INT4_W4A16, PACK_QUANTIZED, 4, 32,
                                unquantized=frozenset({ATTENTION, DENSE_MLP}),
                                experts_only=True),
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(QUANT_MOE))
def test_quantized_mixture_through_the_table(fmt):
    """Qwen3-MoE's demo (a dense layer, then a sparse one) quantized: the
    table holds the experts' codes in W13 and W2 and their scales in
    W13_SCALE and W2_SCALE (FP8 also the buffers EXPERT_UP quantizes its
    outputs into for EXPERT_DOWN, and the slots' arrival counts, zero); the
    stand-in reads the codes only (no dense expert is registered), and a
    step of 3 requests in a bucket of 4 equals reference mode's (inputs
    quantized as each GEMM takes them, weights dequantized). With the
    routed experts alone quantized, the rest of the table is a bf16
    kernel's (no scale: the attention's and dense MLP's weights bf16)."""
    spec = dataclasses.replace(demo_spec("qwen3_moe"), quant=QUANT_MOE[fmt])
    weights = random_weights(spec, seed=1)
    program = plan(spec, 4, SMALL, with_lm_head=True)
    standin = KernelStandIn(program, weights)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=4)  # fmt: skip
    shape = ex.shape
    assert shape.moe and shape.quantized and ex.ptrs_host.shape[1] == QUANT_MOE_SLOTS
    sparse = spec.moe.sparse_layers.index(True)
    lw, row = weights.layers[sparse], ex.ptrs_host[sparse]
    assert row[LayerSlot.GATE_UP] == 0
    experts_only = fmt == "int4-experts"
    assert shape.dense_quantized != experts_only
    if experts_only:
        dense = spec.moe.sparse_layers.index(False)
        assert weights.layers[dense].quant is None and lw.quant is None
        for i, w in ((sparse, lw), (dense, weights.layers[dense])):
            assert ex.ptrs_host[i, LayerSlot.QKV] == w.qkv.data_ptr()
            assert w.qkv.dtype == torch.bfloat16
            scales = ex.ptrs_host[i, LayerSlot.QKV_SCALE : LayerSlot.DOWN_SCALE + 1]
            assert not scales.any()
    else:
        assert lw.quant.gate_up is None
    for slot, scale, w in (
        (LayerSlot.W13, LayerSlot.W13_SCALE, lw.moe.quant.w13),
        (LayerSlot.W2, LayerSlot.W2_SCALE, lw.moe.quant.w2),
    ):
        assert row[slot] == w.codes.data_ptr() and row[scale] == w.scale.data_ptr()
    fp8 = fmt.startswith("fp8")
    assert (row[LayerSlot.XQ] != 0) == fp8 and (row[LayerSlot.ARRIVE] != 0) == fp8
    if fp8:
        assert not ex.ws["arrive"].any()
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref_inputs = dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )
    register_executor(standin, ex, inputs.kv_caches)
    for t in (lw.moe.w13, lw.moe.w2):  # (a table entry pointing at one fails)
        standin.tensors.pop(t.data_ptr(), None)
    got = ex.step(inputs)
    want = ReferenceExecutor(spec, weights).step(ref_inputs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=TOL[torch.bfloat16])


def test_experts_only_is_int4_experts_of_a_mixture():
    """``KernelShape.experts_only`` takes INT4 routed experts (FP8
    checkpoints quantize every projection); a dense kernel has no experts
    to quantize alone; its dense projections then need no INT4 widths."""
    spec = dataclasses.replace(demo_spec("qwen3_moe"), quant=QUANT_MOE["int4-experts"])
    shape = KernelShape.from_program(plan(spec, 4, SMALL), BLOCK_SIZE)
    assert shape.experts_only and shape.quantized and not shape.dense_quantized
    with pytest.raises(ValueError, match="experts_only: INT4 experts of a mixture"):
        dataclasses.replace(shape, fp8=True, int4_group=0)
    dense = KernelShape.from_program(plan(demo_spec("llama"), 4, SMALL), BLOCK_SIZE)
    with pytest.raises(ValueError, match="experts_only: INT4 experts of a mixture"):
        dataclasses.replace(dense, int4_group=32, experts_only=True)
    # (An intermediate of 96 is no whole number of the INT4 GEMV's k blocks.)
    assert dataclasses.replace(shape, intermediate=96).experts_only
    with pytest.raises(ValueError, match="INT4 GEMV widths"):
        dataclasses.replace(shape, intermediate=96, experts_only=False)


# (format, batch, arch): FP8 blocks at 16 requests (experts' inputs staged
# in passes: stage_rows), INT4 at 1 on Blackwell. CI time.
QUANT_GRID = [("fp8-block", 16, "sm_90a"), ("int4", 1, "sm_100a")]


@pytest.mark.parametrize("case", QUANT_GRID, ids=lambda c: "-".join(map(str, c)))
def test_quantized_mixtures_compile_clean(case, tmp_path):
    """The quantized experts (gemv_quant.py; FP8's quantization of EXPERT_UP's
    outputs by each slot's last tile: one GPU-scope add a tile) beside the
    quantized projections' tensor cores, on the demo Qwen3-MoE: clean SASS,
    within the register share. (Real shapes: scripts/compile_grid.py.)"""
    fmt, batch, arch = case
    spec = dataclasses.replace(demo_spec("qwen3_moe"), quant=QUANT_MOE[fmt])
    shape = KernelShape.from_program(plan(spec, batch, H200, with_lm_head=True),
                                     BLOCK_SIZE)  # fmt: skip
    assert shape.quantized and shape.moe and ring_slots(shape) > 0
    built = build(arch, tmp_path, shape)
    check_sass(built)
    assert built.mma_ops > 0 and built.bulk_copies > 0  # the projections
    if fmt != "int4":
        assert built.e4m3_converts > 0
    print(f"{fmt} b{batch} {arch}: {built.registers} at launch, "
          f"{built.max_register} used")  # fmt: skip


def test_workspace_lists_the_mixtures_buffers():
    """Sized as the interpreter's (the routing as the kernel's words), and
    absent from a dense kernel, whose table stays NUM_SLOTS wide."""
    spec, _, program, ex, _ = moe_executor("deepseek_like")
    sizes = workspace_sizes(ex.shape, spec.num_layers)
    slots = program.num_slots + 1  # the shared expert's
    width = max(spec.moe.expert_intermediate, spec.moe.shared_intermediate)
    assert sizes["xact"] == (spec.num_layers, slots, 4, width)
    assert sizes["router"] == (spec.num_layers, 4, 8)  # 4 experts, rows of 8
    dense = KernelShape.from_program(plan(demo_spec("qwen3_moe").with_layers(1), 4,
                                          SMALL), 16)  # fmt: skip
    assert "route" not in workspace_sizes(dense, 1)
    assert NUM_SLOTS < MOE_SLOTS


# ------------------------------------------------------------ TOPK's mapping


def emulate_topk(logits, seq_lens, shape: KernelShape, bias):
    """kernel/ops/topk.py lane by lane in float32 (numpy): a warp of 32
    lanes per request, lane l holding experts l + 32 j; butterfly
    reductions; the flags' prefix count. Returns (weights, slots, experts)
    like the kernel's routing words."""
    import numpy as np

    f32 = np.float32
    b, e, k = shape.batch, shape.num_experts, shape.top_k
    per_lane = (e + 31) // 32
    lanes = np.arange(32)
    ex = lanes[:, None] + 32 * np.arange(per_lane)[None, :]  # [32, per_lane]
    valid = ex < e

    def butterfly(vals, combine):
        vals = list(vals)
        for off in (16, 8, 4, 2, 1):
            vals = [combine(vals[i], vals[i ^ off]) for i in range(32)]
        assert all(v == vals[0] or v != v for v in vals)  # every lane agrees
        return vals[0]

    weights = np.zeros((b, k), f32)
    chosen = np.full((b, k), -1)
    used = np.zeros(e, bool)
    for r in range(b):
        if seq_lens[r] <= 0:
            continue
        raw = np.full(ex.shape, -np.inf, f32)
        raw[valid] = logits[r, ex[valid]]
        if shape.moe_sigmoid:
            score = f32(1) / (f32(1) + np.exp(-raw))
        else:
            m = butterfly(raw.max(axis=1), max)
            p = np.exp(raw - m)
            part = [f32(0)] * 32
            for lane in range(32):
                for j in range(per_lane):
                    part[lane] = f32(part[lane] + p[lane, j])
            score = p / butterfly(part, lambda a, c: f32(a + c))
        pick = score.copy()
        if bias is not None:
            pick[valid] = score[valid] + bias[ex[valid]]
        if shape.grouped:
            size = e // shape.num_groups
            rank = []
            for g in range(shape.num_groups):
                member = (ex // size == g) & valid
                m1 = butterfly(np.where(member, pick, -np.inf).max(axis=1), max)
                if bias is not None:
                    holders = np.where(member & (pick == m1), ex, e)
                    first = butterfly(holders.min(axis=1), min)
                    rest = member & (ex != first)
                    m2 = butterfly(np.where(rest, pick, -np.inf).max(axis=1), max)
                    rank.append(f32(m1 + m2))
                else:
                    rank.append(m1)
            kept = []
            for _ in range(shape.topk_groups):
                cands = [g for g in range(shape.num_groups) if g not in kept]
                kept.append(max(cands, key=lambda g: (rank[g], -g)))
            pick = np.where(np.isin(ex // size, kept), pick, -np.inf).astype(f32)
        taken = ~valid
        picked = []
        for t in range(k):
            best = []
            for lane in range(32):
                cur = (-np.inf, e, f32(0))
                for j in range(per_lane):
                    if not taken[lane, j] and (cur[1] == e or pick[lane, j] > cur[0]):
                        cur = (pick[lane, j], ex[lane, j], score[lane, j])
                best.append(cur)

            def better(a, c):
                if c[1] < e and (
                    a[1] == e or c[0] > a[0] or (c[0] == a[0] and c[1] < a[1])
                ):
                    return c
                return a

            _, idx, w = butterfly(best, better)
            taken[idx % 32, idx // 32] = True
            chosen[r, t] = idx
            used[idx] = True
            picked.append(w)
        if shape.renormalize:
            total = picked[0]
            for w in picked[1:]:
                total = f32(total + w)
            picked = [f32(w / total) for w in picked]
        weights[r] = [f32(w * f32(shape.routed_scaling)) for w in picked]
    distinct = np.flatnonzero(used)  # the ballots' prefix count, ascending
    slot_of = np.full(e, -1)
    slot_of[distinct] = np.arange(len(distinct))
    experts = np.full(shape.num_slots, -1)
    experts[: len(distinct)] = distinct
    slots = np.where(chosen >= 0, slot_of[chosen], -1)
    return weights, slots, experts


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-moe"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_topk_mapping_matches_the_reference(model, ties):
    """The kernel's TOPK, emulated lane by lane, against ops/topk.py on the
    same bf16 logits, at batch 16 with 3 padding rows: the same experts,
    slots and slot experts (ties too: logits from a few values, a bias
    from a few values), weights within a few fp32 ulps (exp and the
    softmax sum's order are the device's: ops/topk.py's docstring)."""
    from types import SimpleNamespace

    from vllm_ext.megakernel.ops import topk as topk_op

    spec = real_spec(model, 16)
    shape = real_shape(model, 16)
    gen = torch.Generator().manual_seed(3)
    e = shape.num_experts
    if ties:
        logits = torch.randint(-3, 3, (16, e), generator=gen).float() / 4
    else:
        logits = torch.randn(16, e, generator=gen)
    logits = logits.to(torch.bfloat16)
    bias = None
    if shape.correction_bias:
        bias = torch.randn(e, generator=gen) * 0.01
        if ties:
            bias = torch.randint(0, 2, (e,), generator=gen).float() / 64
    seq_lens = torch.tensor([5] * 13 + [0] * 3)
    layer = SimpleNamespace(moe=SimpleNamespace(correction_bias=bias))
    want = topk_op.reference(logits, layer, spec, seq_lens, shape.num_slots)
    w, slots, experts = emulate_topk(
        logits.float().numpy(), seq_lens.numpy(), shape,
        None if bias is None else bias.numpy(),
    )  # fmt: skip
    assert slots.tolist() == want.slots.tolist()
    assert experts.tolist() == want.experts.tolist()
    torch.testing.assert_close(torch.from_numpy(w)[:13], want.weights[:13],
                               rtol=4e-7, atol=0)  # fmt: skip


def test_expert_down_walk_keeps_the_slot_order():
    """kernel/ops/expert_down.py's walk, emulated: each request's choices
    sorted by slot, a cursor per request of a group of 8 advanced as the
    slots go by in order, skipping empty slots. Every request meets each
    of its choices once, in ascending slot order, with its weight, which is
    the order ops/expert_down.py adds them in (padding rows: none)."""
    from types import SimpleNamespace

    from vllm_ext.megakernel.ops import topk as topk_op

    spec = real_spec("qwen3-30b-a3b", 16)
    shape = real_shape("qwen3-30b-a3b", 16)
    k, group = shape.top_k, 8
    logits = torch.randn(16, shape.num_experts, generator=torch.Generator()
                         .manual_seed(4)).to(torch.bfloat16)  # fmt: skip
    seq_lens = torch.tensor([3] * 14 + [0] * 2)
    layer = SimpleNamespace(moe=SimpleNamespace(correction_bias=None))
    routing = topk_op.reference(logits, layer, spec, seq_lens, shape.num_slots)
    # The bubble sort's result: by slot (a request's slots are distinct).
    choice = [sorted(zip(routing.slots[r].tolist(), routing.weights[r].tolist(),
                        strict=True), key=lambda c: c[0])
              for r in range(16)]  # fmt: skip
    met = {r: [] for r in range(16)}
    for b0 in range(0, 16, group):
        cur = [0] * group
        for slot, expert in enumerate(routing.experts.tolist()):
            if expert < 0:
                continue
            for i in range(group):
                r = b0 + i
                if cur[i] < k and choice[r][cur[i]][0] == slot:
                    met[r].append((slot, choice[r][cur[i]][1]))
                    cur[i] += 1
    for r in range(16):
        want = sorted((s, w) for s, w in zip(routing.slots[r].tolist(),
                                             routing.weights[r].tolist(),
                                             strict=True) if s >= 0)  # fmt: skip
        assert met[r] == want
    assert met[14] == met[15] == []
