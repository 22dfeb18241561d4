# SPDX-License-Identifier: Apache-2.0
"""The persistent kernel: one CTA per SM runs its queue of instructions.

The default kernel's CTA is three roles in 384 threads (``control.py``):

* warps 0-7, the consumers (``NUM_THREADS``): wait for the next
  instruction (``queue_ready``), execute it (``ops/``), meet at their named
  barrier, then thread 0 signals (a release atomic at GPU scope);
* warp 8, lane 0, the producer (``ops/weight_pipe.produce``): keeps the
  ring of weight pages full in queue order, never waiting on a counter;
* warp 9, lane 0, the controller: fetches instructions into the
  instruction ring and waits for their inputs ahead of the consumers.

Warps 8-11 are one warpgroup, so ``setmaxnreg`` moves registers from it to
the consumers (``PRODUCER_REGS``, ``CONSUMER_REGS``). The only CTA-wide
barrier is the one after start-up init. ``KernelShape.legacy_control``
builds the previous control instead (256 threads; thread 0 fetches, waits
and signals between CTA barriers; the GEMVs read global memory), for the
side-by-side GPU comparison.

Model shape and batch bucket are compile-time (``KernelShape``); every
address comes from the table ``ptrs`` (``shape.py``). The experimental
variants (``variants.py``) are ``KernelShape`` flags, compiled out when
off. So is the mixture of experts (ROUTE, TOPK, EXPERT_UP, EXPERT_DOWN and
their shared scratch): compiled in only for a shape with one; and so is the
multi-head latent attention (MLA_QKV_A, MLA_Q, MLA_APPEND, MLA_ATTN,
MLA_COMBINE and their scratch), in place of QKV, ATTN and COMBINE and
theirs.
"""

import dataclasses
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from vllm_ext.megakernel.isa import WORDS, Op
from vllm_ext.megakernel.kernel.control import (
    InstrRing,
    controller,
    release_instruction,
    ring_bytes,
    ring_init,
    signal_done,
    wait_inputs,
    wait_instruction,
)
from vllm_ext.megakernel.kernel.ops.all_reduce import all_reduce
from vllm_ext.megakernel.kernel.ops.attn import attn
from vllm_ext.megakernel.kernel.ops.attn_wide import attn_wide
from vllm_ext.megakernel.kernel.ops.combine import combine
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    consumer_sync,
    quant_stages,
    stage_rows,
)
from vllm_ext.megakernel.kernel.ops.embed import embed
from vllm_ext.megakernel.kernel.ops.expert_down import expert_down
from vllm_ext.megakernel.kernel.ops.expert_up import (
    expert_up,
    quant_words,
    routed_words,
    routing_of,
)
from vllm_ext.megakernel.kernel.ops.final_norm import final_norm
from vllm_ext.megakernel.kernel.ops.gemv_quant import x_scale_shape
from vllm_ext.megakernel.kernel.ops.mla_append import mla_append
from vllm_ext.megakernel.kernel.ops.mla_attn import mla_attn, pass_tiles
from vllm_ext.megakernel.kernel.ops.mla_attn import scratch_floats as attn_floats
from vllm_ext.megakernel.kernel.ops.mla_combine import mla_combine
from vllm_ext.megakernel.kernel.ops.mla_q import (
    mla_q,
    q_input_width,
    q_scale_floats,
    stages_q_input,
    wuk_scratch_floats,
)
from vllm_ext.megakernel.kernel.ops.mla_qkv_a import mla_qkv_a
from vllm_ext.megakernel.kernel.ops.prefetch import prefetch_weights
from vllm_ext.megakernel.kernel.ops.projections import down, gate_up, lm_head, o_proj
from vllm_ext.megakernel.kernel.ops.qkv import qkv
from vllm_ext.megakernel.kernel.ops.route import route
from vllm_ext.megakernel.kernel.ops.topk import topk
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    MAX_SLOTS,
    Pipe,
    instr_pages,
    pipe_bytes,
    pipe_init,
    pipe_slots,
    produce,
)
from vllm_ext.megakernel.kernel.queue import Queue, fetch
from vllm_ext.megakernel.kernel.shape import KernelShape, table_width
from vllm_ext.megakernel.kernel.sync import record_abort

