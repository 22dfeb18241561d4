# SPDX-License-Identifier: Apache-2.0
"""Model shape + batch bucket + device -> a program: per-SM queues.

The planner lists the step's instructions phase by phase in one global
topological order (embedding; per layer QKV, ATTN, COMBINE, O_PROJ, GATE_UP,
DOWN; final norm; LM head) and deals each to the SM with the fewest bytes a
step reads so far, but no SM more than its share of the phase's tiles or of
the opcode's in the layer. Every queue is therefore a subsequence of the
global order, which is what makes the program deadlock-free when all CTAs
are co-resident (see verify.py). An instruction waits through one counter
for the instructions that write what it reads: the whole previous phase,
except where the data allows finer (a kv group's ATTN waits for that group's
QKV tiles only, an MLA layer's MLA_Q for q_a's tiles of the down projection
and MLA_APPEND for kv_a's). Tiles are sized from bytes so every phase
spreads over all SMs.

COMBINE runs a tile per unit: a q head's dim part, as many parts as keep
one tile per SM (``combine_parts_to_fill``; Llama's 32 q heads in 4 parts).
Every group's ATTN precedes every COMBINE in the global order: a queue
runs in order, and a merge between two groups' chunks held the later one
until the earlier group had ended. (A fused COMBINE, the last chunk of a
head merging its partials, was planned until 2026-12-02: the cost model
put it at or above this program everywhere: a choice on the model's word,
docs/predictions.md.)

QKV's tiles are parts of heads (isa.py), as many parts per head as keep
one tile per SM (``qkv_parts_to_fill``): whole heads would give 48 tiles on
the Llama shapes, where the other phases use all 132 SMs. With QK-norm,
ATTN then finishes q and the new K (``Program.qk_in_attn``). The cost model
chose parts (docs/predictions.md: not measured); the GPU check times whole heads
beside them (``qkv_parts=1``, build.py's ``--whole-heads``).

A multi-head latent attention layer (``spec.mla``) runs MLA_QKV_A (the fused
q_a/kv_a down projection over all SMs), MLA_Q (one tile per head) beside
one MLA_APPEND, MLA_ATTN over head groups x sequence chunks and MLA_COMBINE
per (head, v part) in place of QKV, ATTN and COMBINE (``mla_split``).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch

from vllm_ext.megakernel.cost import KV_HINT_BYTES, Cost, Device
from vllm_ext.megakernel.isa import (
    NO_COUNTER,
    Instruction,
    Op,
    Point,
    encode,
    pack_cols,
    unpack_cols,
)
from vllm_ext.model_spec import ModelSpec

# Smallest GEMV tile: 16 output columns (one MMA N-tile, 128-bit rows of bf16).
COL_MULTIPLE = 16
# Upper bound on KV chunks per kv head: enough to fill the SMs for models
# with few kv heads, few enough that the combine stays short.
MAX_ATTN_CHUNKS = 16
# Context length the cost model assumes for attention unless told the run's
# (``Program.context``; plans do not depend on it: chunks are sized at run
# time from each sequence's length).
NOMINAL_CONTEXT = 1024
# MLA_ATTN's M tile (a group's heads x a request's rows) and the tiles one
# pass over a request's latent rows holds (kernel/ops/mla_attn.py's
# HEAD_ROWS and PASS_TILES; a test keeps them equal, and this module free of
# the kernel's imports).
MLA_HEAD_ROWS = 16
MLA_PASS_TILES = 2


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the largest power of two <= max_batch."""
    buckets = [1]
    while buckets[-1] * 2 <= max_batch:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def split(n: int, parts: int, multiple: int = 1) -> list[tuple[int, int]]:
    """[0, n) in at most ``parts`` ranges, each a multiple of ``multiple``
    (the last may be shorter), as even as that allows."""
    units = math.ceil(n / multiple)
    parts = max(1, min(parts, units))
    base, extra = divmod(units, parts)
    ranges, lo = [], 0
    for p in range(parts):
        hi = min(n, lo + (base + (p < extra)) * multiple)
        ranges.append((lo, hi))
        lo = hi
    return ranges


