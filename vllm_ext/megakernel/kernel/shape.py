# SPDX-License-Identifier: Apache-2.0
"""What the kernel is compiled for, and the table of addresses it reads.

Pure Python (no CuTe DSL, no vLLM): the host launcher and the GPU check
import it where CuTe DSL is not installed.

Model shape and batch bucket are compile-time constants (loops unroll, tile
sizes fold); everything that moves per step or per engine (weights, KV
cache, activations, the step's inputs) is an address in one int64 table
``ptrs[num_layers + 1, table_width(shape)]``: row ``l`` for layer ``l``, the
last row for the model-wide tensors (a mixture-of-experts kernel's rows are
wider: ``LayerSlot.ROUTER`` on). So one compiled kernel serves any number of
layers and any KV cache size, and the launch takes a handful of scalars.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum

from vllm_ext.quant import BLOCK as FP8_GROUP
from vllm_ext.quant import FP8_BLOCK, FP8_W8A8, INT4_W4A16


class LayerSlot(IntEnum):
    """Columns of a layer's row of the address table."""

    INPUT_NORM = 0  # [hidden] bf16
    QKV = 1  # [q_size + 2 kv_size, hidden] bf16
    QKV_BIAS = 2  # [q_size + 2 kv_size] bf16 (0 when absent)
    Q_NORM = 3  # [head_dim] bf16 (0 when absent)
    K_NORM = 4
    O_PROJ = 5  # [hidden, q_size]
    POST_NORM = 6  # [hidden]
    GATE_UP = 7  # [2 intermediate, hidden]
    DOWN = 8  # [hidden, intermediate]
    KV_CACHE = 9  # this layer's view, LBNHC
    H_IN = 10  # [B, hidden] bf16: residual stream entering the layer
    HMID = 11  # [B, hidden] after attention
    Q = 12  # [B, q_heads, head_dim] bf16, normed and rotated
    ATTN = 13  # [B, q_heads, head_dim] bf16
    ACT = 14  # [B, intermediate] bf16
    PART_O = 15  # [chunks, kv_heads, B, group, head_dim] fp32
    PART_LSE = 16  # [chunks, kv_heads, B, group] fp32
    H_OUT = 17  # [B, hidden]: H_IN of the next layer
    # A mixture-of-experts kernel's rows are MOE_SLOTS wide: these follow
    # (0 in a dense layer, and absent from a dense kernel's table, whose
    # width and SASS stay those of a kernel without them).
    ROUTER = 18  # [experts, hidden] bf16
    W13 = 19  # [experts, 2 expert_intermediate, hidden]: gate rows, then up
    W2 = 20  # [experts, hidden, expert_intermediate]
    CORRECTION_BIAS = 21  # [experts] fp32 (0 when absent)
    SHARED_GATE_UP = 22  # [2 shared_intermediate, hidden] (0 when absent)
    SHARED_DOWN = 23  # [hidden, shared_intermediate] (0 when absent)
    ROUTER_LOGITS = 24  # [B, router_stride] bf16
    ROUTE = 25  # route_words(shape) 4-byte words: see route_layout
    XACT = 26  # [xact_slots, B, xact_width] bf16
    # A multi-head latent attention kernel's rows are MLA_SLOTS wide (the
    # mixture's columns 0 without one). An MLA layer leaves QKV, QKV_BIAS,
    # Q_NORM, K_NORM and Q at 0; KV_CACHE is its latent cache
    # ``[blocks, block_size, latent_width]``, ATTN its o_proj input ``[B,
    # heads, v_head_dim]`` and PART_O / PART_LSE MLA_ATTN's partials
    # ``[chunks, groups, B, per_group, kv_lora_rank]`` / ``[.., per_group]``.
    MLA_Q_A = 27  # [q_lora_rank, hidden]: rows [0, q_lora_rank) of the
    # fused down projection (0 without a q LoRA)
    MLA_KV_A = 28  # [latent_width, hidden]: the fused projection's next rows
    MLA_Q_A_NORM = 29  # [q_lora_rank] (0 without a q LoRA)
    MLA_Q_B = 30  # [heads * qk_head_dim, q_lora_rank or hidden]: q_b / q_proj
    MLA_KV_A_NORM = 31  # [kv_lora_rank]
    # kv_b_proj [heads * (nope + v), rank] read as two strided views, as
    # MlaWeights.w_uk / w_uv: head h's rows start at h * (nope + v) * rank.
    MLA_W_UK = 32  # kv_b_proj's address: [nope, rank] per head
    MLA_W_UV = 33  # kv_b_proj's address + nope rows: [v_head_dim, rank] per head
    QKV_A = 34  # [B, q_lora_rank + latent_width] bf16: the down projection
    Q_LAT = 35  # [B, heads, kv_lora_rank] bf16: q_nope @ W_UK
    Q_PE = 36  # [B, heads, qk_rope_head_dim] bf16, rotated
    # A quantized kernel's rows are QUANT_SLOTS wide (KernelShape.quantized):
    # QKV, O_PROJ, GATE_UP and DOWN then hold e4m3 codes (the same [N, K]
    # row-major shapes, a byte each; INT4: [N, K / 2] bytes, two codes
    # each, low nibble first) and these their scales: FP8's fp32, one an
    # output row ([N]; GATE_UP's: gate rows, then up rows) or, with
    # ``fp8_block``, one a 128 x 128 block ([N / 128, K / 128] row-major);
    # INT4's bf16, one a row and group ([N, K / group]).
    QKV_SCALE = 37  # [q_size + 2 kv_size] fp32
    O_PROJ_SCALE = 38  # [hidden]
    GATE_UP_SCALE = 39  # [2 intermediate]
    DOWN_SCALE = 40  # [hidden]
    # A quantized mixture's or latent attention's rows are QUANT_MOE_SLOTS
    # wide: W13 and W2 then
    # hold its experts' codes (FP8 [E, N, K], INT4 [E, N, K / 2] bytes) and
    # these their scales (FP8 blocks [E, N / 128, K / 128], per channel
    # [E, N], fp32; INT4 [E, N, K / group] bf16), then, FP8 only, EXPERT_UP's
    # outputs quantized for EXPERT_DOWN (ops/expert_up.py, ``quantize_slot``).
    W13_SCALE = 41
    W2_SCALE = 42
    XQ = 43  # [xact_slots, B, xact_width] bf16: XACT's e4m3 values
    XSCALE = 44  # [xact_slots, B, xact_groups] fp32: their scales
    ARRIVE = 45  # [xact_slots] int32: a slot's EXPERT_UP columns done (0
    # between steps: the slot's last tile resets it)
    # The shared expert's scales (its codes in SHARED_GATE_UP / SHARED_DOWN),
    # and a latent attention's (codes in MLA_Q_A, MLA_KV_A and MLA_Q_B; FP8
    # only; q_a's and kv_a's scales are two views of the fused layer's).
    SHARED_GATE_UP_SCALE = 46
    SHARED_DOWN_SCALE = 47
    MLA_Q_A_SCALE = 48
    MLA_KV_A_SCALE = 49
    MLA_Q_B_SCALE = 50


