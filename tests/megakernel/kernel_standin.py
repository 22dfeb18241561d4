# SPDX-License-Identifier: Apache-2.0
"""A CPU stand-in for the compiled kernel, behind the same launch call.

It knows nothing of the executor's Python objects (of the weights it is
made with it keeps only the softmax scale, which the launch must pass):
like the kernel, it reads every address from the table, resolves each back
to a tensor through a registry of what the test allocated
(``register_executor``: by address, as the kernel has nothing else), runs
the program interpreter on what those addresses hold, and writes the
results where the table says. So a wrong table entry, a wrong padding or a
missing step bump in the launcher shows up as a wrong result or a failed
check.

Read through the table (the interpreter runs on these tensors only):

- every weight: a layer's INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM,
  O_PROJ, POST_NORM, GATE_UP, DOWN; a sparse layer's ROUTER, W13, W2,
  CORRECTION_BIAS, SHARED_GATE_UP, SHARED_DOWN; a latent attention layer's
  MLA_Q_A, MLA_KV_A, MLA_Q_A_NORM, MLA_Q_B, MLA_KV_A_NORM, and kv_b_proj
  rebuilt from the MLA_W_UK and MLA_W_UV views, each from its own column;
  the model's EMBED, FINAL_NORM, LM_HEAD and COS_SIN (the launcher's fp32
  ``[positions, rotary dim]``, cos half then sin half: the interpreter's
  rotary table);
- the step's inputs (INPUT_IDS, POSITIONS, BLOCK_TABLE, SEQ_LENS,
  SLOT_MAPPING; QUERY_MAP in a latent attention kernel of ``query_rows`` >
  1, 0 elsewhere), each layer's KV_CACHE (the interpreter appends to it in
  place), the step number (the last counter) and the launch's scalars.

A weight is read where the compiled kernel reads one for this model (its
QKV bias, QK norm, sparse layers, latent attention, q LoRA, correction
bias, shared expert, LM head): the entry must then be a registered tensor
of the dtype and shape the kernel reads (EMBED and LM_HEAD: at least the
vocabulary's rows; COS_SIN: any rows). Where the kernel reads none (no
bias, no QK norm, no q LoRA, ...; an MLA layer's QKV, a sparse layer's
GATE_UP) the entry must be 0, which means absent. Anything else fails
loudly. (Not read, so not checked: a dense layer's mixture columns.)

Written where the table says, as the kernel writes them: H0 (EMBED's
output), each layer's HMID, Q (or an MLA layer's QKV_A, Q_LAT, Q_PE), ATTN,
ACT, PART_O, PART_LSE and H_OUT, a sparse layer's ROUTER_LOGITS, ROUTE (the
routing in the kernel's word layout) and XACT, then OUT and LOGITS. The
residual stream crosses columns, so after the writes each layer's H_IN and
the model's H_LAST must hold what EMBED or the layer before wrote there (a
wrong H0, H_IN, H_OUT or H_LAST fails).

Aborts as the kernel does (kernel/sync.py): the table's ABORT entry is the
record. A queue with a wait no instruction of the step can meet (more
signals awaited than the queue sends: how the GPU check plants a hang)
expires: the first such wait in queue order is recorded (SM, instruction,
counter, the count awaited and the count the counter reaches), and the step
leaves its results garbage (NaN in OUT and LOGITS). Once the record is set,
every later step does the same, as the kernel's waits stop waiting."""

from __future__ import annotations

import dataclasses

import torch

from vllm_ext.megakernel.interpret import ProgramInterpreter, RankSetInterpreter, _run
from vllm_ext.megakernel.isa import NO_COUNTER, Point
from vllm_ext.megakernel.kernel.launcher import (  # noqa: F401 (tests)
    decode_route,
    w_uv_base,
)
from vllm_ext.megakernel.kernel.shape import (
    ABORT_WORDS,
    AbortWhat,
    AbortWord,
    GlobalSlot,
    KernelShape,
    LayerSlot,
    partial_row,
    partial_rows,
    route_layout,
)
from vllm_ext.quant import FP8_BLOCK, INT4_W4A16, Fp8Weight, PackedInt4
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import (
    DecodeWeights,
    LayerWeights,
    MlaWeights,
    MoeWeights,
    QuantExperts,
    QuantLinears,
    QuantMla,
)

BF16, FP32 = torch.bfloat16, torch.float32


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.stride()


