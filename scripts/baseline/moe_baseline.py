# SPDX-License-Identifier: Apache-2.0
"""The per-op baseline of a mixture-of-experts layer at decode: what vLLM
0.32.0's default runs for an unquantized bf16 MoE on an H200, kernel by
kernel, on a machine without vLLM.

What vLLM 0.32.0 selects (read from the installed package, paths under
``vllm/model_executor/layers/fused_moe/`` unless stated; C++ sources from
the sdist, ``csrc/``):

- The experts: ``oracle/unquantized.py:69-80`` lists, on CUDA, FlashInfer
  TRT-LLM, FlashInfer CUTLASS, TRITON, BATCHED_TRITON, and on Hopper
  (``is_device_capability_family(90)``) moves both FlashInfer backends to
  the back ("slower than Triton"); the loop at ``:358`` takes the first
  whose ``is_supported_config`` holds: ``TritonExperts``
  (``experts/triton_moe.py:65``; supported for bf16 with fewer than 1024
  padded experts, ``:69-91``). No ``moe_backend`` set, no LoRA, no DP/EP.
- ``TritonExperts.apply`` (``experts/triton_moe.py:243``): the tile config
  from ``try_get_optimal_moe_config`` (``fused_moe.py:1419``): the JSON
  ``configs/E={E},N={N},device_name=NVIDIA_H200.json`` (``N`` the expert's
  intermediate size, ``w2.shape[2]``; bf16 adds no dtype; every H200
  variant maps to ``NVIDIA_H200``, ``fused_moe.py:1093``), the entry of the
  batch size nearest ``M`` (``:1444``); with no file, ``get_default_config``
  (``:1296``, bf16 branch: ``BLOCK_SIZE_M`` 16 up to M 32, ``N`` 64 up to
  M 64, ``K`` 128, 4 warps, 4 stages up to M 32). Qwen3-30B-A3B (E=128,
  N=768) and Mixtral-8x7B (E=8, N=14336) have H200 files; Mixtral-8x22B
  (E=8, N=16384) and the test models do not.
- The expert assignment (``fused_moe.py:1541``): "naive" when
  ``M * top_k * 4 <= E`` (``:1559``; Qwen3-30B-A3B up to M 4, Mixtral at
  M 1): one program per (token, slot), ``expert_ids = topk_ids``, and a
  ``torch.full`` for the padded count; otherwise ``moe_align_block_size``
  (``moe_align_block_size.py:55``), the CUDA op
  ``csrc/moe/moe_align_sum_kernels.cu:673``: one kernel for E <= 64 and
  under 1024 ids (``:719``), else two (align, then count-and-sort with
  atomics, ``:745-785``).
- Then ``fused_moe_kernel`` (Triton, ``fused_moe.py:297``) twice through
  ``invoke_fused_moe_triton_kernel`` (``:761``: grid, ``EM`` trimmed to
  ``M * top_k * BLOCK_SIZE_M`` for small M at ``:823-833``, ``SPLIT_K`` 1,
  no swap-AB and no tensor descriptors for bf16 on CUDA): gate/up into
  ``[M, top_k, 2N]``, ``silu_and_mul`` (``csrc/activation_kernels.cu``: the
  SiLU rounded to the dtype, ``:165``, then times ``up``, ``:44``), down with
  the routing weight applied in fp32 into ``[M, top_k, H]``; ``moe_sum``
  (``experts/triton_moe.py:610``, ``csrc/moe/moe_align_sum_kernels.cu:420``:
  fp32 sum over the slots, rounded once).
- The router GEMM: Qwen3-MoE (``models/qwen3_moe.py:170``) and Mixtral
  (``models/mixtral.py:111``) build ``GateLinear`` with no ``out_dtype``,
  so its Hopper tiers (cute-DSL ``ll_bf16``, cuBLAS bf16->fp32; both want
  ``out_dtype`` fp32, ``router/gate_linear.py:231,282``) are off and it is
  ``F.linear`` (``:287``): cuBLAS, bf16 logits.
- The routing: ``router/router_factory.py:258`` ``FusedTopKRouter``:
  ``fused_topk`` (``router/fused_topk_router.py:80``), the CUDA op
  ``topk_softmax`` (one kernel: softmax in fp32, top-k, renormalise; fp32
  weights, int32 ids). DeepSeek-style grouped routing with a correction
  bias: ``router/grouped_topk_router.py:81``, the CUDA op ``grouped_topk``.

What this baseline runs, per layer (``moe_layer``):

1. router GEMM: ``F.linear`` (cuBLAS), bf16 logits: the same call.
2. routing: ``_route_kernel`` (ours, Triton, one kernel; softmax or
   sigmoid, correction bias for selection, grouped top-k, renormalise,
   scale: ``vllm_ext/moe.py``'s rule, ties to the lower index) for vLLM's
   one ``topk_softmax`` / ``grouped_topk`` kernel.
3. assignment: the naive rule as vLLM's (same condition, same
   ``torch.full``); otherwise ``_align_kernel`` (ours, Triton, one CTA, one
   kernel) for ``moe_align_block_size``: the same three outputs with the
   same sizes and meaning (tokens of an expert in token order, where vLLM's
   atomics leave the order within an expert free).
4. gate/up and down: vLLM's own ``fused_moe_kernel``, taken from the
   installed vLLM at bundle-build time (``prepare``: its ``@triton.jit``
   functions, by ``ast``, unchanged) with vLLM's tile config for the shape
   (its H200 JSON; or its ``get_default_config``, compiled from the same
   source and run for the batch sizes asked with the platform a CUDA one,
   ``vllm_default_config``); launched with
   ``invoke_fused_moe_triton_kernel``'s arguments for the unquantized case.
5. ``_silu_mul_kernel`` (ours, Triton, one kernel; vLLM's rounding) for
   ``silu_and_mul``; ``torch.sum`` over the slots (one kernel, fp32
   accumulation) for ``moe_sum``.
6. a shared expert (DeepSeek): ``F.linear``, ``_silu_mul_kernel``,
   ``F.linear``, added to the routed sum (vLLM runs it as a dense MLP).

The expert GEMMs, which carry nearly all of the time (the expert weights),
are vLLM's kernel with vLLM's configs. The stand-ins are one kernel each
where vLLM has one (two for ``moe_align_block_size`` with E > 64): as many
launches or fewer, so the baseline is no slower by construction except
where ``_align_kernel``'s single CTA were slower than vLLM's two kernels
(argued, not yet timed; ``time_layer`` times the layer and, apart, the
part before the experts). The Triton on the GPU machine is 3.6.0 (torch
2.11), not the one vLLM 0.32.0's torch 2.13 brings; the kernel's code is
the same, its compiled code may differ a little.

Host side: ``prepare(bundle, shapes, batches)`` writes
``bundle/moe_baseline/`` (the extracted kernel module, the configs, a
manifest). GPU side, no vLLM: ``MoeBaseline.load(bundle)``, ``moe_layer``,
``time_layer``. Under ``TRITON_INTERPRET=1`` (set before triton is
imported) everything runs on CPU tensors, which is how
``tests/megakernel/test_moe_baseline.py`` holds it to
``vllm_ext.reference.moe_mlp``.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script, or loaded by path
    sys.path.insert(0, str(ROOT))

from vllm_ext.model_spec import ModelSpec, MoeSpec  # noqa: E402
from vllm_ext.weights import MoeWeights  # noqa: E402

# Inside the installed vLLM package.
FUSED_MOE = "model_executor/layers/fused_moe/fused_moe.py"
CONFIG_DIR = "model_executor/layers/fused_moe/configs"
# vLLM's Triton functions the expert GEMMs need, in source order.
KERNELS = ("write_zeros_to_output", "fused_moe_kernel")
# The device that names vLLM's config files (every H200 maps to it).
DEVICE_NAME = "NVIDIA_H200"
# What prepare writes under the bundle.
SUBDIR = "moe_baseline"
KERNEL_MODULE = "vllm_fused_moe_kernel.py"
MANIFEST = "manifest.json"


# --------------------------------------------------------- host: extraction


def vllm_package() -> Path:
    """The installed vLLM's package directory, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vLLM is not installed: nothing to extract from")
    return Path(spec.origin).parent


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """Names ``fn`` reads that it neither binds nor gets from builtins."""
    bound = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    loads = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Store):
                bound.add(node.id)
            else:
                loads.add(node.id)
    return loads - bound - set(dir(builtins))


