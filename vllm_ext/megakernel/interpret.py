# SPDX-License-Identifier: Apache-2.0
"""The reference executor of a program: runs the instructions one by one in
PyTorch, in any order the counters allow.

A seeded random scheduler picks, at each step, one SM whose next
instruction's wait is met (``counters[c] >= epoch * count``), runs it, and
signals. Counters persist across steps and are never reset (epochs), as on
the GPU. Every instruction computes its output from its inputs alone, and
reductions run in a fixed order, so the result is bit for bit the same
under every interleaving; the tests check that.

A tensor-parallel program runs either as a rank set in one process
(``RankSetInterpreter``: every rank's queues under one scheduler, the
counters signalled on every rank shared as on the GPU, ALL_REDUCE summing
the ranks' partial buffers), or as one rank of vLLM's tensor-parallel group
(``GroupReducer``: ALL_REDUCE's sum is vLLM's all-reduce of the point's
partials, called once per point and step; the other ranks' signals are
taken as given, the collective itself waiting for them).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from vllm_ext.megakernel.isa import (
    NO_COUNTER,
    Instruction,
    Op,
    Point,
    unpack_cols,
)
from vllm_ext.megakernel.ops import (
    all_reduce,
    attn,
    combine,
    down,
    embed,
    expert_down,
    expert_up,
    final_norm,
    gate_up,
    lm_head,
    mla_append,
    mla_attn,
    mla_combine,
    mla_q,
    mla_qkv_a,
    o_proj,
    qkv,
    route,
    topk,
)
from vllm_ext.megakernel.planner import Program
from vllm_ext.paged_kv import write_kv
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights

_MLA_OPS = (Op.MLA_QKV_A, Op.MLA_Q, Op.MLA_APPEND, Op.MLA_ATTN, Op.MLA_COMBINE)


class DeadlockError(RuntimeError):
    pass


# ALL_REDUCE's sum of a point's columns over the ranks: (interpreter,
# point, layer, lo, hi) -> [B, hi - lo] in the model dtype.
Reducer = Callable[["ProgramInterpreter", Point, int, int, int], torch.Tensor]


class ProgramInterpreter:
    def __init__(
        self,
        program: Program,
        weights: DecodeWeights,
        seed: int = 0,
        reducer: Reducer | None = None,
    ):
        self.program = program
        self.weights = weights
        self.rng = random.Random(seed)
        self.counters = [0] * program.num_counters
        self.epoch = 0
        self.reducer = reducer

    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        """One decode step of exactly ``program.batch`` rows; returns the
        final-normed hidden states (a pipeline stage before the last: its
        residual stream) and, with an LM head, sets ``self.logits``. A
        tensor-parallel program needs a ``reducer``."""
        return _run([self], [inputs], self.rng)[0]

    def _wait_met(self, instr: Instruction) -> bool:
        c = instr.wait_counter
        return c == NO_COUNTER or self.counters[c] >= self.epoch * instr.wait_count

    # ------------------------------------------------------------ buffers

    def _begin(self, inputs: DecodeInputs) -> None:
        s, b = self.program.spec, self.program.batch
        dtype, dev = s.dtype, self.weights.cos_sin.device
        layers, chunks = s.num_layers, self.program.attn_chunks
        group = s.num_q_heads // s.num_kv_heads

        def nan(*shape, dt=dtype):
            # Poisoned: an instruction that reads what nobody wrote yields NaN.
            return torch.full(shape, float("nan"), dtype=dt, device=dev)

        self.inputs = inputs
        self.seq_lens = inputs.seq_lens
        self.cos, self.sin = self.weights.cos_sin[inputs.positions.long()].chunk(2, -1)
        self.buf = {
            "h": [nan(b, s.hidden_size) for _ in range(layers + 1)],
            "hmid": [nan(b, s.hidden_size) for _ in range(layers)],
            "q": [nan(b, s.num_q_heads, s.head_dim) for _ in range(layers)],
            "attn": [nan(b, s.num_q_heads, s.head_dim) for _ in range(layers)],
            "act": [nan(b, s.intermediate_size) for _ in range(layers)],
            "part_o": [
                nan(chunks, s.num_kv_heads, b, group, s.head_dim, dt=torch.float32)
                for _ in range(layers)
            ],
            "part_lse": [
                nan(chunks, s.num_kv_heads, b, group, dt=torch.float32)
                for _ in range(layers)
            ],
            "out": nan(b, s.hidden_size),
        }
        if not s.pp_first:  # the previous pipeline stage's output
            if inputs.hidden_in is None:
                raise ValueError("a later pipeline stage needs the hidden states in")
            self.buf["h"][0] = inputs.hidden_in.to(dtype)
        if s.tp_size > 1:
            # This rank's partial sums of each point (isa.py), per layer.
            self.buf["partial"] = {
                Point.EMBED: [nan(b, s.hidden_size)],
                Point.ATTN: [nan(b, s.hidden_size) for _ in range(layers)],
                Point.MLP: [nan(b, s.hidden_size) for _ in range(layers)],
            }
        mla = s.mla
        if mla is not None:
            # Latent attention (isa.py): the down projection's output, each
            # head's latent query and rotated q_pe, partials per (chunk,
            # head group), and o_proj's input of heads * v_head_dim.
            groups = self.program.mla_head_groups
            per_group, rank = mla.num_heads // groups, mla.kv_lora_rank
            width = (mla.q_lora_rank or 0) + mla.latent_width
            self.buf.update(
                qkv_a=[nan(b, width) for _ in range(layers)],
                q_lat=[nan(b, mla.num_heads, rank) for _ in range(layers)],
                q_pe=[nan(b, mla.num_heads, mla.qk_rope_head_dim)
                      for _ in range(layers)],
                part_o=[nan(chunks, groups, b, per_group, rank, dt=torch.float32)
                        for _ in range(layers)],
                part_lse=[nan(chunks, groups, b, per_group, dt=torch.float32)
                          for _ in range(layers)],
                attn=[nan(b, mla.num_heads, mla.v_head_dim) for _ in range(layers)],
            )  # fmt: skip
            del self.buf["q"]
        moe = s.moe
        if moe is not None:
            # Sparse layers: router logits and each slot's activations
            # (rows of requests not routed to a slot stay NaN, unread).
            # The shared expert's activations (if any) follow the slots'.
            slots = self.program.num_slots + (self.program.shared_slot is not None)
            width = max(moe.expert_intermediate, moe.shared_intermediate)
            sparse = moe.sparse_layers
            self.buf["router"] = [
                nan(b, moe.num_experts) if sparse[i] else None for i in range(layers)
            ]
            self.buf["xact"] = [
                nan(slots, b, width) if sparse[i] else None for i in range(layers)
            ]
        self.routing: list[topk.Routing | None] = [None] * layers
        # The routed tiles' own routing of each layer: computed by the first
        # that runs, as the kernel computes it once per SM and layer.
        self.tile_routing: list[topk.Routing | None] = [None] * layers
        if self.program.with_lm_head:
            self.logits = nan(b, s.lm_head_rows, dt=torch.float32)

    # ------------------------------------------------------------ dispatch

    def _execute(self, i: Instruction) -> None:
        s, w, buf = self.program.spec, self.weights, self.buf
        layer, a, b = i.layer, i.arg0, i.arg1
        dtype = s.dtype
        tp = s.tp_size > 1
        if i.op == Op.EMBED:
            out = buf["partial"][Point.EMBED][0] if tp else buf["h"][0]
            out[:, a:b] = embed.reference(
                w.embed, self.inputs.input_ids, a, b, dtype, w.vocab_range
            )
        elif i.op == Op.ALL_REDUCE:
            self._all_reduce(Point(a), layer, *unpack_cols(b))
        elif i.op == Op.QKV:
            # Units are head parts (isa.py): compute the heads they are part
            # of, keep the parts' dims (each output element alone, so this
            # is bit for bit what a whole-head program computes).
            parts = self.program.qkv_parts
            lo, hi = a // parts, (b - 1) // parts + 1
            cos, sin, late = self.cos, self.sin, self.program.qk_in_attn
            heads = qkv.reference(buf["h"][layer], w.layers[layer], s, lo, hi, cos,
                                  sin, late)  # fmt: skip
            for u in range(a, b):
                head = u // parts
                for dims in head_part_dims(s.head_dim, parts, u % parts):
                    self._store_qkv(layer, head, dims, heads[:, head - lo, dims])
        elif i.op == Op.ATTN:
            group = s.num_q_heads // s.num_kv_heads
            q = buf["q"][layer][:, a * group : (a + 1) * group]
            if self.program.qk_in_attn:  # QKV left QK-norm and RoPE here
                lw, chunks = w.layers[layer], self.program.attn_chunks
                attn.finish_new_k(
                    self.inputs.kv_caches[layer], a, self.inputs.slot_mapping,
                    self.seq_lens, b, chunks, lw.k_norm, s, self.cos, self.sin,
                )  # fmt: skip
                q = qkv.finish(q, lw.q_norm, s, self.cos, self.sin)
            o, lse = attn.reference(
                q,
                self.inputs.kv_caches[layer],
                a,
                self.inputs.block_table,
                self.seq_lens,
                b,
                self.program.attn_chunks,
                w.attn_scale,
            )
            buf["part_o"][layer][b, a] = o
            buf["part_lse"][layer][b, a] = lse
        elif i.op == Op.COMBINE:
            group = s.num_q_heads // s.num_kv_heads
            parts = self.program.combine_parts
            dims = s.head_dim // parts
            o, lse = buf["part_o"][layer][:, a], buf["part_lse"][layer][:, a]
            out = buf["attn"][layer][:, a * group : (a + 1) * group]
            lo, hi = unpack_cols(b)
            # Units: dim parts of q heads (isa.py); the merge is elementwise
            # over dims, so a part's bits are the whole head's.
            for u in range(lo, hi):
                j, cols = u // parts, slice(u % parts * dims, (u % parts + 1) * dims)
                out[:, j, cols] = combine.reference(
                    o[:, :, j, cols], lse[:, :, j], dtype
                )
        elif i.op == Op.O_PROJ:
            attn_flat = buf["attn"][layer].reshape(self.program.batch, -1)
            if tp:  # the rank's partial sum; ALL_REDUCE adds the residual
                out, residual = buf["partial"][Point.ATTN][layer], None
            else:
                out, residual = buf["hmid"][layer], buf["h"][layer]
            out[:, a:b] = o_proj.reference(
                attn_flat, residual, w.layers[layer].o_proj, a, b, dtype, s.quant
            )
        elif i.op == Op.GATE_UP:
            buf["act"][layer][:, a:b] = gate_up.reference(
                buf["hmid"][layer], w.layers[layer], s, a, b
            )
        elif i.op == Op.DOWN:
            out, residual = self._mlp_out(layer)
            out[:, a:b] = down.reference(
                buf["act"][layer], residual, w.layers[layer].down, a, b, dtype,
                s.quant,
            )  # fmt: skip
        elif i.op == Op.FINAL_NORM:
            buf["out"][:, a:b] = final_norm.reference(
                buf["h"][layer], w.final_norm, s.rms_norm_eps, a, b, dtype
            )
        elif i.op == Op.LM_HEAD:
            self.logits[:, a:b] = lm_head.reference(buf["out"], w.lm_head, a, b)
        elif i.op == Op.ROUTE:
            buf["router"][layer][:, a:b] = route.reference(
                buf["hmid"][layer], w.layers[layer], s, a, b
            )
        elif i.op == Op.TOPK:
            self.routing[layer] = topk.reference(
                buf["router"][layer], w.layers[layer], s, self.seq_lens,
                self.program.num_slots,
            )  # fmt: skip
        elif i.op == Op.EXPERT_UP:
            lo, hi = unpack_cols(b)
            if a == self.program.shared_slot:  # every row, no routing read
                rows = torch.arange(self.program.batch)
                buf["xact"][layer][a, :, lo:hi] = expert_up.reference(
                    buf["hmid"][layer], w.layers[layer], s, None, rows, lo, hi
                )
                return
            # A routed tile's own routing, from the logits (isa.py).
            routing = self.tile_routing[layer]
            if routing is None:
                routing = self.tile_routing[layer] = topk.reference(
                    buf["router"][layer], w.layers[layer], s, self.seq_lens,
                    self.program.num_slots,
                )  # fmt: skip
            expert = int(routing.experts[a])
            if expert < 0:  # a slot this step leaves empty
                return
            rows = (routing.slots == a).any(dim=-1).nonzero().flatten()
            buf["xact"][layer][a, rows, lo:hi] = expert_up.reference(
                buf["hmid"][layer], w.layers[layer], s, expert, rows, lo, hi
            )
        elif i.op == Op.EXPERT_DOWN:
            routing = self.routing[layer]
            assert routing is not None, "EXPERT_DOWN ran before its TOPK"
            out, residual = self._mlp_out(layer)
            out[:, a:b] = expert_down.reference(
                buf["xact"][layer],
                residual,
                w.layers[layer],
                routing,
                a,
                b,
                dtype,
                s.quant,
            )
        elif i.op in _MLA_OPS:
            self._execute_mla(i)
        else:
            raise ValueError(f"cannot execute {i}")

    def _mlp_out(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where a layer's MLP writes, and the residual it adds: ``h[l + 1]``
        and ``hmid[l]``, or with tensor parallel the rank's partial sum and
        none (ALL_REDUCE adds it)."""
        if self.program.spec.tp_size > 1:
            return self.buf["partial"][Point.MLP][layer], None
        return self.buf["h"][layer + 1], self.buf["hmid"][layer]

    def _all_reduce(self, point: Point, layer: int, lo: int, hi: int) -> None:
        buf, dtype = self.buf, self.program.spec.dtype
        if self.reducer is None:
            raise ValueError("a tensor-parallel program runs with a reducer")
        total = self.reducer(self, point, layer, lo, hi)
        if point == Point.EMBED:
            out, residual = buf["h"][0], None
        elif point == Point.ATTN:
            out, residual = buf["hmid"][layer], buf["h"][layer][:, lo:hi]
        else:
            out, residual = buf["h"][layer + 1], buf["hmid"][layer][:, lo:hi]
        out[:, lo:hi] = all_reduce.reference([total], residual, dtype)

    def partial(self, point: Point, layer: int) -> torch.Tensor:
        """This rank's partial sums of ``point`` in ``layer`` (all columns)."""
        return self.buf["partial"][point][layer if point != Point.EMBED else 0]

    def _execute_mla(self, i: Instruction) -> None:
        """The latent attention's instructions (isa.py)."""
        p, w, buf = self.program, self.weights, self.buf
        s, layer, a, b = p.spec, i.layer, i.arg0, i.arg1
        mla, lw = s.mla, w.layers[i.layer]
        assert mla is not None and lw.mla is not None
        per_group = mla.num_heads // p.mla_head_groups
        if i.op == Op.MLA_QKV_A:
            buf["qkv_a"][layer][:, a:b] = mla_qkv_a.reference(
                buf["h"][layer], lw, s, a, b
            )
        elif i.op == Op.MLA_Q:
            q_lat, q_pe = mla_q.reference(
                buf["qkv_a"][layer], buf["h"][layer], lw, s, a, b, self.cos, self.sin
            )
            buf["q_lat"][layer][:, a:b] = q_lat
            buf["q_pe"][layer][:, a:b] = q_pe
        elif i.op == Op.MLA_APPEND:
            lora = mla.q_lora_rank or 0
            mla_append.reference(
                buf["qkv_a"][layer][:, lora:], lw, s, self.cos, self.sin,
                self.inputs.kv_caches[layer], self.inputs.slot_mapping,
            )  # fmt: skip
        elif i.op == Op.MLA_ATTN:
            heads = slice(a * per_group, (a + 1) * per_group)
            o, lse = mla_attn.reference(
                buf["q_lat"][layer][:, heads], buf["q_pe"][layer][:, heads],
                self.inputs.kv_caches[layer], self.inputs.block_table,
                self.seq_lens, b, p.attn_chunks, w.attn_scale,
                self.inputs.query_map if p.query_rows > 1 else None,
            )  # fmt: skip
            buf["part_o"][layer][b, a] = o
            buf["part_lse"][layer][b, a] = lse
        elif i.op == Op.MLA_COMBINE:
            g, j = divmod(a, per_group)
            cols = mla.v_head_dim // p.mla_v_parts
            w_uv = lw.mla.w_uv(mla.num_heads, mla.qk_nope_head_dim)[a]
            buf["attn"][layer][:, a, b * cols : (b + 1) * cols] = mla_combine.reference(
                buf["part_o"][layer][:, g, :, j], buf["part_lse"][layer][:, g, :, j],
                w_uv, b * cols, (b + 1) * cols, s.dtype,
            )  # fmt: skip

    def _store_qkv(self, layer: int, head: int, dims: slice, y: torch.Tensor) -> None:
        """Dims ``dims`` of fused head ``head``: to q, or appended to the
        paged cache as the new K or V at each request's slot."""
        s = self.program.spec
        nq, nkv = s.num_q_heads, s.num_kv_heads
        if head < nq:
            self.buf["q"][layer][:, head, dims] = y
            return
        is_k = head < nq + nkv
        g = head - nq if is_k else head - nq - nkv
        y = y[:, None]  # [B, 1 head, len(dims)]
        write_kv(
            self.inputs.kv_caches[layer],
            y if is_k else None,
            None if is_k else y,
            self.inputs.slot_mapping,
            heads=slice(g, g + 1),
            dims=dims,
        )


