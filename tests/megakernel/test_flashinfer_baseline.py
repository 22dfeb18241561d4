# SPDX-License-Identifier: Apache-2.0
"""The per-op baseline's attention (scripts/baseline/flashinfer_baseline.py)
where no GPU is needed: its split-KV plan is FlashInfer's (the least chunk
whose work items fit the grid; a full batch unsplit), covers each request's
tokens once and in order, and attention computed chunk by chunk on that plan
and merged by log-sum-exp is the plain attention; the library's entry points
bind and report errors as CUDA error codes."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.utils import load_script
from vllm_ext.reference import decode_attention

ROOT = Path(__file__).resolve().parents[2]
H200_SMS = 132
BS = 16  # block (page) size, as vLLM's default


fb = load_script("scripts/baseline/flashinfer_baseline.py")


def _table(lens: list[int], seed: int = 0) -> torch.Tensor:
    """Shuffled physical blocks, each request's row wide enough for all."""
    width = max(-(-n // BS) for n in lens)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(lens) * width, generator=gen)
    return perm.view(len(lens), width).to(torch.int32)


def _plan(lens: list[int], kv_heads: int, grid: int) -> dict:
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return fb.plan(_table(lens), seq_lens, BS, kv_heads, grid)


def _least_chunk(pages: list[int], kv_heads: int, grid: int) -> int:
    """The definition the binary search implements: the least chunk of at
    least 128 tokens whose work items fit the grid (the longest request's
    pages where none does)."""
    low = max(fb.MIN_CHUNK_TOKENS // BS, 1)
    for chunk in range(low, max(pages) + 1):
        if sum(-(-p // chunk) for p in pages) * kv_heads <= grid:
            return chunk
    return max(low, max(pages))


@pytest.mark.parametrize("seed", range(20))
def test_the_chunk_is_the_least_that_fits(seed):
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 40, (1,), generator=gen))
    pages = torch.randint(0, 600, (batch,), generator=gen).tolist()
    kv_heads = (1, 2, 4, 8)[seed % 4]
    grid = H200_SMS * (1, 2, 4, 8, 16)[seed % 5]
    chunk, items, split = fb.split_kv(pages, kv_heads, grid, BS)
    assert items == sum(-(-max(p, 1) // chunk) for p in pages)
    if batch * kv_heads >= grid:  # the batch alone fills the grid
        assert not split and items == batch
        return
    assert chunk == _least_chunk(pages, kv_heads, grid)
    assert items * kv_heads <= grid or chunk >= max(pages)
    assert split == (items != batch)


@pytest.mark.parametrize("seed", range(6))
def test_the_chunks_cover_each_request_once_in_order(seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 1500, (9,), generator=gen).tolist()
    lens[:3] = [1, BS, 8 * BS + 1]  # one token, one full page, 128 + 1
    p = _plan(lens, kv_heads=2, grid=64 + 16 * seed)
    assert p["split"]
    chunk = p["chunk"].item()
    assert chunk == p["chunk_pages"] * BS and chunk >= fb.MIN_CHUNK_TOKENS
    req, tile = p["request_indices"].tolist(), p["kv_tile_indices"].tolist()
    o_indptr = p["o_indptr"].tolist()
    assert len(req) == len(tile) == p["work_items"] == o_indptr[-1]
    assert o_indptr[0] == 0 and len(o_indptr) == len(lens) + 1
    for i, n in enumerate(lens):
        items = range(o_indptr[i], o_indptr[i + 1])
        assert [req[j] for j in items] == [i] * len(items)
        assert [tile[j] for j in items] == list(range(len(items)))
        spans = [(t * chunk, min((t + 1) * chunk, n)) for t in range(len(items))]
        # Back to back from 0 to the request's length, none empty.
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a < b for a, b in spans)
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))


def test_page_lists():
    p = _plan([33, 16, 1], kv_heads=1, grid=0)
    table = _table([33, 16, 1])
    pages = [table[0, :3].tolist(), table[1, :1].tolist(), table[2, :1].tolist()]
    assert p["indices"].tolist() == sum(pages, [])
    assert p["indptr"].tolist() == [0, 3, 4, 5]
    assert p["last"].tolist() == [1, 16, 1]
    # grid 0: one work item per request, not split.
    assert not p["split"] and p["request_indices"].tolist() == [0, 1, 2]
    assert p["kv_tile_indices"].tolist() == [0, 0, 0]
    assert p["o_indptr"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("per_sm", [4, 8, 16])
def test_batch_1_long_context_fills_the_sms(per_sm):
    """One request of 32k tokens on 8 KV heads: unsplit, 8 CTAs of the
    H200's 132 SMs; split, as many as the grid holds, at least one per SM."""
    grid = H200_SMS * per_sm
    p = _plan([32768], kv_heads=8, grid=grid)
    ctas = p["work_items"] * 8
    assert p["split"] and H200_SMS <= ctas <= grid
    assert ctas > grid * 3 // 4  # the least chunk: one page less overflows
    assert -(-2048 // (p["chunk_pages"] - 1)) * 8 > grid


def test_a_short_context_is_cut_at_128_tokens():
    """Batch 1 at the GPU check's context (512): FlashInfer's floor of 128
    tokens a chunk decides, 4 work items on each KV head."""
    p = _plan([512], kv_heads=8, grid=H200_SMS * 8)
    assert p["split"] and p["chunk_pages"] == 8 and p["work_items"] == 4


@pytest.mark.parametrize(
    "tokens, per_sm", [(100, 2), (100, 8), (4096, 2)], ids=["short", "short8", "long"]
)
def test_batch_64_is_not_split(tokens, per_sm):
    """64 requests on 8 KV heads are 512 CTAs: as many as a grid of 2 a SM
    holds and more, unsplit whatever the context; short contexts (7 pages,
    under the 128-token floor) stay unsplit on a larger grid too."""
    p = _plan([tokens] * 64, kv_heads=8, grid=H200_SMS * per_sm)
    assert not p["split"] and p["work_items"] == 64
    assert p["request_indices"].tolist() == list(range(64))
    assert p["o_indptr"].tolist() == list(range(65))


def _vllm_cache(blocks: int, kv_heads: int, d: int, seed: int) -> torch.Tensor:
    """vLLM's FlashAttention layout: memory [block, token, head, K|V]."""
    gen = torch.Generator().manual_seed(seed)
    phys = torch.randn(blocks, BS, kv_heads, 2 * d, generator=gen).bfloat16()
    return phys.permute(0, 2, 1, 3)


def split_decode(q: torch.Tensor, cache: torch.Tensor, p: dict, scale: float):
    """The split computation as the kernel runs the plan: each work item's
    chunk of its request's tokens (through the page list), its softmax-
    weighted V and log-sum-exp in fp32; then each request's items merged,
    weighted by exp(lse - their log-sum-exp)."""
    nq, d = q.shape[1], q.shape[2]
    kv_heads = cache.shape[1]
    indices, indptr = p["indices"].tolist(), p["indptr"].tolist()
    last, chunk = p["last"].tolist(), p["chunk"].item()
    outs, lses = [], []
    for r, t in zip(p["request_indices"].tolist(), p["kv_tile_indices"].tolist(),
                    strict=True):  # fmt: skip
        pages = indptr[r + 1] - indptr[r]
        length = (pages - 1) * BS + last[r]
        # (unsplit, the kernel runs the whole request whatever the chunk)
        lo, hi = (t * chunk, (t + 1) * chunk) if p["split"] else (0, length)
        hi = min(hi, length)
        pos = torch.arange(lo, hi)
        page = torch.tensor(indices)[indptr[r] + pos // BS]
        kv = cache[page, :, pos % BS].float()  # [tokens, kv heads, K|V]
        qi = q[r].float().view(kv_heads, -1, d)
        s = torch.einsum("hgd,shd->hgs", qi, kv[..., :d]) * scale
        o = torch.einsum("hgs,shd->hgd", torch.softmax(s, -1), kv[..., d:])
        outs.append(o.reshape(nq, d))
        lses.append(torch.logsumexp(s, -1).reshape(nq))
    o_indptr = p["o_indptr"].tolist()
    merged = []
    for i in range(len(o_indptr) - 1):
        rows = slice(o_indptr[i], o_indptr[i + 1])
        o, lse = torch.stack(outs[rows]), torch.stack(lses[rows])  # [items, nq, ...]
        w = torch.softmax(lse, 0)  # exp(lse_j - logsumexp(lse))
        merged.append((w[..., None] * o).sum(0))
    return torch.stack(merged)


@pytest.mark.parametrize("grid", [0, 24, 48, 1000], ids=lambda g: f"grid{g}")
def test_split_attention_is_the_plain_attention(grid):
    """On the same plan, chunk by chunk then merged: the reference's
    attention to fp32 rounding (grid 0: unsplit; 24 and 48: split at the
    floor and above it; 1000: more CTAs than work, the floor again)."""
    lens = [1, BS, 8 * BS, 8 * BS + 1, 300, 700, 2000]
    kv_heads, nq, d = 2, 8, 64
    table = _table(lens, seed=1)
    cache = _vllm_cache(table.numel(), kv_heads, d, seed=2)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), nq, d, generator=torch.Generator().manual_seed(3))
    q = q.bfloat16()
    p = fb.plan(table, seq_lens, BS, kv_heads, grid)
    assert p["split"] == (grid > 0)
    if grid == 24:
        assert p["chunk_pages"] > 8  # above the floor
    scale = d**-0.5
    got = split_decode(q, cache, p, scale)
    want = decode_attention(q, cache, table, seq_lens, scale)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_the_cache_layout_is_checked():
    cache = _vllm_cache(4, 2, 64, seed=0)
    fb.cache_layout(cache)
    fb.cache_layout(cache[1:])  # another base, same strides
    with pytest.raises(ValueError, match="strides"):
        fb.cache_layout(cache.contiguous())  # [block, head, token, K|V]
    with pytest.raises(ValueError, match="bf16"):
        fb.cache_layout(cache.float())


def test_a_split_plan_gets_its_workspace():
    p = fb.workspace(_plan([700], kv_heads=2, grid=64), 8, 64)
    assert p["tmp_v"].shape == (p["work_items"], 8, 64)
    assert p["tmp_v"].dtype == torch.bfloat16
    assert p["tmp_s"].shape == (p["work_items"], 8)
    assert p["tmp_s"].dtype == torch.float32
    assert "tmp_v" not in fb.workspace(_plan([100], kv_heads=2, grid=64), 8, 64)


def test_no_library_no_baseline(tmp_path):
    assert fb.FlashInferDecode.load(tmp_path) is None


@pytest.fixture(scope="module")
def library(baseline_builds) -> Path:
    proc, out = baseline_builds.result("build_flashinfer.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # nvcc's warnings ("file(line): warning #..."), not pip's about its
    # index locations.
    assert not re.search(r"\): warning|: warning:", proc.stderr), proc.stderr[-3000:]
    return out / fb.LIBRARY


def test_the_library_needs_nothing_on_the_gpu_machine(library):
    """The GPU machine has libc and libstdc++, not the CUDA runtime the
    build linked statically."""
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.splitlines()
              if "(NEEDED)" in line}  # fmt: skip
    assert needed <= {"libc.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                      "libm.so.6", "ld-linux-x86-64.so.2"}  # fmt: skip


def test_the_entry_points_bind_and_report_errors(library):
    """Every entry point the wrapper calls is exported, and a shape the
    kernels do not take comes back as cudaErrorInvalidValue (1), raised,
    before any GPU work (so this runs without one)."""
    lib = fb.FlashInferDecode(library)
    with pytest.raises(RuntimeError, match="CUDA error 1$"):
        lib.estimate([0, 4], 40, 8, 128, BS)  # group size 5
    with pytest.raises(RuntimeError, match="CUDA error 1$"):
        lib.estimate([0, 4], 32, 8, 96, BS)  # head_dim 96
    args = (None, None, None, None, 1, 8, 128, 0, 4096, 0, 0, 0, 0, None)
    assert lib.lib.kv_append(*args) == 1  # page size 0
    split = [None] * 12 + [2, 1, 32, 8, 128, BS, 4096, 4096, 128, 1.0, None]
    assert lib.lib.flashinfer_paged_decode_split(*split) == 1  # fewer items
    if not torch.cuda.is_available():  # no driver: an error, not a crash
        with pytest.raises(RuntimeError, match="CUDA error"):
            lib.estimate([0, 4], 32, 8, 128, BS)