def extract_kernels(source: str, names: Sequence[str] = KERNELS) -> dict[str, Any]:
    """The ``@triton.jit`` functions ``names`` of vLLM's ``fused_moe.py``
    ``source``, verbatim with their decorators: ``{"code", "lines"}``.
    Raises where one is missing, is not plainly ``@triton.jit``, or reads a
    module-level name other than ``tl``, ``triton`` and the others taken
    (a helper a later vLLM adds must be taken too, not found missing on
    the GPU machine)."""
    lines = source.splitlines()
    spans: dict[str, tuple[int, int]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or node.name not in names:
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if decorators != ["triton.jit"]:
            raise ValueError(f"{node.name}: decorators {decorators}, want triton.jit")
        free = _free_names(node) - {"tl", "triton", *names}
        if free:
            raise ValueError(f"{node.name} reads {sorted(free)}: extract those too")
        assert node.end_lineno is not None
        spans[node.name] = (node.decorator_list[0].lineno, node.end_lineno)
    missing = set(names) - set(spans)
    if missing:
        raise ValueError(f"not in fused_moe.py: {sorted(missing)}")
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    code = "\n\n\n".join("\n".join(lines[a - 1 : b]) for _, (a, b) in ordered)
    return {"code": code + "\n", "lines": {n: list(s) for n, s in ordered}}


def config_file_name(num_experts: int, n: int, dtype: torch.dtype) -> str:
    """vLLM's file name for an unquantized shape on an H200
    (``get_config_file_name`` with ``_get_config_dtype_str``: bf16 and fp16
    add nothing, fp32 adds ``dtype=float32``)."""
    suffix = ",dtype=float32" if dtype == torch.float32 else ""
    return f"E={num_experts},N={n},device_name={DEVICE_NAME}{suffix}.json"


class MoeShape(NamedTuple):
    """What selects the expert GEMMs' tile config. (Not dataclasses: a
    script loaded by path is in no ``sys.modules``.)"""

    num_experts: int
    intermediate: int  # N: one expert's gate (or up) width
    hidden: int  # K of the gate/up GEMM
    top_k: int
    dtype: torch.dtype

    @classmethod
    def of(cls, spec: ModelSpec) -> MoeShape:
        assert spec.moe is not None, f"{spec.architecture} has no mixture"
        m = spec.moe
        return cls(m.num_experts, m.expert_intermediate, spec.hidden_size, m.top_k,
                   spec.dtype)  # fmt: skip

    @property
    def key(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"E={self.num_experts},N={self.intermediate},K={self.hidden},"
                f"top_k={self.top_k},dtype={dt}")  # fmt: skip


class _CudaPlatform:
    """vLLM's ``current_platform`` as an H200 answers what
    ``get_default_config`` asks; anything else raises (a later vLLM that
    asks more must be answered here, not by this host's CPU platform)."""

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"current_platform.{name}: not answered off vLLM")