def _run(
    interps: list[ProgramInterpreter],
    inputs: list[DecodeInputs],
    rng: random.Random,
) -> list[torch.Tensor]:
    """One step of ``interps`` (one program: a rank each, or one rank of a
    group whose other ranks run elsewhere) under one random scheduler. A
    signal to every rank adds ``tp_size / len(interps)`` to each here: the
    ranks not here are taken to signal alike (their collective waits for
    them)."""
    p = interps[0].program
    for it, x in zip(interps, inputs, strict=True):
        if x.batch_size != p.batch:
            raise ValueError(f"program is for batch {p.batch}, got {x.batch_size}")
        it.epoch += 1
        it._begin(x)
    share = p.spec.tp_size // len(interps)
    queues = p.queues
    pos = [[0] * len(queues) for _ in interps]
    ready: list[tuple[int, int]] = []
    blocked: dict[tuple[int, int], list[int]] = {}

    def arrive(k: int, sm: int) -> None:
        """Queue rank k's ``sm`` as ready, or park it on its wait."""
        if pos[k][sm] == len(queues[sm]):
            return
        instr = queues[sm][pos[k][sm]]
        if interps[k]._wait_met(instr):
            ready.append((k, sm))
        else:
            blocked.setdefault((k, instr.wait_counter), []).append(sm)

    def signal(k: int, c: int, by: int) -> None:
        interps[k].counters[c] += by
        for waiter in blocked.pop((k, c), []):
            arrive(k, waiter)

    for k in range(len(interps)):
        for sm in range(len(queues)):
            arrive(k, sm)
    while ready:
        j = rng.randrange(len(ready))
        ready[j], ready[-1] = ready[-1], ready[j]
        k, sm = ready.pop()
        instr = queues[sm][pos[k][sm]]
        interps[k]._execute(instr)
        pos[k][sm] += 1
        c = instr.signal_counter
        if c != NO_COUNTER:
            if instr.signal_ranks:
                for r in range(len(interps)):
                    signal(r, c, share)
            else:
                signal(k, c, 1)
        arrive(k, sm)
    stuck = [(k, sm) for k in range(len(interps)) for sm in range(len(queues))
             if pos[k][sm] < len(queues[sm])]  # fmt: skip
    if stuck:
        shown = [f"rank {k} SM {sm}: {queues[sm][pos[k][sm]]}" for k, sm in stuck[:4]]
        raise DeadlockError("no SM can proceed: " + "; ".join(shown))
    # A pipeline stage before the last hands on its residual stream.
    return [it.buf["out"] if p.spec.pp_last else it.buf["h"][-1] for it in interps]


