# SPDX-License-Identifier: Apache-2.0
"""A CPU stand-in for the compiled kernel, behind the same launch call.

It knows nothing of the executor's Python objects: like the kernel, it reads
every address from the table (resolved back to tensors through a registry
of what the test allocated) and the step number from the last counter, then
runs the program interpreter on what those addresses hold and writes the
results where the table says. So a wrong table entry, a wrong padding or a
missing step bump in the launcher shows up as a wrong result."""

from __future__ import annotations

import torch

from vllm_ext.megakernel.interpret import ProgramInterpreter
from vllm_ext.megakernel.kernel.shape import GlobalSlot, LayerSlot
from vllm_ext.runner import DecodeInputs


class KernelStandIn:
    def __init__(self, program, weights) -> None:
        self.interp = ProgramInterpreter(program, weights, seed=5)
        self.program = program
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
        interp.step(inputs)
        buf = interp.buf
        for i in range(layers):
            row = table[i]
            for slot, src in (
                (LayerSlot.H_IN, buf["h"][i]), (LayerSlot.HMID, buf["hmid"][i]),
                (LayerSlot.Q, buf["q"][i]), (LayerSlot.ATTN, buf["attn"][i]),
                (LayerSlot.ACT, buf["act"][i]), (LayerSlot.PART_O, buf["part_o"][i]),
                (LayerSlot.PART_LSE, buf["part_lse"][i]),
                (LayerSlot.H_OUT, buf["h"][i + 1]),
            ):  # fmt: skip
                self._at(row[slot]).copy_(src)
        self._at(glob[GlobalSlot.OUT]).copy_(buf["out"])
        if p.with_lm_head:
            self._at(glob[GlobalSlot.LOGITS]).copy_(interp.logits)
        self.launches += 1


def register_executor(standin: KernelStandIn, ex, kv_caches=()) -> None:
    """Everything the executor allocated (what the kernel may address)."""
    standin.register(
        ex.input_ids, ex.positions, ex.seq_lens, ex.slot_mapping, ex.block_table,
        *kv_caches,
    )  # fmt: skip
    for name, t in ex.ws.items():
        # Per-layer buffers by layer (layer 0 shares the whole buffer's
        # address, and must resolve to the layer's view).
        per_layer = name in ("h", "hmid", "q", "attn", "act", "part_o", "part_lse")
        standin.register(*(t.unbind(0) if per_layer else (t,)))
