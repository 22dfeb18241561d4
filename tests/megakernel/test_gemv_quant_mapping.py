# SPDX-License-Identifier: Apache-2.0
"""The experts' GEMV on quantized weights (CUDA cores;
kernel/ops/gemv_quant.py) emulated lane by lane in PyTorch, without a GPU
or a compile (fp32 where the GPU rounds in fp32, bits where it moves
bits), and held to the reference (``vllm_ext.quant``). Each check has
plausible slips (``mutation``) that it must catch.

- ``e4m3x4_f32``: a 32-bit word's codes, low byte first, are the codes in
  memory order (the word a little-endian load of the e4m3 bytes); decoded
  (e4m3 -> f16 -> f32) they equal ``codes.float()``, all 256 codes, also
  through FP8 ``lane_weights`` (two words a vector). Caught: high byte
  first.
- ``round_e4m3`` (``cvt.rn.satfinite``) equals a float64 table's nearest
  e4m3 value, ties to even, +-448 at and past the range (infinities too).
  Caught: overflow to NaN, a detour through bf16 (two roundings).
  ``quantize_rows`` (amax over 448, at least 1 / (448 * 512); per token
  times the reciprocal, per group of 128 divided by the scale) times its
  scales equals ``quantize_input`` bit for bit, PER_TOKEN and
  PER_TOKEN_GROUP, on rows of very different ranges, one under the
  scale's floor, all zeros, one whose amax lands past 448 after scaling
  (saturated), one where the two scalings round to different codes.
  Caught: the other scaling, no floor.
- ``lane_weights`` INT4: ``unpack`` bit by bit (the group's bf16 scale
  bits in both halves of ``s2``, ``lop3`` with 0x000F000F and 0x43004300,
  bf16 subtraction of 136 and product with the scale, each rounded once),
  ``bf16x2_f32``, pair p at elements p and p + 4: ``PackedInt4.dequantize``
  bit for bit, every code at every place of a word. Caught: a pair
  swapped, pairs adjacent (the tensor-core path's register order).
- ``_qrow`` (a warp a row of ``qgemv``): lane l takes vectors j = l,
  l + 32, ... of 8 k; a vector's 8 products summed in fp32, FP8 blocks
  scaled ``(part * a[g]) * w[row // 128, g]`` (g = 8 j // 128), the lanes'
  sums added by the warp's butterfly, FP8 per channel then ``a * (w[row] *
  sum)``; 256 rows (two blocks), K 256 / 384 (lanes 16 .. 31 a vector
  short) / 512. Held to the float64 product of ``quantize_input``'s inputs
  and the dequantized weights (``Fp8Weight``, ``PackedInt4``). Caught: a
  block scale a block row off, the input group g + 1, an INT4 pair
  swapped, FP8 bytes high first, the next row's channel scale.
- EXPERT_DOWN's ``_quant_dots`` on the slot's outputs as ``quantize_slot``
  quantizes them (XQ, XSCALE ``[B, xact_groups]``): per channel each
  lane's share scaled, ``a * (w * share)``, before the caller's warp sum;
  within the same bound as scaling the sum. Caught: shares unscaled,
  scaled twice.

Tolerance (``bound``): the products are exact in fp32 (e4m3 x e4m3: 8
significant bits; bf16 x bf16: 16), so only fp32 roundings differ from
exact arithmetic. A term meets at most 7 additions in its vector, 2 block
scalings, an addition a vector of its lane (ceil(K / 256)), 5 butterfly
additions and 2 channel scalings (chain), each off by at most 2^-24 of a
partial no larger than the sum of the magnitudes it holds (a fused
multiply-add rounds less); the reference's operands are each rounded to
fp32 once (2 more), and 1 covers its float64 sums and second-order terms:
|got - want| <= (chain + 3) 2^-24 sum_i |x_i w_i|. Measured: the emulation
within 3% of that; each caught slip 10^5 times past it or more.
The kernel itself runs on the GPU.
"""

import pytest
import torch

from vllm_ext.megakernel.kernel.ops.common import VEC
from vllm_ext.megakernel.kernel.ops.gemv_int4 import BF16X2_128, BF16X2_136
from vllm_ext.megakernel.kernel.ops.gemv_quant import (
    E4M3_MAX,
    MIN_SCALE,
    code_bytes,
    input_groups,
    row_bytes,
    scale_bytes,
)
from vllm_ext.megakernel.kernel.shape import FP8_GROUP, KernelShape
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    Int4Weight,
    QuantFormat,
    pack_int4,
    quantize_blocks,
    quantize_input,
    quantize_int4,
    quantize_rows,
)