class RankSetInterpreter:
    """Every rank of a tensor-parallel program in one process (each with its
    shard of the weights, ``parallel.shard_weights``, and its own KV cache),
    interleaved under one scheduler; ALL_REDUCE sums the ranks' partials."""

    def __init__(self, program: Program, weights: list[DecodeWeights], seed: int = 0):
        if len(weights) != program.spec.tp_size:
            raise ValueError(
                f"{program.spec.tp_size} ranks, {len(weights)} weight shards"
            )
        self.rng = random.Random(seed)
        self.ranks = [ProgramInterpreter(program, w, reducer=self._sum)
                      for w in weights]  # fmt: skip

    def _sum(self, interp, point: Point, layer: int, lo: int, hi: int):
        parts = [r.partial(point, layer)[:, lo:hi] for r in self.ranks]
        return all_reduce.reference(parts, None, interp.program.spec.dtype)

    def step(self, inputs: list[DecodeInputs]) -> list[torch.Tensor]:
        return _run(self.ranks, inputs, self.rng)


class GroupReducer:
    """ALL_REDUCE in one rank of vLLM's tensor-parallel group: the first
    tile of a point in a step all-reduces the whole point through vLLM's
    ``tensor_model_parallel_all_reduce`` (its communicator; every rank
    reaches the points in the same order: each needs the one before), the
    point's other tiles read the sum."""

    def __init__(self) -> None:
        self._epoch = 0
        self._sums: dict[tuple[Point, int], torch.Tensor] = {}

    def __call__(self, interp, point: Point, layer: int, lo: int, hi: int):
        from vllm.distributed import tensor_model_parallel_all_reduce

        if interp.epoch != self._epoch:  # a new step
            self._epoch, self._sums = interp.epoch, {}
        total = self._sums.get((point, layer))
        if total is None:
            partial = interp.partial(point, layer).clone()
            total = self._sums[point, layer] = tensor_model_parallel_all_reduce(partial)
        return total[:, lo:hi]