@dataclass(frozen=True)
class Program:
    spec: ModelSpec
    batch: int
    device: Device
    attn_chunks: int
    with_lm_head: bool
    queues: tuple[tuple[Instruction, ...], ...]
    counter_names: tuple[str, ...]
    # (sm, index in queue) of every instruction, in the global order.
    order: tuple[tuple[int, int], ...] = field(repr=False)
    # QKV's units: heads split into this many RoPE-pair parts (isa.py).
    qkv_parts: int = 1
    # MLA (isa.py): MLA_ATTN's head groups, MLA_COMBINE's parts per head.
    mla_head_groups: int = 1
    mla_v_parts: int = 1
    # COMBINE's units: q heads split into this many dim parts (isa.py).
    combine_parts: int = 1
    # Each request's history in tokens, for the attention's bytes (the cost
    # model's only; the program is the same at every length): a measured
    # run's context where its prediction stands beside it.
    context: int = NOMINAL_CONTEXT
    # Query rows a request the latent attention is built for (1 + drafts of
    # a verify step): above 1, MLA_ATTN's passes over a request's cache
    # serve all its rows (the step's query map; ``mla_passes``). 1 in a
    # grouped-query program.
    query_rows: int = 1

    @property
    def num_instructions(self) -> int:
        return len(self.order)

    @property
    def num_counters(self) -> int:
        return len(self.counter_names)

    @property
    def num_slots(self) -> int:
        return expert_slots(self.spec, self.batch)

    @property
    def qk_in_attn(self) -> bool:
        """QK-norm and RoPE are ATTN's (isa.py): heads in parts with QK-norm."""
        return self.spec.qk_norm and self.qkv_parts > 1

    @property
    def shared_slot(self) -> int | None:
        """EXPERT_UP's slot argument for the shared expert (isa.py): the one
        after the routed slots, or None without a shared expert."""
        moe = self.spec.moe
        return self.num_slots if moe is not None and moe.shared_intermediate else None

    @property
    def expected_experts(self) -> float:
        """Distinct experts a sparse layer reads per step, expected under
        uniform routing (each request picks top_k distinct experts)."""
        return expected_experts(self.spec, self.batch)

    def in_global_order(self) -> Iterator[tuple[int, int, Instruction]]:
        for sm, idx in self.order:
            yield sm, idx, self.queues[sm][idx]

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        return encode([list(q) for q in self.queues])

    def digest(self) -> str:
        """SHA-256 of the encoded queues: what a GPU report records of the
        program that ran, so that a calibration of it can tell whether the
        program planned later is the same one (same lengths are not)."""
        table, lengths = self.encode()
        h = hashlib.sha256(lengths.numpy().tobytes())
        h.update(table.numpy().tobytes())
        return h.hexdigest()

    @property
    def occupied_slots(self) -> int:
        """The expected distinct experts, rounded (0 without a mixture):
        what the plan CLI reports; the cost model reads the fraction
        (``step_cost``), and ``expert_split`` weighs both neighbours."""
        return occupied_slots(self.spec, self.batch)

    def step_cost(self, instr: Instruction) -> Cost:
        """``cost(instr)`` in a step that fills the expected number of slots
        (``expected_experts``, the floor's): slots below it are filled, the
        one it falls in by its fraction, the rest read nothing; EXPERT_DOWN
        reads the filled slots' rows. (Rounding it to whole slots let
        Mixtral-8x7B at batch 4, 5.47 experts, come out under its floor.)"""
        routed = self.routed_weight_bytes(instr)
        if not routed:
            return self.cost(instr)
        full = self.cost(instr)
        expected = self.expected_experts
        if instr.op == Op.EXPERT_UP:
            share = min(1.0, max(0.0, expected - instr.arg0))
            if share == 1.0:
                return full
            return Cost(
                round(full.weight_bytes * share), round(full.other_bytes * share)
            )
        unread = routed - round(routed * expected / self.num_slots)
        return Cost(full.weight_bytes - unread, full.other_bytes)

    def weight_bytes(self) -> int:
        """Weight bytes a step reads; a sparse layer's experts counted at
        their expected number (``expected_experts``), not every slot."""
        total, experts = 0, 0
        for q in self.queues:
            for i in q:
                routed = self.routed_weight_bytes(i)
                experts += routed
                total += self.cost(i).weight_bytes - routed
        if experts:
            experts = round(experts * self.expected_experts / self.num_slots)
        return total + experts

    def routed_weight_bytes(self, instr: Instruction) -> int:
        """The part of ``instr``'s weight bytes that is routed experts' rows
        (read only for the experts a step selects); the shared expert's are
        read every step."""
        moe = self.spec.moe
        if moe is None or instr.op not in (Op.EXPERT_UP, Op.EXPERT_DOWN):
            return 0
        if instr.op == Op.EXPERT_UP:
            if instr.arg0 == self.shared_slot:
                return 0
            return self.cost(instr).weight_bytes
        lo, hi = instr.arg0, instr.arg1
        inter = moe.expert_intermediate
        return self.num_slots * self._linear_bytes(hi - lo, inter, routed=True)

    @cached_property
    def _costs(self) -> dict[Instruction, Cost]:
        return {}

    def cost(self, instr: Instruction) -> Cost:
        """Bytes ``instr`` moves: weights (prefetchable) and the rest."""
        # Memoised: the cost model and calibrate's solvers ask for every
        # instruction's many times over.
        c = self._costs.get(instr)
        if c is None:
            c = self._costs[instr] = self._cost(instr)
        return c

    def _linear_bytes(self, rows: int, cols: int, routed: bool = False) -> int:
        """Bytes of ``rows`` x ``cols`` of a projection's weight (``routed``:
        a routed expert's): the model dtype's, or a quantized checkpoint's
        with its scales (``experts_only``: the routed experts' only)."""
        e, quant = self.spec.dtype.itemsize, self.spec.quant
        if quant is None or (quant.experts_only and not routed):
            return rows * cols * e
        return quant.weight_bytes(rows, cols, e)

    def _cost(self, instr: Instruction) -> Cost:
        s, b = self.spec, self.batch
        e = s.dtype.itemsize
        lo, hi = instr.arg0, instr.arg1
        h, d = s.hidden_size, s.head_dim
        if instr.op == Op.NOP:  # waits and signals only (timing probes)
            return Cost(0, 0)
        if instr.op == Op.EMBED:
            return Cost(0, 2 * b * (hi - lo) * e)
        if instr.op == Op.QKV:
            cols = (hi - lo) * d // self.qkv_parts
            w = self._linear_bytes(cols, h) + h * e + (cols * e if s.qkv_bias else 0)
            return Cost(w, b * h * e + 2 * b * cols * e)
        if instr.op == Op.ATTN:
            group = s.num_q_heads // s.num_kv_heads
            tokens = math.ceil(self.context / self.attn_chunks)
            kv = b * tokens * 2 * d * e
            late, early = _hinted(kv, s.num_kv_heads * kv, s.num_kv_heads)
            return Cost(0, late + b * group * d * (e + 4) + b * group * 4, early)
        if instr.op == Op.COMBINE:
            lo, hi = unpack_cols(instr.arg1)
            units, dims = hi - lo, d // self.combine_parts
            return Cost(
                0, self.attn_chunks * b * units * (dims + 1) * 4 + b * units * dims * e
            )
        if instr.op == Op.O_PROJ:
            width = s.q_size if s.mla is None else s.mla.num_heads * s.mla.v_head_dim
            w = self._linear_bytes(hi - lo, width)
            return Cost(w, b * width * e + 2 * b * (hi - lo) * e)
        if s.mla is not None and instr.op in _MLA_OPS:
            return self._mla_cost(instr)
        if instr.op == Op.GATE_UP:
            w = self._linear_bytes(2 * (hi - lo), h) + h * e
            return Cost(w, b * h * e + b * (hi - lo) * e)
        if instr.op == Op.DOWN:
            w = self._linear_bytes(hi - lo, s.intermediate_size)
            return Cost(w, b * s.intermediate_size * e + 2 * b * (hi - lo) * e)
        if instr.op == Op.FINAL_NORM:
            return Cost(h * e, b * h * e + b * (hi - lo) * e)
        if instr.op == Op.ALL_REDUCE:
            # Its own partial of the columns, the residual and the sum here;
            # the other ranks' partials over NVLink.
            lo, hi = unpack_cols(instr.arg1)
            cols = b * (hi - lo) * e
            return Cost(0, 3 * cols, link_bytes=(s.tp_size - 1) * cols)
        if instr.op == Op.LM_HEAD:
            return Cost((hi - lo) * h * e, b * h * e + b * (hi - lo) * 4)
        moe = s.moe
        if instr.op == Op.ROUTE:
            return Cost((hi - lo) * h * e + h * e, b * h * e + b * (hi - lo) * e)
        if instr.op == Op.TOPK and moe is not None:
            return Cost(0, b * moe.num_experts * e + b * moe.top_k * 8)
        # An expert slot's cost as if occupied (weight_bytes() takes the
        # expected occupancy).
        if instr.op == Op.EXPERT_UP and moe is not None:
            lo, hi = unpack_cols(instr.arg1)
            routed = instr.arg0 != self.shared_slot
            w = self._linear_bytes(2 * (hi - lo), h, routed) + h * e
            return Cost(w, b * h * e + b * (hi - lo) * e)
        if instr.op == Op.EXPERT_DOWN and moe is not None:
            inter, shared = moe.expert_intermediate, moe.shared_intermediate
            w = self.num_slots * self._linear_bytes(hi - lo, inter, routed=True)
            if shared:
                w += self._linear_bytes(hi - lo, shared)
            acts = b * (moe.top_k * inter + shared) * e
            return Cost(w, acts + 2 * b * (hi - lo) * e)
        raise ValueError(f"no cost for {instr}")

    def _mla_cost(self, instr: Instruction) -> Cost:
        """The latent attention's bytes (isa.py); norm weights re-read by
        every tile count as weights, as GATE_UP's."""
        s, b, mla = self.spec, self.batch, self.spec.mla
        assert mla is not None
        e, h = s.dtype.itemsize, s.hidden_size
        lo, hi = instr.arg0, instr.arg1
        rank, rope, lora = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank
        # (FP8 blocks: q_a, kv_a, q_b as the checkpoint's; W_UK and W_UV in
        # the model dtype, as vLLM dequantizes kv_b.)
        if instr.op == Op.MLA_QKV_A:
            w = self._linear_bytes(hi - lo, h) + h * e
            return Cost(w, b * h * e + b * (hi - lo) * e)
        if instr.op == Op.MLA_Q:
            n = hi - lo
            k = lora or h  # q_b's input: the q_a row, or h without a q LoRA
            w = self._linear_bytes(n * mla.qk_head_dim, k) + k * e  # q_b + norm
            w += n * mla.qk_nope_head_dim * rank * e  # W_UK
            return Cost(w, b * k * e + b * n * (rank + rope) * e)
        if instr.op == Op.MLA_APPEND:
            return Cost(rank * e, 2 * b * mla.latent_width * e)
        if instr.op == Op.MLA_ATTN:
            # A request's latent rows in the chunk at the context, as ATTN's,
            # read once a pass (``mla_passes``): with a verify step's rows a
            # request (the last request fewer), its rows share the passes.
            group = mla.num_heads // self.mla_head_groups
            tokens = math.ceil(self.context / self.attn_chunks)
            chunk = tokens * mla.latent_width * e
            q = self.query_rows
            requests, last = divmod(b, q)
            passes = requests * mla_passes(group, q, q)
            if last:
                requests, passes = requests + 1, passes + mla_passes(group, last, q)
            queries = b * group * (rank + rope) * e
            # (The hint walks rows, each over its request's blocks.)
            late, early = _hinted(passes * chunk, requests * chunk,
                                  self.mla_head_groups, b * chunk)  # fmt: skip
            return Cost(0, late + queries + b * group * (rank + 1) * 4, early)
        if instr.op == Op.MLA_COMBINE:
            cols = mla.v_head_dim // self.mla_v_parts
            parts = self.attn_chunks * b * (rank + 1) * 4
            return Cost(cols * rank * e, parts + b * cols * e)
        raise ValueError(f"no cost for {instr}")