class GlobalSlot(IntEnum):
    """Columns of the last row of the address table."""

    EMBED = 0  # [vocab, hidden] bf16
    FINAL_NORM = 1  # [hidden]
    LM_HEAD = 2  # [vocab, hidden]
    COS_SIN = 3  # [max_position, head_dim] fp32: cos half, then sin half
    INPUT_IDS = 4  # [B] int32
    POSITIONS = 5  # [B] int32
    BLOCK_TABLE = 6  # [B, block_table_stride] int32
    SEQ_LENS = 7  # [B] int32, 0 for a padded row
    SLOT_MAPPING = 8  # [B] int32, -1 for a padded row
    H0 = 9  # [B, hidden]: the embedding's output
    H_LAST = 10  # [B, hidden]: the last layer's output
    OUT = 11  # [B, hidden] bf16: final-normed hidden states
    LOGITS = 12  # [B, vocab] fp32
    ABORT = 13  # [ABORT_WORDS] int32: the abort record (AbortWord)
    # Tensor parallel only (0 without): this rank's partial sums, the
    # ranks' addresses, and a value, not an address.
    PARTIALS = 14  # [partial_rows(L), B, hidden] bf16 (partial_row)
    PEERS = 15  # [2, tp] int64: every rank's counters, then PARTIALS, as
    # this GPU addresses them (symmetric memory; one GPU's own memory in
    # the check's one-launch ranks)
    VOCAB_START = 16  # the first vocabulary row of the rank's embedding shard
    # A latent attention kernel of query_rows > 1 only (0 without): [B, 2]
    # int32, each row's request's first row and row count (a padded row: its
    # own, 1). MLA_ATTN passes over a request's rows together.
    QUERY_MAP = 17


class AbortWord(IntEnum):
    """The abort record: zero until a bounded wait of a step expires; the
    first CTA whose wait expires sets ``FLAG`` and writes where it waited.
    Set, it stays set: the waits of every CTA, in this step and any later
    one, stop waiting on other CTAs, so every CTA runs through its queue
    without waiting and leaves (the step's results are garbage; the host
    fails the step). One record serves every batch bucket."""

    FLAG = 0  # 1 once set
    SM = 1  # the CTA whose wait expired
    INDEX = 2  # its instruction (pc), or its weight page
    COUNTER = 3  # the counter it waited on (-1: an mbarrier of the CTA)
    EXPECTED = 4  # the count it waited for (the ring's parity for an mbarrier)
    SEEN = 5  # the count it saw
    WHAT = 6  # AbortWhat
    BATCH = 7  # the kernel's batch bucket


