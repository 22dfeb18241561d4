# SPDX-License-Identifier: Apache-2.0
"""The megakernel's instruction set and its encoding.

A program is one queue of instructions per SM. Each instruction is
``WORDS`` int32 words::

    [opcode, layer, arg0, arg1, wait_counter, wait_count, signal_counter,
     signal_ranks]

(a row of 32 bytes: the controller fetches it in one vector load). It first
waits until ``counters[wait_counter] >= epoch *
wait_count`` (``wait_counter == NO_COUNTER``: no wait), runs, makes its
stores visible, then adds 1 to ``counters[signal_counter]``. ``epoch`` is
the 1-based step number, kept on the device (the cell after the last
counter, bumped before each launch): counters only grow, so the same
program replays step after step (inside a CUDA graph too) with no host
reset.

What ``arg0``/``arg1`` mean per opcode (all instructions cover every request
of the batch):

========== ======================================== ========================
opcode     computes                                 args
========== ======================================== ========================
EMBED      h[0][:, lo:hi] = embed[ids, lo:hi]       hidden cols [lo, hi)
QKV        RMSNorm(h[l]) @ Wqkv (+bias) for heads   fused head parts
           [lo, hi); q/k: QK-norm, RoPE; k/v:       [lo, hi): q heads, then
           appended to the paged KV cache           k, then v (see below)
ATTN       partial attention of kv head g's q       g, chunk c (of
           heads over chunk c of each sequence      ``attn_chunks``)
           -> (o, lse) in fp32
COMBINE    merge kv head g's chunks by lse for      g, packed units
           its units [lo, hi) -> those dims of      [lo, hi) of g
           attn[l] (unit u: dim part u % C of q     (``pack_cols``)
           head g * group + u // C)
O_PROJ     hmid[l][:, lo:hi] = h[l][:, lo:hi]       hidden cols [lo, hi)
           + attn[l] @ Wo[lo:hi].T
GATE_UP    act[l][:, lo:hi] = SiLU(x @ Wg.T) *      intermediate cols
           (x @ Wu.T), x = RMSNorm(hmid[l])         [lo, hi)
DOWN       h[l+1][:, lo:hi] = hmid[l][:, lo:hi]     hidden cols [lo, hi)
           + act[l] @ Wd[lo:hi].T
FINAL_NORM out = RMSNorm(h[L])                      hidden cols [lo, hi)
LM_HEAD    logits[:, lo:hi] = out @ Wlm[lo:hi].T    vocab cols [lo, hi)
           (fp32)
ROUTE      router[l][:, lo:hi] = x @ Wr[lo:hi].T,   experts [lo, hi)
           x = RMSNorm(hmid[l])
TOPK       route[l]: each request's experts and     (none)
           weights (moe.py); the batch's distinct
           experts, ascending, in slots 0..u-1
EXPERT_UP  xact[l][s, r, lo:hi] = SiLU(x @ Wg.T) *  slot s, intermediate
           (x @ Wu.T) of slot s's expert, for the   cols [lo, hi) packed
           requests r routed to it (both from       (``pack_cols``)
           router[l], as TOPK finds them)
EXPERT_DOWN h[l+1][:, lo:hi] = hmid[l][:, lo:hi] +  hidden cols [lo, hi)
           sum over each request's slots, in slot
           order, of weight * xact @ Wd[lo:hi].T,
           then the shared expert's (weight 1)
MLA_QKV_A  qkv_a[l][:, lo:hi] = x @ [Wq_a | Wkv_a]  fused output cols
           [lo:hi].T, x = RMSNorm(h[l]) (Wkv_a      [lo, hi)
           alone without a q LoRA)
MLA_Q      heads [lo, hi)'s latent query: q_a_norm  heads [lo, hi)
           (row recomputed per tile), @ Wq_b rows
           of the heads (q_proj on RMSNorm(h[l])
           without a q LoRA); q_pe: GPT-J RoPE;
           q_nope @ W_UK -> q_lat[l], q_pe[l]
MLA_APPEND kv_a_norm(kv_c), RoPE(k_pe) -> the       (none)
           paged latent cache row at each
           request's slot
MLA_ATTN   partial absorbed attention of head       g, chunk c (of
           group g over chunk c of each sequence    ``attn_chunks``)
           -> (o_latent, lse) in fp32
MLA_COMBINE merge head's chunks by lse, round,      head, v part p (of
           @ W_UV rows of part p -> attn[l]         ``mla_v_parts``)
ALL_REDUCE cols [lo, hi) of point p: the sum over   p (``Point``), packed
           ranks, in rank order, of their partial   cols [lo, hi)
           sums, rounded, plus the residual, to
           p's destination (tensor parallel only)
========== ======================================== ========================

Tensor parallel (``spec.tp_size`` ranks, parallel.py): every rank runs the
same program on its shard of the weights. EMBED, O_PROJ and DOWN /
EXPERT_DOWN then write the rank's partial sum of their point (``Point``)
without the residual, and signal a counter *of every rank*
(``signal_ranks``: on the GPU, an atomic add to each rank's copy of the
counter at system scope), so a wait on it counts ``tp_size`` signals per
tile. ALL_REDUCE tiles wait for that count: every rank's partial of the
point is in; each reads its columns of them all. The sum runs in rank order
on every rank, so every rank gets the same bits. A rank's partials of a
point are written once per step and read by the point's ALL_REDUCE on
every rank; the next step's writer of the same buffer on any rank runs
after that step's LM head gathers every rank's output, which needs every
ALL_REDUCE of this step to have run.

The last four run a sparse layer's mixture of experts (model_spec.MoeSpec)
in place of GATE_UP and DOWN. Which expert a slot holds is known only once
the router's logits are: the program plans ``min(batch * top_k,
num_experts)`` slots per layer, and EXPERT_UP of a slot that the step
leaves empty does nothing. Weight addresses are thus data: they depend on
``router[l]``, which the counters order like any activation. A routed
EXPERT_UP tile computes the routing itself from ``router[l]`` (TOPK's
rule, so the same slots) and waits for ROUTE only: its rows do not wait
for TOPK's signal. TOPK writes ``route[l]`` beside them and signals their
counter, which EXPERT_DOWN (reading ``route[l]``) waits for. A shared
expert (DeepSeek-V3, Kimi-K2) is slot ``num_slots``: its EXPERT_UP tiles
run on every request and read no routing, so they wait for O_PROJ alone
and fill the SMs while ROUTE runs (planner.py).

The five MLA_* opcodes run a multi-head latent attention layer
(model_spec.MlaSpec; reference.mla_attention) in place of QKV, ATTN and
COMBINE; O_PROJ then reads ``attn[l]`` of ``heads * v_head_dim`` columns.
There is one kv head (the latent row), so MLA_ATTN splits the heads into
``mla_head_groups`` groups of consecutive heads, each over the same
``attn_chunks`` chunks as ATTN: every SM has a tile at batch 1. MLA_Q and
MLA_APPEND signal one counter, which MLA_ATTN waits for (it reads both).

QKV's units are parts of fused heads: with ``P = qkv_parts`` (planner.py:
as many as fill the SMs; 1 makes units heads), unit ``u`` is part ``u % P`` of fused
head ``u // P``, and part ``p`` of a head is its output dims
``[p*d/2P, (p+1)*d/2P)`` and the same shifted by ``d/2``: the pairs NeoX
RoPE rotates together, so a part needs no other part's output. QK-norm
needs the whole head, so with QK-norm and P > 1 QKV writes q and the new K
as projected, and ATTN applies QK-norm and RoPE: to its q heads as it loads
them, and, in the chunk that holds a request's newest token (the only one
that reads it), to the new K in the cache row, in place, before any of the
chunk's tokens is read (``Program.qk_in_attn``).

COMBINE's units are dim parts of q heads: with ``C = combine_parts``
(planner.py: as many as fill the SMs; 1 makes units heads), unit ``u`` of
kv head g is dims ``[p*d/C, (p+1)*d/C)``, ``p = u % C``, of its q head
``u // C``. The merge is elementwise over dims, so a part needs nothing of
another.

Every activation buffer is written once per step (per-layer buffers), so
the only hazards are read-after-write, which the counters order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

WORDS = 8
NO_COUNTER = -1


class Op(IntEnum):
    NOP = 0
    EMBED = 1
    QKV = 2
    ATTN = 3
    COMBINE = 4
    O_PROJ = 5
    GATE_UP = 6
    DOWN = 7
    FINAL_NORM = 8
    LM_HEAD = 9
    ROUTE = 10
    TOPK = 11
    EXPERT_UP = 12
    EXPERT_DOWN = 13
    MLA_QKV_A = 14
    MLA_Q = 15
    MLA_APPEND = 16
    MLA_ATTN = 17
    MLA_COMBINE = 18
    ALL_REDUCE = 19


class Point(IntEnum):
    """Where a tensor-parallel layer's partial sums are added up, and where
    ALL_REDUCE writes the sum (plus the residual): ``h[0]``; ``hmid[l] =
    h[l] + sum``; ``h[l + 1] = hmid[l] + sum``."""

    EMBED = 0
    ATTN = 1  # o_proj's
    MLP = 2  # down's or the mixture's (EXPERT_DOWN)


def pack_cols(lo: int, hi: int) -> int:
    """EXPERT_UP's column range (COMBINE's q heads) in one argument
    word."""
    if not 0 <= lo < hi < 1 << 15:
        raise ValueError(f"columns [{lo}, {hi}) do not pack")
    return lo << 16 | hi


def unpack_cols(word: int) -> tuple[int, int]:
    return word >> 16, word & 0xFFFF


@dataclass(frozen=True)
class Instruction:
    op: Op
    layer: int
    arg0: int
    arg1: int
    wait_counter: int = NO_COUNTER
    wait_count: int = 0
    signal_counter: int = NO_COUNTER
    # The signal goes to the counter of every tensor-parallel rank.
    signal_ranks: bool = False

    def words(self) -> tuple[int, ...]:
        return (
            int(self.op),
            self.layer,
            self.arg0,
            self.arg1,
            self.wait_counter,
            self.wait_count,
            self.signal_counter,
            int(self.signal_ranks),
        )

    @classmethod
    def from_words(cls, words) -> Instruction:
        op, layer, a0, a1, wc, wn, sc, sr = (int(w) for w in words)
        return cls(Op(op), layer, a0, a1, wc, wn, sc, bool(sr))

    def __str__(self) -> str:
        wait = (
            ""
            if self.wait_counter == NO_COUNTER
            else (f" wait c{self.wait_counter}>={self.wait_count}")
        )
        ranks = " (every rank)" if self.signal_ranks else ""
        return (
            f"{self.op.name}(l={self.layer}, {self.arg0}, {self.arg1}){wait}"
            f" signal c{self.signal_counter}{ranks}"
        )


def encode(queues: list[list[Instruction]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Queues -> (``[num_sms, max_len, WORDS]`` int32 padded with NOP,
    ``[num_sms]`` int32 queue lengths): what the kernel reads."""
    max_len = max((len(q) for q in queues), default=0)
    table = torch.zeros(len(queues), max(max_len, 1), WORDS, dtype=torch.int32)
    lengths = torch.tensor([len(q) for q in queues], dtype=torch.int32)
    for sm, queue in enumerate(queues):
        if queue:
            table[sm, : len(queue)] = torch.tensor([i.words() for i in queue])
    return table, lengths


def decode(table: torch.Tensor, lengths: torch.Tensor) -> list[list[Instruction]]:
    return [
        [Instruction.from_words(table[sm, i].tolist()) for i in range(int(n))]
        for sm, n in enumerate(lengths.tolist())
    ]
