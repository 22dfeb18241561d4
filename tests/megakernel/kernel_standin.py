# SPDX-License-Identifier: Apache-2.0
"""A CPU stand-in for the compiled kernel, behind the same launch call.

It knows nothing of the executor's Python objects: like the kernel, it reads
every address from the table (resolved back to tensors through a registry
of what the test allocated) and the step number from the last counter, then
runs the program interpreter on what those addresses hold and writes the
results where the table says. So a wrong table entry, a wrong padding or a
missing step bump in the launcher shows up as a wrong result.

A sparse layer's mixture reads its weights through the table too (router,
w13, w2, correction bias, shared expert), and its buffers (router logits,
the routing in the kernel's word layout, each slot's activations) are
written where the table says, so an MoE table round-trips: a wrong or
swapped entry gives a wrong result or a wrong buffer.

So does a latent attention layer's: its weights (q_a, kv_a, their norms,
q_b, and kv_b_proj rebuilt from the W_UK and W_UV views, each from its own
column) are read through the table, its buffers (the down projection's
output, the latent queries, the rotated q_pe, the partials, o_proj's
input) written where the table says."""

from __future__ import annotations

import dataclasses

import torch

from vllm_ext.megakernel.interpret import ProgramInterpreter
from vllm_ext.megakernel.kernel.launcher import (  # noqa: F401 (tests)
    decode_route,
    w_uv_base,
)
from vllm_ext.megakernel.kernel.shape import (
    GlobalSlot,
    KernelShape,
    LayerSlot,
    route_layout,
)
from vllm_ext.runner import DecodeInputs


