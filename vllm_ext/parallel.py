# SPDX-License-Identifier: Apache-2.0
"""Tensor and pipeline parallel: what one rank of vLLM's groups holds.

vLLM's parallel layers split a model over ``tp`` ranks (``linear.py``,
``vocab_parallel_embedding.py``, ``fused_moe``): QKV and gate/up by output
rows (heads, intermediate columns), o_proj and down by input columns, so
each rank's o_proj / down output is a partial sum that an all-reduce adds
up; kv heads split while there are at least as many as ranks, else each
rank holds one, replicated (``num_kv_head_replicas``); the embedding by
vocabulary rows (a rank looks up its own rows, zeros elsewhere, and an
all-reduce adds them); a mixture's experts each by intermediate columns,
the router replicated; a latent attention by heads, its down projections
(q_a, kv_a) replicated.

A rank's program is planned from the rank's spec (``shard_spec``) and reads
the rank's weights as vLLM loaded them; its ALL_REDUCE instructions
(isa.py) add the ranks' partial sums. ``shard_weights`` cuts one-rank
weights the same way, for checks that run every rank in one process.
A quantized layer's scales go with its codes, as vLLM's parameters load
them: split by output rows, a row's scales (FP8 per channel, INT4 groups)
or a 128-row block's (FP8 blocks) go with the rows; split by input columns
(o_proj, down), FP8 per-channel scales are every row's, INT4 groups and
FP8 blocks are cut with their columns.

A pipeline stage (``stage_spec``) holds the layers vLLM gives it
(``get_pp_indices``): its program runs them, embedding only on the first
stage and applying the final norm only on the last.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_ext.model_spec import VOCAB_PADDING, ModelSpec, UnsupportedModelError


def stage_spec(spec: ModelSpec, pp_rank: int, pp_size: int) -> ModelSpec:
    """The layers pipeline stage ``pp_rank`` of ``pp_size`` holds, as
    vLLM splits them; raises ``UnsupportedModelError`` for a stage
    without a layer."""
    if pp_size == 1:
        return spec
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(spec.num_layers, pp_rank, pp_size)
    if end <= start:
        raise UnsupportedModelError(
            f"{spec.architecture}: {spec.num_layers} layers over {pp_size} "
            f"pipeline stages leave stage {pp_rank} none"
        )
    moe = spec.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers[start:end])
    return dataclasses.replace(
        spec,
        num_layers=end - start,
        moe=moe,
        pp_first=pp_rank == 0,
        pp_last=pp_rank == pp_size - 1,
    )


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """vLLM's ``QKVParallelLinear``: split, or one replicated head a rank."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1