# The producer warpgroup (warps 8-11): the producer's and the controller's
# lanes; the other two warps idle. setmaxnreg is warpgroup-wide, so the
# roles take a whole warpgroup to hand its registers to the consumers.
PRODUCER_WARP = NUM_WARPS
CONTROLLER_WARP = NUM_WARPS + 1
ROLE_THREADS = 128
# Registers per thread after setmaxnreg: 256 x 224 + 128 x 56 = 64512, the
# launch's grant (65536 / 384 = 168 each). 56 was chosen when the waits
# still printed (at 40 the roles' loops kept values in the stack across
# printf's call); not tuned again since nothing prints. The consumers' peak
# on the shapes built so far is 222 (DeepSeek-V3 and Kimi-K2, sm_100a).
CONSUMER_REGS = 224
PRODUCER_REGS = 56


# Shared memory one Hopper/Blackwell CTA may use (227 KiB).
SMEM_LIMIT = 227 * 1024


def _buffers(s: KernelShape) -> list[int]:
    """The CTA's shared buffers but the weight pipeline's, in bytes."""
    return [
        4 * s.batch,  # rstd
        # (A latent attention kernel's are in its shared region: mla_buffers.)
        *([] if s.mla else x_stage_buffers(s)),
        *gqa_buffers(s),
        *([] if s.legacy_control else ring_bytes()),
        4 * moe_words(s),  # the mixture's int32 scratch
        4 * s.batch * s.top_k,  # EXPERT_DOWN's sorted weights
        *mla_buffers(s),
    ]


def mla_stage_shape(s: KernelShape) -> tuple[int, int]:
    """MLA_Q's normed input in shared memory (a placeholder vector when it
    does not fit: the GEMV then norms on the fly)."""
    return (s.batch, q_input_width(s)) if stages_q_input(s) else (1, VEC)


def gqa_buffers(s: KernelShape) -> list[int]:
    """Grouped-query attention's shared buffers, in bytes: QKV's head_buf
    and head_rstd, ATTN's warp_m, warp_l and warp_o. None in a latent
    attention kernel, which has no QKV, ATTN or COMBINE."""
    if s.mla:
        return []
    return [
        4 * s.batch * s.head_dim,  # head_buf
        4 * s.batch,  # head_rstd
        2 * 4 * NUM_WARPS * s.group,  # warp_m, warp_l
        4 * NUM_WARPS * s.group * s.head_dim,  # warp_o
    ]


def mla_red_floats(s: KernelShape) -> int:
    """The fp32 scratch of W_UK's partial sums (MLA_Q), MLA_COMBINE's chunk
    weights and MLA_ATTN's staged queries and P too (one at a time)."""
    return max(
        wuk_scratch_floats(),
        s.batch * (s.attn_chunks + 1),
        attn_floats(s.kv_lora_rank + s.qk_rope,
                    pass_tiles(s.mla_per_group, s.query_rows)),
    )  # fmt: skip


def x_stage_buffers(s: KernelShape) -> list[int]:
    """x_stage and the FP8 kernels' x_scales, in bytes."""
    return [2 * max(stage_rows(s) * s.hidden, VEC), 4 * x_scale_floats(s)]


def x_scale_floats(s: KernelShape) -> int:
    """fp32 input scales of an FP8 kernel's staged passes (gemv_quant's
    ``x_scale_shape``; none elsewhere)."""
    if not (s.fp8 and quant_stages(s)):
        return 0
    rows, groups = x_scale_shape(s)
    return rows * groups


def mla_union_parts(s: KernelShape) -> tuple[list[int], list[int], list[int]]:
    """The three users of one shared region, in bytes: MLA_Q's staged input
    and a head's q in fp32 (FP8: then the staged input's scales,
    ``q_scale_floats``); MLA_COMBINE's merged latent rows; the other
    instructions' x_stage and x_scales (MLA_QKV_A, ROUTE, the experts, the
    dense GATE_UP). One instruction runs at a time (the consumers meet
    between two) and none leaves anything there for the next, so they
    never live together."""
    rows, cols = mla_stage_shape(s)
    q_buf = 4 * (s.batch * s.qk_head_dim + q_scale_floats(s))
    return (
        [2 * rows * cols, q_buf],
        [2 * s.batch * s.kv_lora_rank],
        x_stage_buffers(s),
    )


