# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's MLA paged decode (``flashinfer_mla.cu``, built here by
``build_flashinfer_mla.py``) through ctypes, over vLLM's latent cache
``[pages, page_size, 576]`` read in place: the GPU check's second reference
for the MLA cases' attention and the per-op MLA step's attention when the
bundle carries it (else the torch ops of ``mla_per_op.torch_mla_attend``).

What vLLM's FLASHINFER_MLA backend runs (its default on Blackwell; on an
H200 vLLM's default is FLASH_ATTN_MLA, which cannot travel): FlashInfer's
planner on the host for the batch's lengths, once, then one cooperative
launch per layer (the split-KV partials and their merge inside it).
Its first GPU run (H200, 2026-12-04) hit an illegal address: the plan's
int workspace was never copied to the device (FlashInfer 0.7's MLAPlan
leaves that copy to its caller; flashinfer_mla.cu makes it now), not yet
rerun. Every call raises RuntimeError on a CUDA error, and the check
reports a reference that fails or disagrees with the torch one without
counting it against the kernel.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctypes_library import CtypesLibrary  # noqa: E402

LIBRARY = "libflashinfer_mla_sm90a.so"
# FlashInfer's MLA wrapper allocates these (its partial o of every cluster
# tile, its plan's index arrays).
FLOAT_WORKSPACE = 128 << 20
INT_WORKSPACE = 8 << 20
PLAN_FIELDS = 18
RANK, ROPE = 512, 64  # the one shape the library is built for


_p, _u32, _f32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_float
_size = ctypes.c_size_t


class FlashInferMla(CtypesLibrary):
    LIBRARY = LIBRARY
    SIGNATURES = {
        "flashinfer_mla_plan": [_p, _size, _p, _p, _size, _p, _p, _p, _p, _u32, _u32,
                                _p],
        "flashinfer_mla_run": [_p, _p, _p, _p, _p, _p, _p, _p, _p, _u32, _u32, _u32,
                               _u32, _u32, _u32, _u32, _u32, _f32, _p],
    }  # fmt: skip

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, heads: int,
             page_size: int) -> dict[str, Any]:  # fmt: skip
        """FlashInfer's plan for these lengths (one query token each), with
        its workspaces and the requests' pages flattened (kv_indices)."""
        dev = block_table.device
        lens = seq_lens.cpu().to(torch.int32)
        pages = (lens + page_size - 1) // page_size
        b = len(lens)
        kv_indptr = torch.zeros(b + 1, dtype=torch.int32)
        kv_indptr[1:] = pages.cumsum(0)
        qo_indptr = torch.arange(b + 1, dtype=torch.int32)
        rows = [block_table[i, : int(pages[i])].to(torch.int32) for i in range(b)]
        out = {
            "float_ws": torch.empty(FLOAT_WORKSPACE, dtype=torch.uint8, device=dev),
            "int_ws": torch.empty(INT_WORKSPACE, dtype=torch.uint8, device=dev),
            # The planner stages its arrays here and copies them on the
            # stream: kept alive with the plan.
            "host": torch.empty(INT_WORKSPACE, dtype=torch.uint8).pin_memory(),
            "kv_indices": torch.cat(rows).contiguous(),
            "info": (ctypes.c_int64 * PLAN_FIELDS)(),
            "heads": heads, "page_size": page_size, "batch": b,
            "indptr": (qo_indptr, kv_indptr, lens),
        }  # fmt: skip
        err = self.lib.flashinfer_mla_plan(
            out["float_ws"].data_ptr(), FLOAT_WORKSPACE, out["int_ws"].data_ptr(),
            out["host"].data_ptr(), INT_WORKSPACE, out["info"], qo_indptr.data_ptr(),
            kv_indptr.data_ptr(), lens.data_ptr(), b, heads,
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        self._check("flashinfer_mla_plan", err)
        # The plan's copy from the pinned buffer (flashinfer_mla.cu) is
        # queued on the stream by hand (torch does not know of it): done
        # before the buffer can go.
        torch.cuda.current_stream().synchronize()
        return out

    def __call__(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 plan: dict[str, Any], out: torch.Tensor, scale: float,
                 lse: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The latent output ``out`` [n, heads, 512] bf16 (contiguous) of
        ``q_latent`` [n, heads, 512] and ``q_pe`` [n, heads, 64] bf16 (last
        dimension contiguous) over ``cache``; ``lse`` [n, heads] fp32 if
        given (natural log)."""
        n, heads = q_latent.shape[:2]
        if cache.dtype != torch.bfloat16 or cache.shape[-1] != RANK + ROPE:
            raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype}")
        if cache.stride(-1) != 1 or cache.stride(1) != RANK + ROPE:
            raise ValueError(f"cache strides {cache.stride()}")
        for name, x, d in (("q_latent", q_latent, RANK), ("q_pe", q_pe, ROPE)):
            if (
                x.dtype != torch.bfloat16
                or x.shape != (n, heads, d)
                or x.stride(2) != 1
            ):
                raise ValueError(f"{name} {tuple(x.shape)} {x.dtype} {x.stride()}")
        if out.shape != (n, heads, RANK) or not out.is_contiguous():
            raise ValueError(f"out {tuple(out.shape)}")
        if (n, heads, cache.shape[1]) != (plan["batch"], plan["heads"],
                                         plan["page_size"]):  # fmt: skip
            raise ValueError("the plan is for another batch, heads or page size")
        err = self.lib.flashinfer_mla_run(
            plan["float_ws"].data_ptr(), plan["int_ws"].data_ptr(), plan["info"],
            q_latent.data_ptr(), q_pe.data_ptr(), cache.data_ptr(),
            plan["kv_indices"].data_ptr(), out.data_ptr(),
            lse.data_ptr() if lse is not None else None, heads, cache.shape[1],
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            cache.stride(0), cache.stride(1), scale,
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        self._check("flashinfer_mla_run", err)
        return out


def flashinfer_attention(fi: FlashInferMla, spec, weights, inputs):
    """``mla_per_op.absorbed_attend``'s attention by FlashInfer, planned once
    here for ``inputs``' lengths (a plan that fails raises here)."""
    mla, b = spec.mla, inputs.batch_size
    block_size = inputs.kv_caches[0].shape[1]
    plan = fi.plan(inputs.block_table, inputs.seq_lens, mla.num_heads, block_size)
    out = torch.empty(b, mla.num_heads, mla.kv_lora_rank, dtype=torch.bfloat16,
                      device=inputs.block_table.device)  # fmt: skip

    def attention(layer: int, q_lat, q_pe, cache) -> torch.Tensor:
        return fi(q_lat, q_pe.contiguous(), cache, plan, out, weights.attn_scale)

    return attention
