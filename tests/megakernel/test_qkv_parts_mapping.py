# SPDX-License-Identifier: Apache-2.0
"""QKV over head parts (kernel/ops/qkv.py, ``_head_parts``; isa.py): the
kernel's index arithmetic, emulated in float64 and held against the QKV
reference (ops/qkv.py; its norm and RoPE compute in fp32, hence the fp32
tolerance).

The kernel cannot run on this machine; this checks what is new in the
variant: which weight rows each of a part's two GEMV blocks reads, where
they land in the head buffer, which dims RoPE pairs and with which cos/sin
entries, and where q, K and V are stored. Together the parts of a head must
give the whole-head result, every dim written once."""

import dataclasses

import pytest
import torch
from test_interpret import make_spec

from vllm_ext.megakernel.ops import qkv
from vllm_ext.reference import rms_norm
from vllm_ext.testing import random_weights


def emulate_unit(w, x, cos_sin, pos, head, part, d, parts, nq, nkv, shift=0):
    """``_head_parts`` for one unit: ``{(buffer, head, dim): [B] values}``
    (buffer "q", "k" or "v"). ``shift`` moves the RoPE dim by that much (a
    deliberately wrong mapping)."""
    n, half = d // (2 * parts), d // 2
    b = x.shape[0]
    head_buf = torch.full((b, d), float("nan"), dtype=torch.float64)
    for blk in (0, 1):
        first = head * d + blk * half + part * n
        for row in range(first, first + n):
            head_buf[:, blk * n + row - first] = x @ w[row]
    out = {}
    if head < nq + nkv:
        name, h = ("q", head) if head < nq else ("k", head - nq)
        for j in range(n):
            dim = (part * n + j + shift) % half
            x1, x2 = head_buf[:, j], head_buf[:, n + j]
            c, sn = cos_sin[pos, dim], cos_sin[pos, dim + half]
            out[(name, h, dim)] = x1 * c - x2 * sn
            out[(name, h, dim + half)] = x2 * c + x1 * sn
    else:
        for col in range(2 * n):
            dim = (col // n) * half + part * n + col % n
            out[("v", head - nq - nkv, dim)] = head_buf[:, col]
    return out


def reference_f64(spec, weights, h, pos):
    """ops/qkv.py over every fused head, in float64."""
    spec = dataclasses.replace(spec, dtype=torch.float64)
    layer = weights.layers[0]
    layer = dataclasses.replace(
        layer, **{f.name: getattr(layer, f.name).double()
                  for f in dataclasses.fields(layer)
                  if isinstance(getattr(layer, f.name), torch.Tensor)}
    )  # fmt: skip
    cos, sin = weights.cos_sin.double()[pos].chunk(2, -1)
    heads = spec.num_q_heads + 2 * spec.num_kv_heads
    return qkv.reference(h.double(), layer, spec, 0, heads, cos, sin), layer


@pytest.mark.parametrize("arch, parts", [("llama", 2), ("mistral", 2),
                                         ("mistral", 4)])  # fmt: skip
@pytest.mark.parametrize("shift", [0, 1], ids=["kernel", "wrong_dim"])
def test_head_parts_give_the_whole_head(arch, parts, shift):
    spec = make_spec(arch, torch.float32)
    weights = random_weights(spec, seed=1)
    b, d = 3, spec.head_dim
    nq, nkv = spec.num_q_heads, spec.num_kv_heads
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(b, spec.hidden_size, generator=gen)
    pos = torch.tensor([0, 5, 17])
    want, layer = reference_f64(spec, weights, h, pos)
    # The GEMV's input: the normed row, as the reference forms it.
    x = rms_norm(h.double(), layer.input_norm, spec.rms_norm_eps).double()
    got: dict = {}
    for unit in range((nq + 2 * nkv) * parts):
        written = emulate_unit(layer.qkv, x, weights.cos_sin.double(), pos,
                               unit // parts, unit % parts, d, parts, nq, nkv,
                               shift)  # fmt: skip
        assert not set(written) & set(got), "a dim written twice"
        got.update(written)
    if shift:
        # Off by one dim: values land on their neighbours' dims and rotate
        # with their cos/sin, which the comparison must catch.
        with pytest.raises(AssertionError):
            check(got, want, nq, nkv, d)
        return
    check(got, want, nq, nkv, d)


def check(got: dict, want: torch.Tensor, nq: int, nkv: int, d: int) -> None:
    base = {"q": 0, "k": nq, "v": nq + nkv}
    expected = {(name, h, dim) for name, n in (("q", nq), ("k", nkv), ("v", nkv))
                for h in range(n) for dim in range(d)}  # fmt: skip
    assert set(got) == expected, "dims missing or out of range"
    for (name, h, dim), value in got.items():
        torch.testing.assert_close(value, want[:, base[name] + h, dim],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
