# SPDX-License-Identifier: Apache-2.0
"""The per-op MoE baseline (scripts/baseline/moe_baseline.py) where no GPU
is needed: vLLM's expert kernel is extracted from the installed vLLM
unchanged, with vLLM's tile configs; the bundle runs with vLLM made
unimportable; and the layer it computes, run by Triton's CPU interpreter,
is the mixture ``vllm_ext.reference.moe_mlp`` computes, with vLLM's
rounding points exactly, for Qwen3-MoE-, Mixtral- and DeepSeek-like
mixtures at batch 1 (vLLM's naive assignment) and 5 (the aligned blocks).

The layers run in one subprocess (``TRITON_INTERPRET=1`` must be set before
triton is imported; vLLM blocked on ``sys.meta_path``), every buffer the
baseline allocates poisoned (NaN, or an out-of-range index)."""

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.utils import load_script
from vllm_ext.model_spec import MoeSpec
from vllm_ext.moe import route
from vllm_ext.reference import linear, moe_mlp
from vllm_ext.weights import MoeWeights

ROOT = Path(__file__).resolve().parents[2]
mb = load_script("scripts/baseline/moe_baseline.py")

HIDDEN = 64
MOES = {
    "qwen3_moe": MoeSpec(num_experts=16, top_k=4, expert_intermediate=32,
                         sparse_layers=(True,)),
    "mixtral": MoeSpec(num_experts=8, top_k=2, expert_intermediate=32,
                       sparse_layers=(True,)),
    # DeepSeek-V3's routing: sigmoid, a correction bias, grouped top-k,
    # scaled weights, a shared expert.
    "deepseek": MoeSpec(num_experts=16, top_k=4, expert_intermediate=32,
                        sparse_layers=(True,), scoring="sigmoid", grouped=True,
                        num_groups=4, topk_groups=2, correction_bias=True,
                        routed_scaling=2.5, shared_intermediate=64),
}  # fmt: skip
# Batch 1: M * top_k * 4 <= E in all three, vLLM's naive assignment (one
# program per slot); batch 5: moe_align_block_size's blocks.
BATCHES = (1, 5)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |a - b| / max |b| against reference.moe_mlp. fp32: the same sums in
# another order. bf16: vLLM rounds the SiLU before the product and each
# expert's weighted down projection before the sum, the reference once at
# the end; observed up to 2**-7 (one step at the output's largest).
TOL_REFERENCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
# ... and against vllm_rounding (the same rounding points as vLLM): fp32
# order only; bf16 at most one rounding step of the largest output where an
# fp32 sum in another order lands on the other side (observed: equal).
TOL_VLLM = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
# A layer with two experts' weights swapped must be further off than this.
SWAPPED_MIN = 0.1
# Align cases: (experts, slots, BLOCK_SIZE_M); 1000 slots run 16 chunks.
LAYERS = [(a, d, b) for a in MOES for d in DTYPES for b in BATCHES]
ALIGN = [(8, 20, 16), (128, 40, 16), (128, 1000, 16), (128, 1000, 64), (64, 300, 32)]

# Run in the subprocess: vLLM blocked; the interpreter taught what the GPU
# does that it lacks (Triton 3.9: tl.dot on bf16 multiplies the raw bits,
# and an fp32 -> bf16 cast truncates; the GPU widens bf16 exactly and
# rounds to nearest even); torch.empty poisoned; the cases run.
DRIVER = r"""
import importlib.abc, importlib.util, json, sys
from pathlib import Path


class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"blocked: {name}")
        return None


sys.meta_path.insert(0, NoVllm())
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as ti

dot, cast = ti.InterpreterBuilder.create_dot, ti.InterpreterBuilder.cast_impl


def wide(h):
    if h.dtype == tl.bfloat16:
        bits = h.data.astype(np.uint32) << 16
        return ti.TensorHandle(bits.view(np.float32), tl.float32)
    return h


def create_dot(self, a, b, d, *args):
    return dot(self, wide(a), wide(b), d, *args)


def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        f = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        bits = f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return ti.TensorHandle(bits, tl.bfloat16)
    return cast(self, src, dst_type)


ti.InterpreterBuilder.create_dot = create_dot
ti.InterpreterBuilder.cast_impl = cast_impl
empty = torch.empty


def poisoned(*args, **kwargs):
    t = empty(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else 2**30)


torch.empty = poisoned
root, bundle, cases, out = map(Path, sys.argv[1:5])
sys.path.insert(0, str(root))
spec = importlib.util.spec_from_file_location(
    "moe_baseline", root / "scripts/baseline/moe_baseline.py")
mb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mb)
base = mb.MoeBaseline.load(bundle)
results = {}
for name, case in torch.load(cases, weights_only=False).items():
    kind, args = case
    if kind == "layer":
        x, w, moe = args
        results[name] = mb.moe_layer(base, x, w, moe)
    elif kind == "timing":
        x, layers, moe = args
        runs = []

        def timer(fn, iters, repeats):
            runs.append(fn())
            return 2.0

        result = mb.time_layer(base, x, layers, moe, timer=timer)
        # (the layers' outputs; the assignments, named tuples, counted)
        results[name] = (result, runs[0], len(runs[1]))
    elif kind == "align":
        results[name] = mb.align_block_size(*args)
    else:
        results[name] = mb.route(*args)
torch.save(results, out)
try:
    import vllm  # noqa
    blocked = False
except ModuleNotFoundError:
    blocked = True
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print(json.dumps({"blocked": blocked, "vllm_modules": loaded}))
"""


