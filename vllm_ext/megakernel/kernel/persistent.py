# SPDX-License-Identifier: Apache-2.0
"""The persistent kernel: one CTA per SM runs its queue of instructions.

Per instruction (words as in ``isa.py``): fetch it (``queue.py``); thread
0 starts the next instruction's weight stream, then waits for the inputs
(``control.wait_inputs``: a bounded spin that traps with a message); a CTA
barrier; the CTA executes the instruction (``ops/``); a CTA barrier (all
stores issued); thread 0 signals (``control.signal_done``: a release
atomic at GPU scope).

Model shape and batch bucket are compile-time (``KernelShape``); every
address comes from the table ``ptrs`` (``shape.py``). The experimental
variants (``variants.py``) are ``KernelShape`` flags, compiled out when
off: the default kernel's SASS does not change with them. So is the
mixture of experts (ROUTE, TOPK, EXPERT_UP, EXPERT_DOWN and their shared
scratch): compiled in only for a shape with one, so a dense model's cubin
is the one built before they existed; and so is the multi-head latent
attention (MLA_QKV_A, MLA_Q, MLA_APPEND, MLA_ATTN, MLA_COMBINE and their
scratch).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from vllm_ext.megakernel.isa import WORDS, Op
from vllm_ext.megakernel.kernel.control import run_tail, signal_done, wait_inputs
from vllm_ext.megakernel.kernel.ops.attn import attn
from vllm_ext.megakernel.kernel.ops.attn_wide import attn_wide
from vllm_ext.megakernel.kernel.ops.combine import combine
from vllm_ext.megakernel.kernel.ops.common import (
    NUM_THREADS,
    NUM_WARPS,
    VEC,
    stages_input,
)
from vllm_ext.megakernel.kernel.ops.embed import embed
from vllm_ext.megakernel.kernel.ops.expert_down import expert_down
from vllm_ext.megakernel.kernel.ops.expert_up import expert_up, gather_words
from vllm_ext.megakernel.kernel.ops.final_norm import final_norm
from vllm_ext.megakernel.kernel.ops.gemv_mma import red_floats
from vllm_ext.megakernel.kernel.ops.mla_append import mla_append
from vllm_ext.megakernel.kernel.ops.mla_attn import mla_attn
from vllm_ext.megakernel.kernel.ops.mla_combine import mla_combine
from vllm_ext.megakernel.kernel.ops.mla_q import (
    mla_q,
    q_input_width,
    stages_q_input,
    wuk_scratch_floats,
)
from vllm_ext.megakernel.kernel.ops.mla_qkv_a import mla_qkv_a
from vllm_ext.megakernel.kernel.ops.prefetch import prefetch_weights
from vllm_ext.megakernel.kernel.ops.projections import down, gate_up, lm_head, o_proj
from vllm_ext.megakernel.kernel.ops.qkv import qkv
from vllm_ext.megakernel.kernel.ops.route import route
from vllm_ext.megakernel.kernel.ops.topk import topk, topk_words
from vllm_ext.megakernel.kernel.ops.weight_pipe import (
    BASE,
    MAX_SLOTS,
    MIN_SLOTS,
    Pipe,
    instr_pages,
    pipe_bytes,
    pipe_init,
    pipe_slots,
    top_up,
)
from vllm_ext.megakernel.kernel.ops.weight_stage import W_STAGE_ELEMS, stage_weights
from vllm_ext.megakernel.kernel.queue import Queue, fetch
from vllm_ext.megakernel.kernel.shape import KernelShape, table_width
from vllm_ext.megakernel.kernel.sync import trap

# Queue entries staged in shared memory with shape.stage_queue (8 KiB; a
# 36-layer model plans under 180 per SM on 132 SMs).
QUEUE_STAGE = 256


# Shared memory one Hopper/Blackwell CTA may use (227 KiB).
SMEM_LIMIT = 227 * 1024


def _buffers(s: KernelShape) -> list[int]:
    """The CTA's shared buffers but the weight pipeline's, in bytes."""
    return [
        4 * s.batch,  # rstd
        4 * s.batch * s.head_dim,  # head_buf
        4 * s.batch,  # head_rstd
        2 * (s.batch * s.hidden if stages_input(s) else VEC),  # x_stage
        2 * 4 * NUM_WARPS * s.group,  # warp_m, warp_l
        4 * NUM_WARPS * s.group * s.head_dim,  # warp_o
        W_STAGE_ELEMS * 2 if s.stage_weights else 0,
        QUEUE_STAGE * WORDS * 4 if s.stage_queue else 0,
        4 if s.fused_combine else 0,  # tail flag
        # (With the weight pipeline, the pipeline holds this scratch.)
        red_floats(s.batch) * 4 if s.mma_gemv and not s.weight_pipe else 0,
        4 * moe_words(s),  # the mixture's int32 scratch
        4 * s.batch * s.top_k,  # EXPERT_DOWN's sorted weights
        *mla_buffers(s),
    ]


def mla_stage_shape(s: KernelShape) -> tuple[int, int]:
    """MLA_Q's normed input in shared memory (a placeholder vector when it
    does not fit: the GEMV then norms on the fly)."""
    return (s.batch, q_input_width(s)) if stages_q_input(s) else (1, VEC)


def mla_buffers(s: KernelShape) -> list[int]:
    """The latent attention's shared buffers, in bytes (none in a kernel
    without one): MLA_Q's staged input, a head's q in fp32, the fp32
    scratch of W_UK's partial sums (MLA_COMBINE's chunk weights too), and
    MLA_COMBINE's merged latent rows."""
    if not s.mla:
        return []
    rows, cols = mla_stage_shape(s)
    return [
        2 * rows * cols,
        4 * s.batch * s.qk_head_dim,
        4 * max(wuk_scratch_floats(), s.batch * (s.attn_chunks + 1)),
        2 * s.batch * s.kv_lora_rank,
    ]


