# SPDX-License-Identifier: Apache-2.0
"""Host side of the kernel: load a built library and run decode steps.

Needs torch and the CUDA driver only (no CuTe DSL, no vLLM), so the same
code runs inside vLLM and in the GPU check. ``KernelExecutor`` owns what a
CUDA graph needs to stay put: the program, the counters, the activation
workspace, static copies of the step's inputs and the address table; a step
copies the inputs in, bumps the device-side step number and launches, all
on the current stream with no host sync, so it can be captured.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.shape import (
    ABORT_WORDS,
    AbortWhat,
    AbortWord,
    GlobalSlot,
    KernelShape,
    LayerSlot,
    route_layout,
    table_width,
    workspace_sizes,
)
from vllm_ext.megakernel.planner import Program
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import QUANT_LINEARS, DecodeWeights, LayerWeights

# Kernel architecture of each compute capability the kernel is built for.
ARCH_OF_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
# Polls of a counter before a wait gives up and the step aborts (x a 32 ns
# nanosleep, which PTX only bounds by twice that: up to ~1 s, far past any
# real step, far short of a hung server).
DEFAULT_MAX_SPINS = 1 << 24


def new_abort_record(device: torch.device) -> torch.Tensor:
    """The abort record (``shape.AbortWord``), clear: shared by every batch
    bucket's executor of a backend, so one read tells whether any step
    aborted."""
    return torch.zeros(ABORT_WORDS, dtype=torch.int32, device=device)


def describe_abort(record: torch.Tensor, programs: dict[int, Program]) -> str | None:
    """The host copy of an abort record, in words (None: clear). ``programs``
    by batch bucket, to name the instruction a wait stopped at."""
    words = [int(w) for w in record.tolist()]
    if not words[AbortWord.FLAG]:
        return None
    sm, index = words[AbortWord.SM], words[AbortWord.INDEX]
    batch = words[AbortWord.BATCH]
    try:
        what = AbortWhat(words[AbortWord.WHAT])
    except ValueError:
        what = None
    where = f"SM {sm}"
    if what in (AbortWhat.WEIGHT_SLOT, AbortWhat.WEIGHT_PAGE):
        where += f", weight page {index}"
    else:
        where += f", instruction {index}"
        program = programs.get(batch)
        if program is not None and what != AbortWhat.BAD_OPCODE:
            queue, lengths = program.encode()
            if sm < queue.shape[0] and 0 <= index < int(lengths[sm]):
                op = int(queue[sm, index, 0])
                where += f" ({Op(op).name}, layer {int(queue[sm, index, 1])})"
    if what == AbortWhat.INPUTS:
        waited = (
            f"for counter {words[AbortWord.COUNTER]} to reach "
            f"{words[AbortWord.EXPECTED]} (it saw {words[AbortWord.SEEN]})"
        )
    elif what == AbortWhat.BAD_OPCODE:
        waited = f"on opcode {words[AbortWord.EXPECTED]}, which it does not know"
    else:
        name = what.name.lower().replace("_", " ") if what else "an unknown wait"
        waited = f"for the {name}"
    return (
        f"the megakernel's bounded wait expired in a step of batch bucket "
        f"{batch}: {where} waited {waited}; every CTA left the step early"
    )


class MegakernelError(RuntimeError):
    pass


def arch_for_device(device: torch.device) -> str:
    capability = torch.cuda.get_device_capability(device)
    arch = ARCH_OF_CAPABILITY.get(tuple(capability))
    if arch is None:
        raise MegakernelError(
            f"the megakernel is built for compute capability "
            f"{', '.join(f'{a}.{b}' for a, b in ARCH_OF_CAPABILITY)}; this GPU "
            f"has {capability[0]}.{capability[1]}"
        )
    return arch


class KernelLibrary:
    """One library from ``build.py``: its module loaded on ``device``."""

    def __init__(self, path: str | Path, device: int) -> None:
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(self.path))
        self.lib.megakernel_error_string.restype = ctypes.c_char_p
        self.lib.megakernel_launch.argtypes = [
            ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
            ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_int32,
            ctypes.c_void_p,
        ]  # fmt: skip
        self._check(self.lib.megakernel_load(device), "load")

    def _check(self, err: int, what: str) -> None:
        if err:
            message = self.lib.megakernel_error_string(err).decode()
            raise MegakernelError(f"megakernel {what} ({self.path.name}): {message}")

    def launch(
        self,
        queue: torch.Tensor,
        lengths: torch.Tensor,
        counters: torch.Tensor,
        ptrs: torch.Tensor,
        block_table_stride: int,
        kv_block_stride: int,
        attn_scale: float,
        max_spins: int,
        stream: int,
    ) -> None:
        err = self.lib.megakernel_launch(
            queue.data_ptr(), queue.shape[0], queue.shape[1], lengths.data_ptr(),
            counters.data_ptr(), counters.shape[0], ptrs.data_ptr(), ptrs.shape[0],
            block_table_stride, kv_block_stride, attn_scale, max_spins, stream,
        )  # fmt: skip
        self._check(err, "launch")


def _address(t: torch.Tensor | None, what: str) -> int:
    if t is None:
        return 0
    if not t.is_contiguous():
        raise MegakernelError(f"megakernel: {what} must be contiguous")
    if t.data_ptr() % 16:
        raise MegakernelError(f"megakernel: {what} must be 16-byte aligned")
    return t.data_ptr()


class KernelExecutor:
    """Runs decode steps of ``program.batch`` (or fewer, padded) requests."""

    def __init__(
        self,
        program: Program,
        weights: DecodeWeights,
        launch,  # KernelLibrary.launch, or a stand-in in tests
        *,
        block_size: int,
        max_blocks: int,
        max_spins: int = DEFAULT_MAX_SPINS,
        abort: torch.Tensor | None = None,
        counters: torch.Tensor | None = None,
        partial: torch.Tensor | None = None,
        ranks_in_launch: int = 1,
    ) -> None:
        """``counters`` and ``ranks_in_launch``: a rank of ``OneLaunchRanks``
        (its block of the stacked counters); ``counters`` and ``partial``: a
        tensor-parallel rank's in symmetric memory (kernel/symmetric.py)."""
        self.program, self.weights, self.launch = program, weights, launch
        self.max_spins = max_spins
        self.shape = shape = KernelShape.from_program(
            program, block_size, ranks_in_launch=ranks_in_launch
        )
        if shape.tp_size > 1 and weights.vocab_range is None:
            raise MegakernelError(
                "megakernel: a tensor-parallel rank's weights name its "
                "vocabulary shard (vocab_range)"
            )
        if shape.mla:
            _check_mla(shape, weights)
        # (A later pipeline stage has no embedding.)
        dev = weights.layers[0].input_norm.device
        self.device = dev
        _check_weights(weights, shape)
        queue, lengths = program.encode()
        self.queue, self.lengths = queue.to(dev), lengths.to(dev)
        # One cell per counter, then the step number (epoch).
        if counters is None:
            counters = torch.zeros(program.num_counters + 1, dtype=torch.int32,
                                   device=dev)  # fmt: skip
        self.counters = counters
        # Where a step records that it aborted (new_abort_record).
        self.abort = new_abort_record(dev) if abort is None else abort
        layers = program.spec.num_layers
        self.ws: dict[str, torch.Tensor] = {}
        for name, dims in workspace_sizes(shape, layers).items():
            # (route: fp32 words, its int32 fields stored as their bits.)
            fp32 = name in ("part_o", "part_lse", "logits", "route")
            dtype = torch.float32 if fp32 else torch.bfloat16
            if name == "partial" and partial is not None:
                if partial.dtype != dtype or tuple(partial.shape) != tuple(dims):
                    raise MegakernelError(
                        f"megakernel: partial sums {tuple(partial.shape)} "
                        f"{partial.dtype}, expected {tuple(dims)} {dtype}"
                    )
                self.ws[name] = partial
                continue
            if name == "arrive":  # (counts: zero, and zero again after a step)
                self.ws[name] = torch.zeros(dims, dtype=torch.int32, device=dev)
                continue
            if name == "xscale":
                dtype = torch.float32
            # NaN until written: a read of an unwritten value shows as NaN.
            self.ws[name] = torch.full(dims, float("nan"), dtype=dtype, device=dev)
        b = shape.batch
        self.input_ids = torch.zeros(b, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        # Each row's request (first row, row count): only where MLA_ATTN
        # passes over a request's rows together.
        self.query_map = self._own_rows = None
        if shape.query_rows > 1:
            rows = torch.arange(b, dtype=torch.int32, device=dev)
            self._own_rows = torch.stack([rows, torch.ones_like(rows)], 1)
            self.query_map = self._own_rows.clone()
        self.cos_sin = weights.cos_sin.to(device=dev, dtype=torch.float32).contiguous()
        # TOPK reads the correction bias in fp32 (the routing runs in fp32).
        self.correction_bias = [
            None if lw.moe is None or lw.moe.correction_bias is None
            else lw.moe.correction_bias.to(device=dev, dtype=torch.float32).contiguous()
            for lw in weights.layers
        ]  # fmt: skip
        self.ptrs_host = self._table()
        if dev.type == "cuda":
            # Pinned: re-uploading it (KV binding) is then an async copy,
            # legal even inside a CUDA-graph capture.
            self.ptrs_host = self.ptrs_host.pin_memory()
        self.ptrs = self.ptrs_host.to(dev)
        self.kv_caches: tuple[torch.Tensor, ...] | None = None
        self.kv_block_stride = 0
        self.peers: torch.Tensor | None = None

    # ------------------------------------------------------------ table

    def _table(self) -> torch.Tensor:
        w, ws, p = self.weights, self.ws, self.program
        layers = p.spec.num_layers
        table = torch.zeros(layers + 1, table_width(self.shape), dtype=torch.int64)
        for i, lw in enumerate(w.layers):
            row = {
                LayerSlot.INPUT_NORM: lw.input_norm,
                LayerSlot.QKV: lw.qkv,
                LayerSlot.QKV_BIAS: lw.qkv_bias,
                LayerSlot.Q_NORM: lw.q_norm,
                LayerSlot.K_NORM: lw.k_norm,
                LayerSlot.O_PROJ: lw.o_proj,
                LayerSlot.POST_NORM: lw.post_norm,
                LayerSlot.GATE_UP: lw.gate_up,
                LayerSlot.DOWN: lw.down,
                LayerSlot.H_IN: ws["h"][i],
                LayerSlot.HMID: ws["hmid"][i],
                LayerSlot.Q: ws["q"][i] if "q" in ws else None,
                LayerSlot.ATTN: ws["attn"][i],
                LayerSlot.ACT: ws["act"][i],
                LayerSlot.PART_O: ws["part_o"][i],
                LayerSlot.PART_LSE: ws["part_lse"][i],
                LayerSlot.H_OUT: ws["h"][i + 1],
            }
            if lw.moe is not None:
                m = lw.moe
                row |= {
                    LayerSlot.ROUTER: m.router,
                    LayerSlot.W13: m.w13,
                    LayerSlot.W2: m.w2,
                    LayerSlot.CORRECTION_BIAS: self.correction_bias[i],
                    LayerSlot.SHARED_GATE_UP: m.shared_gate_up,
                    LayerSlot.SHARED_DOWN: m.shared_down,
                    LayerSlot.ROUTER_LOGITS: ws["router"][i],
                    LayerSlot.ROUTE: ws["route"][i],
                    LayerSlot.XACT: ws["xact"][i],
                }
            if lw.mla is not None:
                row |= self._mla_row(i, lw.mla)
            if self.shape.quantized:  # codes where the dense weights were, scales
                row |= self._quant_row(i, lw)
            for slot, t in row.items():
                table[i, slot] = _address(t, f"layer {i} {slot.name.lower()}")
        glob = {
            GlobalSlot.EMBED: w.embed,
            GlobalSlot.FINAL_NORM: w.final_norm,
            GlobalSlot.LM_HEAD: w.lm_head if p.with_lm_head else None,
            GlobalSlot.COS_SIN: self.cos_sin,
            GlobalSlot.INPUT_IDS: self.input_ids,
            GlobalSlot.POSITIONS: self.positions,
            GlobalSlot.BLOCK_TABLE: self.block_table,
            GlobalSlot.SEQ_LENS: self.seq_lens,
            GlobalSlot.SLOT_MAPPING: self.slot_mapping,
            GlobalSlot.QUERY_MAP: self.query_map,
            GlobalSlot.H0: ws["h"][0],
            GlobalSlot.H_LAST: ws["h"][layers],
            GlobalSlot.OUT: ws["out"],
            GlobalSlot.LOGITS: ws["logits"] if p.with_lm_head else None,
            GlobalSlot.ABORT: self.abort,
            # (PEERS: set_peers, once every rank's addresses are known.)
            GlobalSlot.PARTIALS: ws.get("partial"),
        }
        for slot, t in glob.items():
            table[layers, slot] = _address(t, slot.name.lower())
        if self.shape.tp_size > 1:
            table[layers, GlobalSlot.VOCAB_START] = w.vocab_range[0]
        return table

    def _quant_row(self, i: int, lw: LayerWeights) -> dict:
        """A quantized layer's codes and scales (shape.py's QKV_SCALE ..
        ARRIVE); a sparse layer's experts' in place of its dense MLP's.
        (``experts_only``: the experts', the rest as a bf16 kernel's.)"""
        f, ws, dense = lw.quant, self.ws, self.shape.dense_quantized
        row = {}
        for slot, scale, w in (
            (LayerSlot.QKV, LayerSlot.QKV_SCALE, f.qkv),
            (LayerSlot.O_PROJ, LayerSlot.O_PROJ_SCALE, f.o_proj),
            (LayerSlot.GATE_UP, LayerSlot.GATE_UP_SCALE, f.gate_up),
            (LayerSlot.DOWN, LayerSlot.DOWN_SCALE, f.down),
        ) if dense else ():  # fmt: skip
            row[slot] = None if w is None else w.codes
            row[scale] = None if w is None else w.scale
        if lw.mla is not None and dense:
            m = lw.mla.quant
            row |= {
                LayerSlot.MLA_Q_A: None if m.q_a is None else m.q_a.codes,
                LayerSlot.MLA_Q_A_SCALE: None if m.q_a is None else m.q_a.scale,
                LayerSlot.MLA_KV_A: m.kv_a.codes,
                LayerSlot.MLA_KV_A_SCALE: m.kv_a.scale,
                LayerSlot.MLA_Q_B: m.q_b.codes,
                LayerSlot.MLA_Q_B_SCALE: m.q_b.scale,
            }
        if lw.moe is not None:
            e = lw.moe.quant
            row |= {
                LayerSlot.W13: e.w13.codes,
                LayerSlot.W2: e.w2.codes,
                LayerSlot.W13_SCALE: e.w13.scale,
                LayerSlot.W2_SCALE: e.w2.scale,
            }
            if e.shared_gate_up is not None:
                row |= {
                    LayerSlot.SHARED_GATE_UP: e.shared_gate_up.codes,
                    LayerSlot.SHARED_DOWN: e.shared_down.codes,
                    LayerSlot.SHARED_GATE_UP_SCALE: e.shared_gate_up.scale,
                    LayerSlot.SHARED_DOWN_SCALE: e.shared_down.scale,
                }
            if self.shape.xact_groups:
                row |= {
                    LayerSlot.XQ: ws["xq"][i],
                    LayerSlot.XSCALE: ws["xscale"][i],
                    LayerSlot.ARRIVE: ws["arrive"][i],
                }
        return row

    def set_peers(self, peers: torch.Tensor) -> None:
        """A tensor-parallel rank: every rank's counters and partial sums
        (``[2, tp]`` int64 on this device, as this GPU addresses them)."""
        tp = self.shape.tp_size
        if peers.dtype != torch.int64 or tuple(peers.shape) != (2, tp):
            raise MegakernelError(f"megakernel: PEERS must be int64 [2, {tp}]")
        self.peers = peers
        self.ptrs_host[-1, GlobalSlot.PEERS] = _address(peers, "peers")
        self.ptrs.copy_(self.ptrs_host)

    def _mla_row(self, i: int, m) -> dict:
        """A latent attention layer's weights and buffers (shape.py)."""
        s, ws = self.shape, self.ws
        nope, rank = s.qk_nope, s.kv_lora_rank
        kv_b = m.kv_b
        if tuple(kv_b.shape) != (s.mla_heads * (nope + s.v_head_dim), rank):
            raise MegakernelError(
                f"megakernel: layer {i} kv_b_proj {tuple(kv_b.shape)}"
            )
        return {
            LayerSlot.MLA_Q_A: m.q_a,
            LayerSlot.MLA_KV_A: m.kv_a,
            LayerSlot.MLA_Q_A_NORM: m.q_a_norm,
            LayerSlot.MLA_Q_B: m.q_b,
            LayerSlot.MLA_KV_A_NORM: m.kv_a_norm,
            # The views MlaWeights.w_uk / w_uv take: each head's W_UK rows,
            # then its W_UV rows (head stride (nope + v) * rank elements).
            LayerSlot.MLA_W_UK: kv_b,
            LayerSlot.MLA_W_UV: w_uv_base(kv_b, nope),
            LayerSlot.QKV_A: ws["qkv_a"][i],
            LayerSlot.Q_LAT: ws["q_lat"][i],
            LayerSlot.Q_PE: ws["q_pe"][i],
        }

    def _bind_kv(self, kv_caches: tuple[torch.Tensor, ...]) -> None:
        """Put each layer's cache address in the table (once: vLLM's caches
        do not move), after checking the view is the LBNHC the kernel reads."""
        s = self.shape
        d2 = 2 * s.head_dim
        layers = self.program.spec.num_layers
        if len(kv_caches) != layers:
            raise MegakernelError(f"expected {layers} KV caches, got {len(kv_caches)}")
        strides = {c.stride(0) for c in kv_caches}
        for i, c in enumerate(kv_caches):
            if s.mla:
                # One latent row [kv_c | k_pe] per token (paged_kv.py).
                w = s.latent_width
                if not (
                    c.dtype == torch.bfloat16
                    and c.shape[1:] == (s.block_size, w)
                    and c.stride()[1:] == (w, 1)
                    and c.data_ptr() % 16 == 0
                ):
                    raise MegakernelError(
                        f"megakernel: layer {i} latent cache {tuple(c.shape)} "
                        f"strides {c.stride()} {c.dtype} is not the bf16 "
                        f"[blocks, {s.block_size}, {w}] the kernel reads"
                    )  # fmt: skip
                self.ptrs_host[i, LayerSlot.KV_CACHE] = c.data_ptr()
                continue
            ok = (
                c.dtype == torch.bfloat16
                and c.shape[1:] == (s.kv_heads, s.block_size, d2)
                and c.stride()[1:] == (d2, s.kv_heads * d2, 1)
                and c.data_ptr() % 16 == 0
            )
            if not ok:
                raise MegakernelError(
                    f"megakernel: layer {i} KV cache {tuple(c.shape)} strides "
                    f"{c.stride()} {c.dtype} is not the bf16 LBNHC view "
                    f"[blocks, {s.kv_heads}, {s.block_size}, {d2}] the kernel reads"
                )
            self.ptrs_host[i, LayerSlot.KV_CACHE] = c.data_ptr()
        # Entries are read with 128-bit loads: block starts 16-byte aligned.
        if len(strides) != 1 or max(strides) >= 2**31 or max(strides) % 8:
            raise MegakernelError(f"megakernel: KV block strides {sorted(strides)}")
        self.kv_block_stride = strides.pop()
        self.ptrs.copy_(self.ptrs_host)
        self.kv_caches = kv_caches

    # ------------------------------------------------------------ step

    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        """One decode step: this program's launch (a tensor-parallel rank's
        reaches its peers through PEERS: ``set_peers``; the one-GPU check's
        ranks launch together through ``OneLaunchRanks``)."""
        if self.shape.tp_size > 1 and self.peers is None:
            raise MegakernelError(
                "megakernel: a tensor-parallel rank launches with its peers' "
                "counters and partial sums in PEERS (set_peers)"
            )
        n = self.stage(inputs)
        self.launch_staged()
        return self.output(n)

    def output(self, n: int) -> torch.Tensor:
        """The step's result rows: the final-normed hidden states, or on a
        pipeline stage before the last its residual stream ``h[L]``."""
        if self.program.spec.pp_last:
            return self.ws["out"][:n]
        return self.ws["h"][-1][:n]

    def stage(self, inputs: DecodeInputs) -> int:
        """Copy the step's inputs in and bump the step number (``unstage``
        takes it back if the launch is refused); returns the batch."""
        n, b = inputs.batch_size, self.shape.batch
        if not 1 <= n <= b:
            raise MegakernelError(f"batch {n} does not fit the bucket of {b}")
        bound = [] if self.kv_caches is None else self.kv_caches
        if [c.data_ptr() for c in bound] != [c.data_ptr() for c in inputs.kv_caches]:
            self._bind_kv(inputs.kv_caches)
        # vLLM's runners pad their block tables past max_model_len's blocks
        # (to a 128-token alignment, each runner its own way); those columns
        # are never read, as no sequence is longer than max_model_len.
        width = min(inputs.block_table.shape[1], self.block_table.shape[1])
        # Padded rows (n..b) read token 0 at position 0, attend to nothing
        # and write no cache slot, as a CUDA graph's padding does.
        for dst, src, pad in (
            (self.input_ids, inputs.input_ids, 0),
            (self.positions, inputs.positions, 0),
            (self.seq_lens, inputs.seq_lens, 0),
            (self.slot_mapping, inputs.slot_mapping, -1),
        ):
            dst[:n].copy_(src[:n])
            dst[n:].fill_(pad)
        self.block_table[:n, :width].copy_(inputs.block_table[:n, :width])
        self.block_table[n:].zero_()  # never read (length 0), but valid ids
        if self.query_map is not None:
            # A row per request unless the step says otherwise (a verify
            # step); padded rows each their own.
            self.query_map.copy_(self._own_rows)
            if inputs.query_map is not None:
                self.query_map[:n].copy_(inputs.query_map[:n])
        if not self.program.spec.pp_first:
            # A later pipeline stage starts from the previous stage's
            # residual stream (the program has no EMBED): h[0], its padded
            # rows zero as the reference pads them.
            if inputs.hidden_in is None:
                raise MegakernelError(
                    "megakernel: a later pipeline stage needs the previous "
                    "stage's hidden states"
                )
            self.ws["h"][0][:n].copy_(inputs.hidden_in[:n])
            self.ws["h"][0][n:].zero_()
        # The kernel's waits count in steps: bump the step number for this
        # launch, and take it back if the launch was refused (nothing ran),
        # or every later step of this bucket would wait one step too long
        # and abort.
        self.counters[-1:].add_(1)
        return n

    def unstage(self) -> None:
        self.counters[-1:].sub_(1)

    def stream(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0  # a CPU stand-in launch in tests takes no stream

    def launch_staged(self) -> None:
        try:
            self.launch(
                self.queue, self.lengths, self.counters, self.ptrs,
                self.block_table.stride(0), self.kv_block_stride,
                self.weights.attn_scale, self.max_spins, self.stream(),
            )  # fmt: skip
        except Exception:
            self.unstage()
            raise

    @property
    def logits(self) -> torch.Tensor:
        return self.ws["logits"]


def _check_weights(w: DecodeWeights, shape: KernelShape) -> None:
    """bf16 weights, or (``shape.fp8``) FP8 W8A8 layers' codes and scales in
    the kernel's layout (``QuantLinears``) in place of the linear weights."""
    tensors = {"embed": w.embed, "final_norm": w.final_norm, "lm_head": w.lm_head}
    linears = QUANT_LINEARS if shape.dense_quantized else ()
    # (experts_only: the routed experts' codes, the rest bf16.)
    codes = ("w13", "w2") if shape.quantized else ()
    if shape.dense_quantized:
        codes += ("shared_gate_up", "shared_down")
    for i, lw in enumerate(w.layers):
        if shape.quantized:
            _check_quant(i, lw, shape)
        for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj",
                     "post_norm", "gate_up", "down"):  # fmt: skip
            if name not in linears:
                tensors[f"layer {i} {name}"] = getattr(lw, name)
        # (A quantized kernel reads codes in place of these: _check_quant.)
        if lw.moe is not None:
            for name in ("router", "w13", "w2", "shared_gate_up", "shared_down"):
                if name not in codes:
                    tensors[f"layer {i} moe.{name}"] = getattr(lw.moe, name)
        if lw.mla is not None:
            for name in ("q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b"):
                if not (shape.dense_quantized and name in ("q_a", "q_b", "kv_a")):
                    tensors[f"layer {i} mla.{name}"] = getattr(lw.mla, name)
    bad = [n for n, t in tensors.items() if t is not None and t.dtype != torch.bfloat16]
    if bad:
        raise MegakernelError(
            "the megakernel runs bf16 weights (--dtype bfloat16); not bf16: "
            + ", ".join(bad[:4])
        )


def _check_quant(i: int, lw: LayerWeights, shape: KernelShape) -> None:
    """A quantized kernel's operands: FP8's e4m3 codes ``[N, K]`` with fp32
    row (or block) scales; INT4's packed codes ``[N, K / 2]`` uint8 with
    bf16 group scales; a sparse layer's experts' ``[E, ...]`` in place of
    its dense MLP's. (``experts_only``: the experts' only.)"""
    dense = shape.dense_quantized
    if dense and lw.quant is None:
        raise MegakernelError(
            f"megakernel: layer {i}: a quantized kernel reads the layer's codes "
            "and scales (LayerWeights.quant), and it has none"
        )
    h, q, inter = shape.hidden, shape.q_size, shape.intermediate
    dims = {"qkv": (q + 2 * shape.kv_heads * shape.head_dim, h), "o_proj": (h, q),
            "gate_up": (2 * inter, h), "down": (h, inter)}  # fmt: skip
    operands = {name: (getattr(lw.quant, name), ()) for name in QUANT_LINEARS if dense}
    if lw.mla is not None and dense:
        m = lw.mla.quant
        if m is None:
            raise MegakernelError(
                f"megakernel: layer {i}: a quantized kernel reads the latent "
                "attention's codes and scales (MlaWeights.quant), and it has none"
            )
        lora, lat = shape.q_lora_rank, shape.latent_width
        operands.pop("qkv")
        dims |= {"q_a": (lora, h), "kv_a": (lat, h),
                 "q_b": (shape.mla_heads * shape.qk_head_dim, lora or h)}  # fmt: skip
        operands |= {"kv_a": (m.kv_a, ()), "q_b": (m.q_b, ())}
        if lora:
            operands["q_a"] = (m.q_a, ())
    if lw.moe is not None:
        if lw.moe.quant is None:
            raise MegakernelError(
                f"megakernel: layer {i}: a quantized kernel reads the experts' "
                "codes and scales (MoeWeights.quant), and the layer has none"
            )
        e, ei = shape.num_experts, shape.expert_intermediate
        operands.pop("gate_up", None)
        operands.pop("down", None)
        dims |= {"w13": (2 * ei, h), "w2": (h, ei)}
        operands |= {"w13": (lw.moe.quant.w13, (e,)), "w2": (lw.moe.quant.w2, (e,))}
        if shape.shared_intermediate and dense:
            si = shape.shared_intermediate
            dims |= {"shared_gate_up": (2 * si, h), "shared_down": (h, si)}
            operands |= {"shared_gate_up": (lw.moe.quant.shared_gate_up, ()),
                         "shared_down": (lw.moe.quant.shared_down, ())}  # fmt: skip
    for name, (f, lead) in operands.items():
        rows, k = dims[name]
        codes, code_dtype = (*lead, rows, k), torch.float8_e4m3fn
        scales, scale_dtype = (*lead, rows), torch.float32
        if shape.fp8_block:
            scales = (*lead, -(-rows // 128), -(-k // 128))
        if shape.int4_group:
            codes, code_dtype = (*lead, rows, k // 2), torch.uint8
            scales, scale_dtype = (*lead, rows, k // shape.int4_group), torch.bfloat16
        if (
            f.codes.dtype != code_dtype
            or tuple(f.codes.shape) != codes
            or not f.codes.is_contiguous()
            or f.scale.dtype != scale_dtype
            or tuple(f.scale.shape) != scales
            or not f.scale.is_contiguous()
        ):
            raise MegakernelError(
                f"megakernel: layer {i} {name}: the kernel reads {code_dtype} "
                f"codes {codes} row-major and {scale_dtype} scales {scales}; got "
                f"{f.codes.dtype} {tuple(f.codes.shape)}, {f.scale.dtype} "
                f"{tuple(f.scale.shape)}"
            )


def _check_mla(shape: KernelShape, w: DecodeWeights) -> None:
    """What MLA_ATTN and the RoPE of MLA_Q / MLA_APPEND read besides the
    table: the launch's scale and the cos/sin rows of qk_rope_head_dim."""
    if abs(w.attn_scale - shape.mla_scale) > 1e-6 * shape.mla_scale:
        raise MegakernelError(
            f"megakernel: the weights' softmax scale {w.attn_scale} is not the "
            f"model's MLA scale {shape.mla_scale}"
        )
    if w.cos_sin.shape[-1] != shape.qk_rope:
        raise MegakernelError(
            f"megakernel: cos/sin rows of {w.cos_sin.shape[-1]}, not the MLA "
            f"rope dims {shape.qk_rope}"
        )


def w_uv_base(kv_b: torch.Tensor, nope: int) -> torch.Tensor:
    """kv_b_proj from head 0's first W_UV row on, flat: the table's W_UV
    address (MlaWeights.w_uv reads ``[heads, v, rank]`` at head stride
    ``(nope + v) * rank`` from there)."""
    if not kv_b.is_contiguous():
        raise MegakernelError("megakernel: kv_b_proj must be contiguous")
    return kv_b.view(-1)[nope * kv_b.shape[-1] :]


def decode_route(words: torch.Tensor, shape: KernelShape):
    """(weights ``[B, top_k]`` fp32, slots ``[B, top_k]`` int32, experts
    ``[num_slots]`` int32) from a layer's routing words
    (``shape.route_layout``): what TOPK wrote, for the checks that read it."""
    lay, b, k = route_layout(shape), shape.batch, shape.top_k
    ints = words.view(torch.int32)
    return (
        words[lay.weights : lay.weights + b * k].view(b, k),
        ints[lay.slots : lay.slots + b * k].view(b, k),
        ints[lay.experts : lay.experts + shape.num_slots],
    )