def head_part_dims(head_dim: int, parts: int, part: int) -> tuple[slice, slice]:
    """The two dim ranges of part ``part`` of a head (isa.py): a slice of
    each RoPE half."""
    n, half = head_dim // (2 * parts), head_dim // 2
    lo = part * n
    return slice(lo, lo + n), slice(half + lo, half + lo + n)


class ProgramExecutor:
    """What ``VLLM_MEGAKERNEL_INTERPRET=1`` runs: each decode step planned for
    its batch bucket (once per bucket, verified), padded to the bucket, and
    interpreted under a seeded random interleaving."""

    def __init__(
        self,
        spec,
        weights: DecodeWeights,
        device,
        buckets: tuple[int, ...],
        seed: int = 0,
        query_rows: int = 1,
    ) -> None:
        """``query_rows``: a verify step's rows a request (planner.plan)."""
        self.spec, self.weights, self.device = spec, weights, device
        self.buckets, self.seed = buckets, seed
        self.query_rows = query_rows
        self.interpreters: dict[int, ProgramInterpreter] = {}

    def interpreter(self, batch: int) -> ProgramInterpreter:
        bucket = next((b for b in self.buckets if b >= batch), None)
        if bucket is None:
            raise ValueError(f"batch {batch} is above the largest bucket")
        if bucket not in self.interpreters:
            from vllm_ext.megakernel.planner import plan
            from vllm_ext.megakernel.verify import verify

            program = plan(self.spec, bucket, self.device, query_rows=self.query_rows)
            verify(program)
            # A tensor-parallel rank: vLLM's group adds the partial sums.
            reducer = GroupReducer() if self.spec.tp_size > 1 else None
            self.interpreters[bucket] = ProgramInterpreter(
                program, self.weights, seed=self.seed + bucket, reducer=reducer
            )
        return self.interpreters[bucket]

    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        batch = inputs.batch_size
        interp = self.interpreter(batch)
        self._last = interp, batch
        return interp.step(pad_inputs(inputs, interp.program.batch))[:batch]

    def residual_stream(self, layer: int) -> torch.Tensor:
        interp, batch = self._last
        return interp.buf["h"][layer][:batch].clone()