def shard_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The model as one rank of ``tp`` holds it (``spec.tp_size`` = tp);
    raises ``UnsupportedModelError`` naming what does not divide."""
    if tp == 1:
        return spec

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise UnsupportedModelError(
                f"{spec.architecture}: {what} do not split over {tp} "
                "tensor-parallel ranks"
            )

    need(spec.num_q_heads % tp == 0, f"{spec.num_q_heads} attention heads")
    nkv = spec.num_kv_heads
    if spec.mla is None:
        need(nkv % tp == 0 or tp % nkv == 0, f"{nkv} kv heads")
        nkv = kv_heads_per_rank(nkv, tp)
    dense = spec.intermediate_size
    need(dense % tp == 0, f"an intermediate size of {dense}")
    moe, mla = spec.moe, spec.mla
    if moe is not None:
        expert, shared = moe.expert_intermediate, moe.shared_intermediate
        need(expert % tp == 0, f"experts of intermediate size {expert}")
        need(shared % tp == 0, f"shared experts of intermediate size {shared}")
        moe = dataclasses.replace(
            moe,
            expert_intermediate=moe.expert_intermediate // tp,
            shared_intermediate=moe.shared_intermediate // tp,
        )
    if mla is not None:
        mla = dataclasses.replace(mla, num_heads=mla.num_heads // tp)
    return dataclasses.replace(
        spec,
        num_q_heads=spec.num_q_heads // tp,
        num_kv_heads=nkv,
        intermediate_size=dense // tp,
        moe=moe,
        mla=mla,
        tp_size=tp,
    )


def rank_caches(
    caches, spec: ModelSpec, tp: int, rank: int
) -> tuple[torch.Tensor, ...]:
    """A copy of the rank's own KV cache out of one-rank caches (``[blocks,
    heads, ...]`` views, paged_kv.py): its kv heads of every layer (vLLM's
    split, or its one replicated head), or the whole latent cache."""
    if spec.mla is not None:
        return tuple(c.clone() for c in caches)
    nkv, n = spec.num_kv_heads, kv_heads_per_rank(spec.num_kv_heads, tp)
    first = rank * n if nkv >= tp else rank // (tp // nkv)
    return tuple(c[:, first : first + n].clone() for c in caches)


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """The token ids whose embedding rows ``rank`` holds."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = padded // tp
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def shard_weights(weights, spec: ModelSpec, tp: int, rank: int):
    """One-rank ``DecodeWeights`` of ``spec`` cut as vLLM's parallel layers
    load them on ``rank`` of ``tp`` (module docstring), for the rank sets
    the interpreter runs in one process."""
    from vllm_ext.quant import BLOCK, Fp8Weight
    from vllm_ext.weights import DecodeWeights, LayerWeights, MoeWeights, QuantLinears

    assert isinstance(weights, DecodeWeights)

    def rows(t: torch.Tensor | None, n: int, dim: int = 0) -> torch.Tensor | None:
        # Rank's share of n equal parts of t along dim.
        if t is None:
            return None
        size = t.shape[dim] // n
        return t.narrow(dim, rank * size, size)

    def halves(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        # Gate rows then up rows: the rank's share of each.
        if t is None:
            return None
        gate, up = t.chunk(2, dim)
        return torch.cat([rows(gate, tp, dim), rows(up, tp, dim)], dim)

    nq, nkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    kv_rank = rank if nkv >= tp else rank // (tp // nkv)
    kv_n = max(nkv // tp, 1)

    def qkv_rows(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        q, k, v = t.split([nq * d, nkv * d, nkv * d])
        k, v = (x.narrow(0, kv_rank * kv_n * d, kv_n * d) for x in (k, v))
        return torch.cat([rows(q, tp), k, v])

    def quant_rows(w, cut):
        # A column-parallel layer's codes, and the scales of its rows: a
        # scale a row, or (FP8 blocks) one a block of 128 rows, whose rows
        # a rank must hold whole (vLLM refuses the checkpoint otherwise).
        if w is None:
            return None
        if not (isinstance(w, Fp8Weight) and w.scale.dim() == 2):
            return type(w)(cut(w.codes), cut(w.scale))
        held = cut(torch.arange(w.codes.shape[0]))
        starts = held[::BLOCK]
        whole = (starts[:, None] + torch.arange(BLOCK)).flatten()
        if (starts % BLOCK).any() or not torch.equal(held, whole):
            raise ValueError(
                f"FP8 blocks: rank {rank} of {tp} holds rows of a 128-row block "
                "without the rest"
            )
        return Fp8Weight(cut(w.codes), w.scale[starts // BLOCK].contiguous())

    def quant_cols(w):
        # A row-parallel layer's K columns; INT4 groups and FP8 blocks cut
        # with them (per-channel FP8: every row's scale).
        codes = rows(w.codes, tp, 1)
        if w.scale.dim() == 1:
            return type(w)(codes, w.scale)
        if w.scale.shape[1] % tp:
            raise ValueError(
                f"{w.scale.shape[1]} scale groups along K do not split over {tp} ranks"
            )
        return type(w)(codes, rows(w.scale, tp, 1))

    layers = []
    for w in weights.layers:
        moe, mla, q = w.moe, w.mla, w.quant
        if (moe is not None and moe.quant is not None) or (
            mla is not None and mla.quant is not None
        ):
            raise ValueError(
                "quantized mixtures and latent attention: their codes are not "
                "cut by rank"
            )
        if q is not None:
            q = QuantLinears(
                qkv=quant_rows(q.qkv, qkv_rows),
                o_proj=quant_cols(q.o_proj),
                gate_up=quant_rows(q.gate_up, lambda t: halves(t, 0)),
                down=None if q.down is None else quant_cols(q.down),
            )
        if moe is not None:
            moe = MoeWeights(
                router=moe.router,
                correction_bias=moe.correction_bias,
                w13=halves(moe.w13, 1),
                w2=rows(moe.w2, tp, 2),
                shared_gate_up=halves(moe.shared_gate_up, 0),
                shared_down=rows(moe.shared_down, tp, 1),
            )
        if mla is not None:
            mla = dataclasses.replace(
                mla, q_b=rows(mla.q_b, tp), kv_b=rows(mla.kv_b, tp)
            )
        layers.append(
            LayerWeights(
                input_norm=w.input_norm,
                qkv=qkv_rows(w.qkv),
                qkv_bias=qkv_rows(w.qkv_bias),
                q_norm=w.q_norm,
                k_norm=w.k_norm,
                o_proj=rows(w.o_proj, tp, 1),
                post_norm=w.post_norm,
                gate_up=halves(w.gate_up, 0),
                down=rows(w.down, tp, 1),
                moe=moe,
                mla=mla,
                quant=q,
            )
        )
    start, end = vocab_range(spec.vocab_size, tp, rank)
    # The LM head's rows padded to the rank's share (zero rows past the
    # vocabulary, as vLLM pads them).
    rows = shard_spec(spec, tp).lm_head_rows
    lm_head = weights.lm_head.new_zeros(rows, spec.hidden_size)
    lm_head[: end - start] = weights.lm_head[start:end]
    return dataclasses.replace(
        weights,
        embed=weights.embed[start:end],
        layers=tuple(layers),
        lm_head=lm_head,
        vocab_range=(start, end),
    )