def _weights(moe: MoeSpec, dtype, gen: torch.Generator) -> MoeWeights:
    def mat(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    e, n, s = moe.num_experts, moe.expert_intermediate, moe.shared_intermediate
    bias = 0.01 * torch.randn(e, generator=gen) if moe.correction_bias else None
    return MoeWeights(
        router=mat(e, HIDDEN), correction_bias=bias, w13=mat(e, 2 * n, HIDDEN),
        w2=mat(e, HIDDEN, n), shared_gate_up=mat(2 * s, HIDDEN) if s else None,
        shared_down=mat(HIDDEN, s) if s else None,
    )  # fmt: skip


def _layer_cases() -> dict:
    cases = {}
    for i, (arch, dname, batch) in enumerate(LAYERS):
        moe, dtype = MOES[arch], DTYPES[dname]
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(batch, HIDDEN, generator=gen).to(dtype)
        w = _weights(moe, dtype, gen)
        cases[f"{arch}-{dname}-{batch}"] = ("layer", (x, w, moe))
    return cases


def _timing_cases() -> dict:
    """Two Qwen3-MoE-like layers at batch 5 (bf16) through time_layer."""
    x, w, moe = _layer_cases()["qwen3_moe-bf16-5"][1]
    gen = torch.Generator().manual_seed(99)
    return {"timing": ("timing", (x, [w, _weights(moe, x.dtype, gen)], moe))}


def _align_cases() -> dict:
    gen = torch.Generator().manual_seed(7)
    cases = {}
    for e, n, bm in ALIGN:
        ids = torch.randint(0, e, (n,), generator=gen, dtype=torch.int32)
        ids[: n // 4] = 3  # one expert with many slots (several blocks)
        cases[f"align-{e}-{n}-{bm}"] = ("align", (ids.view(-1, 1), bm, e))
    return cases


def _route_cases() -> dict:
    gen = torch.Generator().manual_seed(11)
    cases = {}
    for arch, moe in MOES.items():
        logits = torch.randn(7, moe.num_experts, generator=gen).bfloat16()
        bias = 0.1 * torch.randn(moe.num_experts, generator=gen)
        cases[f"route-{arch}"] = ("route", (logits, moe, bias if moe.correction_bias
                                            else None))  # fmt: skip
    # Ties: equal logits; the lower expert index first (vllm_ext/moe.py).
    tie = torch.zeros(2, 16).bfloat16()
    tie[1, 5:9] = 1.0
    cases["route-ties"] = ("route", (tie, MOES["qwen3_moe"], None))
    return cases


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bundle")
    shapes = [mb.MoeShape(m.num_experts, m.expert_intermediate, HIDDEN, m.top_k, dt)
              for m in MOES.values() for dt in DTYPES.values()]  # fmt: skip
    # Qwen3-30B-A3B: vLLM ships its H200 table.
    shapes.append(mb.MoeShape(128, 768, 2048, 8, torch.bfloat16))
    mb.prepare(path, shapes, BATCHES)
    return path


@pytest.fixture(scope="module")
def run(bundle, tmp_path_factory) -> dict:
    """Every case through the bundle in one subprocess without vLLM."""
    work = tmp_path_factory.mktemp("run")
    cases = {**_layer_cases(), **_timing_cases(), **_align_cases(), **_route_cases()}
    torch.save(cases, work / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(ROOT), str(bundle), str(work / "cases.pt"),
         str(work / "out.pt")],
        capture_output=True, text=True, timeout=300, env=env, cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"cases": cases, "out": torch.load(work / "out.pt"), "status": status}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def vllm_rounding(x: torch.Tensor, w: MoeWeights, moe: MoeSpec) -> torch.Tensor:
    """The mixture with vLLM's rounding points, slot by slot: router logits,
    gate/up and the SiLU rounded to the dtype, the SiLU times up rounded,
    each slot's down projection times its weight rounded (the kernel's
    store), the slots summed in fp32 and rounded (``moe_sum``); a shared
    expert's output rounded and added in the dtype."""
    dt = x.dtype
    weights, ids = route(linear(x, w.router).to(dt), moe, w.correction_bias)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.to(dt).float().chunk(2, dim=-1)
        return (F.silu(gate).to(dt).float() * up).to(dt)

    out = torch.zeros(x.shape)
    for i in range(x.shape[0]):
        for j, e in enumerate(ids[i].tolist()):
            y = linear(act(linear(x[i : i + 1], w.w13[e])), w.w2[e])
            out[i] += (y[0] * weights[i, j]).to(dt).float()
    out = out.to(dt)
    if w.shared_gate_up is not None:
        shared = linear(act(linear(x, w.shared_gate_up)), w.shared_down).to(dt)
        out = out + shared
    return out


@pytest.mark.parametrize("arch, dname, batch", LAYERS)
def test_layer_is_the_reference_mixture(run, arch, dname, batch):
    name = f"{arch}-{dname}-{batch}"
    x, w, moe = run["cases"][name][1]
    got = run["out"][name]
    dtype = DTYPES[dname]
    # (the grid covers both of vLLM's assignments)
    assert (batch * moe.top_k * 4 <= moe.num_experts) == (batch == 1)
    assert got.shape == x.shape and got.dtype == dtype
    assert not got.isnan().any()
    assert _rel(got, moe_mlp(x, w, moe)) < TOL_REFERENCE[dtype]
    assert _rel(got, vllm_rounding(x, w, moe)) <= TOL_VLLM[dtype]


@pytest.mark.parametrize("arch, dname, batch", LAYERS)
def test_swapped_experts_are_told_apart(run, arch, dname, batch):
    """Row 0's first expert swapped with an expert no row picks: the
    baseline's output is far from that mixture (so the comparison above
    fails where the kernel read the wrong expert's weights)."""
    name = f"{arch}-{dname}-{batch}"
    x, w, moe = run["cases"][name][1]
    _, ids = route(linear(x, w.router).to(x.dtype), moe, w.correction_bias)
    unused = sorted(set(range(moe.num_experts)) - set(ids.flatten().tolist()))
    a, b = int(ids[0, 0]), unused[0]
    perm = list(range(moe.num_experts))
    perm[a], perm[b] = b, a
    swapped = dataclasses.replace(w, w13=w.w13[perm], w2=w.w2[perm])
    assert _rel(run["out"][name], moe_mlp(x, swapped, moe)) > SWAPPED_MIN


@pytest.mark.parametrize("experts, slots, block_m", ALIGN)
def test_align_is_moe_align_block_sizes_layout(run, experts, slots, block_m):
    """vLLM's layout: each expert's slots in one run of whole blocks,
    experts in order, padded with ``slots``; each block's expert; the
    padded total; sizes as vLLM allocates them."""
    ids = run["cases"][f"align-{experts}-{slots}-{block_m}"][1][0].flatten()
    sorted_ids, expert_ids, total = run["out"][f"align-{experts}-{slots}-{block_m}"]
    counts = torch.bincount(ids.long(), minlength=experts).tolist()
    padded = [-(-c // block_m) * block_m for c in counts]
    size = slots + experts * (block_m - 1)
    if slots < experts:
        size = min(slots * block_m, size)
    assert sorted_ids.shape == (size,) and expert_ids.shape == (-(-size // block_m),)
    assert total.tolist() == [sum(padded)]
    start = 0
    for e, (c, p) in enumerate(zip(counts, padded, strict=True)):
        run_e = sorted_ids[start : start + p].tolist()
        # (vLLM's atomics leave the order within an expert free; ours is
        # token order)
        assert run_e[:c] == (ids == e).nonzero().flatten().tolist()
        assert run_e[c:] == [slots] * (p - c)
        blocks = expert_ids[start // block_m : (start + p) // block_m]
        assert blocks.tolist() == [e] * (p // block_m)
        start += p
    assert (expert_ids[start // block_m :] == -1).all()


@pytest.mark.parametrize("name", [*(f"route-{a}" for a in MOES), "route-ties"])
def test_route_kernel_is_the_routing_rule(run, name):
    logits, moe, bias = run["cases"][name][1]
    weights, ids = run["out"][name]
    want_w, want_ids = route(logits, moe, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)
    if name == "route-ties":
        assert ids.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]


def test_time_layer_runs_every_layer_and_counts_what_it_reads(run):
    """The timed functions run each layer in turn (the layers, then their
    assignments alone); the bytes are the router and the picked experts."""
    x, layers, moe = run["cases"]["timing"][1]
    result, layer_outs, assigns = run["out"]["timing"]
    assert len(layer_outs) == assigns == len(layers) == result["layers"]
    for out, w in zip(layer_outs, layers, strict=True):
        assert _rel(out, vllm_rounding(x, w, moe)) <= TOL_VLLM[x.dtype]
    read = 0
    for w in layers:
        _, ids = route(linear(x, w.router).to(x.dtype), moe)
        read += w.router.nbytes + len(set(ids.flatten().tolist())) * (
            w.w13[0].nbytes + w.w2[0].nbytes
        )
    assert result["read_bytes"] == read // len(layers)
    assert result["layer_ms"] == result["front_ms"] == 1.0  # 2 ms / 2 layers
    assert result["gb_per_s"] == result["read_bytes"] / 1e6
    assert result["batch"] == x.shape[0]


def test_the_bundle_ran_without_vllm(run):
    assert run["status"] == {"blocked": True, "vllm_modules": []}


def test_the_kernel_is_vllms_unchanged(bundle):
    """The module's functions are vLLM's, node for node; its manifest names
    the source file by hash and the lines taken."""
    manifest = json.loads((bundle / mb.SUBDIR / mb.MANIFEST).read_text())
    source = (mb.vllm_package() / mb.FUSED_MOE).read_text()
    theirs = {n.name: ast.dump(n) for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef)}  # fmt: skip
    text = (bundle / mb.SUBDIR / mb.KERNEL_MODULE).read_text()
    ours = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]
    assert [n.name for n in ours] == list(mb.KERNELS)
    assert all(ast.dump(n) == theirs[n.name] for n in ours)
    assert manifest["vllm_version"].startswith("0.32.0")
    lines = source.splitlines()
    for name, (a, b) in manifest["lines"].items():
        assert lines[a - 1] == "@triton.jit" and f"def {name}(" in lines[a]
        assert "\n".join(lines[a - 1 : b]) in text


def test_the_configs_are_vllms(bundle):
    """Qwen3-30B-A3B's bf16 shape: vLLM's H200 table, looked up at the
    nearest batch size (the smaller on a tie); a shape with no table:
    vLLM's defaults for the batch sizes prepared, and no other."""
    base = mb.MoeBaseline.load(bundle)
    qwen = mb.MoeShape(128, 768, 2048, 8, torch.bfloat16)
    entry = base.manifest["shapes"][qwen.key]
    assert entry["file"] == "E=128,N=768,device_name=NVIDIA_H200.json"
    table = json.loads((mb.vllm_package() / mb.CONFIG_DIR / entry["file"]).read_text())
    table.pop("triton_version", None)
    assert {int(k): v for k, v in entry["configs"].items()} == {
        int(k): v for k, v in table.items()
    }
    for m, key in [(1, "1"), (3, "2"), (5, "4"), (6, "4"), (20, "16"), (9999, "4096")]:
        assert base.config(qwen, m) == table[key]
    tiny = mb.MoeShape(16, 32, HIDDEN, 4, torch.bfloat16)
    assert base.manifest["shapes"][tiny.key]["file"] is None
    assert base.config(tiny, 1) == vllm_default(1)
    with pytest.raises(KeyError):
        base.config(tiny, 2)


def vllm_default(m: int) -> dict:
    """vLLM 0.32.0's bf16 default tile config on CUDA for m tokens, as its
    get_default_config reads (fused_moe.py:1296; E=16, N=32: no grouping)."""
    block_m = 16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if m <= 64 else 128,
            "BLOCK_SIZE_K": 128 if m <= 64 else 64, "GROUP_SIZE_M": 1,
            "SPLIT_K": 1, "num_warps": 4 if m <= 128 else 8,
            "num_stages": 4 if m <= 32 else 3}  # fmt: skip


@pytest.mark.parametrize("m", [1, 32, 33, 64, 65, 96, 97, 128, 129, 512, 513])
def test_default_configs_are_vllms_for_cuda(m):
    """get_default_config compiled from vLLM's source, asked as on CUDA
    (this host's platform is a CPU one), at each of its thresholds."""
    default = mb.vllm_default_config()
    assert default(m, 16, 32, HIDDEN, 4, None) == vllm_default(m)
    with pytest.raises(AttributeError, match="not answered"):
        mb._CudaPlatform().is_xpu()


def test_extraction_refuses_what_it_cannot_carry():
    jit = "@triton.jit\ndef {name}(x):\n    return {body}\n"
    helper = jit.format(name="fused_moe_kernel", body="helper(x)")
    with pytest.raises(ValueError, match="helper"):
        mb.extract_kernels(helper, ["fused_moe_kernel"])
    with pytest.raises(ValueError, match="not in fused_moe.py"):
        mb.extract_kernels(jit.format(name="other", body="x"), ["fused_moe_kernel"])
    jitted = "@triton.jit(debug=True)\ndef fused_moe_kernel(x):\n    pass\n"
    with pytest.raises(ValueError, match="decorators"):
        mb.extract_kernels(jitted, ["fused_moe_kernel"])