E4M3 = torch.float8_e4m3fn
F32 = torch.float32
U = 2.0**-24  # fp32's unit roundoff
FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)
FP8_BLOCKS = QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP)
ROWS = 256  # two 128-row blocks
# Small tensors: a second intra-op thread only spins (conftest's one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# --- bits ------------------------------------------------------------------


def le_words(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 4 n] (uint8) as the 32-bit words a little-endian load
    gives (int64 [..., n]): byte 4 i the low byte of word i."""
    b = b.to(torch.int64).view(*b.shape[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding 32 bits -> the fp32 they encode."""
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(F32)


def bits_of(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> its 32 bits (int64)."""
    return v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def bf16_bits(v: torch.Tensor) -> torch.Tensor:
    """bf16 -> its 16 bits (int64)."""
    return v.view(torch.int16).to(torch.int64) & 0xFFFF


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp32 bit for bit (-0 apart from 0), NaN where the other is."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(bits_of(a[~nan]), bits_of(b[~nan]))


# --- e4m3x4_f32, round_e4m3, quantize_rows ----------------------------------


def e4m3x4_f32(words: torch.Tensor, high_first: bool = False) -> torch.Tensor:
    """``e4m3x4_f32`` on words [...]: [..., 4] fp32. ``mov.b32 {lo, hi}``
    splits bytes (0, 1) from (2, 3), each ``cvt.rn.f16x2.e4m3x2`` puts its
    low byte in the low half, ``mov.b32 {h0, h1}`` takes the low half
    first: byte i is value i (e4m3 -> f16 -> f32, exact)."""
    order = (3, 2, 1, 0) if high_first else (0, 1, 2, 3)
    codes = torch.stack([(words >> (8 * i)) & 0xFF for i in order], dim=-1)
    return codes.to(torch.uint8).view(E4M3).to(torch.float16).to(F32)


def round_e4m3(v: torch.Tensor, mutation: str = "") -> torch.Tensor:
    """``round_e4m3``: ``cvt.rn.satfinite.e4m3x2.f32`` (nearest even; past
    +-448, infinities included, +-448) and back through f16 to fp32.
    Mutations: overflow to NaN (no ``.satfinite``), or a detour through
    bf16 (two roundings)."""
    r = v.clamp(-E4M3_MAX, E4M3_MAX)
    if mutation == "via_bf16":
        r = r.to(torch.bfloat16)
    r = r.to(E4M3).to(torch.float16).to(F32)
    if mutation == "no_saturation":
        r = torch.where(v.abs() >= 464.0, torch.nan, r)  # past 448's rounding
    return r


def quantize_rows_emulated(x: torch.Tensor, per_group: bool, mutation: str = ""):
    """``quantize_rows`` on ``x`` [B, K] bf16 (a warp a row or group):
    the amax (``fmax`` of |y|, exact), ``scale = fmax(m / 448,
    MIN_SCALE)``, ``inv = 1 / scale`` (IEEE fp32), ``z = y * inv`` (per
    token) or ``y / scale`` (per group), ``round_e4m3(z)`` stored as bf16.
    Returns (dst [B, K] bf16, scales [B, groups] fp32, z [B, K] fp32)."""
    b, k = x.shape
    groups = input_groups(k, per_group)
    y = x.float().view(b, groups, k // groups)
    m = y.abs().amax(dim=-1)
    scale = m / torch.tensor(E4M3_MAX, dtype=F32)
    if mutation != "no_floor":
        scale = torch.maximum(scale, torch.tensor(MIN_SCALE, dtype=F32))
    inv = torch.tensor(1.0, dtype=F32) / scale
    divide = per_group != (mutation == "other_rounding")
    z = y / scale[..., None] if divide else y * inv[..., None]
    q = round_e4m3(z)
    dst = q.to(torch.bfloat16)
    assert same_bits(dst.float(), q)  # e4m3 values are bf16 values
    return dst.view(b, k), scale, z.view(b, k)


def e4m3_oracle(v: torch.Tensor) -> torch.Tensor:
    """float64: the nearest finite e4m3 value, ties to the even code,
    +-448 at and past the range (PTX's ``.satfinite``)."""
    table = torch.arange(127, dtype=torch.uint8).view(E4M3).double()  # 0 .. 448
    a = v.double().abs()
    i = (torch.searchsorted(table, a, right=True) - 1).clamp(max=125)
    lo, hi = table[i], table[i + 1]
    up = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 1))
    r = torch.where(up, hi, lo)
    r = torch.where(a >= E4M3_MAX, torch.tensor(E4M3_MAX, dtype=torch.float64), r)
    return torch.copysign(r, v.double())