class AbortWhat(IntEnum):
    """Which wait expired."""

    INPUTS = 1  # an instruction's inputs (a counter other CTAs signal)
    INSTRUCTION = 2  # the consumers, for the controller's next instruction
    INSTRUCTION_SLOT = 3  # the controller, for a free instruction slot
    WEIGHT_SLOT = 4  # the producer, for a free weight page
    WEIGHT_PAGE = 5  # the consumers, for a weight page to land
    BAD_OPCODE = 6  # no wait: an instruction word the kernel does not know


ABORT_WORDS = len(AbortWord)


NUM_SLOTS = 18
MOE_SLOTS = 27
MLA_SLOTS = 37
QUANT_SLOTS = 41
QUANT_MOE_SLOTS = 51


def partial_rows(num_layers: int) -> int:
    """Rows of a rank's partial sums: the embedding's, then two a layer."""
    return 1 + 2 * num_layers


def partial_row(point: int, layer: int) -> int:
    """The row of point ``point`` (isa.Point: 0 EMBED, 1 ATTN, 2 MLP) of
    ``layer`` (the kernel's ops/all_reduce.py computes the same)."""
    return 0 if point == 0 else 2 * layer + point


def table_width(shape: KernelShape) -> int:
    """Columns of the address table the kernel for ``shape`` reads."""
    if shape.quantized:
        return QUANT_MOE_SLOTS if shape.moe or shape.mla else QUANT_SLOTS
    if shape.mla:
        return MLA_SLOTS
    return MOE_SLOTS if shape.moe else NUM_SLOTS


# Deliberately wrong kernels, for the GPU check only (KernelShape.planted_bug):
# it must reject each. "kv-slot": the KV append writes the new token's K and
# V to the neighbouring token of its block (slot ^ 1), a silent stray write
# inside the cache. "oob-store": FINAL_NORM writes the last row of ``out`` one
# element too long, a store just past the buffer's end.
PLANTED_BUGS = ("kv-slot", "oob-store")
# Requests accumulated per pass over a weight row (see ops/gemv.py).
BATCH_GROUP = 8
# The consumers' named barrier (ops/common.py; barrier 0 is the whole CTA's).
CONSUMERS_BARRIER = 1
# A page of the weight pipeline (ops/weight_pipe.py).
PAGE_BYTES = 32 * 1024
# TOPK holds a request's scores in a warp's registers (MAX_EXPERTS / 32 a
# lane) and picks its top_k by that many warp-wide argmax rounds.
MAX_EXPERTS = 512
MAX_TOP_K = 16
# MLA_Q's q_nope @ W_UK: requests per pass over a head's W_UK (accumulators
# of 8 latent columns each, partial over row slices reduced in shared
# memory).
WUK_GROUP = 4
# The FP8 tensor-core GEMV's k per lane quad and step (gemv_mma.py): 4
# lanes x 16 e4m3 codes, two m16n8k32 MMAs.
FP8_K_BLOCK = 64
# Shared memory for a normed copy of a projection's input (all requests):
# each element is then normed once per instruction instead of once per
# output row, and re-read from shared memory instead of L1 (ops/common.py).
STAGE_BYTES = 64 * 1024
# The largest batch bucket of an FP8 or INT4 kernel (compile_grid: clean up
# to 16).
QUANT_MAX_BATCH = 16
# The INT4 tensor-core GEMV's k per lane quad and step: 4 lanes x 32 codes.
INT4_K_BLOCK = 128
# INT4 group sizes the kernel takes (a lane's 32 codes lie in one group).
INT4_GROUPS = (32, 64, 128)


def quant_refusal(quant) -> str | None:
    """Why the kernel cannot run a checkpoint's format (``quant.QuantFormat``
    or None), or None: its device functions are FP8 W8A8's, FP8 blocks' and
    INT4 W4A16's in groups of ``INT4_GROUPS`` (the one list the build CLI
    and the backend ask)."""
    if quant is not None and quant.unquantized and not quant.experts_only:
        return (
            f"{quant.name} checkpoints leaving "
            f"{', '.join(sorted(quant.unquantized))} in the model dtype: the "
            "kernel's quantized projections are all of a model's or its routed "
            "experts' only"
        )
    if quant is None or quant.name in (FP8_W8A8, FP8_BLOCK):
        return None
    if quant.name == INT4_W4A16 and quant.group_size in INT4_GROUPS:
        return None
    if quant.name == INT4_W4A16:
        return (
            f"{quant.name} weights with a group size of {quant.group_size}: the "
            f"kernel's INT4 GEMV takes groups of {', '.join(map(str, INT4_GROUPS))}"
        )
    return f"{quant.name} weights: the kernel has no device functions for them"


def page_rows(k: int, dual: bool = False) -> int:
    """Rows of a [*, k] bf16 matrix one weight-pipeline page holds (per
    matrix when dual): the largest power of two that fits, so pages divide
    a head's rows and split a CTA's warps evenly."""
    fit = PAGE_BYTES // (2 * k * (2 if dual else 1))
    if fit == 0:
        raise ValueError(
            f"a {k}-wide weight row{' pair' if dual else ''} does not fit a "
            f"{PAGE_BYTES}-byte page of the weight pipeline"
        )
    return 1 << (fit.bit_length() - 1)


