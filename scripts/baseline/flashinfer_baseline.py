# SPDX-License-Identifier: Apache-2.0
"""The per-op baseline's attention on the GPU: the KV append and split-KV
paged decode attention of ``flashinfer_decode.cu`` (built here by
``build_flashinfer.py``, run on the GPU machine through ctypes: no vLLM, no
FlashInfer Python package there).

What vLLM 0.32's default decode runs for attention on an H200, and the
stand-in for each:

- the cache write: vLLM's ``reshape_and_cache_flash``, one kernel per layer
  writing every token's K and V at its slot (padded slots skipped). Here:
  ``kv_append``, one kernel per layer doing the same work (one CTA a token,
  16-byte copies): no slower by construction (not yet timed on a GPU).
- decode attention: FlashAttention 3 (``get_flash_attn_version`` is 3 on
  SM 9.x), its scheduler metadata computed ahead of time, which splits each
  request's KV so that the batch's CTAs fill the SMs (at most 32 splits
  under a FULL CUDA graph), then merges the splits. Here: FlashInfer's
  paged decode with split-KV (``partition_kv``), its chunk chosen as
  FlashInfer's own planner chooses it (``plan``: the smallest chunk, of at
  least 128 tokens, whose work items fit the decode kernel's resident CTAs
  on all SMs), the partial outputs merged by FlashInfer's
  ``VariableLengthMergeStates``. Both fill the SMs by splitting long KV;
  without the split, batch 1 would run one CTA per KV head (8 of 132
SMs). The
  GPU check checks the plan against FlashInfer's planner
  (``FlashInferDecode.split_plan``) and the attention against the
  reference (``device_run.flashinfer_checks``).

The plan holds for one set of sequence lengths (vLLM re-plans each step):
the GPU check plans a step's inputs, then captures the step in a CUDA
graph, as vLLM's FULL graph mode replays it. It carries no padding (FlashInfer
pads its CUDA-graph grid to the largest plan and always merges): exact for
the captured inputs, and by construction no slower.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctypes_library import CtypesLibrary  # noqa: E402

LIBRARY = "libflashinfer_decode_sm_90a.so"
# FlashInfer's decode planner never cuts a chunk shorter than 128 tokens
# (max(128 / page_size, 1) pages; scheduler.cuh).
MIN_CHUNK_TOKENS = 128


def split_kv(
    num_pages: list[int], kv_heads: int, max_grid_size: int, page_size: int
) -> tuple[int, int, bool]:
    """(chunk in pages, work items, split): FlashInfer's choice
    (``BatchDecodeWithPagedKVCacheWorkEstimationDispatched`` with
    ``PartitionPagedKVCacheBinarySearchMinNumPagePerBatch``). A work item
    runs one chunk of one request on ``kv_heads`` CTAs; ``max_grid_size``
    is how many CTAs of the decode kernel the GPU holds at once (0: never
    split). A batch that fills the grid already is not split; otherwise
    the smallest chunk of at least MIN_CHUNK_TOKENS whose work items still
    fit, and the split only where some request has more than one chunk."""
    batch = len(num_pages)
    longest = max(num_pages, default=0)
    if max_grid_size <= 0 or batch * kv_heads >= max_grid_size:
        return max(longest, 1), batch, False
    low, high = max(MIN_CHUNK_TOKENS // page_size, 1), longest
    while low < high:  # the least chunk whose work items fit the grid
        mid = (low + high) // 2
        if sum(-(-p // mid) for p in num_pages) * kv_heads > max_grid_size:
            low = mid + 1
        else:
            high = mid
    work_items = sum(-(-max(p, 1) // low) for p in num_pages)
    return low, work_items, work_items != batch


def plan(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    kv_heads: int = 1,
    max_grid_size: int = 0,
) -> dict[str, Any]:
    """The decode's page lists and work items, computed on the host (the
    caller plans before it captures), as tensors on ``block_table``'s
    device: ``indices``/``indptr``/``last`` (each request's pages and the
    tokens in its last), ``request_indices``/``kv_tile_indices`` (work item
    j runs chunk ``kv_tile_indices[j]`` of request ``request_indices[j]``),
    ``o_indptr`` (the merge's indptr: request i's items are ``o_indptr[i]``
    .. ``o_indptr[i + 1] - 1``, in order), ``chunk`` (the chunk in tokens);
    and as ints: ``chunk_pages``, ``work_items``, ``split``. With
    ``max_grid_size`` 0, one work item per request."""
    dev = block_table.device
    lens = seq_lens.cpu().long()
    pages = (lens + block_size - 1) // block_size
    table = block_table.cpu()
    take = torch.arange(table.shape[1])[None, :] < pages[:, None]
    counts = pages.tolist()
    chunk, work_items, split = split_kv(counts, kv_heads, max_grid_size, block_size)
    request_indices, kv_tile_indices, o_indptr = [], [], [0]
    for i, p in enumerate(counts):
        chunks = -(-max(p, 1) // chunk)
        request_indices += [i] * chunks
        kv_tile_indices += range(chunks)
        o_indptr.append(o_indptr[-1] + chunks)
    assert o_indptr[-1] == work_items

    def i32(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(dev)

    return {
        "indices": i32(table[take]),
        "indptr": i32(torch.cat([pages.new_zeros(1), pages.cumsum(0)])),
        "last": i32(lens - (pages - 1) * block_size),
        "request_indices": i32(request_indices),
        "kv_tile_indices": i32(kv_tile_indices),
        "o_indptr": i32(o_indptr),
        "chunk": i32([chunk * block_size]),
        "chunk_pages": chunk,
        "work_items": work_items,
        "split": split,
    }


def workspace(plan_: dict[str, Any], q_heads: int, head_dim: int) -> dict[str, Any]:
    """The split's partial outputs (bf16, as FlashInfer keeps them) and
    log-sum-exps (fp32), one row per work item, added to ``plan_``; none
    where nothing is split (the kernel then writes the output directly)."""
    if plan_["split"]:
        dev, n = plan_["indices"].device, plan_["work_items"]
        plan_["tmp_v"] = torch.empty(n, q_heads, head_dim, dtype=torch.bfloat16,
                                     device=dev)  # fmt: skip
        plan_["tmp_s"] = torch.empty(n, q_heads, dtype=torch.float32, device=dev)
    return plan_


def cache_layout(cache: torch.Tensor) -> None:
    """Raise unless ``cache`` is a bf16 view ``[blocks, kv_heads, block,
    K|V]`` of memory ``[block, token, kv_head, K|V]`` (vLLM's FlashAttention
    layout, what the kernels read; only the block stride is free)."""
    _, heads, _, entry = cache.shape
    if cache.dtype != torch.bfloat16 or cache.stride()[1:] != (entry, heads * entry, 1):
        raise ValueError(
            f"cache {cache.dtype} strides {cache.stride()}: want bf16, "
            f"(*, {entry}, {heads * entry}, 1)"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [n, heads, d] as the kernels read it: the last dimension
    contiguous and every row 16-byte aligned (else a contiguous copy)."""
    aligned = (x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
               and x.stride(1) % 8 == 0)  # fmt: skip
    return x if x.stride(2) == 1 and aligned else x.contiguous()