def moe_words(s: KernelShape) -> int:
    """Int32 scratch of TOPK, EXPERT_UP's gather and EXPERT_DOWN's sorted
    slots, one at a time (0 in a dense kernel)."""
    if not s.moe:
        return 0
    return max(topk_words(s), gather_words(s.batch), s.batch * s.top_k)


def _padded(buffers: list[int]) -> int:
    # Each buffer rounded up to 128 bytes, an upper bound on its alignment.
    return sum((b + 127) // 128 * 128 for b in buffers)


def ring_slots(s: KernelShape) -> int:
    """Pages in the weight pipeline's ring: what the rest leaves (0: off,
    or too little room)."""
    if not s.weight_pipe:
        return 0
    # Everything but the pages, with the mbarriers of the largest ring.
    rest = _padded(_buffers(s) + pipe_bytes(MAX_SLOTS, s)[1:])
    return pipe_slots(SMEM_LIMIT - rest)


def shared_bytes(s: KernelShape) -> int:
    """The CTA's shared memory, as the kernel allocates it."""
    pipe = pipe_bytes(ring_slots(s), s) if s.weight_pipe else []
    return _padded(_buffers(s) + pipe)


class Megakernel:
    def __init__(self, shape: KernelShape):
        if shape.weight_pipe and ring_slots(shape) == 0:
            raise ValueError(
                f"the kernel for {shape} leaves no room in shared memory for "
                f"the weight pipeline's {MIN_SLOTS} pages"
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
            block=(NUM_THREADS, 1, 1),
            stream=stream,
            cooperative=True,
            # One CTA per SM: ptxas may then use up to 255 registers instead
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
        glob = ptrs.shape[0] - 1  # the model-wide row of the table
        # The step number lives on the device, bumped by the host before each
        # launch, so a CUDA graph replays the same launch step after step.
        epoch = counters[counters.shape[0] - 1]

        smem = SmemAllocator()
        rstd = smem.allocate_tensor(Float32, cute.make_layout(s.batch), 16)
        head_buf = smem.allocate_tensor(
            Float32, cute.make_layout((s.batch, s.head_dim), stride=(s.head_dim, 1)), 16
        )
        head_rstd = smem.allocate_tensor(Float32, cute.make_layout(s.batch), 16)
        stage = (s.batch, s.hidden) if stages_input(s) else (1, VEC)
        x_stage = smem.allocate_tensor(
            BFloat16, cute.make_layout(stage, stride=(stage[1], 1)), 16
        )
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
            rows, cols = mla_stage_shape(s)
            mla_x = smem.allocate_tensor(
                BFloat16, cute.make_layout((rows, cols), stride=(cols, 1)), 16
            )
            mla_qb = smem.allocate_tensor(
                Float32,
                cute.make_layout((s.batch, s.qk_head_dim), stride=(s.qk_head_dim, 1)),
                16,
            )
            mla_red = smem.allocate_tensor(
                Float32,
                cute.make_layout(
                    max(wuk_scratch_floats(), s.batch * (s.attn_chunks + 1))
                ),
                16,
            )
            mla_lat = smem.allocate_tensor(
                BFloat16,
                cute.make_layout((s.batch, s.kv_lora_rank), stride=(s.kv_lora_rank, 1)),
                16,
            )

        # Thread 0 tells the CTA whether its ATTN completed the head.
        tail = None
        if cutlass.const_expr(s.fused_combine):
            tail = smem.allocate_tensor(Int32, cute.make_layout(1), 4)

        # The weight stage (experimental, shape.stage_weights); without it
        # the ops receive x_stage in its place and never read it.
        w_stage = x_stage
        if cutlass.const_expr(s.stage_weights):
            w_stage = smem.allocate_tensor(
                BFloat16, cute.make_layout(W_STAGE_ELEMS), 128
            )
        if cutlass.const_expr(s.mma_gemv and not s.weight_pipe):
            # The tensor-core GEMV's cross-warp reduction scratch.
            w_stage = smem.allocate_tensor(
                Float32, cute.make_layout(red_floats(s.batch)), 128
            )

        # The queue's head in shared memory (experimental, shape.stage_queue):
        # one copy at launch instead of a dependent global load per
        # instruction; past QUEUE_STAGE entries it is read from global memory.
        q = Queue(queue, sm)
        if cutlass.const_expr(s.stage_queue):
            q_stage = smem.allocate_tensor(
                Int32, cute.make_layout((QUEUE_STAGE, WORDS), stride=(WORDS, 1)), 32
            )
            n_staged = cutlass.min(lengths[sm], Int32(QUEUE_STAGE))
            for idx in cutlass.range(tidx, n_staged * WORDS, NUM_THREADS):
                q_stage[idx // WORDS, idx % WORDS] = queue[sm, idx // WORDS,
                                                           idx % WORDS]  # fmt: skip
            cute.arch.sync_threads()
            q = Queue(queue, sm, q_stage, n_staged)

        # The weight pipeline (experimental, shape.weight_pipe): the ops
        # receive it in place of the weight stage.
        if cutlass.const_expr(s.weight_pipe):
            w_stage = Pipe.allocate(
                s, ring_slots(s), smem, q=q, length=lengths[sm], ptrs=ptrs,
                glob=glob, max_spins=max_spins,
            )  # fmt: skip
            if tidx == 0:
                pipe_init(w_stage)
            cute.arch.sync_threads()
            # (Written through an alias: the loop below must not look like it
            # rebinds w_stage, a trace-time object.)
            pipe_state = w_stage.state

        ins = cute.make_rmem_tensor((WORDS,), Int32)
        for pc in cutlass.range(lengths[sm]):
            fetch(q, pc, ins)
            op, layer, a0, a1 = ins[0], ins[1], ins[2], ins[3]
            if cutlass.const_expr(s.stage_weights):
                # All threads start copying this instruction's weights into
                # shared memory before thread 0 waits for its inputs.
                stage_weights(s, ptrs, glob, op, layer, a0, a1, w_stage)
            if cutlass.const_expr(s.weight_pipe):
                if tidx == 0:
                    top_up(w_stage, pipe_state[BASE])
            if tidx == 0:
                # Weight streams start before the wait (see ops/prefetch.py).
                if pc == 0:
                    prefetch_weights(s, ptrs, glob, op, layer, a0, a1)
                if pc + 1 < lengths[sm]:
                    if cutlass.const_expr(s.stage_queue):
                        nxt = cute.make_rmem_tensor((WORDS,), Int32)
                        fetch(q, pc + 1, nxt)
                        prefetch_weights(s, ptrs, glob, nxt[0], nxt[1], nxt[2],
                                         nxt[3])  # fmt: skip
                    else:
                        nxt = queue[sm, pc + 1, None]
                        prefetch_weights(s, ptrs, glob, nxt[0], nxt[1], nxt[2],
                                         nxt[3])  # fmt: skip
                wait_inputs(s, counters, ins, epoch, sm, pc, max_spins,
                            w_stage if s.weight_pipe else None)  # fmt: skip
            cute.arch.sync_threads()
            if cutlass.const_expr(s.stage_weights):
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()

            if op == Op.QKV:
                qkv(s, ptrs, layer, glob, a0, a1, kv_block_stride, rstd, head_buf,
                    head_rstd, x_stage, w_stage)  # fmt: skip
            elif op == Op.ATTN:
                if cutlass.const_expr(s.wide_attn):
                    attn_wide(s, ptrs, layer, glob, a0, a1, kv_block_stride,
                              block_table_stride, attn_scale, warp_m, warp_l,
                              warp_o)  # fmt: skip
                else:
                    attn(s, ptrs, layer, glob, a0, a1, kv_block_stride,
                         block_table_stride, attn_scale, warp_m, warp_l,
                         warp_o)  # fmt: skip
            elif op == Op.COMBINE:
                combine(s, ptrs, layer, a0)
            elif op == Op.O_PROJ:
                o_proj(s, ptrs, layer, a0, a1, rstd, w_stage)
            elif op == Op.GATE_UP:
                gate_up(s, ptrs, layer, a0, a1, rstd, x_stage, w_stage)
            elif op == Op.DOWN:
                down(s, ptrs, layer, a0, a1, rstd, w_stage)
            elif op == Op.EMBED:
                embed(s, ptrs, glob, a0, a1)
            elif op == Op.FINAL_NORM:
                final_norm(s, ptrs, glob, a0, a1, rstd)
            elif op == Op.LM_HEAD:
                lm_head(s, ptrs, glob, a0, a1, rstd, w_stage)
            elif op != Op.NOP:
                if cutlass.const_expr(s.mla):
                    if op == Op.MLA_QKV_A:
                        mla_qkv_a(s, ptrs, layer, a0, a1, rstd, x_stage)
                    elif op == Op.MLA_Q:
                        mla_q(s, ptrs, layer, glob, a0, a1, rstd, mla_x, mla_qb,
                              mla_red)  # fmt: skip
                    elif op == Op.MLA_APPEND:
                        mla_append(s, ptrs, layer, glob, kv_block_stride, rstd)
                    elif op == Op.MLA_ATTN:
                        mla_attn(s, ptrs, layer, glob, a0, a1, kv_block_stride,
                                 block_table_stride, attn_scale)  # fmt: skip
                    elif op == Op.MLA_COMBINE:
                        mla_combine(s, ptrs, layer, a0, a1, rstd, mla_lat, mla_red)
                    else:
                        _moe_op(s, ptrs, op, layer, glob, a0, a1, rstd, x_stage,
                                moe_i, moe_f, sm, pc)  # fmt: skip
                else:
                    _moe_op(s, ptrs, op, layer, glob, a0, a1, rstd, x_stage, moe_i,
                            moe_f, sm, pc)  # fmt: skip

            # Every thread's stores are issued before the release below.
            cute.arch.sync_threads()
            if tidx == 0:
                if cutlass.const_expr(s.weight_pipe):
                    # Every page of this instruction is released.
                    pipe_state[BASE] = pipe_state[BASE] + instr_pages(s, op, a0, a1)
                signal_done(s, counters, ins, op, epoch, tail)
            if cutlass.const_expr(s.fused_combine):
                if op == Op.ATTN:
                    # The tail: the last chunk of kv head a0 merges its partials.
                    run_tail(s, ptrs, counters, ins, layer, a0, tail)


@cute.jit
def _moe_op(s: cutlass.Constexpr, ptrs, op, layer, glob, a0, a1, rstd, x_stage,
            moe_i, moe_f, sm, pc):  # fmt: skip
    """The mixture-of-experts opcodes (compiled in only for a shape with a
    mixture), or a bad opcode."""
    if cutlass.const_expr(s.moe):
        if op == Op.ROUTE:
            route(s, ptrs, layer, a0, a1, rstd, x_stage)
        elif op == Op.TOPK:
            topk(s, ptrs, layer, glob, moe_i)
        elif op == Op.EXPERT_UP:
            expert_up(s, ptrs, layer, a0, a1, rstd, x_stage, moe_i)
        elif op == Op.EXPERT_DOWN:
            expert_down(s, ptrs, layer, a0, a1, moe_i, moe_f)
        else:
            _bad_opcode(op, sm, pc)
    else:
        _bad_opcode(op, sm, pc)


@cute.jit
def _bad_opcode(op, sm, pc):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        cute.printf("megakernel: bad opcode %d (sm %d pc %d)\n", op, sm, pc)
        trap()


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
