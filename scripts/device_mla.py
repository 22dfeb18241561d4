# SPDX-License-Identifier: Apache-2.0
"""The GPU check's multi-head latent attention parts (DeepSeek-V3, Kimi-K2),
used by device_run.py; torch only, like it.

An MLA case runs the first few layers of the model at its real widths with
random weights (device_check.sh, DEVICE_CHECK_MLA). Each step's MLA_QKV_A,
MLA_Q, MLA_APPEND, MLA_ATTN and MLA_COMBINE are judged against their
references (``vllm_ext/megakernel/ops/mla_*.py``) on the inputs the kernel
gave them, as device_run judges the dense instructions: ``layer_errors``.
The attention is also held, unsplit, to the torch absorbed attention
(``reference.mla_decode_attention``, then W_UV), and to FlashInfer's MLA
paged decode where the bundle carries it (scripts/baseline/flashinfer_mla.py;
counted only while FlashInfer itself agrees with the torch reference, as
the dense cases count FlashInfer's decode). The timing runs at a 4k-token
context, beside the attention's roofline (``roofline``).
"""

from __future__ import annotations

import torch

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.ops import mla_append, mla_attn, mla_combine, mla_q, mla_qkv_a
from vllm_ext.model_spec import ModelSpec
from vllm_ext.reference import mla_decode_attention
from vllm_ext.runner import DecodeInputs

# Every request's history in an MLA case's timing: the 4k-token
# context (testing.MAX_POSITION, the random weights' cos/sin rows, is 4096).
BENCH_CONTEXT = 4096
# bf16 dense matrix rate measured on an H200 of this workplace
# (shared/GUIDE.md section 7): the roofline's tensor-core term.
PEAK_BF16_FLOPS = 790e12
# The unsplit attention check's reference (the report's wording).
ATTENTION_REFERENCE = "torch absorbed MLA, unsplit"
# Element-wise floors (device_run.ELEMENT_FLOOR): q_pe and the latent row's
# k_pe are RoPE outputs, two rounded values combined.
ELEMENT_FLOOR = {"MLA_Q_PE": 1.0, "MLA_APPEND": 1.0}
# Breakdown rows of an MLA case (device_run.BREAKDOWN): each MLA kind alone,
# and the rows the dense cases time that an MLA program has.
BREAKDOWN = {
    "MLA_QKV_A": ((Op.MLA_QKV_A,), False),
    "MLA_Q": ((Op.MLA_Q,), False),
    "MLA_APPEND": ((Op.MLA_APPEND,), False),
    "MLA_ATTN": ((Op.MLA_ATTN,), False),
    "MLA_COMBINE": ((Op.MLA_COMBINE,), False),
}
ROWS = ("no waits", *BREAKDOWN, "O_PROJ", "GATE_UP", "DOWN", "LM_HEAD", "NOP",
        "NOP, waits")  # fmt: skip