@dataclass(frozen=True)
class KernelShape:
    """Compile-time constants of one kernel build (bf16 weights; FP8's where
    ``fp8``, INT4's where ``int4_group``)."""

    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    batch: int
    block_size: int
    attn_chunks: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    # For the GPU check's side-by-side comparison only (build.py's
    # --legacy-control, not a variant): the control validated on an H200 at
    # commit 42d7577 (256 threads; thread 0 fetches, waits and signals
    # between CTA barriers; the GEMVs read global memory) instead of the
    # warp roles (kernel/persistent.py, kernel/control.py).
    legacy_control: bool = False
    # The experimental variant (not yet measured): ATTN with 128-bit K/V
    # loads, several tokens per warp load and requests side by side
    # (kernel/ops/attn_wide.py).
    wide_attn: bool = False
    # QKV's units are heads split into this many RoPE-pair parts (isa.py),
    # so the phase spreads over the SMs. Set from the program, which it must
    # match.
    qkv_parts: int = 1
    # COMBINE's units are q heads split into this many dim parts (isa.py).
    # Set from the program, which it must match.
    combine_parts: int = 1
    # The mixture of experts of the sparse layers (model_spec.MoeSpec; all
    # 0 / False in a dense model), run by ROUTE, TOPK, EXPERT_UP and
    # EXPERT_DOWN (ops/route.py, topk.py, expert_up.py, expert_down.py).
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    # Routed expert slots per sparse layer (the program's num_slots); the
    # shared expert, if any, is slot num_slots of xact.
    num_slots: int = 0
    moe_sigmoid: bool = False  # scores: sigmoid, else softmax
    renormalize: bool = False
    grouped: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    routed_scaling: float = 1.0
    shared_intermediate: int = 0
    # Multi-head latent attention (model_spec.MlaSpec; all 0 in a GQA model),
    # run by MLA_QKV_A, MLA_Q, MLA_APPEND, MLA_ATTN and MLA_COMBINE
    # (ops/mla_*.py). The GQA fields then describe O_PROJ's input: q_heads =
    # kv_heads = mla_heads, head_dim = v_head_dim (no QKV/ATTN runs).
    mla_heads: int = 0
    q_lora_rank: int = 0  # 0: q_proj on RMSNorm(h) in place of q_a / q_b
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head_dim: int = 0
    mla_scale: float = 0.0  # the softmax scale (the launch's attn_scale)
    mla_groups: int = 0  # MLA_ATTN's head groups (the program's)
    mla_v_parts: int = 0  # MLA_COMBINE's v parts per head (the program's)
    # Query rows a request MLA_ATTN is built for (the program's; 1 + drafts
    # of a verify step): above 1 it passes over a request's rows together,
    # heads x rows as the MMA's M, reading its cache once (GlobalSlot.
    # QUERY_MAP). 1: a row per request, the kernel as without speculation.
    query_rows: int = 1
    # Tensor parallel (parallel.py): the program's ranks, and how many of
    # them this launch runs (1 on a TP deployment, one kernel per GPU;
    # tp_size for the one-GPU check, whose CTAs split into rank groups
    # with one table, queue set and counter set each, stacked).
    tp_size: int = 1
    ranks_in_launch: int = 1
    # FP8 W8A8 (quant.FP8_W8A8, per-channel weight scales): QKV, O_PROJ,
    # GATE_UP and DOWN read e4m3 weights with a scale an output row and
    # quantize their inputs per token as they enter, on tensor cores at
    # every batch (gemv_mma.py); embedding and LM head stay bf16.
    fp8: bool = False
    # With ``fp8``: 128 x 128 weight blocks and inputs quantized per token
    # in groups of 128 (quant.FP8_BLOCK, DeepSeek-V3's and Qwen3's FP8
    # checkpoints), each k group's sum scaled before it is added.
    fp8_block: bool = False
    # INT4 W4A16 (quant.INT4_W4A16; 0: not): the group size of the bf16
    # scales along k. QKV, O_PROJ, GATE_UP and DOWN read 4-bit codes (two a
    # byte) on tensor cores at every batch (gemv_int4.py).
    int4_group: int = 0
    # With a format: the routed experts are the one kind quantized (Kimi-K2-
    # Thinking's INT4 experts; quant.QuantFormat.experts_only): attention,
    # dense MLPs and shared experts read bf16 as in a bf16 kernel.
    experts_only: bool = False
    # Test only, never served: "" or one of PLANTED_BUGS, a deliberately
    # wrong kernel the GPU check must reject. Only the build CLI's
    # --plant-bug sets it (not from_program, not VLLM_MEGAKERNEL_VARIANTS).
    planted_bug: str = ""

    def __post_init__(self) -> None:
        if self.planted_bug and self.planted_bug not in PLANTED_BUGS:
            raise ValueError(
                f"planted_bug {self.planted_bug!r}: one of {', '.join(PLANTED_BUGS)}"
            )
        for name in ("hidden", "intermediate", "head_dim"):
            if getattr(self, name) % 8:
                raise ValueError(f"{name} must be a multiple of 8 (128-bit loads)")
        if not 1 <= self.query_rows <= max(1, self.batch):
            raise ValueError(f"query_rows {self.query_rows}: 1 to the batch")
        if self.query_rows > 1 and not self.mla:
            raise ValueError("query rows share a pass in latent attention only "
                             "(query_rows 1 without MLA)")  # fmt: skip
        if self.mla:
            self._check_mla()
        elif self.head_dim not in (64, 128):
            raise ValueError("head_dim must be 64 or 128")
        if self.batch > BATCH_GROUP and self.batch % BATCH_GROUP:
            raise ValueError(
                f"batch {self.batch}: above {BATCH_GROUP}, a multiple of "
                f"{BATCH_GROUP} (the GEMV's request groups)"
            )
        if self.q_heads % self.kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")
        if self.combine_parts < 1 or self.head_dim % self.combine_parts:
            raise ValueError(f"{self.combine_parts} COMBINE parts do not divide "
                             f"head_dim {self.head_dim}")  # fmt: skip
        if self.moe:
            self._check_moe()
        if self.ranks_in_launch not in (1, self.tp_size):
            raise ValueError(f"{self.ranks_in_launch} ranks in a launch: 1 or "
                             f"tp_size ({self.tp_size})")  # fmt: skip
        if self.fp8_block and not self.fp8:
            raise ValueError("fp8_block is a kind of fp8 kernel (fp8 too)")
        if self.fp8 or self.int4_group:
            self._check_quantized()
        if self.tp_size > 1 and self._variants():
            raise ValueError("tensor parallel runs in the default kernel only, "
                             f"not with {', '.join(self._variants())}")  # fmt: skip

    def _variants(self) -> list[str]:
        return [name for name in ("legacy_control", "wide_attn") if getattr(self, name)]

    def _check_mla(self) -> None:
        variants = self._variants()
        if variants:
            raise ValueError(
                "the multi-head latent attention instructions run in the default "
                f"kernel only, not with the experimental {', '.join(variants)}"
            )
        if self.qkv_parts != 1 or self.combine_parts != 1:
            raise ValueError("an MLA kernel has no QKV or COMBINE to split "
                             "(qkv_parts, combine_parts 1)")  # fmt: skip
        heads, rank, rope = self.mla_heads, self.kv_lora_rank, self.qk_rope
        if (self.q_heads, self.kv_heads, self.head_dim) != (
            heads, heads, self.v_head_dim
        ):  # fmt: skip
            raise ValueError(
                "an MLA kernel's q_heads, kv_heads, head_dim are its heads, heads "
                "and v_head_dim (O_PROJ's input)"
            )
        # MLA_ATTN: a lane holds rank / 32 latent dims (128-bit loads) and
        # lanes [0, rope / 8) one 128-bit vector of k_pe each; MLA_Q splits
        # W_UK's 128-bit column vectors over the CTA's threads.
        if rank % 256 or not 256 <= rank <= 2048:
            raise ValueError(f"kv_lora_rank {rank}: a multiple of 256, at most 2048")
        if rope % 16 or rope > 256 or rope % (rank // 32):
            raise ValueError(f"qk_rope_head_dim {rope}: a multiple of 16 and of "
                             f"{rank // 32}, at most 256")  # fmt: skip
        slices = 256 // (rank // 8)
        if self.qk_nope % slices or self.qk_nope % 8:
            raise ValueError(f"qk_nope_head_dim {self.qk_nope}: a multiple of "
                             f"{max(slices, 8)}")  # fmt: skip
        if self.v_head_dim % 8 or self.q_lora_rank % 8 or self.mla_width % 8:
            raise ValueError("v_head_dim, q_lora_rank and q_lora_rank + "
                             "latent width must be multiples of 8")  # fmt: skip
        if self.mla_groups < 1 or heads % self.mla_groups:
            raise ValueError(f"{self.mla_groups} head groups do not divide {heads}")
        per_group = heads // self.mla_groups
        if per_group > 8 and per_group % 8:
            raise ValueError(f"{per_group} heads per group: at most 8 or a multiple "
                             "of 8 (MLA_ATTN's warps)")  # fmt: skip
        if per_group > 32:
            raise ValueError(f"{per_group} heads per group: at most 32 (4 a warp)")
        if self.mla_v_parts < 1 or self.v_head_dim % self.mla_v_parts:
            raise ValueError(f"{self.mla_v_parts} v parts do not divide "
                             f"v_head_dim {self.v_head_dim}")  # fmt: skip
        if not self.mla_scale > 0:
            raise ValueError("the MLA softmax scale must be positive")

    def _check_quantized(self) -> None:
        kind = "FP8" if self.fp8 else "INT4"
        if self.fp8 and self.int4_group:
            raise ValueError("a kernel's weights are FP8 or INT4, not both")
        if self.experts_only and not (self.int4_group and self.moe):
            # (FP8 checkpoints quantize every projection: quant.py.)
            raise ValueError("experts_only: INT4 experts of a mixture")
        if self._variants():
            raise ValueError(f"{kind} weights run in the default kernel only")
        if self.tp_size > 1 and (self.moe or self.mla):
            # (A dense rank's O_PROJ and DOWN write partial sums through the
            # same epilogue as bf16's; a mixture's and a latent attention's
            # quantized shards are neither cut by parallel.shard_weights nor
            # checked.)
            raise ValueError(
                f"{kind} weights at tensor parallel: dense GQA models only, not "
                "a mixture of experts or latent attention"
            )
        mla = self.mla and self.dense_quantized
        if mla and not self.fp8:
            raise ValueError(
                "INT4 weights: latent attention's quantized device functions "
                "are FP8's only"
            )
        if mla and self.q_lora_rank % FP8_GROUP:
            raise ValueError(
                f"q_lora_rank {self.q_lora_rank}: FP8 latent attention's q_a "
                f"and kv_a share a fused layer's blocks at {FP8_GROUP} rows"
            )
        q_width = self.q_lora_rank or self.hidden
        if mla and self.batch * q_width * 2 > STAGE_BYTES:
            # (MLA_Q quantizes q_b's input in its stage: ops/mla_q.py.)
            raise ValueError(
                f"batch {self.batch}: FP8 latent attention stages q_b's "
                f"{q_width}-wide input for every request in {STAGE_BYTES} bytes"
            )
        if self.batch > QUANT_MAX_BATCH:
            # (8B FP8's batch-64 build kept two words in local memory at
            # 222 registers, the consumers' budget.)
            raise ValueError(
                f"batch {self.batch}: {kind} kernels take at most "
                f"{QUANT_MAX_BATCH} requests (register budget)"
            )
        if self.int4_group and self.int4_group not in INT4_GROUPS:
            raise ValueError(
                f"INT4 group size {self.int4_group}: one of {INT4_GROUPS} (a "
                "lane's 32 codes in one group; per-channel scales not yet)"
            )
        widths = (self.hidden, self.q_heads * self.head_dim, self.intermediate)
        group = FP8_GROUP if self.fp8_block else self.int4_group
        experts = ("expert_intermediate",)
        if self.dense_quantized:
            experts += ("shared_intermediate",)
        elif self.hidden % group:
            raise ValueError(f"hidden {self.hidden}: {kind} experts' inputs are "
                             f"whole groups of {group}")  # fmt: skip
        for name in experts:
            if group and getattr(self, name) % group:
                raise ValueError(
                    f"{name} {getattr(self, name)}: {kind} experts' widths are "
                    f"whole groups of {group}"
                )
        multiple = FP8_K_BLOCK
        if self.fp8_block:
            multiple = FP8_GROUP
        elif self.int4_group:
            multiple = INT4_K_BLOCK
        if self.dense_quantized and any(k % multiple for k in widths):
            raise ValueError(
                f"{kind} GEMV widths {widths}: multiples of {multiple} (the k per "
                "lane quad; with FP8 blocks, their k groups)"
            )

    @property
    def quantized(self) -> bool:
        """The routed experts (and unless ``experts_only`` every other
        projection but the LM head) read codes with scales (FP8, INT4)."""
        return self.fp8 or self.int4_group > 0

    @property
    def dense_quantized(self) -> bool:
        """QKV, O_PROJ, GATE_UP and DOWN, a latent attention's projections
        and a shared expert read codes with scales."""
        return self.quantized and not self.experts_only

    @property
    def xact_groups(self) -> int:
        """FP8 mixtures: input scales of an EXPERT_DOWN row (XSCALE): a
        group of 128 each with blocks, one per channel; 0 otherwise."""
        if not (self.fp8 and self.moe):
            return 0
        return self.xact_width // FP8_GROUP if self.fp8_block else 1

    @property
    def fp8_groups(self) -> int:
        """Block FP8: k groups of the widest quantized input (0 otherwise)."""
        if not self.fp8_block:
            return 0
        return max(self.hidden, self.q_size, self.intermediate) // FP8_GROUP

    def _check_moe(self) -> None:
        variants = self._variants()
        if variants:
            raise ValueError(
                "the mixture-of-experts instructions run in the default kernel "
                f"only, not with the experimental {', '.join(variants)}"
            )
        for name in ("expert_intermediate", "shared_intermediate"):
            if getattr(self, name) % 8:
                raise ValueError(f"{name} must be a multiple of 8 (128-bit loads)")
        if not 1 <= self.top_k <= min(self.num_experts, MAX_TOP_K):
            raise ValueError(f"top_k {self.top_k}: 1 to min(num_experts, {MAX_TOP_K})")
        if self.num_experts > MAX_EXPERTS:
            raise ValueError(
                f"{self.num_experts} experts: TOPK holds at most {MAX_EXPERTS} "
                "scores per request in a warp's registers"
            )
        if self.num_slots != min(self.batch * self.top_k, self.num_experts):
            raise ValueError(
                f"num_slots {self.num_slots}: the program's min(batch * top_k, "
                "num_experts)"
            )
        if self.grouped and not (
            self.num_groups <= 32
            and self.num_experts % self.num_groups == 0
            and 1 <= self.topk_groups <= self.num_groups
            # (With the bias a group ranks by its best two experts.)
            and self.num_experts // self.num_groups >= 1 + self.correction_bias
        ):
            raise ValueError(
                f"grouped top-k: {self.num_experts} experts in {self.num_groups} "
                f"groups (at most 32, dividing them), keep {self.topk_groups}"
            )

    @property
    def mma_gemv(self) -> bool:
        """The GEMVs run on tensor cores (kernel/ops/gemv_mma.py, over the
        weight pipeline's pages): every batch above 1, where the CUDA-core
        GEMV is bound by instruction issue, when every GEMV's K is a
        multiple of the MMA's k block (32). Not in the legacy control (the
        previous CUDA-core kernel, for the side-by-side comparison), nor in
        a mixture-of-experts or latent-attention kernel: at batch 64 their
        own scratch leaves no room for the staged activations beside a
        3-page ring (Qwen3-30B-A3B, DeepSeek-V3), so their projections keep
        the CUDA-core rows at every batch."""
        widths = (self.hidden, self.q_heads * self.head_dim, self.intermediate)
        return (
            self.batch > 1
            and not self.legacy_control
            and not self.moe
            and not self.mla
            and not any(k % 32 for k in widths)
        )

    @property
    def qk_in_attn(self) -> bool:
        """ATTN applies QK-norm and RoPE (isa.py): heads in parts with QK-norm."""
        return self.qk_norm and self.qkv_parts > 1

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mla(self) -> bool:
        return self.mla_heads > 0

    @property
    def latent_width(self) -> int:
        """One latent cache row: ``[kv_c | k_pe]``."""
        return self.kv_lora_rank + self.qk_rope

    @property
    def mla_width(self) -> int:
        """Columns of the fused down projection's output (QKV_A)."""
        return self.q_lora_rank + self.latent_width

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def mla_per_group(self) -> int:
        return self.mla_heads // self.mla_groups

    @property
    def xact_slots(self) -> int:
        """Slots of xact: the routed ones, then the shared expert's."""
        return self.num_slots + (self.shared_intermediate > 0)

    @property
    def xact_width(self) -> int:
        return max(self.expert_intermediate, self.shared_intermediate)

    @property
    def router_stride(self) -> int:
        """Row stride of the router's logits: experts rounded up to 8, so
        each layer's buffer stays 16-byte aligned."""
        return -(-self.num_experts // 8) * 8

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def q_size(self) -> int:
        return self.q_heads * self.head_dim

    @classmethod
    def from_program(
        cls,
        program,
        block_size: int,
        legacy_control: bool = False,
        wide_attn: bool = False,
        ranks_in_launch: int = 1,
    ) -> KernelShape:
        s = program.spec
        refused = quant_refusal(s.quant)
        if refused:
            raise ValueError(refused)
        fp8 = s.quant is not None and s.quant.name in (FP8_W8A8, FP8_BLOCK)
        int4 = s.quant is not None and s.quant.name == INT4_W4A16
        gqa = dict(q_heads=s.num_q_heads, kv_heads=s.num_kv_heads,
                   head_dim=s.head_dim)  # fmt: skip
        mla = {}
        if s.mla is not None:
            m = s.mla
            if not m.rope_interleaved:
                raise ValueError("MLA's RoPE runs GPT-J (interleaved) style only")
            # O_PROJ reads heads x v_head_dim columns (isa.py).
            gqa = dict(q_heads=m.num_heads, kv_heads=m.num_heads,
                       head_dim=m.v_head_dim)  # fmt: skip
            mla = dict(
                mla_heads=m.num_heads, q_lora_rank=m.q_lora_rank or 0,
                kv_lora_rank=m.kv_lora_rank, qk_nope=m.qk_nope_head_dim,
                qk_rope=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                mla_scale=float(m.softmax_scale),
                mla_groups=program.mla_head_groups, mla_v_parts=program.mla_v_parts,
                query_rows=program.query_rows,
            )  # fmt: skip
        moe = {}
        if s.moe is not None and any(s.moe.sparse_layers):
            m = s.moe
            moe = dict(
                num_experts=m.num_experts, top_k=m.top_k,
                expert_intermediate=m.expert_intermediate,
                num_slots=program.num_slots, moe_sigmoid=m.scoring == "sigmoid",
                renormalize=m.renormalize, grouped=m.grouped,
                num_groups=m.num_groups if m.grouped else 1,
                topk_groups=m.topk_groups if m.grouped else 1,
                correction_bias=m.correction_bias,
                routed_scaling=float(m.routed_scaling),
                shared_intermediate=m.shared_intermediate,
            )  # fmt: skip
            if m.scoring not in ("softmax", "sigmoid"):
                raise ValueError(f"MoE scoring {m.scoring!r}: softmax or sigmoid")
        return cls(
            hidden=s.hidden_size,
            intermediate=s.intermediate_size,
            # A tensor-parallel rank's vocabulary shard (embedding and LM head).
            vocab=s.lm_head_rows,
            batch=program.batch,
            block_size=block_size,
            attn_chunks=program.attn_chunks,
            rms_norm_eps=s.rms_norm_eps,
            qkv_bias=s.qkv_bias,
            qk_norm=s.qk_norm,
            legacy_control=legacy_control,
            wide_attn=wide_attn,
            qkv_parts=program.qkv_parts,
            combine_parts=program.combine_parts,
            tp_size=s.tp_size,
            ranks_in_launch=ranks_in_launch,
            fp8=fp8,
            fp8_block=fp8 and s.quant.name == FP8_BLOCK,
            int4_group=s.quant.group_size if int4 else 0,
            experts_only=s.quant is not None and s.quant.experts_only,
            **gqa,
            **moe,
            **mla,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def workspace_sizes(shape: KernelShape, num_layers: int) -> dict[str, tuple]:
    """Per-step activation buffers (shapes), each written once per step."""
    b, h, d = shape.batch, shape.hidden, shape.head_dim
    sizes = {
        "h": (num_layers + 1, b, h),
        "hmid": (num_layers, b, h),
        "q": (num_layers, b, shape.q_heads, d),
        "attn": (num_layers, b, shape.q_heads, d),
        "act": (num_layers, b, shape.intermediate),
        "part_o": (num_layers, shape.attn_chunks, shape.kv_heads, b, shape.group, d),
        "part_lse": (num_layers, shape.attn_chunks, shape.kv_heads, b, shape.group),
        "out": (b, h),
        "logits": (b, shape.vocab),
    }
    if shape.tp_size > 1:
        sizes["partial"] = (partial_rows(num_layers), b, h)
    if shape.moe:
        # Per layer (unused in a dense layer of a mixed model, which the
        # table does not point them at): router logits, the routing, and
        # each slot's SiLU-mul activations (rows of requests not routed to
        # a slot are never written nor read).
        sizes["router"] = (num_layers, b, shape.router_stride)
        sizes["route"] = (num_layers, route_layout(shape).words)
        sizes["xact"] = (num_layers, shape.xact_slots, b, shape.xact_width)
        if shape.xact_groups:
            # FP8 experts: xact quantized for EXPERT_DOWN, its scales, and
            # each slot's count of EXPERT_UP columns done (int32, zero; each
            # layer's row padded to 16 bytes, as every table entry is).
            words = shape.xact_slots * b * shape.xact_groups
            sizes["xq"] = (num_layers, shape.xact_slots, b, shape.xact_width)
            sizes["xscale"] = (num_layers, -(-words // 4) * 4)
            sizes["arrive"] = (num_layers, -(-shape.xact_slots // 4) * 4)
    if shape.mla:
        # As the interpreter's buffers: no q; the partials per (chunk, head
        # group); o_proj's input of heads x v_head_dim (attn, as sized above).
        heads, rank, g = shape.mla_heads, shape.kv_lora_rank, shape.mla_groups
        del sizes["q"]
        sizes["qkv_a"] = (num_layers, b, shape.mla_width)
        sizes["q_lat"] = (num_layers, b, heads, rank)
        sizes["q_pe"] = (num_layers, b, heads, shape.qk_rope)
        per = shape.mla_per_group
        sizes["part_o"] = (num_layers, shape.attn_chunks, g, b, per, rank)
        sizes["part_lse"] = (num_layers, shape.attn_chunks, g, b, per)
    return sizes


@dataclass(frozen=True)
class RouteLayout:
    """TOPK's output, one buffer of 4-byte words per layer (fp32: the int32
    fields are stored as their bits, so the buffer poisons with NaN like
    every other): offsets in words."""

    weights: int  # [B, top_k] fp32, each request's choices best first
    slots: int  # [B, top_k] int32: each choice's slot; -1 for a padding row
    experts: int  # [num_slots] int32: each slot's expert, ascending, then -1
    words: int  # the total, a multiple of 4 (16-byte aligned per layer)


def route_layout(shape: KernelShape) -> RouteLayout:
    n = shape.batch * shape.top_k
    words = -(-(2 * n + shape.num_slots) // 4) * 4
    return RouteLayout(0, n, 2 * n, words)