def pad_inputs(inputs: DecodeInputs, batch: int) -> DecodeInputs:
    """Pad to ``batch`` rows the way a captured CUDA graph's padding looks:
    token 0 at position 0, no cache slot (-1), sequence length 0."""
    extra = batch - inputs.batch_size
    if extra == 0:
        return inputs

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        tail = torch.full((extra, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
        return torch.cat([t, tail])

    return DecodeInputs(
        input_ids=pad(inputs.input_ids, 0),
        positions=pad(inputs.positions, 0),
        block_table=pad(inputs.block_table, 0),
        seq_lens=pad(inputs.seq_lens, 0),
        slot_mapping=pad(inputs.slot_mapping, -1),
        kv_caches=inputs.kv_caches,
        hidden_in=None if inputs.hidden_in is None else pad(inputs.hidden_in, 0),
        query_map=(
            None if inputs.query_map is None else pad_query_map(inputs.query_map, batch)
        ),
    )


def pad_query_map(query_map: torch.Tensor, batch: int) -> torch.Tensor:
    """A query map padded to ``batch`` rows: each padded row a request of
    its own (first row itself, one row)."""
    n = query_map.shape[0]
    tail = torch.arange(n, batch, dtype=query_map.dtype, device=query_map.device)
    return torch.cat([query_map, torch.stack([tail, torch.ones_like(tail)], 1)])