def vllm_default_config() -> Callable[..., dict[str, Any]]:
    """vLLM's ``get_default_config`` (``fused_moe.py``), compiled from the
    installed source, not imported (vLLM's import takes seconds and would
    answer for this host's platform): ``current_platform`` a CUDA one,
    ``envs.VLLM_BATCH_INVARIANT`` unset (its default); any other name it
    reads raises when called (only quantized branches read them)."""
    path = vllm_package() / FUSED_MOE
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                and n.name == "get_default_config")  # fmt: skip
    namespace: dict[str, Any] = {
        "envs": SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "current_platform": _CudaPlatform(),
    }
    for name in _free_names(node) - namespace.keys():

        def refuse(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise RuntimeError(f"get_default_config reads {_name}: not here")

        namespace[name] = refuse
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace["get_default_config"]


def expert_configs(shape: MoeShape, batches: Sequence[int]) -> dict[str, Any]:
    """vLLM's tile configs for ``shape`` on an H200: ``{"file", "exact",
    "configs"}`` with ``configs`` ``{batch size: config}``: its JSON's
    whole table (looked up by nearest batch size, as vLLM does), or, with
    no JSON, vLLM's ``get_default_config`` for each of ``batches`` (exact:
    no other batch size may use them)."""
    name = config_file_name(shape.num_experts, shape.intermediate, shape.dtype)
    path = vllm_package() / CONFIG_DIR / name
    if path.exists():
        table = json.loads(path.read_text())
        table.pop("triton_version", None)
        return {"file": name, "exact": False,
                "configs": {int(m): c for m, c in table.items()}}  # fmt: skip
    default = vllm_default_config()
    dtype = "float32" if shape.dtype == torch.float32 else None
    e, n, k, top_k = shape.num_experts, shape.intermediate, shape.hidden, shape.top_k
    configs = {m: default(m, e, n, k, top_k, dtype) for m in sorted(set(batches))}
    return {"file": None, "exact": True, "configs": configs}


def prepare(
    bundle: Path, shapes: Sequence[MoeShape], batches: Sequence[int]
) -> dict[str, Any]:
    """Write ``bundle/moe_baseline/``: vLLM's expert kernel as a module of
    its own (``KERNEL_MODULE``: ``import triton``, ``tl``, the functions)
    and ``MANIFEST`` (vLLM's version, the source file's sha256, the lines
    taken, and each shape's configs). Returns the manifest."""
    pkg = vllm_package()
    source = (pkg / FUSED_MOE).read_text()
    taken = extract_kernels(source)
    version = importlib.metadata.version("vllm")
    where = ", ".join(f"{n} {a}-{b}" for n, (a, b) in taken["lines"].items())
    header = (
        f"# SPDX-License-Identifier: Apache-2.0\n"
        f"# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
        f"# Taken unchanged at bundle-build time by scripts/baseline/"
        f"moe_baseline.py\n# from vLLM {version}, vllm/{FUSED_MOE} (lines: "
        f"{where}).\n# Not part of vllm-megakernel's sources.\n"
        f"import triton\nimport triton.language as tl\n\n\n"
    )
    out = bundle / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    (out / KERNEL_MODULE).write_text(header + taken["code"])
    manifest = {
        "vllm_version": version,
        "source": f"vllm/{FUSED_MOE}",
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "lines": taken["lines"],
        "device_name": DEVICE_NAME,
        "shapes": {s.key: expert_configs(s, batches) for s in shapes},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


# ------------------------------------------------------- our Triton kernels


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_row, scaling,
    E_P2: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
):  # fmt: skip
    """One row of router logits -> its top-k weights (fp32) and expert ids
    (int32), best first; ``vllm_ext/moe.py``'s rule."""
    row = tl.program_id(0)
    offs = tl.arange(0, E_P2)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=-float("inf"))
    x = x.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))
    if GROUPS > 1:
        # (the host sends only E == E_P2 here: groups tile the row exactly)
        per: tl.constexpr = E_P2 // GROUPS
        grouped = tl.reshape(choice, (GROUPS, per))
        best = tl.max(grouped, axis=1)
        if HAS_BIAS:  # a group ranked by the sum of its best two
            at = tl.argmax(grouped, axis=1)
            col = tl.arange(0, per)[None, :]
            rest = tl.where(col == at[:, None], -float("inf"), grouped)
            best += tl.max(rest, axis=1)
        group = tl.arange(0, GROUPS)
        kept = tl.zeros([GROUPS], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            g = tl.argmax(best, axis=0)
            kept = tl.where(group == g, 1, kept)
            best = tl.where(group == g, -float("inf"), best)
        mine = (offs[:, None] // per) == group[None, :]
        keep = tl.sum(tl.where(mine, kept[None, :], 0), axis=1) > 0
        choice = tl.where(keep, choice, -float("inf"))
    slot = tl.arange(0, K_P2)
    weights = tl.zeros([K_P2], dtype=tl.float32)
    ids = tl.zeros([K_P2], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        e = tl.argmax(choice, axis=0)  # (ties: the lower index)
        w = tl.sum(tl.where(offs == e, scores, 0.0), axis=0)
        weights = tl.where(slot == k, w, weights)
        ids = tl.where(slot == k, e, ids)
        choice = tl.where(offs == e, -float("inf"), choice)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    weights = weights * scaling
    keep_slot = slot < TOP_K
    tl.store(weights_ptr + row * TOP_K + slot, weights, mask=keep_slot)
    tl.store(ids_ptr + row * TOP_K + slot, ids, mask=keep_slot)


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, numel, num_blocks,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, PAD_P2: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr, NUM_BLOCK_CHUNKS: tl.constexpr,
):  # fmt: skip
    """``moe_align_block_size``'s outputs in one CTA: each expert's slots
    (flat ``token * top_k + k`` indices, in token order) padded to a
    multiple of BLOCK_M with ``numel``, experts in order; the expert of
    each block of BLOCK_M (-1 past the end); the padded total."""
    experts = tl.arange(0, E_P2)
    r = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        offs = c * CHUNK + r
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    # A slot's place: its expert's start, plus that expert's slots before it
    # in earlier chunks (seen) and in its own chunk (before).
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        offs = c * CHUNK + r
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        base = tl.sum(hit * (starts + seen)[None, :], axis=1)
        same = (ids[:, None] == ids[None, :]) & (r[None, :] < r[:, None])
        before = tl.sum(same.to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + before, offs, mask=offs < numel)
        seen += tl.sum(hit, axis=0)
    # The padding: each expert's last block after its slots (disjoint from
    # the slots written above, so no ordering between the two is needed).
    j = tl.arange(0, PAD_P2)[None, :]
    pad_at = (starts + counts)[:, None] + j
    pad = tl.zeros([E_P2, PAD_P2], dtype=tl.int32) + numel
    tl.store(sorted_ptr + pad_at, pad, mask=j < (padded - counts)[:, None])
    # A block's expert: how many experts' padded ranges end at or before it.
    for c in range(NUM_BLOCK_CHUNKS):
        b = c * BLOCK_CHUNK + tl.arange(0, BLOCK_CHUNK)
        first = b * BLOCK_M
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first < total, owner, -1)
        tl.store(expert_ids_ptr + b, owner, mask=b < num_blocks)


@triton.jit
def _silu_mul_kernel(in_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[r] = silu(in[r, :n]) * in[r, n:]``, the SiLU rounded to the
    output dtype before the product (as vLLM's ``silu_and_mul``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(in_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(dt), mask=mask)


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def route(
    logits: torch.Tensor, moe: MoeSpec, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[M, top_k]`` fp32, ids ``[M, top_k]`` int32): one launch
    of ``_route_kernel``."""
    if moe.scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown MoE scoring {moe.scoring!r}")
    m, e = logits.shape
    grouped = moe.grouped and moe.num_groups > 1
    if grouped and (e != _p2(e) or e % moe.num_groups):
        raise ValueError(f"grouped routing over {e} experts: want a power of two")
    weights = torch.empty(m, moe.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(m, moe.top_k, dtype=torch.int32, device=logits.device)
    bias = correction_bias if correction_bias is not None else weights
    _route_kernel[(m,)](
        logits, bias, weights, ids, e, logits.stride(0), float(moe.routed_scaling),
        E_P2=_p2(e), TOP_K=moe.top_k, K_P2=_p2(moe.top_k),
        SIGMOID=moe.scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        RENORMALIZE=moe.renormalize, GROUPS=moe.num_groups if grouped else 1,
        TOPK_GROUPS=moe.topk_groups if grouped else 1,
        # one warp a row up to 512 experts: its top-k's reductions stay in
        # the warp (no shared-memory round trips), as vLLM's topk_softmax
        num_warps=1 if _p2(e) <= 512 else 4,
    )  # fmt: skip
    return weights, ids


def align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align_block_size(topk_ids, block_m, num_experts)``'s outputs,
    sized as vLLM sizes them (``moe_align_block_size.py``)."""
    numel = topk_ids.numel()
    padded = numel + num_experts * (block_m - 1)
    if numel < num_experts:
        padded = min(numel * block_m, padded)
    blocks = triton.cdiv(padded, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    chunk = min(_p2(numel), 64)
    block_chunk = min(_p2(blocks), 64)
    _align_kernel[(1,)](
        topk_ids.view(-1), sorted_ids, expert_ids, total, numel, blocks,
        E_P2=_p2(num_experts), BLOCK_M=block_m, PAD_P2=_p2(block_m),
        CHUNK=chunk, NUM_CHUNKS=triton.cdiv(numel, chunk),
        BLOCK_CHUNK=block_chunk, NUM_BLOCK_CHUNKS=triton.cdiv(blocks, block_chunk),
    )  # fmt: skip
    return sorted_ids, expert_ids, total


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``[rows, 2n] -> [rows, n]``, one launch."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(_p2(n), 1024)
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out


# ------------------------------------------------------------ device side


_COMPUTE_TYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                 torch.float32: tl.float32}  # fmt: skip


class MoeBaseline:
    """vLLM's expert kernel and tile configs, loaded from a bundle."""

    def __init__(self, kernels: ModuleType, manifest: dict[str, Any]) -> None:
        self.kernels = kernels  # the extracted module: ``fused_moe_kernel``
        self.manifest = manifest

    @classmethod
    def load(cls, bundle: Path) -> MoeBaseline:
        """From ``prepare``'s output (imports nothing of vLLM)."""
        where = Path(bundle) / SUBDIR
        manifest = json.loads((where / MANIFEST).read_text())
        spec = importlib.util.spec_from_file_location(
            "vllm_fused_moe_kernel", where / KERNEL_MODULE
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # (registered before running it: triton.jit reads the source back)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return cls(module, manifest)

    def config(self, shape: MoeShape, m: int) -> dict[str, Any]:
        """vLLM's config for ``m`` tokens: the nearest batch size of the
        JSON (the smaller on a tie, as ``min`` over its ascending keys), or
        the default computed for exactly ``m``."""
        entry = self.manifest["shapes"].get(shape.key)
        if entry is None:
            raise KeyError(f"{shape.key}: not prepared in this bundle")
        table = {int(k): v for k, v in entry["configs"].items()}
        if entry["exact"]:
            if m not in table:
                raise KeyError(f"{shape.key}: no default config for batch {m}")
            return dict(table[m])
        return dict(table[min(sorted(table), key=lambda k: abs(k - m))])


def expert_gemm(
    base: MoeBaseline,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    total: torch.Tensor,
    top_k: int,
    config: dict[str, Any],
) -> None:
    """One launch of vLLM's ``fused_moe_kernel`` with the arguments
    ``invoke_fused_moe_triton_kernel`` gives it for unquantized weights
    (no scales, no bias, no swap-AB, no tensor descriptors): ``c [M,
    top_k, N] = a [rows, K] @ b[expert] [N, K]^T``, times the routing
    weight when ``topk_weights`` is given."""
    config = dict(config)
    block_m = config["BLOCK_SIZE_M"]
    m = a.shape[0]
    num_tokens = m * top_k
    if sorted_ids is not None:
        em = sorted_ids.shape[0]
        if m < block_m:  # (vLLM: at most one block per slot)
            em = min(em, m * top_k * block_m)
    else:
        em = num_tokens * block_m
    n, k = b.shape[1], b.shape[2]
    config["SPLIT_K"] = 1
    block_k = config.pop("BLOCK_SIZE_K")
    grid = (triton.cdiv(em, block_m) * triton.cdiv(n, config["BLOCK_SIZE_N"]),)
    base.kernels.fused_moe_kernel[grid](
        a, b, c, None, None, None, topk_weights, sorted_ids, expert_ids, total,
        n, k, em, num_tokens,
        a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1),
        c.stride(1), c.stride(2), 0, 0, 0, 0, 0, 0, 0, 0, 0,
        MUL_ROUTED_WEIGHT=topk_weights is not None, top_k=top_k,
        compute_type=_COMPUTE_TYPE[a.dtype], use_fp8_w8a8=False,
        use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        naive_block_assignment=sorted_ids is None, HAS_BIAS=False,
        BLOCK_SIZE_K=block_k, SWAP_AB=False, USE_TD=False, **config,
    )  # fmt: skip


class Assignment(NamedTuple):
    """The routing and the expert GEMMs' launch data for one layer."""

    config: dict[str, Any]
    weights: torch.Tensor  # [M, top_k] fp32
    sorted_ids: torch.Tensor | None  # None: vLLM's naive assignment
    expert_ids: torch.Tensor
    total: torch.Tensor  # [1] int32: the padded slot count


def assign(
    base: MoeBaseline, x: torch.Tensor, w: MoeWeights, moe: MoeSpec
) -> Assignment:
    """Router GEMM (``F.linear``, bf16 logits), routing, and the expert
    assignment as vLLM chooses it: naive where ``M * top_k * 4 <= E``
    (``fused_moe.py:1559``), else the aligned blocks."""
    m, hidden = x.shape
    e, two_n, _ = w.w13.shape
    config = base.config(MoeShape(e, two_n // 2, hidden, moe.top_k, x.dtype), m)
    weights, ids = route(F.linear(x, w.router), moe, w.correction_bias)
    block_m = config["BLOCK_SIZE_M"]
    if m * moe.top_k * 4 <= e:
        total = torch.full((1,), ids.numel() * block_m, dtype=torch.int32,
                           device=x.device)  # fmt: skip
        return Assignment(config, weights, None, ids.view(-1), total)
    return Assignment(config, weights, *align_block_size(ids, block_m, e))


def moe_layer(
    base: MoeBaseline, x: torch.Tensor, w: MoeWeights, moe: MoeSpec
) -> torch.Tensor:
    """The layer's mixture on ``x`` ``[M, hidden]`` (normed, model dtype)
    -> ``[M, hidden]`` in the model dtype: ``vllm_ext.reference.moe_mlp``'s
    function, computed as vLLM's default computes it (module docstring)."""
    m, hidden = x.shape
    two_n, top_k = w.w13.shape[1], moe.top_k
    a = assign(base, x, w, moe)
    gate_up = torch.empty(m, top_k, two_n, dtype=x.dtype, device=x.device)
    expert_gemm(base, x, w.w13, gate_up, None, a.sorted_ids, a.expert_ids, a.total,
                top_k, a.config)  # fmt: skip
    act = silu_mul(gate_up.view(m * top_k, two_n))
    down = torch.empty(m, top_k, hidden, dtype=x.dtype, device=x.device)
    expert_gemm(base, act, w.w2, down, a.weights, a.sorted_ids, a.expert_ids,
                a.total, 1, a.config)  # fmt: skip
    out = torch.sum(down, dim=1)  # moe_sum: fp32 over the slots, rounded once
    if w.shared_gate_up is not None:
        assert w.shared_down is not None
        shared = F.linear(silu_mul(F.linear(x, w.shared_gate_up)), w.shared_down)
        out = out + shared
    return out


def graph_ms(fn: Callable[[], Any], iters: int = 20, repeats: int = 5) -> float:
    """``fn`` captured in one CUDA graph (after a warm-up run off the graph,
    where Triton compiles), replayed; CUDA events; the median of
    ``repeats`` runs of ``iters`` replays, in milliseconds a replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / iters)
    return sorted(runs)[len(runs) // 2]


def time_layer(
    base: MoeBaseline,
    x: torch.Tensor,
    layers: Sequence[MoeWeights],
    moe: MoeSpec,
    iters: int = 20,
    repeats: int = 5,
    timer: Callable[..., float] = graph_ms,
) -> dict[str, Any]:
    """``moe_layer`` on ``x`` over ``layers`` in turn, one CUDA graph
    (``timer``: ``graph_ms``; tests pass one that runs on CPU): ``layer_ms``
    a layer; ``front_ms`` the part before the
    experts (router GEMM, routing, assignment: where the stand-ins for
    vLLM's CUDA ops are); ``read_bytes`` the weights a layer reads (router,
    the experts its tokens picked, any shared expert; the mean over
    ``layers``) and ``gb_per_s`` that over ``layer_ms``. Give enough
    layers that what they read outweighs the L2 (50 MB on an H200), or the
    replays read weights from cache."""
    n = len(layers)
    layer_ms = timer(lambda: [moe_layer(base, x, w, moe) for w in layers],
                     iters, repeats) / n  # fmt: skip
    front_ms = timer(lambda: [assign(base, x, w, moe) for w in layers],
                     iters, repeats) / n  # fmt: skip
    read = 0
    for w in layers:
        _, ids = route(F.linear(x, w.router), moe, w.correction_bias)
        per_expert = w.w13[0].nbytes + w.w2[0].nbytes
        read += w.router.nbytes + ids.unique().numel() * per_expert
        if w.shared_gate_up is not None and w.shared_down is not None:
            read += w.shared_gate_up.nbytes + w.shared_down.nbytes
    read //= n
    return {"batch": x.shape[0], "layers": n, "layer_ms": layer_ms,
            "front_ms": front_ms, "read_bytes": read,
            "gb_per_s": read / layer_ms / 1e6}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """``python scripts/baseline/moe_baseline.py BUNDLE --model NAME
    [--shape E,N,HIDDEN,TOP_K] [--batches 1,16]``: ``prepare`` for the
    bf16 mixtures of ``vllm_ext/configs`` models and of explicit shapes."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("bundle", type=Path)
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="a vllm_ext/configs name, e.g. qwen3-30b-a3b",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        help="E,N,HIDDEN,TOP_K: experts, expert width, hidden, top-k",
    )
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args(argv)  # fmt: skip
    from vllm_ext import configs

    shapes = [
        MoeShape.of(
            ModelSpec.from_hf_config(configs.hf_config(name), torch.bfloat16, 4096)
        )  # fmt: skip
        for name in args.model
    ]
    shapes += [MoeShape(*map(int, s.split(",")), torch.bfloat16) for s in args.shape]
    if not shapes:
        parser.error("no --model or --shape")
    batches = [int(b) for b in args.batches.split(",")]
    manifest = prepare(args.bundle, shapes, batches)
    size = sum(p.stat().st_size for p in (args.bundle / SUBDIR).iterdir())
    print(f"{args.bundle / SUBDIR}: {size} bytes, vLLM {manifest['vllm_version']}")
    for key, entry in manifest["shapes"].items():
        print(f"  {key}: {entry['file'] or 'vLLM default configs'}")


if __name__ == "__main__":
    main()