@pytest.mark.parametrize("mutation", ["", "byte_order"])
def test_e4m3_words_decode_in_memory_order(mutation):
    """Every code (NaN included), as ``e4m3x4_f32`` and as an FP8 row's
    lane vectors (``lane_weights``: words 2 j and 2 j + 1)."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randperm(256, generator=gen).to(torch.uint8).view(E4M3)
    words = le_words(codes.view(torch.uint8))
    got = e4m3x4_f32(words, mutation == "byte_order").reshape(-1)
    assert same_bits(got, codes.float()) == (mutation == "")
    row = lane_weights(codes.view(torch.uint8)[None], None, False, mutation)
    assert row.shape == (1, 256 // VEC, VEC)
    assert same_bits(row.reshape(-1), codes.float()) == (mutation == "")


@pytest.mark.parametrize("mutation", ["", "no_saturation", "via_bf16"])
def test_round_e4m3_is_nearest_even_saturated(mutation):
    table = torch.arange(127, dtype=torch.uint8).view(E4M3).float()
    mids = (table[1:] + table[:-1]) / 2  # exact in fp32: ties
    ulp = torch.nextafter(mids, torch.tensor(float("inf"))) - mids
    gen = torch.Generator().manual_seed(2)
    v = torch.cat([
        table, mids, mids + ulp, mids - ulp,
        torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-4, 3, (4096,),
                                                                 generator=gen),
        torch.tensor([448.0, 460.0, 464.0, 470.0, 479.9, 480.0, 1e6, float("inf"),
                      2.0**-10, 2.0**-11, 3 * 2.0**-10]),
    ]).float()  # fmt: skip
    v = torch.cat([v, -v])
    got = round_e4m3(v, mutation)
    assert torch.equal(got.double(), e4m3_oracle(v)) == (mutation == "")


# Rows of very different ranges, one under the scale's floor, all zeros;
# then one whose amax lands past 448 after scaling (saturated to 448) and
# one where dividing by the scale and multiplying by its reciprocal round
# to different codes (a tie: 0.000354766845703125 / (0.96875 / 448)).
PAST_448 = 0.0019989013671875
TIE = (0.96875, 0.000354766845703125)


def _rows(k: int, gen) -> torch.Tensor:
    x = torch.randn(7, k, generator=gen)
    x *= torch.tensor([1.0, 300.0, 1e-9, 0.0, 1e-3, 1.0, 1.0])[:, None]
    x[4] = x[4].clamp(-1.5e-3, 1.5e-3)
    x[4, ::FP8_GROUP] = PAST_448  # the amax of each group of row 4
    x[6] = x[6].clamp(-0.5, 0.5)
    x[6, ::FP8_GROUP], x[6, 1::FP8_GROUP] = TIE
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("mutation", ["", "other_rounding", "no_floor"])
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("fmt", [FP8, FP8_BLOCKS], ids=["per_token", "per_group"])
def test_quantized_rows_are_quantize_input(fmt, k, mutation):
    per_group = fmt.activations == PER_TOKEN_GROUP
    x = _rows(k, torch.Generator().manual_seed(k))
    q, scale, z = quantize_rows_emulated(x, per_group, mutation)
    assert scale.shape == (7, input_groups(k, per_group))
    if not mutation:
        assert (scale[2] == torch.tensor(MIN_SCALE, dtype=F32)).all()  # the floor
        assert z[4].abs().max() > E4M3_MAX  # past the range: saturated
        assert q[4].float().abs().max() == E4M3_MAX
    groups = q.float().view(7, scale.shape[1], -1)
    got = (groups * scale[..., None]).view(7, k)
    assert same_bits(got, quantize_input(x, fmt)) == (mutation == "")


# --- lane_weights (INT4) -------------------------------------------------------


def unpack(word: torch.Tensor, p: int, s2: torch.Tensor) -> torch.Tensor:
    """``gemv_int4.unpack(word, p, s2)`` on int64 words: ``shr``, ``lop3``
    0xEA ((a & b) | c) with 0x000F000F and 0x43004300 (bf16 128 + code),
    ``sub.rn.bf16x2`` 136, ``mul.rn.bf16x2`` by ``s2``'s halves: each half
    rounded to bf16 once (the fp32 difference and product are exact)."""
    t = ((word >> (4 * p)) & 0x000F000F) | BF16X2_128
    out = torch.zeros_like(word)
    for half in (0, 16):
        v = f32_from_bits(((t >> half) & 0xFFFF) << 16)
        c = f32_from_bits(torch.tensor((BF16X2_136 >> half) & 0xFFFF) << 16)
        s = f32_from_bits(((s2 >> half) & 0xFFFF) << 16)
        d = (v - c).to(torch.bfloat16).float()
        prod = (d * s).to(torch.bfloat16)
        out |= bf16_bits(prod) << half
    return out


def bf16x2_f32(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bf16x2_f32``: ``shl 16`` (the low half) and ``and 0xFFFF0000``."""
    return f32_from_bits(word << 16), f32_from_bits(word & 0xFFFF0000)


