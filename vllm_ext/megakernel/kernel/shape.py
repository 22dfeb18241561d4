# SPDX-License-Identifier: Apache-2.0
"""What the kernel is compiled for, and the table of addresses it reads.

Pure Python (no CuTe DSL, no vLLM): the host launcher and the GPU check
import it where CuTe DSL is not installed.

Model shape and batch bucket are compile-time constants (loops unroll, tile
sizes fold); everything that moves per step or per engine (weights, KV
cache, activations, the step's inputs) is an address in one int64 table
``ptrs[num_layers + 1, NUM_SLOTS]``: row ``l`` for layer ``l``, the last row
for the model-wide tensors. So one compiled kernel serves any number of
layers and any KV cache size, and the launch takes a handful of scalars.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum


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


NUM_SLOTS = 18
# Deliberately wrong kernels, for the GPU check only (KernelShape.planted_bug):
# it must reject each. "kv-slot": the KV append writes the new token's K and
# V to the neighbouring token of its block (slot ^ 1), a silent stray write
# inside the cache. "oob-store": FINAL_NORM writes the last row of ``out`` one
# element too long, a store just past the buffer's end.
PLANTED_BUGS = ("kv-slot", "oob-store")
# Requests accumulated per pass over a weight row (see ops/gemv.py).
BATCH_GROUP = 8
# A page of the weight pipeline (ops/weight_pipe.py).
PAGE_BYTES = 32 * 1024


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
    """Compile-time constants of one kernel build (bf16 weights)."""

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
    # Experimental (not yet measured): each GEMV instruction copies the head
    # of its weight tile into shared memory before waiting for its inputs
    # (kernel/ops/weight_stage.py). Off: the kernel validated on an H200.
    stage_weights: bool = False
    # Experimental (not yet measured), against the 0.9 us each instruction
    # costs: the queue's head is copied into shared memory at launch, so
    # fetching an instruction is no global load, and a wait polls with
    # acquire loads, so one already met costs one load instead of two.
    stage_queue: bool = False
    # Experimental (not yet measured): GEMVs on tensor cores (mma.sync), for
    # batches where the CUDA-core GEMV is bound by instruction issue
    # (kernel/ops/gemv_mma.py). Not with stage_weights (one scratch buffer).
    mma_gemv: bool = False
    # Experimental (not yet measured): a ring of shared-memory pages that
    # bulk copies keep filled with the queue's weight rows, through waits and
    # across instructions (kernel/ops/weight_pipe.py). With mma_gemv, the
    # tensor-core GEMV reads its pages; not with stage_weights.
    weight_pipe: bool = False
    # Experimental (not yet measured): with weight_pipe, a second cursor
    # hints the ring's next pages into L2, so the lookahead is the ring plus
    # that much L2 (kernel/ops/weight_pipe.py, L2_AHEAD_PAGES).
    l2_ahead: bool = False
    # Experimental (not yet measured): ATTN with 128-bit K/V loads, several
    # tokens per warp load and requests side by side
    # (kernel/ops/attn_wide.py).
    wide_attn: bool = False
    # Experimental (not yet measured): the program has no COMBINE
    # instructions; the last ATTN chunk of each kv head merges the head's
    # partials (isa.py, tail). Set from the program, which it must match.
    fused_combine: bool = False
    # Experimental (not yet measured): QKV's units are heads split into this
    # many RoPE-pair parts (isa.py), so the phase spreads over more SMs. Set
    # from the program, which it must match.
    qkv_parts: int = 1
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
        if self.head_dim not in (64, 128):
            raise ValueError("head_dim must be 64 or 128")
        if self.batch > BATCH_GROUP and self.batch % BATCH_GROUP:
            raise ValueError(
                f"batch {self.batch}: above {BATCH_GROUP}, a multiple of "
                f"{BATCH_GROUP} (the GEMV's request groups)"
            )
        if self.q_heads % self.kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")
        if self.weight_pipe and self.stage_weights:
            raise ValueError(
                "weight_pipe and stage_weights both move the GEMVs' weights into "
                "shared memory: pick one"
            )
        if self.l2_ahead and not self.weight_pipe:
            raise ValueError("l2_ahead runs ahead of the weight pipeline's ring: "
                             "it needs weight_pipe")  # fmt: skip
        if self.weight_pipe and not self.mma_gemv:  # (mma pages split rows)
            page_rows(self.hidden, dual=True)  # GATE_UP (QKV, LM_HEAD: narrower)
            page_rows(self.q_heads * self.head_dim)  # O_PROJ
            page_rows(self.intermediate)  # DOWN
        if self.qkv_parts > 1 and self.stage_weights:
            raise ValueError(
                "qkv_parts > 1 is not read by the weight stage (it stages whole "
                "heads): use the weight pipeline"
            )
        if self.mma_gemv:
            if self.stage_weights:
                raise ValueError("mma_gemv and stage_weights share a buffer: pick one")
            widths = (self.hidden, self.q_heads * self.head_dim, self.intermediate)
            if any(k % 32 for k in widths):
                raise ValueError("mma_gemv needs every GEMV's K to be a multiple of 32")

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
        stage_weights: bool = False,
        stage_queue: bool = False,
        mma_gemv: bool = False,
        weight_pipe: bool = False,
        wide_attn: bool = False,
        l2_ahead: bool = False,
    ) -> KernelShape:
        s = program.spec
        if s.moe is not None and any(s.moe.sparse_layers):
            # The program has them (isa.py); the device functions not yet.
            raise ValueError("the kernel has no mixture-of-experts instructions yet")
        return cls(
            hidden=s.hidden_size,
            intermediate=s.intermediate_size,
            q_heads=s.num_q_heads,
            kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            vocab=s.vocab_size,
            batch=program.batch,
            block_size=block_size,
            attn_chunks=program.attn_chunks,
            rms_norm_eps=s.rms_norm_eps,
            qkv_bias=s.qkv_bias,
            qk_norm=s.qk_norm,
            stage_weights=stage_weights,
            stage_queue=stage_queue,
            mma_gemv=mma_gemv,
            weight_pipe=weight_pipe,
            wide_attn=wide_attn,
            l2_ahead=l2_ahead,
            fused_combine=program.fuse_combine,
            qkv_parts=program.qkv_parts,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def workspace_sizes(shape: KernelShape, num_layers: int) -> dict[str, tuple]:
    """Per-step activation buffers (shapes), each written once per step."""
    b, h, d = shape.batch, shape.hidden, shape.head_dim
    return {
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
