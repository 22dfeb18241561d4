# SPDX-License-Identifier: Apache-2.0
"""QK-norm and RoPE in ATTN (kernel/ops/qk_finish.py, ``norm_rope``;
isa.py, ``Program.qk_in_attn``): the lane layout, emulated and held against
the reference (ops/qkv.py, ``finish``).

The kernel cannot run on this machine; this checks the layout it relies
on: a head spread over a group of lanes in dim order (ATTN: 32 lanes of d /
32 dims; the wide attention: d / 8 lanes of 8), the sum of squares over the
group, and each dim's RoPE partner in the lane ``lanes / 2`` away, with the
first half's cos/sin. Rounded to bf16 where the kernel rounds, the result
is within one bf16 step (2^-7 relative) of the reference in bf16; a
partner one lane group off must not be."""

import dataclasses

import pytest
import torch
from test_interpret import make_spec

from vllm_ext.megakernel.kernel.ops.common import VEC
from vllm_ext.megakernel.ops import qkv


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def emulate(x, norm, cos_sin_row, n: int, lanes: int, eps: float, offset: int):
    """``norm_rope`` over a lane group: lane l holds dims [l n, (l + 1) n);
    ``offset`` is the partner's lane distance (the kernel's: lanes / 2)."""
    d = x.shape[-1]
    half = d // 2
    regs = [x[..., lane * n : (lane + 1) * n] for lane in range(lanes)]
    ss = sum((r * r).sum(-1, keepdim=True) for r in regs)
    rstd = torch.rsqrt(ss / d + eps)
    normed = [bf16(r * rstd * norm[lane * n : (lane + 1) * n])
              for lane, r in enumerate(regs)]  # fmt: skip
    out = []
    for lane in range(lanes):
        first = lane * n
        sign, j0 = (-1.0, first) if first < half else (1.0, first - half)
        c = cos_sin_row[..., j0 : j0 + n]
        s = cos_sin_row[..., half + j0 : half + j0 + n]
        other = normed[lane ^ offset]
        out.append(bf16(normed[lane] * c + sign * other * s))
    return torch.cat(out, -1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("attention", ["attn", "wide"])
@pytest.mark.parametrize("wrong", [False, True], ids=["kernel", "wrong_partner"])
def test_lane_groups_finish_the_head_as_the_reference(head_dim, attention, wrong):
    d = head_dim
    spec = dataclasses.replace(make_spec("qwen3", torch.bfloat16), head_dim=d)
    n, lanes = (d // 32, 32) if attention == "attn" else (VEC, d // VEC)
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(3, 1, d, generator=gen).to(torch.bfloat16)  # one head
    norm = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    pos = torch.tensor([0, 7, 300]).double()
    freq = 1e6 ** (-torch.arange(0, d, 2).double() / d)
    angle = pos[:, None] * freq
    cos_sin = torch.cat((angle.cos(), angle.sin()), -1).float()  # [3, d]
    cos, sin = cos_sin.chunk(2, -1)
    want = qkv.finish(y, norm, spec, cos, sin).double()
    offset = lanes // 4 if wrong else lanes // 2
    got = emulate(y.double(), norm.double(), cos_sin.double()[:, None], n, lanes,
                  spec.rms_norm_eps, offset)  # fmt: skip
    close = torch.allclose(got, want, rtol=2**-7, atol=1e-6)
    assert close != wrong