_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class FlashInferDecode(CtypesLibrary):
    """The kernels of ``flashinfer_decode.cu`` through ctypes, over vLLM's
    cache layout. Every call raises RuntimeError on a CUDA error, so a GPU
    run reports it."""

    LIBRARY = LIBRARY
    SIGNATURES = {
        "flashinfer_paged_decode_split": [
            _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p,  # pointers, tmp_v, tmp_s
            _i32, _i32, _i32, _i32, _i32, _i32,  # batch .. page_size
            _i64, _i64, _i64, _f32, _p,  # strides, scale, stream
        ],
        "flashinfer_paged_decode": [
            _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _i32, _i32, _i32, _i32, _i32,
            _i64, _f32, _p,
        ],
        "flashinfer_decode_work_estimation": [_p, _i32, _i32, _i32, _i32, _i32, _p],
        "kv_append": [_p, _p, _p, _p, _i32, _i32, _i32, _i32, _i64, _i64, _i64, _i64,
                      _i64, _p],
    }  # fmt: skip

    plan = staticmethod(plan)  # (callers plan through the class)

    def estimate(self, indptr: list[int], q_heads: int, kv_heads: int, head_dim: int,
                 page_size: int) -> dict[str, int]:  # fmt: skip
        """FlashInfer's own decode planner on the GPU (its occupancy query
        gives the grid limit): split, max_grid_size, chunk_pages,
        work_items."""
        host = (ctypes.c_int32 * len(indptr))(*indptr)
        out = (ctypes.c_int32 * 4)()
        err = self.lib.flashinfer_decode_work_estimation(
            host, len(indptr) - 1, q_heads, kv_heads, head_dim, page_size, out
        )
        self._check("flashinfer_decode_work_estimation", err)
        return dict(zip(("split", "max_grid_size", "chunk_pages", "work_items"),
                        out, strict=True))  # fmt: skip

    def split_plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int, q_heads: int, kv_heads: int,
                   head_dim: int) -> dict[str, Any]:  # fmt: skip
        """``plan`` on this GPU's grid limit, with its workspace; raises
        where it differs from FlashInfer's own planner."""
        pages = (seq_lens.cpu().long() + block_size - 1) // block_size
        indptr = [0, *pages.cumsum(0).tolist()]
        theirs = self.estimate(indptr, q_heads, kv_heads, head_dim, block_size)
        grid = theirs["max_grid_size"]
        mine = plan(block_table, seq_lens, block_size, kv_heads, grid)
        keys = ("split", "chunk_pages", "work_items")
        if any(int(mine[k]) != theirs[k] for k in keys):
            raise RuntimeError(
                f"split-KV plan {[int(mine[k]) for k in keys]} differs from "
                f"FlashInfer's {[theirs[k] for k in keys]} ({keys})"
            )
        mine["max_grid_size"] = grid
        return workspace(mine, q_heads, head_dim)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, plan_: dict[str, Any],
                 out: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        """Attention of ``q`` [B, q heads, d] bf16 (strided rows are read in
        place) over ``cache`` into ``out`` (contiguous, like q), split as
        ``plan_`` says (a split plan needs its ``workspace``)."""
        cache_layout(cache)
        q = _rows(q)
        n, nq, d = q.shape
        if q.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            raise ValueError(f"q {q.dtype}, out {out.dtype}: want bf16")
        if not out.is_contiguous() or out.shape != q.shape:
            raise ValueError(f"out {tuple(out.shape)}: want {tuple(q.shape)}")
        if plan_["split"] and "tmp_v" not in plan_:
            raise ValueError("a split plan needs its workspace()")
        tmp_v, tmp_s = plan_.get("tmp_v"), plan_.get("tmp_s")
        err = self.lib.flashinfer_paged_decode_split(
            q.data_ptr(), cache.data_ptr(), plan_["indices"].data_ptr(),
            plan_["indptr"].data_ptr(), plan_["last"].data_ptr(), out.data_ptr(),
            plan_["request_indices"].data_ptr(), plan_["kv_tile_indices"].data_ptr(),
            plan_["o_indptr"].data_ptr(), plan_["chunk"].data_ptr(),
            tmp_v.data_ptr() if tmp_v is not None else None,
            tmp_s.data_ptr() if tmp_s is not None else None,
            n, plan_["work_items"], nq, cache.shape[1], d, cache.shape[2],
            cache.stride(0), q.stride(0), q.stride(1), scale,
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        self._check("flashinfer_paged_decode_split", err)
        return out

    def append(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
               cache: torch.Tensor) -> None:  # fmt: skip
        """Write k, v [T, kv heads, d] bf16 (strided views read in place) at
        ``slot_mapping`` (negative: skipped) into ``cache``: one launch."""
        cache_layout(cache)
        # (the kernel picks 16-byte copies where the addresses allow them)
        k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (k, v))
        slots = slot_mapping.long()  # (no copy when int64 already)
        t, heads, d = k.shape
        if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
            raise ValueError(f"k {k.dtype}, v {v.dtype}: want bf16")
        if v.shape != k.shape or slots.shape != (t,) or heads != cache.shape[1]:
            shapes = [tuple(x.shape) for x in (k, v, slots, cache)]
            raise ValueError(f"k, v, slot_mapping, cache: shapes {shapes}")
        err = self.lib.kv_append(
            k.data_ptr(), v.data_ptr(), slots.data_ptr(), cache.data_ptr(), t, heads, d,
            cache.shape[2], cache.stride(0), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        self._check("kv_append", err)

    def append_error(self, cache: torch.Tensor, slot_mapping: torch.Tensor) -> float:
        """``append`` checked on a cache whose tokens at ``slot_mapping``
        are written already: those entries cleared in a copy, then written
        back by one launch from strided views of [T + 1, kv heads, K|V]
        whose extra token has slot -1 (vLLM's padding: must not land). The
        largest |difference| from ``cache`` (0 if right)."""
        slots = slot_mapping.long()
        bs, d = cache.shape[2], cache.shape[3] // 2
        blk, off = slots // bs, slots % bs
        new = cache[blk, :, off]  # [T, kv heads, K|V]
        kv = torch.cat([new, torch.ones_like(new[:1])])
        copy = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype,
                                   device=cache.device).copy_(cache)  # fmt: skip
        copy[blk, :, off] = 0
        padded = torch.cat([slots, slots.new_full((1,), -1)])
        self.append(kv[..., :d], kv[..., d:], padded, copy)
        return (copy.float() - cache.float()).abs().max().item()