def lane_weights(codes: torch.Tensor, wscale: torch.Tensor, int4: bool,
                 mutation: str = "") -> torch.Tensor:  # fmt: skip
    """``lane_weights`` for every row and vector j: [rows, K / 8, 8] fp32.
    FP8: codes [rows, K] as words 2 j, 2 j + 1 (a 64-bit load). INT4:
    bytes [rows, K / 2], word j (a 32-bit load, codes 8 j .. 8 j + 7),
    ``s2 = t | (t << 16)`` of the bf16 scale bits ``t`` (zero-extended:
    ``weight_scales`` reads them as Uint16) of group 8 j // group."""
    rows = codes.shape[0]
    words = le_words(codes)
    if not int4:
        return e4m3x4_f32(words, mutation == "byte_order").view(rows, -1, VEC)
    n_vec, group = words.shape[1], 2 * codes.shape[1] // wscale.shape[1]
    t = bf16_bits(wscale)[:, torch.arange(n_vec) * VEC // group]
    s2 = t | (t << 16)
    we = torch.empty(rows, n_vec, VEC)
    for p in range(4):
        lo, hi = bf16x2_f32(unpack(words, p, s2))
        if mutation == "pair_swap":  # a plausible slip: (p + 4, p)
            lo, hi = hi, lo
        at = (2 * p, 2 * p + 1) if mutation == "pairs_adjacent" else (p, p + 4)
        we[..., at[0]], we[..., at[1]] = lo, hi
    return we


INT4_MUTATIONS = ("pair_swap", "pairs_adjacent")


@pytest.mark.parametrize("mutation", ["", *INT4_MUTATIONS])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_lane_weights_are_packed_dequantize(group, mutation):
    """Scales over eight decades, each rounded to bf16."""
    gen = torch.Generator().manual_seed(group)
    rows, k = 32, 256
    # Every code at every place of a word: row r holds (k + r) % 16.
    codes = ((torch.arange(k) + torch.arange(rows)[:, None]) % 16).to(torch.uint8)
    scales = torch.rand(rows, k // group, generator=gen).add(0.05) * 10.0 ** (
        torch.randint(-6, 3, (rows, k // group), generator=gen).float()
    )
    packed = pack_int4(Int4Weight(codes, scales.to(torch.bfloat16)))
    want = packed.dequantize()  # bf16 [rows, k]
    got = lane_weights(packed.codes, packed.scale, True, mutation).view(rows, k)
    assert torch.equal(got.to(torch.bfloat16).float(), got)  # bf16 values
    same = torch.equal(bf16_bits(got.to(torch.bfloat16)), bf16_bits(want))
    assert same == (mutation == "")


# --- _qrow / qgemv and EXPERT_DOWN's _quant_dots ------------------------------


def warp_sum(v: torch.Tensor) -> torch.Tensor:
    """``warp_sum`` over the last dim (32 lanes), lane 0's result:
    ``warp_reduction``'s butterfly (offsets 16 .. 1, ``v + shfl_xor(v)``)
    adds lane l + off to lane l, i.e. folds the upper half onto the
    lower (fp32 addition commutes: every lane ends with the same bits)."""
    for off in (16, 8, 4, 2, 1):
        v = v[..., :off] + v[..., off : 2 * off]
    return v[..., 0]


def qrow(kind: str, codes: torch.Tensor, wscale: torch.Tensor, x: torch.Tensor,
         xs: torch.Tensor | None, mutation: str = "",
         shares: bool = False) -> torch.Tensor:  # fmt: skip
    """``_qrow`` for every row of ``codes`` (FP8 [rows, K], INT4 [rows,
    K / 2] bytes) against ``x`` [B, K] bf16 (FP8: e4m3 values, scales
    ``xs`` [B, groups]): [rows, B] fp32, lane 0's ``s1``. ``shares``:
    EXPERT_DOWN's ``_quant_dots``, whose per-channel scaling is of each
    lane's share before the warp sum."""
    rows, (batch, k) = codes.shape[0], x.shape
    n_vec = k // VEC
    block, channel = kind == "fp8_block", kind == "fp8"
    we = lane_weights(codes, wscale, kind.startswith("int4"), mutation)
    xf = x.float().view(batch, n_vec, VEC)
    acc = torch.zeros(rows, batch, 32)
    for j0 in range(0, n_vec, 32):  # lane l's vectors j = l, l + 32, ...
        j = slice(j0, min(j0 + 32, n_vec))
        n = j.stop - j0  # lanes with a vector this step
        part = torch.zeros(rows, batch, n)
        for e in range(VEC):
            part = part + we[:, None, j, e] * xf[None, :, j, e]
        if block:
            g = torch.arange(j0, j.stop) * VEC // FP8_GROUP
            ga = (g + 1).clamp(max=xs.shape[1] - 1) if mutation == "input_group" else g
            wrow = torch.arange(rows) // FP8_GROUP
            if mutation == "block_row":
                wrow = (wrow + 1).clamp(max=wscale.shape[0] - 1)
            part = (part * xs[None, :, ga]) * wscale[wrow][:, None, g]
        acc[..., :n] = acc[..., :n] + part
    if channel:
        w = wscale[(torch.arange(rows) + (mutation == "channel_row")) % rows]
        a = xs[None, :, 0]
        if shares and mutation != "unscaled":
            acc = a[..., None] * (w[:, None, None] * acc)
            if mutation == "scaled_twice":
                return a * (w[:, None] * warp_sum(acc))
        elif not shares:
            return a * (w[:, None] * warp_sum(acc))
    return warp_sum(acc)


def kernel_shape(kind: str, inter: int = 256) -> KernelShape:
    """A small quantized mixture's build (its buffer sizes: ``row_bytes``,
    ``code_bytes``, ``scale_bytes``, ``input_groups``, ``xact_groups``)."""
    if kind.startswith("int4"):
        quant = {"int4_group": int(kind[5:])}
    else:
        quant = {"fp8": True, "fp8_block": kind == "fp8_block"}
    return KernelShape(
        hidden=512, intermediate=512, q_heads=8, kv_heads=2, head_dim=64,
        vocab=1024, batch=4, block_size=16, attn_chunks=1, rms_norm_eps=1e-6,
        qkv_bias=False, qk_norm=True, num_experts=8, top_k=2,
        expert_intermediate=inter, num_slots=8,
        **quant,
    )  # fmt: skip


def weights(kind: str, rows: int, k: int, gen):
    """Random weights quantized as the kind's checkpoints are, each 128 x
    128 block's magnitude a random factor (e^N(0, 1): a wrong block's or
    group's scale shows): (codes as the kernel reads them, uint8; scales;
    the dequantized weight)."""
    blocks = (-(-rows // FP8_GROUP), k // FP8_GROUP)
    spread = torch.exp(torch.randn(*blocks, generator=gen))
    spread = spread.repeat_interleave(FP8_GROUP, 0).repeat_interleave(FP8_GROUP, 1)
    w = torch.randn(rows, k, generator=gen) * spread[:rows]
    if kind.startswith("int4"):
        p = quantize_int4(w.to(torch.bfloat16), int(kind[5:]))
        return p.codes, p.scale, p.dequantize()
    fw = quantize_blocks(w) if kind == "fp8_block" else quantize_rows(w)
    return fw.codes.view(torch.uint8), fw.scale, fw.dequantize()


def inputs(kind: str, batch: int, k: int, gen):
    """Inputs [B, K] bf16 (groups of 128 of spread magnitudes) as the GEMV
    reads them: FP8 through ``quantize_rows`` (values, scales), INT4 as
    they are; and the reference's ``quantize_input`` of them."""
    spread = torch.exp(torch.randn(batch, k // FP8_GROUP, generator=gen))
    x = torch.randn(batch, k, generator=gen) * spread.repeat_interleave(FP8_GROUP, 1)
    x = x.to(torch.bfloat16)
    if kind.startswith("int4"):
        return x, None, x.float()
    fmt = FP8_BLOCKS if kind == "fp8_block" else FP8
    q, xs, _ = quantize_rows_emulated(x, kind == "fp8_block")
    return q, xs, quantize_input(x, fmt)


def bound(k: int, size: torch.Tensor) -> torch.Tensor:
    """The module docstring's tolerance for sums of ``k`` terms."""
    chain = (VEC - 1) + 2 + -(-(k // VEC) // 32) + 5 + 2
    return (chain + 3) * U * size


def check(kind, codes, wscale, w_deq, x, xs, x_deq, k, s, mutation, shares=False):
    """The emulated GEMV against the float64 reference; whether it is
    within ``bound`` (NaN never is). Also the buffers' sizes are the
    kernel's."""
    rows = codes.shape[0]
    assert codes.shape[1] == row_bytes(s, k) and codes.numel() == code_bytes(s, rows, k)
    assert wscale.numel() * wscale.element_size() == scale_bytes(s, rows, k)
    if xs is not None:
        assert xs.shape[1] == input_groups(k, s.fp8_block)
    got = qrow(kind, codes, wscale, x, xs, mutation, shares).double()
    want = w_deq.double() @ x_deq.double().T  # [rows, B]
    size = w_deq.double().abs() @ x_deq.double().abs().T
    return not got.isnan().any() and bool(((got - want).abs() <= bound(k, size)).all())


QROW_CASES = [("fp8", ""), ("fp8", "byte_order"), ("fp8", "channel_row"),
              ("fp8_block", ""), ("fp8_block", "block_row"),
              ("fp8_block", "input_group"), ("int4_32", ""), ("int4_32", "pair_swap"),
              ("int4_128", ""), ("int4_128", "pair_swap")]  # fmt: skip


@pytest.mark.parametrize("k", [256, 384, 512])
@pytest.mark.parametrize("kind, mutation", QROW_CASES)
def test_qgemv_row_is_the_reference(kind, mutation, k):
    """EXPERT_UP's GEMV (a gate or up matrix of 256 rows: two 128-row
    blocks) over three requests; K 384: lanes 16 .. 31 take one vector
    fewer."""
    gen = torch.Generator().manual_seed(k + len(kind) * 31 + len(mutation))
    codes, wscale, w_deq = weights(kind, ROWS, k, gen)
    x, xs, x_deq = inputs(kind, 3, k, gen)
    s = kernel_shape(kind)
    close = check(kind, codes, wscale, w_deq, x, xs, x_deq, k, s, mutation)
    assert close == (mutation == "")


DOWN_CASES = [("fp8", ""), ("fp8", "unscaled"), ("fp8", "scaled_twice"),
              ("fp8_block", ""), ("int4_64", "")]  # fmt: skip


@pytest.mark.parametrize("inter", [256, 384])
@pytest.mark.parametrize("kind, mutation", DOWN_CASES)
def test_expert_down_scales_each_lanes_share(kind, mutation, inter):
    """EXPERT_DOWN's columns (w2's rows [hidden, inter]) against the
    slot's outputs: FP8 quantized by ``quantize_slot``'s ``quantize_rows``
    (per token, or per group of 128 with blocks: XQ and XSCALE
    ``[B, xact_groups]``), INT4 the bf16 XACT. Per channel each lane's
    share is scaled; it holds to the bound as scaling the sum does."""
    gen = torch.Generator().manual_seed(inter + len(kind) + 7 * len(mutation))
    s = kernel_shape(kind, inter)
    codes, wscale, w_deq = weights(kind, ROWS, inter, gen)
    xact, xsc, x_deq = inputs(kind, 4, inter, gen)
    if xsc is not None:
        assert xsc.shape[1] == s.xact_groups
    shares = check(kind, codes, wscale, w_deq, xact, xsc, x_deq, inter, s, mutation,
                   shares=True)  # fmt: skip
    assert shares == (mutation == "")
    if kind == "fp8" and not mutation:
        # The two scalings differ (in rounding only): both within the bound.
        a = qrow(kind, codes, wscale, xact, xsc, shares=True)
        b = qrow(kind, codes, wscale, xact, xsc)
        assert not torch.equal(a, b)
        assert check(kind, codes, wscale, w_deq, xact, xsc, x_deq, inter, s, "")