def mla_buffers(s: KernelShape) -> list[int]:
    """The latent attention's shared buffers, in bytes (none in a kernel
    without one): the scratch of ``mla_red_floats``, then the region of
    ``mla_union_parts``."""
    if not s.mla:
        return []
    return [4 * mla_red_floats(s), max(map(_padded, mla_union_parts(s)))]


def moe_words(s: KernelShape) -> int:
    """Int32 scratch of TOPK, a routed EXPERT_UP's routing and gather and
    EXPERT_DOWN's sorted slots, one at a time (0 in a dense kernel)."""
    if not s.moe:
        return 0
    # (TOPK's and EXPERT_DOWN's fit in it.)
    return routed_words(s) + quant_words(s)


def _padded(buffers: list[int]) -> int:
    # Each buffer rounded up to 128 bytes, an upper bound on its alignment.
    return sum((b + 127) // 128 * 128 for b in buffers)


def ring_slots(s: KernelShape) -> int:
    """Pages in the weight pipeline's ring: what the rest leaves (0: the
    legacy control, or too little room: the GEMVs then read global
    memory)."""
    if s.legacy_control:
        return 0
    # Everything but the pages, with the mbarriers of the largest ring.
    rest = _padded(_buffers(s) + pipe_bytes(MAX_SLOTS, s)[1:])
    return pipe_slots(SMEM_LIMIT - rest)


def shared_bytes(s: KernelShape) -> int:
    """The CTA's shared memory, as the kernel allocates it."""
    slots = ring_slots(s)
    return _padded(_buffers(s) + (pipe_bytes(slots, s) if slots else []))


def block_threads(s: KernelShape) -> int:
    return NUM_THREADS if s.legacy_control else NUM_THREADS + ROLE_THREADS


class Megakernel:
    def __init__(self, shape: KernelShape):
        # (A quantized kernel's projections run on tensor cores at every
        # batch: geometry.)
        if (shape.mma_gemv or shape.quantized) and ring_slots(shape) == 0:
            raise ValueError(
                f"the kernel for {shape} leaves no room in shared memory for the "
                "weight ring the tensor-core GEMV reads"
            )
        need = shared_bytes(shape)
        if need > SMEM_LIMIT:
            raise ValueError(
                f"the kernel for {shape} needs {need} bytes of shared memory, "
                f"over the {SMEM_LIMIT} a CTA may use"
            )
        self.shape = shape

    @cute.jit
    def __call__(
        self,
        queue: cute.Tensor,  # [num_sms, max_len, WORDS] int32
        lengths: cute.Tensor,  # [num_sms] int32
        counters: cute.Tensor,  # [num_counters + 1] int32; the last: the step
        ptrs: cute.Tensor,  # [num_layers + 1, table_width(shape)] int64
        block_table_stride: Int32,
        kv_block_stride: Int32,
        attn_scale: Float32,
        max_spins: Int32,
        stream: cuda.CUstream,
    ):
        # Cooperative: the launch fails rather than leave CTAs unscheduled,
        # since a CTA that never runs would leave the others waiting forever.
        self.kernel(
            queue, lengths, counters, ptrs, block_table_stride, kv_block_stride,
            attn_scale, max_spins,
        ).launch(
            grid=(queue.shape[0], 1, 1),
            block=(block_threads(self.shape), 1, 1),
            stream=stream,
            cooperative=True,
            # One CTA per SM: ptxas may then use up to 255 registers (legacy)
            # or 168, raised by setmaxnreg to CONSUMER_REGS (default), instead
            # of spilling at 128. The carveout keeps most of the unified
            # L1/shared memory as L1 (activations and re-read weight rows);
            # the driver still grants the shared memory the kernel needs.
            min_blocks_per_mp=1,
            preferred_smem_carveout=25,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        queue: cute.Tensor,
        lengths: cute.Tensor,
        counters: cute.Tensor,
        ptrs: cute.Tensor,
        block_table_stride: Int32,
        kv_block_stride: Int32,
        attn_scale: Float32,
        max_spins: Int32,
    ):
        s = self.shape
        tidx, _, _ = cute.arch.thread_idx()
        sm, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(s.ranks_in_launch > 1):
            ptrs, counters = rank_views(s, sm, queue.shape[0], ptrs, counters)
        glob = ptrs.shape[0] - 1  # the model-wide row of the table
        # The step number lives on the device, bumped by the host before each
        # launch, so a CUDA graph replays the same launch step after step.
        epoch = counters[counters.shape[0] - 1]

        smem = SmemAllocator()
        rstd = smem.allocate_tensor(Float32, cute.make_layout(s.batch), 16)
        stage = (stage_rows(s), s.hidden) if stage_rows(s) else (1, VEC)
        stage_layout = cute.make_layout(stage, stride=(stage[1], 1))
        # FP8 kernels' staged passes' input scales (gemv_quant.staged_passes).
        x_stage = x_scales = None
        if cutlass.const_expr(not s.mla):  # (else in the MLA region, below)
            x_stage = smem.allocate_tensor(BFloat16, stage_layout, 16)
            if cutlass.const_expr(x_scale_floats(s) > 0):
                rows, groups = x_scale_shape(s)
                x_scales = smem.allocate_tensor(
                    Float32, cute.make_layout((rows, groups), stride=(groups, 1)), 16
                )
        # Grouped-query attention's scratch (not in a latent attention kernel).
        head_buf = head_rstd = warp_m = warp_l = warp_o = None
        if cutlass.const_expr(not s.mla):
            head_buf = smem.allocate_tensor(
                Float32,
                cute.make_layout((s.batch, s.head_dim), stride=(s.head_dim, 1)),
                16,
            )
            head_rstd = smem.allocate_tensor(Float32, cute.make_layout(s.batch), 16)
            warp_m = smem.allocate_tensor(
                Float32, cute.make_layout((NUM_WARPS, s.group), stride=(s.group, 1)), 16
            )
            warp_l = smem.allocate_tensor(
                Float32, cute.make_layout((NUM_WARPS, s.group), stride=(s.group, 1)), 16
            )
            warp_o = smem.allocate_tensor(
                Float32,
                cute.make_layout(
                    (NUM_WARPS, s.group, s.head_dim),
                    stride=(s.group * s.head_dim, s.head_dim, 1),
                ),
                16,
            )

        # The mixture's scratch (only in a kernel with one).
        moe_i = moe_f = None
        if cutlass.const_expr(s.moe):
            moe_i = smem.allocate_tensor(Int32, cute.make_layout(moe_words(s)), 16)
            moe_f = smem.allocate_tensor(
                Float32, cute.make_layout(s.batch * s.top_k), 16
            )

        # The latent attention's scratch (only in a kernel with one).
        mla_x = mla_qb = mla_red = mla_lat = None
        if cutlass.const_expr(s.mla):
            mla_red = smem.allocate_tensor(
                Float32, cute.make_layout(mla_red_floats(s)), 16
            )
            # MLA_Q's two buffers, MLA_COMBINE's one and x_stage / x_scales
            # share a region (mla_union_parts), each at a 128-byte boundary.
            (x_bytes, _), _, (stage_bytes, _) = mla_union_parts(s)
            region = smem.allocate_tensor(
                cutlass.Uint8, cute.make_layout(mla_buffers(s)[1]), 128
            ).iterator
            x_stage = cute.make_tensor(cute.recast_ptr(region, dtype=BFloat16),
                                       stage_layout)  # fmt: skip
            if cutlass.const_expr(x_scale_floats(s) > 0):
                rows, groups = x_scale_shape(s)
                x_scales = cute.make_tensor(
                    cute.recast_ptr(region + _padded([stage_bytes]), dtype=Float32),
                    cute.make_layout((rows, groups), stride=(groups, 1)),
                )
            rows, cols = mla_stage_shape(s)
            mla_x = cute.make_tensor(
                cute.recast_ptr(region, dtype=BFloat16),
                cute.make_layout((rows, cols), stride=(cols, 1)),
            )
            mla_qb = cute.make_tensor(
                cute.recast_ptr(region + _padded([x_bytes]), dtype=Float32),
                cute.make_layout((s.batch, s.qk_head_dim), stride=(s.qk_head_dim, 1)),
            )
            mla_lat = cute.make_tensor(
                cute.recast_ptr(region, dtype=BFloat16),
                cute.make_layout((s.batch, s.kv_lora_rank), stride=(s.kv_lora_rank, 1)),
            )

        # The legacy control has no weight pipeline: its ops receive x_stage
        # in its place and never read it.
        w_stage = x_stage
        scratch = _Scratch(rstd, head_buf, head_rstd, x_stage, x_scales, warp_m,
                           warp_l, warp_o, moe_i, moe_f, mla_x, mla_qb, mla_red,
                           mla_lat)  # fmt: skip
        q = Queue(queue, sm)
        args = _Args(ptrs, glob, counters, epoch, sm, max_spins, kv_block_stride,
                     block_table_stride, attn_scale, q, lengths)  # fmt: skip
        if cutlass.const_expr(s.moe):
            if tidx == 0:  # (before either control's first barrier)
                moe_i[routing_of(s)] = Int32(-1)  # no layer's routing yet
        if cutlass.const_expr(s.legacy_control):
            _legacy_loop(s, q, lengths[sm], args, scratch, w_stage)
        else:
            slots = ring_slots(s)
            pipe = w_stage
            if cutlass.const_expr(slots > 0):
                pipe = Pipe.allocate(
                    s, slots, smem, q=q, length=lengths[sm], ptrs=ptrs, glob=glob,
                    max_spins=max_spins,
                )  # fmt: skip
            ring = InstrRing.allocate(smem)
            if tidx == 0:
                ring_init(ring, lengths[sm])
                if cutlass.const_expr(slots > 0):
                    pipe_init(pipe)
            # The one CTA-wide barrier: the mbarriers are initialised.
            cute.arch.sync_threads()
            warp = tidx // 32
            if warp >= NUM_WARPS:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if tidx == PRODUCER_WARP * 32:
                    if cutlass.const_expr(slots > 0):
                        produce(pipe)
                elif tidx == CONTROLLER_WARP * 32:
                    controller(s, ring, q, lengths[sm], counters, epoch, max_spins,
                               ptrs, glob, slots > 0, kv_block_stride,
                               block_table_stride)  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                _consumer_loop(s, q, args, scratch, pipe, ring)


def rank_views(
    s: KernelShape, sm, num_sms, ptrs: cute.Tensor, counters: cute.Tensor
) -> tuple[cute.Tensor, cute.Tensor]:
    """The one-GPU check's ranks (``ranks_in_launch``): the CTAs split into
    rank groups of ``num_sms / ranks`` in rank order; rank k's table and
    counters are the k-th of ``ranks`` stacked ones, so a CTA sees its own
    rank's as a TP deployment's kernel sees its GPU's."""
    ranks = s.ranks_in_launch
    rank = sm // (num_sms // ranks)
    width = table_width(s)
    rows = ptrs.shape[0] // ranks
    ptrs = cute.make_tensor(
        ptrs.iterator + rank * rows * width,
        cute.make_layout((rows, width), stride=(width, 1)),
    )
    per = counters.shape[0] // ranks
    counters = cute.make_tensor(counters.iterator + rank * per,
                                cute.make_layout((per,)))  # fmt: skip
    return ptrs, counters


@dataclass(frozen=True)
class _Scratch:
    """The consumers' shared buffers (trace time; None where compiled out)."""

    rstd: object
    head_buf: object
    head_rstd: object
    x_stage: object
    x_scales: object
    warp_m: object
    warp_l: object
    warp_o: object
    moe_i: object
    moe_f: object
    mla_x: object
    mla_qb: object
    mla_red: object
    mla_lat: object


@dataclass(frozen=True)
class _Args:
    """The kernel's arguments the instructions read (trace time)."""

    ptrs: object
    glob: object
    counters: object
    epoch: object
    sm: object
    max_spins: object
    kv_block_stride: object
    block_table_stride: object
    attn_scale: object
    queue: object  # the CTA's Queue (a routed EXPERT_UP hints what follows it)
    lengths: object  # every queue's length (read where needed: kept live, it spills)


@cute.jit
def _consumer_loop(s: cutlass.Constexpr, q: cutlass.Constexpr, a: cutlass.Constexpr,
                   m: cutlass.Constexpr, pipe: cutlass.Constexpr,
                   ring: cutlass.Constexpr):  # fmt: skip
    """The consumers: each instruction once the controller published it;
    ``page`` counts the weight pages of the instructions before it."""
    tidx, _, _ = cute.arch.thread_idx()
    paged = isinstance(pipe, Pipe)
    ins = cute.make_rmem_tensor((WORDS,), Int32)
    page = Int32(0)
    pc = Int32(0)
    # The bound is read from shared memory each pass: a register held
    # across the ops was spilled where they fill the consumers' 224
    # (Kimi-K2 FP8 at batch 4, sm_100a).
    while pc < ring.length[0]:
        wait_instruction(s, ring, pc, ins, a.max_spins, a.sm, a.ptrs, a.glob)
        op, layer, a0, a1 = ins[0], ins[1], ins[2], ins[3]
        w_stage = pipe
        if cutlass.const_expr(paged):
            w_stage = dataclasses.replace(pipe, base=page)
        _execute(s, op, layer, a0, a1, a, m, w_stage, pc)
        # Every consumer's stores are issued (and every consumer has read
        # the instruction's words) before the release below.
        consumer_sync()
        if tidx == 0:
            signal_done(s, a.counters, ins, a.ptrs, a.glob)
            release_instruction(ring, pc)
        if cutlass.const_expr(paged):
            page = page + instr_pages(s, op, a0, a1)
        pc = pc + 1


@cute.jit
def _legacy_loop(s: cutlass.Constexpr, q: cutlass.Constexpr, length,
                 a: cutlass.Constexpr, m: cutlass.Constexpr,
                 w_stage: cutlass.Constexpr):  # fmt: skip
    """The previous control (``legacy_control``): thread 0 starts the next
    instruction's weight stream, waits for the inputs; CTA barriers around
    the instruction; thread 0 signals."""
    tidx, _, _ = cute.arch.thread_idx()
    ins = cute.make_rmem_tensor((WORDS,), Int32)
    for pc in cutlass.range(length):
        fetch(q, pc, ins)
        op, layer, a0, a1 = ins[0], ins[1], ins[2], ins[3]
        if tidx == 0:
            # Weight streams start before the wait (see ops/prefetch.py).
            if pc == 0:
                prefetch_weights(s, a.ptrs, a.glob, op, layer, a0, a1)
            if pc + 1 < length:
                nxt = q.queue[q.sm, pc + 1, None]
                prefetch_weights(s, a.ptrs, a.glob, nxt[0], nxt[1], nxt[2], nxt[3])
            wait_inputs(s, a.counters, ins, a.epoch, a.sm, pc, a.max_spins, a.ptrs,
                        a.glob)  # fmt: skip
        consumer_sync()
        _execute(s, op, layer, a0, a1, a, m, w_stage, pc)
        consumer_sync()
        if tidx == 0:
            signal_done(s, a.counters, ins, a.ptrs, a.glob)


@cute.jit
def _execute(s: cutlass.Constexpr, op, layer, a0, a1, a: cutlass.Constexpr,
             m: cutlass.Constexpr, w_stage: cutlass.Constexpr, pc):  # fmt: skip
    """Instruction (op, layer, a0, a1) by the consumers."""
    ptrs, glob = a.ptrs, a.glob
    if (op == Op.QKV) | (op == Op.ATTN) | (op == Op.COMBINE):
        if cutlass.const_expr(s.mla):
            _bad_opcode(s, op, a, pc)
        else:
            _grouped_query_op(s, op, layer, a0, a1, a, m, w_stage)
    elif op == Op.O_PROJ:
        o_proj(s, ptrs, layer, glob, a0, a1, m.rstd, w_stage)
    elif op == Op.GATE_UP:
        gate_up(s, ptrs, layer, a0, a1, m.rstd, m.x_stage, w_stage)
    elif op == Op.DOWN:
        down(s, ptrs, layer, glob, a0, a1, m.rstd, w_stage)
    elif op == Op.EMBED:
        embed(s, ptrs, glob, a0, a1)
    elif op == Op.FINAL_NORM:
        final_norm(s, ptrs, glob, a0, a1, m.rstd)
    elif op == Op.LM_HEAD:
        lm_head(s, ptrs, glob, a0, a1, m.rstd, w_stage)
    elif op == Op.ALL_REDUCE:
        if cutlass.const_expr(s.tp_size > 1):
            all_reduce(s, ptrs, layer, glob, a0, a1 >> 16, a1 & 0xFFFF)
        else:
            _bad_opcode(s, op, a, pc)
    elif op != Op.NOP:
        if cutlass.const_expr(s.mla):
            if op == Op.MLA_QKV_A:
                mla_qkv_a(s, ptrs, layer, a0, a1, m.rstd, m.x_stage, m.x_scales)
            elif op == Op.MLA_Q:
                mla_q(s, ptrs, layer, glob, a0, a1, m.rstd, m.mla_x, m.mla_qb,
                      m.mla_red)  # fmt: skip
            elif op == Op.MLA_APPEND:
                mla_append(s, ptrs, layer, glob, a.kv_block_stride, m.rstd)
            elif op == Op.MLA_ATTN:
                mla_attn(s, ptrs, layer, glob, a0, a1, a.kv_block_stride,
                         a.block_table_stride, a.attn_scale, m.mla_red)  # fmt: skip
            elif op == Op.MLA_COMBINE:
                mla_combine(s, ptrs, layer, a0, a1, m.rstd, m.mla_lat, m.mla_red)
            else:
                _moe_op(s, a, op, layer, a0, a1, m, pc)
        else:
            _moe_op(s, a, op, layer, a0, a1, m, pc)


@cute.jit
def _grouped_query_op(s: cutlass.Constexpr, op, layer, a0, a1, a: cutlass.Constexpr,
                      m: cutlass.Constexpr, w_stage: cutlass.Constexpr):  # fmt: skip
    """QKV, ATTN or COMBINE (grouped-query attention: compiled in only for a
    shape without latent attention)."""
    ptrs, glob = a.ptrs, a.glob
    if op == Op.QKV:
        qkv(s, ptrs, layer, glob, a0, a1, a.kv_block_stride, m.rstd, m.head_buf,
            m.head_rstd, m.x_stage, w_stage)  # fmt: skip
    elif op == Op.ATTN:
        if cutlass.const_expr(s.wide_attn):
            attn_wide(s, ptrs, layer, glob, a0, a1, a.kv_block_stride,
                      a.block_table_stride, a.attn_scale, m.warp_m, m.warp_l,
                      m.warp_o)  # fmt: skip
        else:
            attn(s, ptrs, layer, glob, a0, a1, a.kv_block_stride,
                 a.block_table_stride, a.attn_scale, m.warp_m, m.warp_l,
                 m.warp_o)  # fmt: skip
    else:
        combine(s, ptrs, layer, a0, a1 >> 16, a1 & 0xFFFF)  # (isa.pack_cols)


@cute.jit
def _moe_op(s: cutlass.Constexpr, a: cutlass.Constexpr, op, layer, a0, a1,
            m: cutlass.Constexpr, pc):  # fmt: skip
    """The mixture-of-experts opcodes (compiled in only for a shape with a
    mixture), or a bad opcode."""
    ptrs, glob, sm = a.ptrs, a.glob, a.sm
    if cutlass.const_expr(s.moe):
        if op == Op.ROUTE:
            route(s, ptrs, layer, a0, a1, m.rstd, m.x_stage)
        elif op == Op.TOPK:
            topk(s, ptrs, layer, glob, m.moe_i)
        elif op == Op.EXPERT_UP:
            expert_up(s, a.queue, ptrs, layer, glob, a0, a1, m.rstd, m.x_stage,
                      m.x_scales, m.moe_i, pc, a.lengths[sm])  # fmt: skip
        elif op == Op.EXPERT_DOWN:
            expert_down(s, ptrs, layer, glob, a0, a1, m.moe_i, m.moe_f)
        else:
            _bad_opcode(s, op, a, pc)
    else:
        _bad_opcode(s, op, a, pc)


@cute.jit
def _bad_opcode(s: cutlass.Constexpr, op, a: cutlass.Constexpr, pc):
    """An instruction word the kernel does not know: recorded as an abort
    (the host fails the step), then skipped."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        record_abort(a.ptrs, a.glob, "BAD_OPCODE", a.sm, pc, Int32(-1), op,
                     Int32(0), s.batch)  # fmt: skip


def fake_args(shape: KernelShape):
    """Fake tensors for compiling without a GPU: symbolic sizes, the
    instruction rows 32-byte aligned for one vector fetch."""
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    n_sm, q_len, n_ctr, n_rows = (cute.sym_int32() for _ in range(4))
    return (
        make_fake_compact_tensor(Int32, (n_sm, q_len, WORDS), stride_order=(2, 1, 0),
                                 assumed_align=32),
        make_fake_compact_tensor(Int32, (n_sm,), assumed_align=4),
        make_fake_compact_tensor(Int32, (n_ctr,), assumed_align=4),
        make_fake_compact_tensor(cutlass.Int64, (n_rows, table_width(shape)),
                                 stride_order=(1, 0), assumed_align=16),
        Int32(1), Int32(1), Float32(1.0), Int32(1 << 24),
        make_fake_stream(),
    )  # fmt: skip