def new_rows(cache: torch.Tensor, inputs: DecodeInputs, n: int) -> torch.Tensor:
    """The latent rows at the step's real requests' slots ``[n, width]``."""
    slots = inputs.slot_mapping[:n].long()
    bs = cache.shape[1]
    return cache[slots // bs, slots % bs].float()


def appended_rows(kv, lw, spec: ModelSpec, cos, sin) -> torch.Tensor:
    """MLA_APPEND's reference rows ``[n, width]`` for kv_a's output ``kv``
    (the kernel's own), written into a scratch cache of one-token blocks."""
    n = kv.shape[0]
    scratch = torch.full((n, 1, spec.mla.latent_width), float("nan"),
                         dtype=spec.dtype, device=kv.device)  # fmt: skip
    slots = torch.arange(n, device=kv.device)
    mla_append.reference(kv, lw, spec, cos, sin, scratch, slots)
    return scratch[:, 0].float()


def layer_errors(
    ex, spec: ModelSpec, inputs: DecodeInputs, n: int, i: int, cache: torch.Tensor,
    cos, sin, note, every_chunk: bool,
) -> None:  # fmt: skip
    """Layer ``i``'s latent attention instructions, each against its
    reference on the kernel's own inputs, recorded through ``note`` (device_run
    local_errors'): ``cache`` is the layer's cache as the step had to leave
    it (the copy from before it plus the kernel's new rows, which
    MLA_APPEND judges). With ``every_chunk``, MLA_ATTN's partial o and LSE
    of every (head group, chunk); MLA_COMBINE every head's o_proj input."""
    ws, lw, mla = ex.ws, ex.weights.layers[i], spec.mla
    h, qkv_a = ws["h"][i][:n], ws["qkv_a"][i][:n]
    note("MLA_QKV_A", i, qkv_a, mla_qkv_a.reference(h, lw, spec, 0, qkv_a.shape[-1]))
    q_lat, q_pe = ws["q_lat"][i][:n], ws["q_pe"][i][:n]
    want_lat, want_pe = mla_q.reference(qkv_a, h, lw, spec, 0, mla.num_heads, cos, sin)
    note("MLA_Q", i, q_lat, want_lat)
    note("MLA_Q_PE", i, q_pe, want_pe)
    kv = qkv_a[:, mla.q_lora_rank or 0 :]
    note("MLA_APPEND", i, new_rows(inputs.kv_caches[i], inputs, n),
         appended_rows(kv, lw, spec, cos, sin))  # fmt: skip
    groups, chunks = ex.program.mla_head_groups, ex.program.attn_chunks
    per = mla.num_heads // groups
    part_o, part_lse = ws["part_o"][i], ws["part_lse"][i]  # [chunks, G, B, per, ..]
    table, lens = inputs.block_table[:n], inputs.seq_lens[:n]
    scale = ex.weights.attn_scale
    for g in range(groups if every_chunk else 0):
        heads = slice(g * per, (g + 1) * per)
        for c in range(chunks):
            o, lse = mla_attn.reference(
                q_lat[:, heads], q_pe[:, heads], cache, table, lens, c, chunks, scale
            )
            note("MLA_ATTN", i, part_o[c, g, :n], o, "attn")
            note("MLA_ATTN_LSE", i, part_lse[c, g, :n], lse, "fp32")
    w_uv = lw.mla.w_uv(mla.num_heads, mla.qk_nope_head_dim)
    attn = ws["attn"][i][:n]
    for head in range(mla.num_heads):
        g, j = divmod(head, per)
        o, lse = part_o[:, g, :n, j], part_lse[:, g, :n, j]
        want = mla_combine.reference(o, lse, w_uv[head], 0, mla.v_head_dim, spec.dtype)
        note("MLA_COMBINE", i, attn[:, head], want)


def unsplit_attention(ex, spec: ModelSpec, inputs: DecodeInputs, n: int,
                      layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(the kernel's o_proj input, the torch absorbed attention's) of
    ``layer``: MLA_ATTN + MLA_COMBINE against one softmax over each whole
    sequence (no chunks, no merge) on the kernel's own queries and cache,
    rounded where vLLM rounds (the latent output, ``@ W_UV``)."""
    mla, ws = spec.mla, ex.ws
    o = mla_decode_attention(ws["q_lat"][layer][:n], ws["q_pe"][layer][:n],
                             inputs.kv_caches[layer], inputs.block_table[:n],
                             inputs.seq_lens[:n], ex.weights.attn_scale)  # fmt: skip
    w_uv = ex.weights.layers[layer].mla.w_uv(mla.num_heads, mla.qk_nope_head_dim)
    want = torch.einsum("bhl,hvl->bhv", o.to(spec.dtype).float(), w_uv.float())
    return ws["attn"][layer][:n], want.to(spec.dtype)


def flashinfer_outputs(fi, ex, spec: ModelSpec, inputs: DecodeInputs, n: int,
                       layer: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """FlashInfer's MLA decode (``fi``, flashinfer_mla.FlashInferMla) on the
    kernel's own queries and cache of ``layer``: (the kernel's o_proj
    input, FlashInfer's after W_UV, FlashInfer's latent output, the torch
    reference's latent output, rounded as vLLM rounds it)."""
    mla, ws = spec.mla, ex.ws
    q_lat, q_pe = ws["q_lat"][layer][:n], ws["q_pe"][layer][:n]
    cache, table, lens = (
        inputs.kv_caches[layer],
        inputs.block_table[:n],
        inputs.seq_lens[:n],
    )
    plan = fi.plan(table, lens, mla.num_heads, cache.shape[1])
    o = torch.empty(n, mla.num_heads, mla.kv_lora_rank, dtype=torch.bfloat16,
                    device=q_lat.device)  # fmt: skip
    fi(q_lat, q_pe.contiguous(), cache, plan, o, ex.weights.attn_scale)
    ref = mla_decode_attention(q_lat, q_pe, cache, table, lens, ex.weights.attn_scale)
    w_uv = ex.weights.layers[layer].mla.w_uv(mla.num_heads, mla.qk_nope_head_dim)
    out = torch.einsum("bhl,hvl->bhv", o.float(), w_uv.float()).to(spec.dtype)
    return ws["attn"][layer][:n], out, o, ref.to(spec.dtype)


def mla_weights(lw):
    """(name, tensor) of a layer's latent attention weights (for the check
    that a step wrote none)."""
    if lw.mla is None:
        return
    for name in ("q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b"):
        t = getattr(lw.mla, name)
        if t is not None:
            yield f"mla.{name}", t


def bench_caches(spec: ModelSpec, blocks: int, block_size: int, device):
    """Random latent caches ``[blocks, block_size, width]`` bf16, one per
    layer (the layout the kernel and vLLM's MLA backends read)."""
    shape = (blocks, block_size, spec.mla.latent_width)
    return tuple(torch.randn(shape, device=device, dtype=torch.bfloat16)
                 for _ in range(spec.num_layers))  # fmt: skip


def attention_weight_bytes(spec: ModelSpec) -> int:
    """One layer's attention weights (q_a, q_b, kv_a, kv_b, o_proj), bf16."""
    m, h = spec.mla, spec.hidden_size
    q_in = m.q_lora_rank or h
    elements = (
        (m.q_lora_rank or 0) * h
        + m.num_heads * m.qk_head_dim * q_in
        + m.latent_width * h
        + m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        + h * m.num_heads * m.v_head_dim
    )
    return 2 * elements


def roofline(spec: ModelSpec, batch: int, context: int) -> dict:
    """One layer's attention at ``context`` tokens a request: its FLOPs
    (scores over the 576-wide rows, the 512-wide latent output: absorbed),
    the latent rows' bytes, and its attention weights' bytes. The roofline
    is the larger of the bytes at the measured copy bandwidth and the FLOPs
    at PEAK_BF16_FLOPS (the report computes it: the bandwidth is the
    call's)."""
    m = spec.mla
    return {
        "heads": m.num_heads, "batch": batch, "context": context,
        "attention_flops": 2 * batch * m.num_heads * context
        * (m.latent_width + m.kv_lora_rank),
        "cache_bytes": 2 * batch * context * m.latent_width,
        "attention_weight_bytes": attention_weight_bytes(spec),
        "peak_flops": PEAK_BF16_FLOPS,
    }  # fmt: skip


def roofline_us(r: dict, bandwidth: float, with_weights: bool = False) -> float:
    """max(HBM time, tensor-core time) in us of one layer's attention (the
    latent rows; with ``with_weights`` its projections' weights too)."""
    nbytes = r["cache_bytes"] + (r["attention_weight_bytes"] if with_weights else 0)
    return max(nbytes / bandwidth, r["attention_flops"] / r["peak_flops"]) * 1e6


def markdown_lines(report: dict, bandwidth: float | None) -> list[str]:
    """The report's MLA table: each MLA case's step against the per-op
    step, the attention alone on both sides (the kernel's MLA_ATTN and
    MLA_COMBINE rows of the breakdown, all layers), and one layer's
    attention roofline at the measured bandwidth."""
    rows = []
    for name, c in report["cases"].items():
        t = c.get("timing") or {}
        r = t.get("roofline")
        if not r:
            continue
        b = t.get("breakdown", {})

        def ms(x):
            return f"{x:.3f}" if isinstance(x, float) else "-"

        def us(with_weights: bool, r: dict = r) -> str:
            if not bandwidth:
                return "-"
            return f"{roofline_us(r, bandwidth, with_weights):.1f}"

        fi = (t.get("flashinfer_mla") or {}).get("mla_attn_vs_flashinfer", {})
        vs = f"{fi['max']:.1e}" if "max" in fi else "-"
        rows.append(
            f"| {name} | {r['heads']} | {r['context']} | {t.get('layers', '-')} "
            f"| {ms(t.get('megakernel_ms'))} | {ms(t.get('per_op_graph_ms'))} "
            f"| {ms(t.get('per_op_attention_ms'))} "
            f"| {ms(b.get('MLA_ATTN', {}).get('ms'))} "
            f"| {ms(b.get('MLA_COMBINE', {}).get('ms'))} | {us(False)} "
            f"| {us(True)} | {t.get('per_op_attention', '-').split(' ')[0]} | {vs} |"
        )
    if not rows:
        return []
    return [
        "",
        "MLA cases (roofline: one layer, max(bytes / copy bandwidth, FLOPs / "
        f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s); the kernel's attention against "
        "FlashInfer's MLA decode, max-relative, reported):",
        "",
        "| case | heads | context | layers | megakernel ms | per-op graph ms "
        "| per-op attention ms | MLA_ATTN ms | MLA_COMBINE ms "
        "| attention roofline us | + attention weights us | per-op attention "
        "| vs FlashInfer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