class KernelStandIn:
    # False: a kernel whose hung wait goes unrecorded (it runs the program's
    # own queue whatever the launch passes): what the abort check must fail.
    aborts = True

    def __init__(self, program, weights) -> None:
        # (``weights`` only for the interpreter's device until the first
        # launch, and the softmax scale the launch must pass.)
        self.interp = ProgramInterpreter(program, weights, seed=5)
        self.program, self.attn_scale = program, weights.attn_scale
        # A tensor-parallel rank's vocabulary shard: which rank it is.
        self.vocab_range = weights.vocab_range
        self.tensors: dict[int, torch.Tensor] = {}
        # Addresses of two tensors of different layouts: the table cannot
        # say which it means.
        self.ambiguous: set[int] = set()
        self.launches = 0

    def register(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            prior = self.tensors.setdefault(t.data_ptr(), t)
            if _layout(prior) != _layout(t):
                self.ambiguous.add(t.data_ptr())

    def _at(self, address: int) -> torch.Tensor:
        assert address in self.tensors, f"table address {address:#x} is unknown"
        assert address not in self.ambiguous, (
            f"table address {address:#x} holds two registered tensors of "
            "different layouts"
        )
        return self.tensors[address]

    def _weight(self, address, what, shape, present=True, dtype=BF16,
                at_least=False):  # fmt: skip
        """The tensor at ``address`` where the kernel reads one, of ``dtype``
        and ``shape`` (``at_least``: that many rows or more), else None and
        the entry 0."""
        if not present:
            assert address == 0, f"{what}: the kernel reads none, the table has one"
            return None
        assert address, f"{what}: the kernel reads one, the table's entry is 0"
        t = self._at(address)
        got = tuple(t.shape)
        fits = got == shape or (
            at_least and len(got) == len(shape) and got[0] >= shape[0]
            and got[1:] == shape[1:]
        )  # fmt: skip
        assert t.dtype == dtype and fits, (
            f"{what}: the kernel reads {dtype} {shape}, the table points at "
            f"{t.dtype} {got}"
        )
        return t

    def __call__(self, queue, lengths, counters, ptrs, bt_stride, kv_stride,
                 scale, max_spins, stream) -> None:  # fmt: skip
        p, interp = self.program, self.interp
        layers = p.spec.num_layers
        table = ptrs.tolist()
        glob = table[layers]
        assert counters.shape[0] == p.num_counters + 1
        assert int(counters[-1]) == interp.epoch + 1, "step number not bumped"
        assert scale == self.attn_scale
        record = self._weight(glob[GlobalSlot.ABORT], "ABORT", (ABORT_WORDS,),
                              dtype=torch.int32)  # fmt: skip
        unmet = _unmet_wait(queue, lengths) if self.aborts else None
        if unmet is not None and not record[AbortWord.FLAG]:
            sm, pc, counter, count, sent, what = unmet
            epoch = interp.epoch + 1
            record.copy_(torch.tensor([1, sm, pc, counter, epoch * count, epoch * sent,
                                       what, p.batch],
                                      dtype=torch.int32))  # fmt: skip
        if record[AbortWord.FLAG]:
            # Every CTA ran through its queue without waiting: garbage.
            interp.epoch += 1
            self._at(glob[GlobalSlot.OUT]).fill_(float("nan"))
            if p.with_lm_head:
                self._at(glob[GlobalSlot.LOGITS]).fill_(float("nan"))
            self.launches += 1
            return
        assert torch.equal(queue, p.encode()[0]) or not self.aborts
        inputs = self._inputs(table, bt_stride, kv_stride)
        interp.weights = self._weights(table)
        interp.step(inputs)
        self._write(table)
        self.launches += 1

    def _inputs(self, table, bt_stride, kv_stride) -> DecodeInputs:
        """The step's inputs and KV caches, from the table (a later
        pipeline stage's residual stream in: what H0 holds)."""
        layers, glob = self.program.spec.num_layers, table[-1]
        hidden_in = None
        if not self.program.spec.pp_first:
            hidden_in = self._at(glob[GlobalSlot.H0]).clone()
        block_table = self._at(glob[GlobalSlot.BLOCK_TABLE])
        assert block_table.stride(0) == bt_stride
        kv = tuple(self._at(table[i][LayerSlot.KV_CACHE]) for i in range(layers))
        assert {c.stride(0) for c in kv} == {kv_stride}
        # MLA_ATTN's shared pass over a request's rows reads the query map.
        p = self.program
        query_map = self._weight(glob[GlobalSlot.QUERY_MAP], "QUERY_MAP",
                                 (p.batch, 2), p.query_rows > 1,
                                 dtype=torch.int32)  # fmt: skip
        return DecodeInputs(
            input_ids=self._at(glob[GlobalSlot.INPUT_IDS]).long(),
            positions=self._at(glob[GlobalSlot.POSITIONS]).long(),
            block_table=block_table,
            seq_lens=self._at(glob[GlobalSlot.SEQ_LENS]),
            slot_mapping=self._at(glob[GlobalSlot.SLOT_MAPPING]).long(),
            kv_caches=kv,
            hidden_in=hidden_in,
            query_map=query_map,
        )

    # ------------------------------------------------------------ weights

    def _weights(self, table) -> DecodeWeights:
        """Every weight the kernel reads, from the table."""
        s, p = self.program.spec, self.program
        layers = s.num_layers
        glob = table[layers]
        h, vocab = s.hidden_size, s.vocab_size
        rotary = s.mla.qk_rope_head_dim if s.mla else s.head_dim

        def at(slot, shape, present=True, dtype=BF16, at_least=False):
            return self._weight(glob[slot], slot.name, shape, present, dtype,
                                at_least)  # fmt: skip

        # A tensor-parallel rank's shards: its vocabulary rows from
        # VOCAB_START (a value), its LM head rows padded (parallel.py).
        embed_rows = vocab
        if s.tp_size > 1:
            start, end = self.vocab_range
            assert glob[GlobalSlot.VOCAB_START] == start, (
                f"VOCAB_START {glob[GlobalSlot.VOCAB_START]}: the rank's "
                f"vocabulary starts at {start}"
            )
            embed_rows = end - start
        # (vLLM may pad the vocabulary; cos/sin has a row per position.)
        # A pipeline stage: the embedding only on the first, the final norm
        # (and LM head) only on the last.
        return DecodeWeights(
            embed=at(GlobalSlot.EMBED, (embed_rows, h), s.pp_first, at_least=True),
            layers=tuple(self._layer(i, table[i]) for i in range(layers)),
            final_norm=at(GlobalSlot.FINAL_NORM, (h,), s.pp_last),
            lm_head=at(
                GlobalSlot.LM_HEAD,
                (s.lm_head_rows, h),
                p.with_lm_head and s.pp_last,
                at_least=True,
            ),  # fmt: skip
            cos_sin=at(GlobalSlot.COS_SIN, (1, rotary), dtype=FP32, at_least=True),
            attn_scale=self.attn_scale,
            vocab_range=self.vocab_range,
        )

    def _layer(self, i: int, row) -> LayerWeights:
        s = self.program.spec
        h, inter = s.hidden_size, s.intermediate_size
        gqa, sparse = s.mla is None, s.moe is not None and s.moe.sparse_layers[i]
        qkv_rows = s.q_size + 2 * s.kv_size
        o_cols = s.mla.num_heads * s.mla.v_head_dim if s.mla else s.q_size

        def at(slot, shape, present=True):
            return self._weight(row[slot], f"layer {i} {slot.name}", shape, present)

        if s.quant is not None and not s.quant.experts_only:
            return self._quant_layer(i, row)
        moe = None
        if sparse and s.quant is not None:  # the routed experts alone are codes
            moe = self._moe(i, row, dense=False, bf16_shared=True)
            moe = self._quant_moe(i, row, moe, shared=False)
        elif sparse:
            moe = self._moe(i, row)
        return LayerWeights(
            input_norm=at(LayerSlot.INPUT_NORM, (h,)),
            qkv=at(LayerSlot.QKV, (qkv_rows, h), gqa),
            qkv_bias=at(LayerSlot.QKV_BIAS, (qkv_rows,), gqa and s.qkv_bias),
            q_norm=at(LayerSlot.Q_NORM, (s.head_dim,), gqa and s.qk_norm),
            k_norm=at(LayerSlot.K_NORM, (s.head_dim,), gqa and s.qk_norm),
            o_proj=at(LayerSlot.O_PROJ, (h, o_cols)),
            post_norm=at(LayerSlot.POST_NORM, (h,)),
            gate_up=at(LayerSlot.GATE_UP, (2 * inter, h), not sparse),
            down=at(LayerSlot.DOWN, (h, inter), not sparse),
            moe=moe,
            mla=None if gqa else self._mla(i, row),
        )

    def _codes(self, i: int, row):
        """A reader of row ``row``'s quantized weights: ``read(codes,
        scales, n, k, lead=())`` gives the codes at column ``codes`` and
        their scales at ``scales`` (FP8's e4m3 ``[N, K]`` and fp32 a row or
        128 x 128 block; INT4's packed bytes ``[N, K / 2]`` and bf16 a row
        and group)."""
        s = self.program.spec
        blocks = s.quant.name == FP8_BLOCK  # a scale a 128 x 128 block

        def at(slot, shape, dtype):
            return self._weight(row[slot], f"layer {i} {slot.name}", shape, True,
                                dtype)  # fmt: skip

        def read(codes, scales, n, k, lead=()):
            if s.quant.name == INT4_W4A16:
                group = s.quant.group_size
                return PackedInt4(at(codes, (*lead, n, k // 2), torch.uint8),
                                  at(scales, (*lead, n, k // group), BF16))  # fmt: skip
            grid = (-(-n // 128), -(-k // 128)) if blocks else (n,)
            return Fp8Weight(at(codes, (*lead, n, k), torch.float8_e4m3fn),
                             at(scales, (*lead, *grid), FP32))  # fmt: skip

        return read

    def _quant_moe(self, i: int, row, moe: MoeWeights, shared: bool) -> MoeWeights:
        """``moe`` with its experts' codes and scales where the bf16 experts
        would be (W13, W2) and in W13_SCALE / W2_SCALE; ``shared``: the
        shared expert's too (SHARED_*_SCALE)."""
        s, fp8 = self.program.spec, self._codes(i, row)
        h = s.hidden_size
        e, ei = s.moe.num_experts, s.moe.expert_intermediate
        si = s.moe.shared_intermediate
        codes = {}
        if si and shared:
            codes = dict(
                shared_gate_up=fp8(LayerSlot.SHARED_GATE_UP,
                                   LayerSlot.SHARED_GATE_UP_SCALE, 2 * si, h),
                shared_down=fp8(LayerSlot.SHARED_DOWN,
                                LayerSlot.SHARED_DOWN_SCALE, h, si),
            )  # fmt: skip
        experts = QuantExperts(
            w13=fp8(LayerSlot.W13, LayerSlot.W13_SCALE, 2 * ei, h, (e,)),
            w2=fp8(LayerSlot.W2, LayerSlot.W2_SCALE, h, ei, (e,)),
            **codes,
        )
        return dataclasses.replace(
            moe, w13=experts.w13.dequantize(), w2=experts.w2.dequantize(),
            quant=experts, **{n: w.dequantize() for n, w in codes.items()},
        )  # fmt: skip

    def _quant_layer(self, i: int, row) -> LayerWeights:
        """A quantized layer (``KernelShape.quantized``): each linear
        weight's codes where the bf16 weight would be (FP8's e4m3 ``[N,
        K]``, INT4's packed bytes ``[N, K / 2]``), its scales in the last
        four columns (FP8's fp32 a row or 128 x 128 block, INT4's bf16 a
        row and group); the interpreter reads their dequantization."""
        s = self.program.spec
        h, inter, d = s.hidden_size, s.intermediate_size, s.head_dim
        qkv_rows = s.q_size + 2 * s.kv_size

        def at(slot, shape, present=True):
            return self._weight(row[slot], f"layer {i} {slot.name}", shape, present)

        sparse = s.moe is not None and s.moe.sparse_layers[i]
        gqa = s.mla is None
        o_cols = s.q_size if gqa else s.mla.num_heads * s.mla.v_head_dim
        fp8 = self._codes(i, row)

        f = QuantLinears(
            qkv=fp8(LayerSlot.QKV, LayerSlot.QKV_SCALE, qkv_rows, h) if gqa else None,
            o_proj=fp8(LayerSlot.O_PROJ, LayerSlot.O_PROJ_SCALE, h, o_cols),
            gate_up=None if sparse else fp8(LayerSlot.GATE_UP,
                                            LayerSlot.GATE_UP_SCALE, 2 * inter, h),
            down=None if sparse else fp8(LayerSlot.DOWN, LayerSlot.DOWN_SCALE, h,
                                         inter),
        )  # fmt: skip
        moe = None
        if sparse:
            moe = self._quant_moe(i, row, self._moe(i, row, dense=False), shared=True)
        mla = None
        if not gqa:
            # q_a, kv_a and q_b's codes and scales (FP8); kv_b in bf16.
            m, lora = s.mla, s.mla.q_lora_rank
            q = QuantMla(
                q_a=fp8(LayerSlot.MLA_Q_A, LayerSlot.MLA_Q_A_SCALE, lora, h)
                if lora else None,
                kv_a=fp8(LayerSlot.MLA_KV_A, LayerSlot.MLA_KV_A_SCALE,
                         m.latent_width, h),
                q_b=fp8(LayerSlot.MLA_Q_B, LayerSlot.MLA_Q_B_SCALE,
                        m.num_heads * m.qk_head_dim, lora or h),
            )  # fmt: skip
            mla = dataclasses.replace(
                self._mla(i, row, dense=False), quant=q,
                q_a=None if q.q_a is None else q.q_a.dequantize(),
                kv_a=q.kv_a.dequantize(), q_b=q.q_b.dequantize(),
            )  # fmt: skip
        return LayerWeights(
            input_norm=at(LayerSlot.INPUT_NORM, (h,)),
            qkv=f.qkv.dequantize() if gqa else None,
            qkv_bias=at(LayerSlot.QKV_BIAS, (qkv_rows,), gqa and s.qkv_bias),
            q_norm=at(LayerSlot.Q_NORM, (d,), gqa and s.qk_norm),
            k_norm=at(LayerSlot.K_NORM, (d,), gqa and s.qk_norm),
            o_proj=f.o_proj.dequantize(),
            post_norm=at(LayerSlot.POST_NORM, (h,)),
            gate_up=None if sparse else f.gate_up.dequantize(),
            down=None if sparse else f.down.dequantize(),
            moe=moe,
            mla=mla,
            quant=f,
        )

    def _moe(
        self, i: int, row, dense: bool = True, bf16_shared: bool | None = None
    ) -> MoeWeights:
        """A sparse layer's mixture (the correction bias: the launcher's
        fp32 copy, as TOPK reads it); ``dense=False``: its experts are
        codes (``_quant_moe`` reads them), and unless ``bf16_shared`` its
        shared expert too."""
        shared_bf16 = dense if bf16_shared is None else bf16_shared
        moe, h = self.program.spec.moe, self.program.spec.hidden_size
        e, inter = moe.num_experts, moe.expert_intermediate
        shared = moe.shared_intermediate

        def at(slot, shape, present=True, dtype=BF16):
            return self._weight(row[slot], f"layer {i} {slot.name}", shape,
                                present, dtype)  # fmt: skip

        return MoeWeights(
            router=at(LayerSlot.ROUTER, (e, h)),
            correction_bias=at(
                LayerSlot.CORRECTION_BIAS, (e,), moe.correction_bias, FP32
            ),
            w13=at(LayerSlot.W13, (e, 2 * inter, h)) if dense else None,
            w2=at(LayerSlot.W2, (e, h, inter)) if dense else None,
            shared_gate_up=at(LayerSlot.SHARED_GATE_UP, (2 * shared, h), shared > 0)
            if shared_bf16 else None,
            shared_down=at(LayerSlot.SHARED_DOWN, (h, shared), shared > 0)
            if shared_bf16 else None,
        )  # fmt: skip

    def _mla(self, i: int, row, dense: bool = True) -> MlaWeights:
        """A latent attention layer's weights, kv_b_proj rebuilt from its
        W_UK and W_UV columns (each head's rows at head stride
        ``(nope + v) * rank``, as the kernel reads them); ``dense=False``:
        its projections are codes (``_quant_layer`` reads them)."""
        s = self.program.spec
        mla, h = s.mla, s.hidden_size
        lora, rank = mla.q_lora_rank, mla.kv_lora_rank
        heads, nope, v = mla.num_heads, mla.qk_nope_head_dim, mla.v_head_dim

        def at(slot, shape, present=True):
            return self._weight(row[slot], f"layer {i} {slot.name}", shape, present)

        kv_b_rows = heads * (nope + v)
        stride = ((nope + v) * rank, rank, 1)
        w_uk = at(LayerSlot.MLA_W_UK, (kv_b_rows, rank))
        w_uv = at(LayerSlot.MLA_W_UV, (kv_b_rows * rank - nope * rank,))
        kv_b = torch.cat([w_uk.as_strided((heads, nope, rank), stride),
                          w_uv.as_strided((heads, v, rank), stride)],
                         dim=1).reshape(-1, rank)  # fmt: skip
        return MlaWeights(
            q_a=at(LayerSlot.MLA_Q_A, (lora or 0, h), lora is not None)
            if dense
            else None,
            q_a_norm=at(LayerSlot.MLA_Q_A_NORM, (lora or 0,), lora is not None),
            q_b=at(LayerSlot.MLA_Q_B, (heads * mla.qk_head_dim, lora or h))
            if dense
            else None,
            kv_a=at(LayerSlot.MLA_KV_A, (mla.latent_width, h)) if dense else None,
            kv_a_norm=at(LayerSlot.MLA_KV_A_NORM, (rank,)),
            kv_b=kv_b,
        )

    # ------------------------------------------------------------ buffers

    def _write(self, table) -> None:
        p, interp, buf = self.program, self.interp, self.interp.buf
        layers = p.spec.num_layers
        glob = table[layers]
        self._at(glob[GlobalSlot.H0]).copy_(buf["h"][0])
        for i in range(layers):
            row = table[i]
            # An MLA layer has no q; its own buffers instead.
            own = [(LayerSlot.Q, buf["q"][i])] if "q" in buf else [
                (LayerSlot.QKV_A, buf["qkv_a"][i]),
                (LayerSlot.Q_LAT, buf["q_lat"][i]),
                (LayerSlot.Q_PE, buf["q_pe"][i]),
            ]  # fmt: skip
            for slot, src in (
                (LayerSlot.HMID, buf["hmid"][i]), *own,
                (LayerSlot.ATTN, buf["attn"][i]), (LayerSlot.ACT, buf["act"][i]),
                (LayerSlot.PART_O, buf["part_o"][i]),
                (LayerSlot.PART_LSE, buf["part_lse"][i]),
                (LayerSlot.H_OUT, buf["h"][i + 1]),
            ):  # fmt: skip
                self._at(row[slot]).copy_(src)
            if interp.routing[i] is not None:
                self._write_moe(row, buf["router"][i], interp.routing[i],
                                buf["xact"][i])  # fmt: skip
        self._at(glob[GlobalSlot.OUT]).copy_(buf["out"])
        if p.with_lm_head and p.spec.pp_last:
            self._at(glob[GlobalSlot.LOGITS]).copy_(interp.logits)
        if p.spec.tp_size > 1:  # the rank's partial sums, as the ranks read them
            partials = self._at(glob[GlobalSlot.PARTIALS])
            for point in Point:
                for i in range(1 if point == Point.EMBED else layers):
                    partials[partial_row(point, i)].copy_(interp.partial(point, i))
        # The residual stream crosses columns: what each reader finds there.
        for i in range(layers):
            assert bits_equal(self._at(table[i][LayerSlot.H_IN]), buf["h"][i]), (
                f"layer {i} H_IN does not hold what "
                f"{'EMBED (H0)' if i == 0 else f'layer {i - 1} (H_OUT)'} wrote"
            )
        assert bits_equal(self._at(glob[GlobalSlot.H_LAST]), buf["h"][layers]), (
            "H_LAST does not hold what the last layer (H_OUT) wrote"
        )

    def _write_moe(self, row, router, routing, xact) -> None:
        """A sparse layer's buffers where the table says, the routing in
        the kernel's layout (shape.route_layout)."""
        experts = router.shape[1]
        self._at(row[LayerSlot.ROUTER_LOGITS])[:, :experts].copy_(router)
        words = self._at(row[LayerSlot.ROUTE])
        lay = route_layout(KernelShape.from_program(self.program, 16))
        n = routing.slots.numel()
        words[lay.weights : lay.weights + n].copy_(routing.weights.flatten())
        ints = words.view(torch.int32)
        ints[lay.slots : lay.slots + n].copy_(routing.slots.flatten())
        ints[lay.experts : lay.experts + len(routing.experts)].copy_(routing.experts)
        self._at(row[LayerSlot.XACT]).copy_(xact)


class RankSetStandIn:
    """``OneLaunchRanks``' launch on CPU: the stacked queues, counters and
    tables split into the ranks' blocks (as the kernel's ``rank_views``
    does); each rank's PEERS checked to list every rank's counters block
    and PARTIALS, in rank order; each rank's weights and inputs read through
    its table (VOCAB_START included); the ranks run together under one
    scheduler, ALL_REDUCE summing their partials
    (``interpret.RankSetInterpreter``); each rank's buffers, its partial
    sums too, written where its table says."""

    def __init__(self, program, weights: list[DecodeWeights]) -> None:
        self.program = program
        self.ranks = [KernelStandIn(program, w) for w in weights]
        for r in self.ranks[1:]:  # one registry: one memory
            r.tensors, r.ambiguous = self.ranks[0].tensors, self.ranks[0].ambiguous
        self.set = RankSetInterpreter(program, list(weights), seed=5)
        for r, interp in zip(self.ranks, self.set.ranks, strict=True):
            r.interp = interp  # (what _write reads)
        self.launches = 0

    def register(self, *tensors: torch.Tensor) -> None:
        self.ranks[0].register(*tensors)

    def __call__(self, queue, lengths, counters, ptrs, bt_stride, kv_stride,
                 scale, max_spins, stream) -> None:  # fmt: skip
        tp = len(self.ranks)
        n_sm, rows = queue.shape[0] // tp, ptrs.shape[0] // tp
        per = counters.shape[0] // tp
        self.run_ranks(
            [queue[k * n_sm : (k + 1) * n_sm] for k in range(tp)],
            [lengths[k * n_sm : (k + 1) * n_sm] for k in range(tp)],
            [counters[k * per : (k + 1) * per] for k in range(tp)],
            [ptrs[k * rows : (k + 1) * rows] for k in range(tp)],
            bt_stride, kv_stride, scale,
        )  # fmt: skip

    def run_ranks(self, queues, lengths, counters, tables, bt_stride, kv_stride,
                  scale) -> None:  # fmt: skip
        """The ranks' step, rank k from its queues, counters and table."""
        p, tp = self.program, len(self.ranks)
        assert all(r.attn_scale == scale for r in self.ranks)
        own = p.encode()
        tables = [t.tolist() for t in tables]
        assert all(len(t) == p.spec.num_layers + 1 for t in tables)
        assert all(c.shape[0] == p.num_counters + 1 for c in counters)
        blocks = [c.data_ptr() for c in counters]
        partials = [t[-1][GlobalSlot.PARTIALS] for t in tables]
        inputs = []
        for k, (r, interp) in enumerate(zip(self.ranks, self.set.ranks, strict=True)):
            table, glob = tables[k], tables[k][-1]
            assert torch.equal(queues[k], own[0])
            assert torch.equal(lengths[k], own[1])
            assert int(counters[k][-1]) == interp.epoch + 1, (
                f"rank {k}: step number not bumped"
            )
            peers = r._weight(glob[GlobalSlot.PEERS], "PEERS", (2, tp),
                              dtype=torch.int64).tolist()  # fmt: skip
            assert peers[0] == blocks, f"rank {k}: PEERS does not list the counters"
            assert peers[1] == partials, f"rank {k}: PEERS does not list PARTIALS"
            r._weight(partials[k], "PARTIALS",
                      (partial_rows(p.spec.num_layers), p.batch,
                       p.spec.hidden_size))  # fmt: skip
            interp.weights = r._weights(table)
            inputs.append(r._inputs(table, bt_stride, kv_stride))
        _run(self.set.ranks, inputs, self.set.rng)
        for r, table in zip(self.ranks, tables, strict=True):
            r._write(table)
        self.launches += 1


class SeparateRanksStandIn(RankSetStandIn):
    """A tensor-parallel deployment's launches on CPU: one launch a rank (its
    own process and GPU in vLLM, ``launcher(k)`` here), each rank's kernel
    reaching the others through its PEERS only; the ranks' kernels run
    together once every rank has launched (one run of ``run_ranks``), as
    persistent kernels on their GPUs wait for each other."""

    def __init__(self, program, weights: list[DecodeWeights]) -> None:
        super().__init__(program, weights)
        self.pending: dict[int, tuple] = {}

    def launcher(self, k: int):
        def launch(queue, lengths, counters, ptrs, bt_stride, kv_stride, scale,
                   max_spins, stream) -> None:  # fmt: skip
            assert k not in self.pending, f"rank {k} launched twice in a step"
            self.pending[k] = (queue, lengths, counters, ptrs,
                               (bt_stride, kv_stride, scale))  # fmt: skip
            if len(self.pending) == len(self.ranks):
                ranks = [self.pending.pop(r) for r in range(len(self.ranks))]
                scalars = {r[4] for r in ranks}
                assert len(scalars) == 1, f"the ranks' launch scalars {scalars}"
                args = zip(*(r[:4] for r in ranks), strict=True)
                self.run_ranks(*(list(a) for a in args), *scalars.pop())

        return launch


def _unmet_wait(queue: torch.Tensor, lengths: torch.Tensor) -> tuple | None:
    """(sm, pc, counter, count awaited, signals sent, AbortWhat.INPUTS) of
    the first wait in queue order that the step's signals cannot meet, or
    None."""
    live = [queue[sm, : int(n)] for sm, n in enumerate(lengths.tolist())]
    sent: dict[int, int] = {}
    for words in live:
        for counter in words[:, 6].tolist():
            if counter != NO_COUNTER:
                sent[counter] = sent.get(counter, 0) + 1
    for sm, words in enumerate(live):
        for pc, (counter, count) in enumerate(words[:, 4:6].tolist()):
            if counter != NO_COUNTER and count > sent.get(counter, 0):
                return sm, pc, counter, count, sent.get(counter, 0), AbortWhat.INPUTS
    return None


def register_executor(standin: KernelStandIn, ex, kv_caches=()) -> None:
    """Every tensor the executor put in its table (``KernelExecutor._table``),
    so what the kernel may address: the step's inputs, the workspace, the
    weights (with the launcher's fp32 copies of cos/sin and the correction
    biases, and kv_b_proj's W_UV view) and the KV caches. A tied LM head is
    the embedding's tensor: one address, one tensor, read by both slots."""
    standin.register(
        ex.input_ids, ex.positions, ex.seq_lens, ex.slot_mapping, ex.block_table,
        ex.abort, *kv_caches,
    )  # fmt: skip
    if ex.query_map is not None:
        standin.register(ex.query_map)
    for name, t in ex.ws.items():
        # Per-layer buffers by layer (layer 0 shares the whole buffer's
        # address, and must resolve to the layer's view).
        per_layer = name in ("h", "hmid", "q", "attn", "act", "part_o", "part_lse",
                             "router", "route", "xact", "qkv_a", "q_lat",
                             "q_pe", "xq", "xscale", "arrive")  # fmt: skip
        standin.register(*(t.unbind(0) if per_layer else (t,)))
    w = ex.weights
    lm_head = w.lm_head if ex.program.with_lm_head else None
    # (A pipeline stage holds the embedding only if first, the final norm
    # and LM head only if last.)
    model_wide = (w.embed, w.final_norm, lm_head, ex.cos_sin)
    standin.register(*(t for t in model_wide if t is not None))
    nope = ex.shape.qk_nope
    for lw, bias in zip(w.layers, ex.correction_bias, strict=True):
        dense = (lw.input_norm, lw.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm,
                 lw.o_proj, lw.post_norm, lw.gate_up, lw.down)  # fmt: skip
        standin.register(*(t for t in dense if t is not None))
        if lw.quant is not None:
            for f in (lw.quant.qkv, lw.quant.o_proj, lw.quant.gate_up, lw.quant.down):
                if f is not None:
                    standin.register(f.codes, f.scale)
        if lw.moe is not None:
            m = lw.moe
            standin.register(*(t for t in (m.router, m.w13, m.w2, bias,
                                           m.shared_gate_up, m.shared_down)
                               if t is not None))  # fmt: skip
            if m.quant is not None:
                q = m.quant
                for f in (q.w13, q.w2, q.shared_gate_up, q.shared_down):
                    if f is not None:
                        standin.register(f.codes, f.scale)
        if lw.mla is not None:
            m = lw.mla
            standin.register(*(t for t in (m.q_a, m.q_a_norm, m.q_b, m.kv_a,
                                           m.kv_a_norm, m.kv_b) if t is not None),
                             w_uv_base(m.kv_b, nope))  # fmt: skip
            if m.quant is not None:
                for f in (m.quant.q_a, m.quant.kv_a, m.quant.q_b):
                    if f is not None:
                        standin.register(f.codes, f.scale)
