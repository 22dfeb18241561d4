# SPDX-License-Identifier: Apache-2.0
"""COMBINE over dim parts of q heads (kernel/ops/combine.py; isa.py): the
kernel's thread-strided walk of a tile's units, run on Python ints through
the kernel's own ``unit_element``, merging in float64 and held against the
COMBINE reference (ops/combine.py, float64 in, so exact up to summation
order: 1e-12).

The kernel cannot run on this machine; this checks what dim parts change:
which request, q head and dim each element of a tile's units is. Together
the tiles of a kv head must write every element of its q heads once and
nothing else; a walk that drops the part's offset must fail."""

import math

import pytest
import torch

from vllm_ext.megakernel.kernel.ops.combine import unit_element
from vllm_ext.megakernel.ops import combine


def emulate(o, lse, units, parts, element=unit_element):
    """Every tile ``(lo, hi)`` of ``units`` run as the kernel walks it (all
    threads' strides together: each idx once) -> ``[B, group, d]`` float64,
    NaN where nothing wrote, and how often each element was written."""
    chunks, b, group, d = o.shape
    dims = d // parts
    out = torch.full((b, group, d), float("nan"), dtype=torch.float64)
    writes = torch.zeros((b, group, d), dtype=torch.int64)
    for lo, hi in units:
        n = hi - lo
        for idx in range(b * n * dims):
            i, gi, dim = element(idx, lo, n, dims, parts)
            top = max(float(lse[c, i, gi]) for c in range(chunks))
            top = 0.0 if top == -math.inf else top
            num = den = 0.0
            for c in range(chunks):
                wgt = math.exp(float(lse[c, i, gi]) - top)
                num += wgt * float(o[c, i, gi, dim])
                den += wgt
            out[i, gi, dim] = num / (den or 1.0)
            writes[i, gi, dim] += 1
    return out, writes


def partials(chunks, b, group, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(chunks, b, group, d, generator=gen, dtype=torch.float64)
    lse = torch.randn(chunks, b, group, generator=gen, dtype=torch.float64)
    lse[:, -1] = -math.inf  # a padded request: no tokens in any chunk
    return o, lse


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
@pytest.mark.parametrize("b, group, d", [(1, 4, 64), (3, 1, 128), (2, 3, 64)])
@pytest.mark.parametrize("tile", [1, 3], ids=["unit", "units"])
def test_the_units_walk_is_the_reference(parts, b, group, d, tile):
    o, lse = partials(4, b, group, d)
    total = group * parts
    # The planner's tiles are one unit each; wider ones walk the same way.
    units = [(lo, min(lo + tile, total)) for lo in range(0, total, tile)]
    got, writes = emulate(o, lse, units, parts)
    assert torch.equal(writes, torch.ones_like(writes))
    want = combine.reference(o, lse, torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_walk_without_the_parts_offset_fails():
    def dropped(idx, lo, n, dims, parts):
        i, gi, dim = unit_element(idx, lo, n, dims, parts)
        return i, gi, dim % dims  # every part writes the first part's dims

    o, lse = partials(4, 2, 2, 64)
    got, writes = emulate(o, lse, [(u, u + 1) for u in range(8)], 4, dropped)
    assert not torch.equal(writes, torch.ones_like(writes))
    assert got.isnan().any()