def _hinted(
    reads: int, blocks: int, sharers: int, walked: int | None = None
) -> tuple[int, int]:
    """An attention chunk that reads ``reads`` bytes of cache blocks of
    ``blocks`` bytes (all heads), shared by ``sharers`` SMs that each hint
    a slice of every block up to ``KV_HINT_BYTES`` (cost.py,
    kernel/ops/kv_hint.py): the bytes it still reads from HBM once its wait
    is met, and those it hints. ``walked``: the block bytes the hints' walk
    meets, repeats included (``blocks`` if None): it walks rows, so a
    verify step's rows of one request meet its blocks once each and spend
    the budget on repeats that read nothing more."""
    walked = blocks if walked is None else walked
    early = min(blocks // sharers, KV_HINT_BYTES * blocks // walked if walked else 0)
    covered = min(1.0, early * sharers / blocks) if blocks else 1.0
    return round(reads * (1 - covered)), early


def mla_passes(per_group: int, rows: int, query_rows: int) -> int:
    """MLA_ATTN's passes over a request's chunk of latent rows (each loads
    every block of it once) for a group of ``per_group`` heads and ``rows``
    rows of the request, in a program of ``query_rows`` (kernel/ops/
    mla_attn.py): with a row a request, a pass a tile of heads; with a
    verify step's shared pass, the rows x heads in tiles of
    ``MLA_HEAD_ROWS``, up to ``MLA_PASS_TILES`` tiles a pass (DeepSeek-V3's
    16 heads a group: one pass for 2 rows, two for 4; Kimi-K2's 8: one for
    up to 4)."""
    tiles = 1
    if query_rows > 1:
        tiles = min(math.ceil(per_group * query_rows / MLA_HEAD_ROWS), MLA_PASS_TILES)
    return math.ceil(per_group * rows / (tiles * MLA_HEAD_ROWS))


_MLA_OPS = (Op.MLA_QKV_A, Op.MLA_Q, Op.MLA_APPEND, Op.MLA_ATTN, Op.MLA_COMBINE)


def mla_split(spec: ModelSpec, num_sms: int) -> tuple[int, int, int]:
    """(head groups, chunks, v parts) of a latent attention layer.

    One kv head: at batch 1 the chunks alone would give at most
    MAX_ATTN_CHUNKS tiles. Groups of heads multiply them; each group re-reads
    the chunk's latent rows, so groups stay few: the largest power of two
    dividing the heads with groups * groups * 2 <= SMs, then as many chunks
    as fill the SMs (DeepSeek-V3 on 132 SMs: 8 groups of 16 heads x 16
    chunks). MLA_COMBINE tiles are heads, split into v parts (each its W_UV
    rows) while the heads leave SMs idle (Kimi-K2: 64 heads x 2 parts)."""
    mla = spec.mla
    assert mla is not None
    heads, groups = mla.num_heads, 1
    while heads % (groups * 2) == 0 and (groups * 2) ** 2 * 2 <= num_sms:
        groups *= 2
    chunks = max(1, min(MAX_ATTN_CHUNKS, num_sms // groups))
    parts = 1
    while (
        heads * parts * 2 <= num_sms
        and mla.v_head_dim % (parts * 2 * COL_MULTIPLE) == 0
    ):
        parts *= 2
    return groups, chunks, parts


def split_within(
    segments: list[tuple[int, int]], parts: int, multiple: int = 1
) -> list[list[tuple[int, int]]]:
    """Each segment ``[lo, hi)`` in ranges that stay inside it (so each range
    can signal its segment's counter): at most ``parts`` ranges in all (or
    one per segment, if there are more), as even as that allows, in
    multiples of ``multiple`` (a segment's last range may be shorter);
    segments must start at multiples of ``multiple``."""
    units = [math.ceil((hi - lo) / multiple) for lo, hi in segments]
    size = max(1, math.ceil(sum(units) / max(1, parts)))
    while sum(math.ceil(n / size) for n in units) > max(parts, len(segments)):
        size += 1
    tiles = []
    for (lo, hi), n in zip(segments, units, strict=True):
        ranges = split(hi - lo, math.ceil(n / size), multiple)
        tiles.append([(lo + a, lo + b) for a, b in ranges])
    return tiles


def qkv_group_tiles(
    spec: ModelSpec, qkv_parts: int, num_sms: int
) -> list[list[tuple[int, int]]]:
    """QKV's tiles per kv group g: ranges of fused-head units (isa.py) within
    g's units alone, its q heads then k head g then v head g. Those are not
    contiguous in the fused order (q heads, then k, then v), so a group has
    at least three tiles; in all at most one per SM (unless the groups are
    more than a third of the SMs), one per unit where the units are fewer
    than the SMs (every real shape on 132 SMs: as before)."""
    p, nq, nkv = qkv_parts, spec.num_q_heads, spec.num_kv_heads
    group = nq // nkv
    segments = []
    for g in range(nkv):
        segments += [
            (g * group * p, (g + 1) * group * p),  # its q heads
            ((nq + g) * p, (nq + g + 1) * p),  # k head g
            ((nq + nkv + g) * p, (nq + nkv + g + 1) * p),  # v head g
        ]
    tiles = split_within(segments, num_sms)
    return [tiles[3 * g] + tiles[3 * g + 1] + tiles[3 * g + 2] for g in range(nkv)]


def expert_slots(spec: ModelSpec, batch: int) -> int:
    """Expert slots per sparse layer (isa.py): as many as the batch's
    requests can select, at most every expert (0 without a mixture)."""
    moe = spec.moe
    return 0 if moe is None else min(batch * moe.top_k, moe.num_experts)


def expected_experts(spec: ModelSpec, batch: int) -> float:
    """Distinct experts a sparse layer reads per step, expected under
    uniform routing (each request picks top_k distinct experts)."""
    moe = spec.moe
    if moe is None:
        return 0.0
    e, k = moe.num_experts, moe.top_k
    return e * (1 - (1 - k / e) ** batch)


def occupied_slots(spec: ModelSpec, batch: int) -> int:
    """The expected distinct experts, rounded (0 without a mixture)."""
    if spec.moe is None:
        return 0
    return min(expert_slots(spec, batch), max(1, round(expected_experts(spec, batch))))


# Sparse layers of the programs that choose expert_split's tiles: the loads
# of a few layers differ little between two splits (DeepSeek-V3 at batch 16,
# 13 or 32 tiles: 3 layers 8742 against 8747 us), but they drift apart
# layer by layer (12 layers: 33639 against 31103; the whole model 161612
# against 145792). The choice takes 21 s at DeepSeek-V3's batch 64 on this
# CPU, 24 s at Kimi-K2's.
SPLIT_LAYERS = 12


def expert_split(
    spec: ModelSpec, batch: int, device: Device, qkv_parts: int = 1
) -> int:
    """Column tiles per routed slot's EXPERT_UP. Candidates: the count that
    minimizes the busiest SM's share of a step's filled tiles (spread
    evenly; each tile's rows plus an instruction's overhead in bytes) with
    the expected distinct experts rounded down, rounded up, and taken as
    its fraction of the two. Where they differ, the one whose program of
    the model's first ``SPLIT_LAYERS`` sparse layers (and the dense ones
    before them) the cost model predicts fastest, ties to more tiles: the
    integer bound misjudges either way (Mixtral-8x7B at batch 4, 5.47
    experts: 26 tiles by the rounded count, 132 by the fraction, 18699
    against 16090 us in the model; Qwen3-30B-A3B at batch 16, 82.4: 8
    against 3, 12476 against 12734 us). One tile per SM where the filled
    slots' tiles fit (batch 1: Qwen3-30B-A3B 16 per slot, Mixtral 66).
    The candidates' programs have the caller's ``qkv_parts``."""
    from vllm_ext.megakernel.cost import predict

    moe = spec.moe
    assert moe is not None
    units = math.ceil(moe.expert_intermediate / COL_MULTIPLE)
    row = 2 * COL_MULTIPLE * spec.hidden_size * spec.dtype.itemsize  # gate, up
    overhead = device.instruction_overhead_s * device.sm_bytes_per_s
    n_sm = device.num_sms
    expected = min(expert_slots(spec, batch), expected_experts(spec, batch))
    low = max(1, math.floor(expected))
    high = max(low, math.ceil(expected))
    frac = expected - math.floor(expected) if high > low else 0.0

    def busiest(tiles: int, share_high: float) -> float:
        largest = math.ceil(units / tiles) * row
        per_sm = [math.ceil(f * tiles / n_sm) for f in (low, high)]
        return ((1 - share_high) * per_sm[0] + share_high * per_sm[1]) * (
            largest + overhead
        )

    # Ties: more tiles, so that more SMs run one and can take the layer's
    # EXPERT_DOWN tiles (Mixtral at batch 1: 66 per slot, one per SM).
    candidates = {
        min(range(1, units + 1), key=lambda t: (busiest(t, share), -t))
        for share in (0.0, 1.0, frac)
    }
    if len(candidates) == 1 or not any(moe.sparse_layers):
        return max(candidates)  # (no sparse layer: no tile of it runs)
    first = moe.sparse_layers.index(True)
    short = spec.with_layers(min(spec.num_layers, first + SPLIT_LAYERS))

    def step_s(tiles: int) -> float:
        program = plan(short, batch, device, qkv_parts=qkv_parts, expert_tiles=tiles)
        return predict(program).step_s

    return min(candidates, key=lambda t: (step_s(t), -t))


def qkv_parts_to_fill(spec: ModelSpec, num_sms: int) -> int:
    """The most parts per head that still leave QKV at most one tile per SM
    (1 where heads cannot be split, ``_qkv_parts_error``, or a latent
    attention has no QKV): the planner's default. With QK-norm, ATTN then
    finishes the heads (``Program.qk_in_attn``)."""
    if spec.mla is not None:
        return 1
    heads, parts = spec.num_q_heads + 2 * spec.num_kv_heads, 1
    while heads * parts * 2 <= num_sms and _qkv_parts_error(spec, parts * 2) is None:
        parts *= 2
    return parts


def combine_parts_to_fill(spec: ModelSpec, num_sms: int) -> int:
    """The most dim parts per q head (a power of two, at least 8 dims each)
    that still leave COMBINE at most one tile per SM: the planner's default
    (1 for a latent attention, which has no COMBINE)."""
    if spec.mla is not None:
        return 1
    parts = 1
    while (spec.num_q_heads * parts * 2 <= num_sms
           and spec.head_dim % (parts * 2 * 8) == 0):  # fmt: skip
        parts *= 2
    return parts


def _qkv_parts_error(spec: ModelSpec, parts: int) -> str | None:
    d = spec.head_dim
    if parts < 1 or parts & (parts - 1):
        return f"qkv_parts must be a power of two, got {parts}"
    if d % (2 * parts * COL_MULTIPLE):
        return (
            f"head_dim {d} in {parts} parts: each part's two RoPE halves must "
            f"be multiples of {COL_MULTIPLE} rows"
        )
    return None


def plan(
    spec: ModelSpec,
    batch: int,
    device: Device,
    *,
    with_lm_head: bool = False,
    max_attn_chunks: int = MAX_ATTN_CHUNKS,
    qkv_parts: int | None = None,
    expert_tiles: int | None = None,
    combine_parts: int | None = None,
    query_rows: int = 1,
) -> Program:
    """The program of one decode step of ``batch`` requests on ``device``
    (``qkv_parts``: QKV's parts per head in place of ``qkv_parts_to_fill``'s,
    for the GPU check's whole-heads case and the tests; ``expert_tiles``: a
    routed slot's EXPERT_UP tiles in place of ``expert_split``'s choice,
    which plans with it; ``combine_parts``: COMBINE's dim parts per q head
    in place of ``combine_parts_to_fill``'s, for reports of older programs
    and the tests; ``query_rows``: a verify step's rows a request, which a
    latent attention's MLA_ATTN passes over together, at most the batch)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if query_rows < 1:
        raise ValueError(f"query_rows must be >= 1, got {query_rows}")
    query_rows = min(query_rows, batch) if spec.mla is not None else 1
    if qkv_parts is None:
        qkv_parts = qkv_parts_to_fill(spec, device.num_sms)
    if combine_parts is None:
        combine_parts = combine_parts_to_fill(spec, device.num_sms)
    if spec.mla is not None and combine_parts != 1:
        raise ValueError("a latent attention merges whole heads (combine_parts 1)")
    if combine_parts < 1 or spec.head_dim % combine_parts:
        raise ValueError(f"{combine_parts} COMBINE parts do not divide head_dim "
                         f"{spec.head_dim}")  # fmt: skip
    if (error := _qkv_parts_error(spec, qkv_parts)) is not None:
        raise ValueError(error)
    n_sm = device.num_sms
    counters: list[str] = []

    def counter(name: str) -> int:
        counters.append(name)
        return len(counters) - 1

    # Phases in global order: (op, layer, tiles, wait (counter, count),
    # signal, signal every rank's counter).
    phases: list[tuple[Op, int, list[tuple[int, int]], tuple[int, int], int, bool]]
    phases = []
    none = (NO_COUNTER, 0)
    tp = spec.tp_size

    def gemv_tiles(n: int) -> list[tuple[int, int]]:
        return split(n, n_sm, COL_MULTIPLE)

    def phase(op, layer, tiles, wait, name, ranks=False) -> tuple[int, int]:
        c = counter(name)
        phases.append((op, layer, tiles, wait, c, ranks))
        return (c, len(tiles) * (tp if ranks else 1))

    def summed(point: Point, layer: int, op, tiles, wait, name) -> tuple[int, int]:
        """A phase that ends a residual block: with tensor parallel, its
        tiles write this rank's partial sums and signal every rank, and
        ALL_REDUCE tiles over the hidden columns add the ranks' partials
        (isa.py)."""
        if tp == 1:
            return phase(op, layer, tiles, wait, name)
        partial = phase(op, layer, tiles, wait, name, ranks=True)
        cols = [(int(point), pack_cols(lo, hi)) for lo, hi in gemv_tiles(h)]
        return phase(Op.ALL_REDUCE, layer, cols, partial, f"{name}.reduce")

    def grouped_query_attention(layer: int, prev) -> tuple[int, int]:
        # Each kv group's QKV tiles signal the group's counter, and its ATTN
        # chunks wait for that counter alone (they read nothing else QKV
        # writes): a group's attention starts once its own heads are in.
        ready = [
            phase(Op.QKV, layer, tiles, prev, f"L{layer}.qkv.g{g}")
            for g, tiles in enumerate(qkv_group_tiles(spec, qkv_parts, n_sm))
        ]
        combine_c = counter(f"L{layer}.combine")
        group = spec.num_q_heads // spec.num_kv_heads
        # Every group's ATTN before any COMBINE in the global order, so in
        # every queue: a queue runs in order, and a merge dealt between two
        # groups' chunks held the later chunk until the earlier group's
        # attention had ended (Llama-3.2-1B at batch 16: predicted 1081 ->
        # 770 us; docs/predictions.md).
        merges = []
        for g in range(spec.num_kv_heads):
            attn_tiles = [(g, c) for c in range(chunks)]
            a = phase(Op.ATTN, layer, attn_tiles, ready[g], f"L{layer}.attn.g{g}")
            # A tile per unit (a q head's dim part): a group's merge is
            # spread over SMs, not read by one (Qwen3-30B-A3B at batch 1:
            # 66 KB of partials, 2 us at an SM's share of bandwidth).
            units = [(g, pack_cols(u, u + 1)) for u in range(group * combine_parts)]
            merges.append((Op.COMBINE, layer, units, a, combine_c))
        phases.extend(m + (False,) for m in merges)
        return (combine_c, spec.num_q_heads * combine_parts)

    def latent_attention(layer: int, prev) -> tuple[int, int]:
        assert mla is not None
        lora = mla.q_lora_rank or 0
        width = lora + mla.latent_width
        if not lora:
            q_a, kv_a = None, phase(Op.MLA_QKV_A, layer, gemv_tiles(width), prev,
                                    f"L{layer}.kv_a")  # fmt: skip
        elif lora % COL_MULTIPLE == 0:
            # q_a's tiles and kv_a's signal counters of their own: MLA_Q
            # reads q_a's columns only, MLA_APPEND kv_a's.
            q_tiles, kv_tiles = split_within(
                [(0, lora), (lora, width)], n_sm, COL_MULTIPLE
            )
            q_a = phase(Op.MLA_QKV_A, layer, q_tiles, prev, f"L{layer}.q_a")
            kv_a = phase(Op.MLA_QKV_A, layer, kv_tiles, prev, f"L{layer}.kv_a")
        else:  # a tile would straddle q_a and kv_a: one counter for both
            q_a = kv_a = phase(Op.MLA_QKV_A, layer, gemv_tiles(width), prev,
                               f"L{layer}.qkv_a")  # fmt: skip
        # MLA_Q (one tile per head) and MLA_APPEND signal one counter: the
        # attention reads both (an instruction signals one counter, and the
        # one latent row serves every head group, so a group cannot wait for
        # its own heads' MLA_Q alone). Without a q LoRA, MLA_Q reads h[l]
        # only and runs beside the down projection.
        q_c = counter(f"L{layer}.q_latent")
        q_tiles = split(mla.num_heads, n_sm, 1)
        q_wait = q_a if lora else prev
        phases.append((Op.MLA_Q, layer, q_tiles, q_wait, q_c, False))
        phases.append((Op.MLA_APPEND, layer, [(0, 0)], kv_a, q_c, False))
        ready = (q_c, len(q_tiles) + 1)
        per_group = mla.num_heads // groups
        combine_c = counter(f"L{layer}.combine")
        for g in range(groups):
            a = phase(Op.MLA_ATTN, layer, [(g, c) for c in range(chunks)], ready,
                      f"L{layer}.attn.g{g}")  # fmt: skip
            tiles = [
                (head, p)
                for head in range(g * per_group, (g + 1) * per_group)
                for p in range(v_parts)
            ]
            phases.append((Op.MLA_COMBINE, layer, tiles, a, combine_c, False))
        return (combine_c, mla.num_heads * v_parts)

    h = spec.hidden_size
    moe, slots = spec.moe, expert_slots(spec, batch)
    per_slot = 1
    if moe is not None:
        per_slot = expert_tiles or expert_split(spec, batch, device, qkv_parts)
    small = split(h, max(1, h // 512), COL_MULTIPLE)  # embed / final norm
    chunks = max(1, min(max_attn_chunks, n_sm // spec.num_kv_heads))
    mla = spec.mla
    groups, v_parts = 1, 1
    if mla is not None:
        groups, chunks, v_parts = mla_split(spec, n_sm)
        chunks = min(chunks, max_attn_chunks)
    # (A pipeline stage past the first starts from the previous stage's
    # hidden states, in h[0] before the launch.)
    prev = none
    if spec.pp_first:
        prev = summed(Point.EMBED, 0, Op.EMBED, small, none, "embed")
    for layer in range(spec.num_layers):
        if mla is not None:
            combined = latent_attention(layer, prev)
        else:
            combined = grouped_query_attention(layer, prev)
        o = summed(Point.ATTN, layer, Op.O_PROJ, gemv_tiles(h), combined,
                   f"L{layer}.o_proj")  # fmt: skip
        if moe is not None and moe.sparse_layers[layer]:
            # The mixture: router logits over all SMs, then each slot's
            # expert split in column tiles (expert_split) that spread a
            # step's filled slots over the SMs.
            r = phase(Op.ROUTE, layer, gemv_tiles(moe.num_experts), o,
                      f"L{layer}.route")  # fmt: skip
            # The shared expert needs no routing: its tiles wait for O_PROJ
            # only and sit before TOPK in the queues, so SMs run them while
            # the router's logits are computed. They, TOPK and the routed
            # tiles signal one counter: EXPERT_DOWN waits for all of them.
            up_c = counter(f"L{layer}.expert_up")
            shared = [
                (slots, pack_cols(lo, hi))
                for lo, hi in split(moe.shared_intermediate, n_sm, COL_MULTIPLE)
            ] if moe.shared_intermediate else []  # fmt: skip
            phases.append((Op.EXPERT_UP, layer, shared, o, up_c, False))
            # TOPK writes the routing table EXPERT_DOWN reads. A routed tile
            # computes the routing itself from the logits (TOPK's code, so
            # the same slots) and waits for ROUTE: no routed row waits for
            # TOPK's signal (isa.py).
            phases.append((Op.TOPK, layer, [(0, 0)], r, up_c, False))
            routed = [
                (slot, pack_cols(lo, hi))
                for slot in range(slots)
                for lo, hi in split(moe.expert_intermediate, per_slot, COL_MULTIPLE)
            ]
            phases.append((Op.EXPERT_UP, layer, routed, r, up_c, False))
            u = (up_c, len(shared) + 1 + len(routed))
            prev = summed(Point.MLP, layer, Op.EXPERT_DOWN, gemv_tiles(h), u,
                          f"L{layer}.expert_down")  # fmt: skip
            continue
        gu = phase(
            Op.GATE_UP,
            layer,
            gemv_tiles(spec.intermediate_size),
            o,
            f"L{layer}.gate_up",
        )
        prev = summed(Point.MLP, layer, Op.DOWN, gemv_tiles(h), gu, f"L{layer}.down")
    if spec.pp_last:
        prev = phase(Op.FINAL_NORM, spec.num_layers, small, prev, "final_norm")
    if with_lm_head and spec.pp_last:
        lm_rows = gemv_tiles(spec.lm_head_rows)  # (a rank's, gathered by vLLM)
        phase(Op.LM_HEAD, spec.num_layers, lm_rows, prev, "lm_head")

    program = Program(
        spec, batch, device, chunks, with_lm_head, (), tuple(counters), (),
        qkv_parts, groups, v_parts, combine_parts, query_rows=query_rows,
    )  # fmt: skip
    queues: list[list[Instruction]] = [[] for _ in range(n_sm)]
    load = [0] * n_sm
    order = []
    # A sparse layer's routed bytes per SM (a step's, expected): its
    # EXPERT_DOWN tiles go to SMs that run a routed EXPERT_UP of the layer,
    # the least loaded first, so that its consumers hint their rows with
    # the routing they computed (kernel/ops/expert_up.py).
    routed: dict[int, int] = {}
    routed_layer = -1
    # The least loaded SM (by what a step reads: an expected-empty slot's
    # tiles weigh nothing) takes a tile, but none more than its share of the
    # phase's tiles, nor of the opcode's in the layer (a layer's QKV groups,
    # its attention chunks): by bytes alone a phase's tiles pile onto the
    # SMs the last phases left light, and a phase ends with its most loaded
    # SM (docs/design.md, "Placement"). An attention chunk's hinted cache
    # rows (Cost.early_bytes) are not load: they stream through the phases
    # before it (counted, the model's Llama-3.2-1B batch-4 step is 682 us,
    # not 616).
    op_tiles = Counter((op, layer) for op, layer, tiles, *_ in phases
                       for _ in tiles)  # fmt: skip
    taken: dict[tuple[Op, int], list[int]] = {}
    for op, layer, tiles, (wait_c, wait_n), signal, ranks in phases:
        if layer != routed_layer:
            routed, routed_layer = {}, layer
        in_phase = [0] * n_sm
        in_op = taken.setdefault((op, layer), [0] * n_sm)
        phase_cap = math.ceil(len(tiles) / n_sm)
        op_cap = math.ceil(op_tiles[op, layer] / n_sm)
        for a0, a1 in tiles:
            instr = Instruction(op, layer, a0, a1, wait_c, wait_n, signal, ranks)
            cost = program.step_cost(instr)
            if op == Op.EXPERT_DOWN:
                sm = min(routed, key=lambda i: (routed[i], load[i]))
            else:
                # (The phase's share always has room; the opcode's may not.)
                open_ = [i for i in range(n_sm) if in_phase[i] < phase_cap]
                # A routed tile: even routed rows first (they all stream
                # after the routing, and EXPERT_DOWN waits for the last).
                first = routed if program.routed_weight_bytes(instr) else {}
                sm = min(
                    [i for i in open_ if in_op[i] < op_cap] or open_,
                    key=lambda i: (first.get(i, 0), load[i]),
                )
            in_phase[sm] += 1
            in_op[sm] += 1
            if program.routed_weight_bytes(instr):
                routed[sm] = routed.get(sm, 0) + cost.weight_bytes
            load[sm] += cost.weight_bytes + cost.other_bytes
            order.append((sm, len(queues[sm])))
            queues[sm].append(instr)
    return Program(
        spec,
        batch,
        device,
        chunks,
        with_lm_head,
        tuple(tuple(q) for q in queues),
        tuple(counters),
        tuple(order),
        qkv_parts,
        groups,
        v_parts,
        combine_parts,
        query_rows=query_rows,
    )