class KernelStandIn:
    def __init__(self, program, weights) -> None:
        self.interp = ProgramInterpreter(program, weights, seed=5)
        self.program, self.weights = program, weights
        self.tensors: dict[int, torch.Tensor] = {}
        self.launches = 0

    def register(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.tensors.setdefault(t.data_ptr(), t)

    def _at(self, address: int) -> torch.Tensor:
        assert address in self.tensors, f"table address {address:#x} is unknown"
        return self.tensors[address]

    def __call__(self, queue, lengths, counters, ptrs, bt_stride, kv_stride,
                 scale, max_spins, stream) -> None:  # fmt: skip
        p, interp = self.program, self.interp
        layers = p.spec.num_layers
        table = ptrs.tolist()
        glob = table[layers]
        assert counters.shape[0] == p.num_counters + 1
        assert int(counters[-1]) == interp.epoch + 1, "step number not bumped"
        assert torch.equal(queue, p.encode()[0]) and scale == interp.weights.attn_scale
        block_table = self._at(glob[GlobalSlot.BLOCK_TABLE])
        assert block_table.stride(0) == bt_stride
        kv = tuple(self._at(table[i][LayerSlot.KV_CACHE]) for i in range(layers))
        assert {c.stride(0) for c in kv} == {kv_stride}
        inputs = DecodeInputs(
            input_ids=self._at(glob[GlobalSlot.INPUT_IDS]).long(),
            positions=self._at(glob[GlobalSlot.POSITIONS]).long(),
            block_table=block_table,
            seq_lens=self._at(glob[GlobalSlot.SEQ_LENS]),
            slot_mapping=self._at(glob[GlobalSlot.SLOT_MAPPING]).long(),
            kv_caches=kv,
        )
        interp.weights = self._mla_weights(table, self._moe_weights(table))
        interp.step(inputs)
        buf = interp.buf
        for i in range(layers):
            row = table[i]
            # An MLA layer has no q; its own buffers instead.
            q = (LayerSlot.Q, "q") if "q" in buf else (LayerSlot.QKV_A, "qkv_a")
            mla = []
            if "q_lat" in buf:
                mla = [(LayerSlot.Q_LAT, buf["q_lat"][i]),
                       (LayerSlot.Q_PE, buf["q_pe"][i])]  # fmt: skip
            for slot, src in (
                (LayerSlot.H_IN, buf["h"][i]), (LayerSlot.HMID, buf["hmid"][i]),
                (q[0], buf[q[1]][i]), (LayerSlot.ATTN, buf["attn"][i]),
                (LayerSlot.ACT, buf["act"][i]), (LayerSlot.PART_O, buf["part_o"][i]),
                (LayerSlot.PART_LSE, buf["part_lse"][i]),
                (LayerSlot.H_OUT, buf["h"][i + 1]), *mla,
            ):  # fmt: skip
                self._at(row[slot]).copy_(src)
            if interp.routing[i] is not None:
                self._write_moe(row, buf["router"][i], interp.routing[i],
                                buf["xact"][i])  # fmt: skip
        self._at(glob[GlobalSlot.OUT]).copy_(buf["out"])
        if p.with_lm_head:
            self._at(glob[GlobalSlot.LOGITS]).copy_(interp.logits)
        self.launches += 1

    def _moe_weights(self, table):
        """The weights, each sparse layer's mixture read from the table."""
        layers = []
        for i, lw in enumerate(self.weights.layers):
            if lw.moe is not None:
                row = table[i]

                def at(slot, row=row):
                    return self._at(row[slot]) if row[slot] else None

                lw = dataclasses.replace(lw, moe=dataclasses.replace(
                    lw.moe, router=at(LayerSlot.ROUTER), w13=at(LayerSlot.W13),
                    w2=at(LayerSlot.W2),
                    correction_bias=at(LayerSlot.CORRECTION_BIAS),
                    shared_gate_up=at(LayerSlot.SHARED_GATE_UP),
                    shared_down=at(LayerSlot.SHARED_DOWN),
                ))  # fmt: skip
            layers.append(lw)
        return dataclasses.replace(self.weights, layers=tuple(layers))

    def _mla_weights(self, table, weights):
        """The weights, each latent attention layer's read from the table
        (kv_b_proj rebuilt from its W_UK and W_UV columns)."""
        mla = self.program.spec.mla
        layers = []
        for i, lw in enumerate(weights.layers):
            if lw.mla is not None:
                row = table[i]

                def at(slot, row=row):
                    return self._at(row[slot]) if row[slot] else None

                heads, rank = mla.num_heads, mla.kv_lora_rank
                nope, v = mla.qk_nope_head_dim, mla.v_head_dim
                stride = ((nope + v) * rank, rank, 1)
                w_uk = at(LayerSlot.MLA_W_UK).as_strided((heads, nope, rank), stride)
                w_uv = at(LayerSlot.MLA_W_UV).as_strided((heads, v, rank), stride)
                kv_b = torch.cat([w_uk, w_uv], dim=1).reshape(-1, rank)
                lw = dataclasses.replace(lw, mla=dataclasses.replace(
                    lw.mla, q_a=at(LayerSlot.MLA_Q_A), kv_a=at(LayerSlot.MLA_KV_A),
                    q_a_norm=at(LayerSlot.MLA_Q_A_NORM), q_b=at(LayerSlot.MLA_Q_B),
                    kv_a_norm=at(LayerSlot.MLA_KV_A_NORM), kv_b=kv_b,
                ))  # fmt: skip
            layers.append(lw)
        return dataclasses.replace(weights, layers=tuple(layers))

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


def register_executor(standin: KernelStandIn, ex, kv_caches=()) -> None:
    """Everything the executor allocated (what the kernel may address)."""
    standin.register(
        ex.input_ids, ex.positions, ex.seq_lens, ex.slot_mapping, ex.block_table,
        *kv_caches,
    )  # fmt: skip
    for name, t in ex.ws.items():
        # Per-layer buffers by layer (layer 0 shares the whole buffer's
        # address, and must resolve to the layer's view).
        per_layer = name in ("h", "hmid", "q", "attn", "act", "part_o", "part_lse",
                             "router", "route", "xact", "qkv_a", "q_lat",
                             "q_pe")  # fmt: skip
        standin.register(*(t.unbind(0) if per_layer else (t,)))
    # The mixtures' weights (the table is their only way in).
    for lw, bias in zip(ex.weights.layers, ex.correction_bias, strict=True):
        if lw.moe is not None:
            m = lw.moe
            standin.register(*(t for t in (m.router, m.w13, m.w2, bias,
                                           m.shared_gate_up, m.shared_down)
                               if t is not None))  # fmt: skip
    # The latent attentions' weights, and kv_b_proj's W_UV view.
    nope = ex.shape.qk_nope
    for lw in ex.weights.layers:
        if lw.mla is not None:
            m = lw.mla
            standin.register(*(t for t in (m.q_a, m.q_a_norm, m.q_b, m.kv_a,
                                           m.kv_a_norm, m.kv_b) if t is not None),
                             w_uv_base(m.kv_b, nope))  # fmt: skip