# attend(layer, q, k, v) as scripts/baseline/per_op.py's Attend.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flashinfer_attend(flashinfer: FlashInferDecode, spec, weights, inputs) -> Attend:
    """The per-op step's attention (``spec`` a ModelSpec, ``weights``
    DecodeWeights, ``inputs`` DecodeInputs on the GPU): the new K/V into the
    paged cache with one ``kv_append`` launch (as vLLM's
    ``reshape_and_cache_flash``), then FlashInfer's split-KV paged decode
    over the same cache and block table as the megakernel, planned once
    here for ``inputs``' sequence lengths. A plan that fails (a CUDA error,
    a plan unlike FlashInfer's) raises where the step runs, which the
    caller reports beside its other figures."""
    b, d = inputs.batch_size, spec.head_dim
    try:
        plan_ = flashinfer.split_plan(inputs.block_table, inputs.seq_lens,
                                      inputs.kv_caches[0].shape[2], spec.num_q_heads,
                                      spec.num_kv_heads, d)  # fmt: skip
    except (RuntimeError, ValueError) as e:
        error = e

        def failed(layer: int, q, k, v) -> torch.Tensor:
            raise error

        return failed
    out = torch.empty(b, spec.num_q_heads, d, device=inputs.block_table.device,
                      dtype=torch.bfloat16)  # fmt: skip

    def attend(layer: int, q, k, v) -> torch.Tensor:
        cache = inputs.kv_caches[layer]  # [blocks, kv heads, block, K|V]
        flashinfer.append(k, v, inputs.slot_mapping, cache)
        return flashinfer(q, cache, plan_, out, weights.attn_scale).view(b, -1)

    return attend
