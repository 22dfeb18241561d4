# SPDX-License-Identifier: Apache-2.0
"""The GPU check is ready to run: the bundle builds here under the size
limit, and its correctness harness (run here on CPU with a stand-in for the
compiled kernel) passes a correct kernel and names the buffer of a wrong
one."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest
import torch
from kernel_standin import KernelStandIn, register_executor
from test_interpret import make_spec
from test_moe_program import deepseek_routing

from tests.utils import load_script
from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel.build import save_program
from vllm_ext.megakernel.calibrate import probe
from vllm_ext.megakernel.cost import DEVICES, predict
from vllm_ext.megakernel.isa import NO_COUNTER, Instruction, Op
from vllm_ext.megakernel.kernel.launcher import KernelExecutor
from vllm_ext.megakernel.kernel.ops.prefetch import PREFETCH_BYTES
from vllm_ext.megakernel.kernel.ops.weight_pipe import L2_AHEAD_PAGES
from vllm_ext.megakernel.kernel.persistent import ring_slots
from vllm_ext.megakernel.kernel.shape import (
    PAGE_BYTES,
    AbortWhat,
    AbortWord,
    KernelShape,
)
from vllm_ext.megakernel.ops import down as down_op
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import stuck_heads
from vllm_ext.model_spec import ModelSpec
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    QuantFormat,
)
from vllm_ext.testing import BLOCK_SIZE, random_weights

ROOT = Path(__file__).resolve().parents[2]


def _device_run():
    return load_script("scripts/device_run.py")


def test_the_gpu_side_needs_no_vllm():
    """The GPU machine has torch, not vLLM: device_run.py and everything it
    imports must load with every ``vllm`` import refused."""
    code = (
        "import sys, importlib.util\n"
        "class NoVllm:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'vllm':\n"
        "            raise ImportError('vLLM imported: ' + name)\n"
        "sys.meta_path.insert(0, NoVllm())\n"
        "spec = importlib.util.spec_from_file_location('d', 'scripts/device_run.py')\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_dry_run_builds_a_small_bundle():
    env = {**os.environ, "DEVICE_CHECK_MODELS": "llama-3.2-1b",
           "DEVICE_CHECK_BATCHES": "1", "DEVICE_CHECK_FLASHINFER": "0",
           "DEVICE_CHECK_VARIANTS": "",
           "DEVICE_CHECK_PLANTED": "kv-slot", "DEVICE_CHECK_COVERAGE": "",
           # (CI time: the MLA case stands for the mixtures' too. Its first
           # four layers: three dense, then a sparse one, whose MoE baseline
           # shape the bundle carries.)
           "DEVICE_CHECK_MOE": "", "DEVICE_CHECK_MLA": "deepseek-v3:1:4",
           # A verify step: requests of 2 rows on the batch-2 bucket's kernel.
           "DEVICE_CHECK_VERIFY": "llama-3.2-1b:2:2",
           # (CI time: the FP8 kernel's build adds ~20 s here on two cores;
           # its case is test_an_fp8_case_is_an_fp8_model_throughout's.)
           "DEVICE_CHECK_QUANT": "",
           # racecheck's own case at batch 1 (CI time; 4 is the same build).
           "DEVICE_CHECK_RACECHECK": "1"}  # fmt: skip
    proc = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "KiB (limit 60 MiB)" in proc.stdout
    bundle = ROOT / ".device"
    manifest = json.loads((bundle / "manifest.json").read_text())
    planted = {"llama-3.2-1b-b1-plant-kv-slot": "kv-slot"}
    assert manifest["planted"] == planted
    # (No variant: each is a build of its own, and CI time is short; their
    # flags are test_build_cli.py's.)
    # (The tensor-parallel case: DEVICE_CHECK_RANKS's default.)
    tp_case = "llama-3.2-1b-b1-tp2"
    verify_case = "llama-3.2-1b-b2-verify2"
    racecheck_case = "llama-3.2-1b-v2048-b1-racecheck"
    assert set(manifest["builds"]) == {"llama-3.2-1b-b1", "deepseek-v3-b1",
                                       tp_case, verify_case, racecheck_case,
                                       *planted}  # fmt: skip
    # racecheck's case: the planted bugs' model, its LM head cut short.
    assert manifest["racecheck"] == [racecheck_case]
    meta = torch.load(bundle / racecheck_case / "program.pt")
    assert meta["shape"]["vocab"] == 2048 and meta["shape"]["hidden"] == 2048
    assert manifest["verify"] == {verify_case: 2}
    assert verify_case in manifest["variant_order"]
    # The latent attention case runs its first four layers, its mixture
    # beside vLLM's fused-MoE kernel (copied from the installed vLLM, not
    # from this repository).
    assert manifest["layers"] == {"deepseek-v3-b1": 4}
    moe = json.loads((bundle / "moe_baseline" / "manifest.json").read_text())
    assert list(moe["shapes"]) == ["E=256,N=2048,K=7168,top_k=8,dtype=bfloat16"]
    assert (bundle / "moe_baseline" / "vllm_fused_moe_kernel.py").exists()
    # legacy_control, wide_attn, qkv_parts, combine_parts (head parts and
    # dim parts on the Llama shape; a latent attention has neither)
    flags = {"llama-3.2-1b-b1": (0, 0, 2, 4),
             "llama-3.2-1b-b1-plant-kv-slot": (0, 0, 2, 4),
             "deepseek-v3-b1": (0, 0, 1, 1), tp_case: (0, 0, 2, 4),
             verify_case: (0, 0, 2, 4), racecheck_case: (0, 0, 2, 4)}  # fmt: skip
    for name, build in manifest["builds"].items():
        assert build["spill_bytes"] == 0 and build["arch"] == "sm_90a"
        meta = torch.load(bundle / name / "program.pt")
        shape = meta["shape"]
        got = (shape["legacy_control"], shape["wide_attn"], shape["qkv_parts"],
               shape["combine_parts"])  # fmt: skip
        assert got == flags[name]
        # A planted bug is the default kernel but for the bug it names.
        assert shape["planted_bug"] == planted.get(name, "")
        # An MLA program has no COMBINE instructions (opcode 4): MLA_COMBINE.
        combines = (meta["queues"][..., 0] == 4).any()
        assert combines != (shape["mla_heads"] > 0)
        assert (shape["mla_heads"] == 128) == (name == "deepseek-v3-b1")
        assert build["async_copies"] == 0
        # The default kernel's ring: bulk copies (the legacy control has none).
        assert (build["bulk_copies"] > 0) != shape["legacy_control"]
    case = bundle / "llama-3.2-1b-b1"
    assert {p.name for p in case.iterdir()} == {
        "libmegakernel_sm_90a.so", "program.pt", "manifest.json", "build.json",
        "predicted.json",
    }  # fmt: skip
    # The model's step beside each case (a planted bug's and a verify case's
    # are their twins'; the cost model has no one-GPU ranks).
    for name in builds_of(manifest):
        predicted = bundle / name / "predicted.json"
        assert predicted.exists() == (name not in {*planted, tp_case, verify_case})
    # Every rank of a TP 2 program in one launch: the rank's program on half
    # the SMs, the unsharded model beside it, one system-scope add a rank
    # after one system fence and ALL_REDUCE's system-scope acquire.
    meta = torch.load(bundle / tp_case / "program.pt")
    assert (meta["shape"]["tp_size"], meta["shape"]["ranks_in_launch"]) == (2, 2)
    assert meta["full_spec"]["num_q_heads"] == 2 * meta["spec"]["num_q_heads"]
    assert meta["queues"].shape[0] == DEVICES["h200"].num_sms // 2
    built = manifest["builds"][tp_case]
    sys_ops = (built["sys_release_atomics"], built["sys_fences"],
               built["sys_acquire_loads"])  # fmt: skip
    assert sys_ops == (2, 1, 1) and tp_case in manifest["variant_order"]
    mla = json.loads((bundle / "deepseek-v3-b1" / "predicted.json").read_text())
    assert mla["context"] == 4096 and set(mla["step_ms"]) == {"1", "2", "5"}
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size < 60 << 20


def test_a_failed_build_fails_the_dry_run():
    """The builds run in the background: one that fails still stops the
    script, with a message."""
    env = {**os.environ, "DEVICE_CHECK_MODELS": "no-such-model",
           "DEVICE_CHECK_BATCHES": "1", "DEVICE_CHECK_FLASHINFER": "0",
           "DEVICE_CHECK_VARIANTS": "", "DEVICE_CHECK_PLANTED": "",
           "DEVICE_CHECK_COVERAGE": "", "DEVICE_CHECK_MOE": "",
           "DEVICE_CHECK_MLA": "", "DEVICE_CHECK_QUANT": ""}  # fmt: skip
    proc = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "no such config: no-such-model" in proc.stderr
    assert "a build failed" in proc.stderr


@pytest.fixture
def harness(request, tmp_path, monkeypatch):
    """device_run on CPU: a tiny Qwen3-shaped case, the kernel replaced by
    the stand-in (optionally corrupting one buffer after each launch). An
    indirect parameter, a dict, changes the architecture ("arch"), makes
    the model quantized ("quant": a QuantFormat, random codes) or
    changes the program (the planner's options)."""
    d = _device_run()
    monkeypatch.setattr(d, "DEVICE", "cpu")
    monkeypatch.setattr(d, "CONTEXT", 40)
    monkeypatch.setattr(d, "FULL_CHECK_BATCHES", (2,))  # the case's batch
    options = dict(getattr(request, "param", {}))
    arch = options.pop("arch", "qwen3")
    quant = options.pop("quant", None)
    if arch == "deepseek_routing":  # qwen3_moe with DeepSeek-V3's mixture
        spec = deepseek_routing(torch.bfloat16)
    elif arch in ("qwen3_moe", "mixtral"):
        spec = ModelSpec.from_hf_config(hf_config(arch), torch.bfloat16, 512)
    else:
        spec = make_spec(arch, torch.bfloat16)
    if quant is not None:
        spec = dataclasses.replace(spec, quant=quant)
    program = plan(spec, 2, DEVICES["h200"], with_lm_head=True, **options)
    save_program(tmp_path / "program.pt", program,
                 KernelShape.from_program(program, BLOCK_SIZE))  # fmt: skip
    corrupt: dict = {}

    def make_executor(case_dir, program, weights, max_blocks):
        standin = KernelStandIn(program, weights)

        def launch(*args):
            register_executor(standin, ex, ex.kv_caches)
            kind = corrupt.get("kind", "buffer")
            if kind == "noncausal":
                # Every row of a request attends to all the step's new
                # tokens (its request's last seq_len), not just its own.
                lens = ex.seq_lens.clone()
                req = ex.block_table[:, 0]
                for r in range(len(lens)):
                    ex.seq_lens[r] = lens[req == req[r]].max()
                standin(*args)
                ex.seq_lens.copy_(lens)
                return
            if kind == "history":
                # A stray write over each request's first token, before the
                # step's attention reads it: the kernel and a reference
                # reading the kernel's cache would agree.
                for cache in ex.kv_caches:
                    for r, slot in enumerate(ex.slot_mapping.tolist()):
                        if slot >= 0 and int(ex.seq_lens[r]) > 1:
                            cache[int(ex.block_table[r, 0]), :, 0] += 1.0
            if kind in FP8_PLANTS:
                with ExitStack() as plants:
                    FP8_PLANTS[kind](plants, corrupt, ex)
                    standin(*args)
                return
            standin(*args)
            if kind == "buffer" and corrupt:
                ex.ws[corrupt["name"]][corrupt["layer"]] += 1.0
            elif kind == "past_end":
                # One element stored just past the buffer's end.
                t = ex.ws[corrupt["name"]]
                flat = t.new_empty(0).set_(t.untyped_storage())
                flat[t.storage_offset() + t.numel()] = 1.0

        ex = KernelExecutor(program, weights, launch, block_size=BLOCK_SIZE,
                            max_blocks=max_blocks)  # fmt: skip
        return ex, None

    monkeypatch.setattr(d, "make_executor", make_executor)
    return d, tmp_path, corrupt


# compressed-tensors' per-channel FP8 (W8A8, dynamic per-token activations).
FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)


def _neighbours_scales(plants: ExitStack, corrupt: dict, ex) -> None:
    """The stand-in reads layer ``corrupt["layer"]``'s DOWN row scales one
    row off (each row takes its neighbour's scale: a wrong index)."""
    read = KernelStandIn._quant_layer

    def layer(self, i, row):
        lw = read(self, i, row)
        if i != corrupt["layer"]:
            return lw
        f = lw.quant.down
        return dataclasses.replace(lw, down=f.codes.float() * f.scale.roll(1)[:, None])

    plants.enter_context(mock.patch.object(KernelStandIn, "_quant_layer", layer))


def _unquantized_down(plants: ExitStack, corrupt: dict, ex) -> None:
    """The stand-in's DOWN multiplies its bf16 input by the dequantized
    weights without quantizing it per token first."""
    plants.enter_context(
        mock.patch.object(down_op, "quantize_input", lambda x, quant: x)
    )


def _scale_write(plants: ExitStack, corrupt: dict, ex) -> None:
    """A stray write over one of layer ``corrupt["layer"]``'s DOWN row
    scales, where a bf16 kernel's weights would hold nothing to write."""
    ex.weights.layers[corrupt["layer"]].quant.down.scale[3] *= 2


def _neighbour_experts_scales(plants: ExitStack, corrupt: dict, ex) -> None:
    """The stand-in reads layer ``corrupt["layer"]``'s W2 scales of the
    next expert (each expert takes its neighbour's: a wrong index into
    W2_SCALE)."""
    read = KernelStandIn._quant_layer

    def layer(self, i, row):
        lw = read(self, i, row)
        if i != corrupt["layer"]:
            return lw
        f = lw.moe.quant.w2
        wrong = type(f)(f.codes, f.scale.roll(1, 0)).dequantize()
        return dataclasses.replace(lw, moe=dataclasses.replace(lw.moe, w2=wrong))

    plants.enter_context(mock.patch.object(KernelStandIn, "_quant_layer", layer))


def _arrive_left(plants: ExitStack, corrupt: dict, ex) -> None:
    """A slot's last EXPERT_UP tile that does not reset its ARRIVE count:
    layer ``corrupt["layer"]``'s slot 1 keeps its columns after the step."""
    plants.callback(lambda: ex.ws["arrive"][corrupt["layer"], 1].fill_(64))


def _expert_scale_write(plants: ExitStack, corrupt: dict, ex) -> None:
    """A stray write over one of layer ``corrupt["layer"]``'s W2 scales."""
    ex.weights.layers[corrupt["layer"]].moe.quant.w2.scale[2].mul_(2)


# Planted FP8 and quantized-mixture faults (corrupt's "kind"): each patches
# the stand-in for one launch.
FP8_PLANTS = {"fp8_scale_row": _neighbours_scales,
              "fp8_unquantized": _unquantized_down,
              "fp8_scale_write": _scale_write,
              "expert_scale": _neighbour_experts_scales,
              "arrive_left": _arrive_left,
              "expert_scale_write": _expert_scale_write}  # fmt: skip
# Llama: QKV in head parts without QK-norm (QKV finishes q and k).
SPLIT = {"arch": "llama"}
# Whole heads (the GPU check's comparison case): QKV finishes Qwen3's q and
# k, where the default's head parts leave QK-norm to ATTN.
HEADS = {"qkv_parts": 1}
MOE = {"arch": "deepseek_routing"}
MIXTURE_CHECKS = {"ROUTE", "TOPK", "TOPK_WEIGHTS", "EXPERT_UP", "EXPERT_DOWN"}
# Llama-shaped FP8 W8A8 (as the GPU check's Llama-3.1-8B FP8 case), FP8
# blocks (Qwen3-8B FP8's) and INT4 W4A16 (the W4A16 configs').
FP8_LLAMA = {"arch": "llama", "quant": FP8}
BLOCKS_LLAMA = {"arch": "llama", "quant": QuantFormat(FP8_BLOCK, "fp8", 8, 128,
                                                      PER_TOKEN_GROUP)}  # fmt: skip
INT4_LLAMA = {"arch": "llama", "quant": QuantFormat(INT4_W4A16, "gptq", 4, 64)}
# Qwen3-MoE-shaped quantized mixtures (the GPU check's Qwen3-30B-A3B FP8 and
# GPTQ-INT4 cases, DEVICE_CHECK_QUANT): FP8 blocks (inputs quantized per
# token and group of 128, EXPERT_UP's output through XQ, XSCALE and ARRIVE)
# and INT4 W4A16; layer 0 dense, layer 1 sparse.
MOE_FP8 = {"arch": "qwen3_moe", "quant": BLOCKS_LLAMA["quant"]}
MOE_INT4 = {"arch": "qwen3_moe", "quant": INT4_LLAMA["quant"]}


@pytest.mark.parametrize(
    "harness",
    [{}, SPLIT, HEADS, MOE, FP8_LLAMA, BLOCKS_LLAMA, INT4_LLAMA, MOE_FP8, MOE_INT4],
    ids=["plain", "split", "heads", "moe", "fp8", "fp8-block", "int4", "moe-fp8-block",
         "moe-int4"],
    indirect=True,
)  # fmt: skip
def test_harness_passes_a_correct_kernel(harness):
    d, case, _ = harness
    result = d.correctness(case)
    assert result["ok"], result
    assert len(result["steps"]) == d.STEPS
    spec = d.load_case(case)[0]
    if spec.moe is not None:
        assert set(result["steps"][0]["errors"]) >= MIXTURE_CHECKS
        assert result["steps"][0]["errors"]["TOPK"]["rows"] == 0
        # FP8 experts' ARRIVE counts checked after every step (INT4 has none).
        fp8 = spec.quant is not None and spec.quant.name == FP8_BLOCK
        assert all(("ARRIVE" in s["errors"]) == fp8 for s in result["steps"])
    if d.is_variant(case):  # (judged by the local checks alone)
        assert {"QKV", "KV_APPEND", "COMBINE"} <= set(result["steps"][0]["errors"])
        return
    assert all(
        s["greedy_agree"] == f"{s['batch']}/{s['batch']}" for s in result["steps"]
    )
    # And as vLLM's CUDA graphs run it: replays over fixed input buffers.
    assert result["graph"]["ok"] and len(result["graph"]["replays"]) == d.GRAPH_REPLAYS


def test_harness_judges_a_verify_step(harness, monkeypatch):
    """A speculative verify case (requests of 2 rows on the batch-2 kernel):
    the harness passes a correct kernel on verify-step inputs, and fails
    one whose rows attend to their request's later new tokens."""
    d, case, corrupt = harness
    monkeypatch.setattr(d, "case_verify_tokens", lambda case_dir: 2)
    result = d.correctness(case)
    assert result["ok"], result
    assert {"QKV", "KV_APPEND", "ATTN"} <= set(result["steps"][0]["errors"])
    corrupt.update(kind="noncausal")
    errors = d.correctness(case)["steps"][0]["errors"]
    assert not d.passes(errors["ATTN"])
    assert d.passes(errors["KV_APPEND"]) and d.passes(errors["INPUTS"])


@pytest.mark.parametrize("harness", [FP8_LLAMA], ids=["fp8"], indirect=True)
def test_an_fp8_case_is_an_fp8_model_throughout(harness):
    """The bundle's FP8 case as the GPU side loads it: its saved spec keeps
    the checkpoint's format (so its program, its references and its floor
    are FP8's: each linear's e4m3 bytes and fp32 row scales where a bf16
    model has two bytes a weight, the LM head bf16), and the weight guard
    covers the codes and scales the kernel reads, not the references'
    dequantization."""
    d, case, _ = harness
    spec, program = d.load_case(case)
    assert spec.quant == FP8
    bf16 = plan(dataclasses.replace(spec, quant=None), 2, DEVICES["h200"],
                with_lm_head=True)  # fmt: skip
    rows = {"qkv": spec.q_size + 2 * spec.kv_size, "o_proj": spec.hidden_size,
            "gate_up": 2 * spec.intermediate_size,
            "down": spec.hidden_size}  # fmt: skip
    cols = {"qkv": spec.hidden_size, "o_proj": spec.q_size,
            "gate_up": spec.hidden_size, "down": spec.intermediate_size}  # fmt: skip
    saved = sum(rows[n] * cols[n] - 4 * rows[n] for n in rows) * spec.num_layers
    assert bf16.weight_bytes() - program.weight_bytes() == saved
    predicted = d.predictions(case)["floor_ms"]
    assert predicted == program.weight_bytes() / DEVICES["h200"].hbm_bytes_per_s * 1e3
    guarded = dict(d._weights(random_weights(spec, seed=1)))
    assert guarded["layer 1 down codes"].dtype == torch.float8_e4m3fn
    assert guarded["layer 1 down scales"].dtype == torch.float32
    assert not {f"layer {i} {n}" for i in range(2) for n in rows} & set(guarded)
    assert d.per_op_baseline(spec) == "per-op-fp8-scaled-mm"


@pytest.mark.parametrize("harness", [FP8_LLAMA], ids=["fp8"], indirect=True)
@pytest.mark.parametrize("kind", ["fp8_scale_row", "fp8_unquantized"])
def test_a_wrong_fp8_linear_fails_its_instruction(harness, monkeypatch, kind):
    """A kernel that reads layer 1's DOWN row scales one row off, or whose
    DOWN skips the input's per-token quantization (in every layer), fails
    DOWN, and the instructions upstream of it pass. (One step, the local
    checks: what judges. The missing quantization moves DOWN's outputs by
    ~2% of the largest, within the max-based bound, but 3x past the
    element-wise one.)"""
    d, case, corrupt = harness
    monkeypatch.setattr(d, "STEPS", 1)
    monkeypatch.setattr(d, "FULL_CHECK_BATCHES", ())
    corrupt.update(kind=kind, layer=1)
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    assert not d.passes(errors["DOWN"]), errors["DOWN"]
    if kind == "fp8_scale_row":
        assert errors["DOWN"]["layer"] == 1
    for op in ("QKV", "O_PROJ", "GATE_UP", "WEIGHTS"):
        assert d.passes(errors[op]), (op, errors[op])


@pytest.mark.parametrize("harness", [FP8_LLAMA], ids=["fp8"], indirect=True)
def test_a_write_over_an_fp8_scale_fails(harness, monkeypatch):
    """The weight guard over an FP8 case's codes and scales: a step that
    writes one of layer 1's DOWN row scales is named."""
    d, case, corrupt = harness
    monkeypatch.setattr(d, "STEPS", 1)
    monkeypatch.setattr(d, "FULL_CHECK_BATCHES", ())
    corrupt.update(kind="fp8_scale_write", layer=1)
    errors = d.correctness(case)["steps"][0]["errors"]
    assert errors["WEIGHTS"]["changed"] == ["layer 1 down scales"]
    assert not d.passes(errors["WEIGHTS"])


@pytest.mark.parametrize("harness", [MOE_FP8, MOE_INT4], ids=["fp8-block", "int4"],
                         indirect=True)  # fmt: skip
def test_a_quantized_mixture_guards_the_codes_the_kernel_reads(harness):
    """A quantized mixture's case as the GPU side loads it: its saved spec
    keeps the format, its weight guard covers the experts' codes and scales
    (not the references' dequantized w13 / w2) and the router, and its
    timing has no per-op MoE step (named in the result)."""
    d, case, _ = harness
    spec = d.load_case(case)[0]
    codes = {FP8_BLOCK: torch.float8_e4m3fn, INT4_W4A16: torch.uint8}
    assert spec.quant.name in codes and spec.moe.sparse_layers == (False, True)
    guarded = dict(d._weights(random_weights(spec, seed=1)))
    assert guarded["layer 0 down codes"].dtype == codes[spec.quant.name]
    for w in ("w13", "w2"):  # layer 1: the sparse one
        assert guarded[f"layer 1 experts {w} codes"].dtype == codes[spec.quant.name]
        assert f"layer 1 experts {w} scales" in guarded
        assert f"layer 1 experts {w}" not in guarded
    assert "layer 1 router" in guarded
    assert d.per_op_moe(spec) == d.QUANT_MOE_BASELINE
    bf16 = dataclasses.replace(spec, quant=None)
    assert d.per_op_moe(bf16) == "vllm-fused-moe-triton"
    assert d.per_op_baseline(spec) is None


def test_each_dense_quantized_format_has_a_named_per_op_step():
    """A dense FP8, FP8-block or INT4 case is timed against the per-op step
    with PyTorch's GEMM of its format, each named apart from vLLM's default
    decode (none opens a bucket)."""
    from vllm_ext.megakernel.measured import FAIR_BASELINE

    d = _device_run()
    llama = make_spec("llama", torch.bfloat16)
    names = {
        h["quant"].name: d.per_op_baseline(dataclasses.replace(llama, quant=h["quant"]))
        for h in (FP8_LLAMA, BLOCKS_LLAMA, INT4_LLAMA)
    }
    assert names == {FP8_W8A8: "per-op-fp8-scaled-mm",
                     FP8_BLOCK: "per-op-fp8-blockwise-scaled-mm",
                     INT4_W4A16: "per-op-int4-tinygemm"}  # fmt: skip
    assert FAIR_BASELINE not in names.values()
    assert d.per_op_baseline(llama) == FAIR_BASELINE


@pytest.mark.parametrize(
    "harness, kind",
    [(MOE_FP8, "expert_scale"), (MOE_INT4, "expert_scale"), (MOE_FP8, "arrive_left"),
     (MOE_INT4, "expert_scale_write")],
    ids=["fp8-block-scale", "int4-scale", "fp8-block-arrive", "int4-scale-write"],
    indirect=["harness"],
)  # fmt: skip
def test_a_wrong_quantized_mixture_fails(harness, monkeypatch, kind):
    """A kernel that reads layer 1's W2 scales of the neighbouring expert
    fails EXPERT_DOWN there (EXPERT_UP, upstream, passes); one whose slot
    keeps its ARRIVE count past the step fails ARRIVE, naming the layer and
    slot; a write over an expert's scale fails the weight guard, named."""
    d, case, corrupt = harness
    monkeypatch.setattr(d, "STEPS", 1)
    monkeypatch.setattr(d, "FULL_CHECK_BATCHES", ())
    corrupt.update(kind=kind, layer=1)
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    failing = {op for op, check in errors.items() if not d.passes(check)}
    if kind == "expert_scale":
        assert failing == {"EXPERT_DOWN"}, errors
        assert errors["EXPERT_DOWN"]["layer"] == 1
    elif kind == "arrive_left":
        assert failing == {"ARRIVE"}, errors
        assert (errors["ARRIVE"]["layer"], errors["ARRIVE"]["slot"]) == (1, 1)
    else:  # (the stand-in read the doubled scale too: EXPERT_DOWN may fail)
        assert "WEIGHTS" in failing and failing <= {"WEIGHTS", "EXPERT_DOWN"}
        assert errors["WEIGHTS"]["changed"] == ["layer 1 experts w2 scales"]


def test_the_abort_check_passes_a_kernel_that_aborts(harness):
    """The GPU check's planted hang, on the stand-in (which aborts as the
    kernel does): the record names the wait, and the next executor's step
    is the interpreter's. Only the GPU judges the kernel's own side."""
    d, case, _ = harness
    result = d.abort_check(case)
    assert result["ok"], result
    assert result["fresh_record_clear"] and result["logits_rel_err_after"] < 1e-6


def test_the_abort_check_fails_a_kernel_that_does_not_say(harness, monkeypatch):
    """A kernel whose hung wait leaves no record (a silent early exit, as
    the host sees it) fails the check."""
    import kernel_standin

    monkeypatch.setattr(kernel_standin.KernelStandIn, "aborts", False)
    d, case, _ = harness
    result = d.abort_check(case)
    assert not result["ok"] and result["record"][0] == 0


@pytest.mark.parametrize("harness", [MOE], ids=["moe"], indirect=True)
@pytest.mark.parametrize(
    "which, ok",
    [("producer", True), ("unstarved", False), ("other_instruction", False),
     ("bad_opcode", False)],
)  # fmt: skip
def test_the_abort_check_takes_any_wait_the_hang_starves(harness, monkeypatch,
                                                         which, ok):  # fmt: skip
    """The first wait to expire need not be the planted one (on an H200 a
    producer's wait for a free weight page expired first): the check takes
    a record naming a wait the hang starves, an input wait at a stuck SM's
    head or a pipeline wait of a stuck SM, and fails one naming an SM that
    finishes, another instruction, or no wait at all. The hang is planted
    in the last layer, so some SMs finish."""
    import kernel_standin

    planted_wait = kernel_standin._unmet_wait

    def unmet(queue, lengths):
        found = planted_wait(queue, lengths)
        if found is None:
            return None
        queues = [[Instruction.from_words(w) for w in queue[s, : int(n)].tolist()]
                  for s, n in enumerate(lengths.tolist())]  # fmt: skip
        stuck = stuck_heads(queues)
        free = [sm for sm in range(len(queues)) if sm not in stuck]
        assert found[0] in stuck and free  # the planted SM waits, others end
        sm = free[0] if which == "unstarved" else found[0]
        pc = stuck.get(sm, 0) + (which == "other_instruction")
        counter = int(queue[sm, pc, 4])
        what = {
            "producer": AbortWhat.WEIGHT_SLOT,
            "bad_opcode": AbortWhat.BAD_OPCODE,
        }.get(which, AbortWhat.INPUTS)
        record.update(sm=sm)
        return sm, pc, counter, 1, 0, what

    record: dict = {}
    monkeypatch.setattr(kernel_standin, "_unmet_wait", unmet)
    d, case, _ = harness
    result = d.abort_check(case)
    assert result["record"][AbortWord.SM] == record["sm"]
    assert not result["names_planted"]
    assert result["names_starved"] is ok and result["ok"] is ok, result


@pytest.mark.parametrize("harness", [{}, HEADS], ids=["plain", "heads"],
                         indirect=True)  # fmt: skip
@pytest.mark.parametrize(
    "buffer, op", [("act", "GATE_UP"), ("q", "QKV"), ("part_o", "ATTN")]
)
def test_harness_names_the_wrong_instruction(harness, buffer, op):
    """The local checks judge each instruction on the kernel's own inputs:
    a wrong buffer fails its producer at its layer, and the instructions
    upstream of it still pass: with QK-norm left to ATTN (the default
    program's head parts: q as projected, ATTN at its looser tolerance) and
    done by QKV (whole heads)."""
    d, case, corrupt = harness
    assert d.load_case(case)[1].qk_in_attn != d.is_variant(case)
    corrupt.update(name=buffer, layer=1)
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    assert errors[op]["layer"] == 1 and errors[op]["max"] > errors[op]["tol"]
    assert errors["EMBED"]["max"] <= errors["EMBED"]["tol"]
    if op != "QKV":
        assert errors["QKV"]["max"] <= errors["QKV"]["tol"]


@pytest.mark.parametrize("harness", [MOE], ids=["moe"], indirect=True)
@pytest.mark.parametrize(
    "buffer, op",
    [("router", "ROUTE"), ("route", "TOPK"), ("xact", "EXPERT_UP"),
     ("h", "EXPERT_DOWN")],
)  # fmt: skip
def test_harness_names_the_wrong_mixture_instruction(harness, buffer, op):
    """Layer 1 is the sparse one: a wrong router logit, routing word, expert
    activation or the mixture's output fails that instruction there, and
    the layer's attention still passes. (A routing word +1.0 is a garbage
    slot id: the check reports it instead of indexing with it.)"""
    d, case, corrupt = harness
    corrupt.update(name=buffer, layer=2 if buffer == "h" else 1)
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    assert errors[op]["layer"] == 1 and errors[op]["max"] > errors[op]["tol"]
    assert d.passes(errors["O_PROJ"]) and d.passes(errors["QKV"])


def test_a_write_to_a_history_slot_fails(harness):
    """A stray write over an earlier token's entry: the kernel's attention
    and a reference reading the kernel's cache would agree (both read the
    corrupted entry); the cache copy taken before the step shows the stray
    write, and attention judged against it fails."""
    d, case, corrupt = harness
    corrupt.update(kind="history")
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    assert errors["KV_STRAY"]["max"] > 0 and not d.passes(errors["KV_STRAY"])
    assert not d.passes(errors["ATTN"])
    assert d.passes(errors["KV_APPEND"]) and d.passes(errors["QKV"])
    assert d.passes(errors["GUARD"]) and d.passes(errors["INPUTS"])


@pytest.mark.parametrize("buffer", ["out", "h", "part_lse"])
def test_a_store_past_a_buffers_end_fails(harness, buffer):
    d, case, corrupt = harness
    corrupt.update(kind="past_end", name=buffer)
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    assert errors["GUARD"]["buffers"] == [buffer] and errors["GUARD"]["max"] > 0
    assert d.passes(errors["KV_STRAY"]) and d.passes(errors["LM_HEAD"])


def test_element_wise_errors_count_where_the_max_hides_them(harness):
    """A small element off by far more than its own rounding, still within
    the max-based bound: FINAL_NORM fails element-wise."""
    d, _, _ = harness
    want = torch.tensor([8.0, 0.01, -3.0, 0.02]).to(torch.bfloat16)
    got = want.clone()
    got[1] = 0.2  # 2.4% of the largest value: within 2^-5 of it
    check = {"max": d.rel_err(got, want), "tol": d.TOLERANCE["bf16"],
             "elem": d.elem_err(got, want, d.DEFAULT_ELEMENT_FLOOR)}  # fmt: skip
    assert check["max"] <= check["tol"] and not d.passes(check)
    # One rounding step of each element passes.
    close = (want.double() * (1 + 2**-8)).to(torch.bfloat16)
    assert d.elem_err(close, want, d.DEFAULT_ELEMENT_FLOOR) <= check["tol"]


def test_graph_replays_are_judged(harness, monkeypatch):
    """A replay that runs nothing (a graph captured around a stale or
    missing launch) leaves NaN; one that reuses the captured step number
    fails its counter check. (On CPU the "graph" is the step itself.)"""
    d, case, _ = harness
    spec, program = d.load_case(case)
    weights = random_weights(spec, seed=1)
    blocks = (d.CONTEXT + BLOCK_SIZE - 1) // BLOCK_SIZE

    def replays(capture, n=2):
        """graph_replays with ``capture(fn, ex)`` standing in for the CUDA
        graph of ``fn`` (the step of executor ``ex``)."""
        ex, _ = d.make_executor(case, program, weights, blocks)
        guards = d.guard_workspace(ex)
        monkeypatch.setattr(d, "capture_step", lambda fn: capture(fn, ex))
        monkeypatch.setattr(d, "GRAPH_REPLAYS", n)
        return d.graph_replays(ex, spec, program.batch, guards)

    graph = replays(lambda fn, ex: fn)
    assert graph["ok"] and len(graph["replays"]) == 2
    assert {"EMBED", "KV_APPEND", "LM_HEAD"} <= set(graph["replays"][0]["errors"])
    graph = replays(lambda fn, ex: lambda: None)
    assert not graph["ok"]
    assert not any(r["ok"] or r["counters_ok"] for r in graph["replays"])

    def stale_epoch(fn, ex):  # the launch without the step number's bump
        return lambda: (fn(), ex.counters[-1:].sub_(1))

    graph = replays(stale_epoch, n=1)  # (the stand-in checks the number too)
    assert not graph["ok"]
    assert graph["replays"][0]["ok"] and not graph["replays"][0]["counters_ok"]


def test_a_default_case_at_another_batch_runs_the_local_checks(harness, monkeypatch):
    d, case, _ = harness
    monkeypatch.setattr(d, "FULL_CHECK_BATCHES", (1,))
    result = d.correctness(case)
    assert result["ok"] and "drift" not in result["steps"][0]


def test_a_variant_case_is_judged_by_the_local_checks_alone(harness):
    d, case, corrupt = harness
    meta = torch.load(case / "program.pt")
    meta["shape"].update(legacy_control=True)
    torch.save(meta, case / "program.pt")
    result = d.correctness(case)
    assert result["ok"] and len(result["steps"]) == d.STEPS
    assert "drift" not in result["steps"][0]  # no interpreter run
    corrupt.update(name="act", layer=1)
    result = d.correctness(case)
    assert not result["ok"]
    assert result["steps"][0]["errors"]["GATE_UP"]["layer"] == 1


def test_sanitizer_step_runs_a_shorter_program_of_the_same_kernel(harness, monkeypatch):
    """The sanitizer runs the case's kernel on a program of fewer layers
    (layers are data to it); the full program must still match the bundle's."""
    d, case, _ = harness
    monkeypatch.setattr(d, "SANITIZE_LAYERS", 1)
    assert d.sanitize_step(case) == {"ok": True, "layers": 1}
    meta = torch.load(case / "program.pt")
    meta["lengths"][0] += 1
    torch.save(meta, case / "program.pt")
    d.load_case(case, layers=1)  # (a shorter program is planned afresh)
    with pytest.raises(SystemExit, match="differs from the bundle"):
        d.load_case(case)


def test_local_checks_cover_every_instruction(harness):
    d, case, _ = harness
    errors = d.correctness(case)["steps"][0]["errors"]
    kinds = {"EMBED", "QKV", "KV_APPEND", "ATTN", "ATTN_LSE", "COMBINE", "O_PROJ",
             "GATE_UP", "DOWN", "FINAL_NORM", "LM_HEAD"}  # fmt: skip
    assert kinds <= set(errors)
    assert all(e["max"] <= e["tol"] for e in errors.values())


def test_probes_keep_only_what_they_are_asked_to():
    spec = make_spec("llama", torch.bfloat16)
    program = plan(spec, 2, DEVICES["h200"], with_lm_head=True)
    queue, lengths = program.encode()
    only_qkv, _ = probe(program, (Op.QKV,), waits=False).encode()
    real = torch.arange(queue.shape[1]) < lengths[:, None]  # (not the padding)
    ops = only_qkv[..., 0][real]
    assert set(ops.unique().tolist()) == {int(Op.NOP), int(Op.QKV)}
    assert (ops == int(Op.QKV)).sum() == (queue[..., 0] == int(Op.QKV)).sum()
    assert (only_qkv[..., 4][real] == NO_COUNTER).all()
    assert torch.equal(only_qkv[..., 1:4], queue[..., 1:4])
    assert torch.equal(only_qkv[..., 6:], queue[..., 6:])  # signals, tails
    assert torch.equal(probe(program).encode()[0], queue)
    assert (probe(program, ()).encode()[0][..., 0] == int(Op.NOP)).all()


def test_waits_probe_is_a_valid_program(monkeypatch):
    """The breakdown's all-NOP probe with waits keeps every signal the waits
    count on, so it runs to the end on the GPU."""
    from vllm_ext.megakernel.verify import verify

    d = _device_run()
    spec = make_spec("llama", torch.bfloat16)
    program = plan(spec, 2, DEVICES["h200"], with_lm_head=True)
    queue, _ = program.encode()
    keep, waits = d.BREAKDOWN["NOP, waits"]
    nops = probe(program, keep, waits)
    table, _ = nops.encode()
    assert (table[..., 4:] == queue[..., 4:]).all()  # waits and signals
    verify(nops)

    ex = types.SimpleNamespace(queue=queue)
    probes = []

    def time_probe(fn, **kw):
        probes.append(ex.queue)
        return 1.0

    monkeypatch.setattr(d, "graphed", lambda step: None)
    monkeypatch.setattr(d, "time_ms", time_probe)
    out = d.breakdown(ex, program, lambda: None, 1.0)
    assert "NOP, waits" in out and "COMBINE" in out
    assert len(probes) == len(out) and ex.queue is queue
    assert torch.equal(probes[list(out).index("NOP, waits")], table)
    # A variant case times the rows the variants move, in the same order.
    rows = d.breakdown(ex, program, lambda: None, 1.0, d.VARIANT_ROWS)
    assert list(rows) == [r for r in out if r in d.VARIANT_ROWS]
    assert set(d.VARIANT_ROWS) <= set(d.BREAKDOWN) and len(rows) < len(out)


def test_report_table():
    d = _device_run()
    report = {
        "gpu": "NVIDIA H200", "num_sms": 132, "torch": "2.11", "skipped": [],
        "manifest": {"commit": "abc1234"}, "bandwidth": {"read_bytes_per_s": 4e12},
        "cases": {"llama-3.2-1b-b1": {
            "correctness": {"ok": True},
            "timing": {"megakernel_ms": 1.0, "per_op_graph_ms": 1.5,
                       "per_op_eager_ops_graph_ms": 2.5, "gemm_attn_graph_ms": 1.2,
                       "per_op_vs_megakernel": 0.031, "weight_bytes": 2_000_000_000,
                       "breakdown": {"QKV": {"ms": 0.1, "weight_bytes": 3e8},
                                     "NOP": {"ms": 0.01, "weight_bytes": None}}},
        }},
        "abort": {"ok": True}, "verdict": "incomplete",
        "why": ["racecheck not run (compute-sanitizer not installed)"],
        "planted": {"m-plant-kv-slot": {"bug": "kv-slot", "rejected": True,
                                        "failing": ["KV_APPEND", "KV_STRAY"]}},
        "sanitizer": {"memcheck": {"status": "passed", "case": "llama-3.2-1b-b1"},
                      "racecheck": {"status": "not run",
                                    "why": "compute-sanitizer not installed"}},
    }  # fmt: skip
    report["cases"]["llama-3.2-1b-b1"]["timing"]["predicted"] = {
        "context": 512, "step_ms": {"1": 0.6, "2": 0.625, "5": 0.75}}  # fmt: skip
    staged = {"correctness": {"ok": True}, "timing": {"megakernel_ms": 0.8}}
    report["cases"]["llama-3.2-1b-b1-split"] = staged
    report["cases"]["llama-3.2-1b-b1-legacy"] = {"correctness": {"ok": False}}
    # A verify step of one request of 4 rows on the batch-4 kernel, against
    # the batch-1 step (and the batch-4 decode step, not in this report).
    report["manifest"]["verify"] = {"llama-3.2-1b-b4-verify4": 4}
    # Its per-op step (rows as requests of FlashInfer's decode) only there,
    # named, never in the main table's fair per-op column.
    report["cases"]["llama-3.2-1b-b4-verify4"] = {
        "correctness": {"ok": True},
        "timing": {"megakernel_ms": 1.1, "per_op_graph_ms": 1.21,
                   "per_op_baseline": d.VERIFY_BASELINE}}  # fmt: skip
    # An FP8 case: its per-op step (vLLM's FP8 linears by torch._scaled_mm)
    # in the main table, named below it.
    report["cases"]["llama-3.1-8b-fp8-b1"] = {
        "correctness": {"ok": True},
        "timing": {"megakernel_ms": 0.9, "per_op_graph_ms": 1.35,
                   "per_op_baseline": d.QUANT_BASELINES[FP8_W8A8]}}  # fmt: skip
    table = d.markdown(report)
    assert "| llama-3.1-8b-fp8-b1 | True | 0.900 | 1.350 | - |" in table
    assert "per-op step of llama-3.1-8b-fp8-b1: per-op-fp8-scaled-mm" in table
    assert (
        "| llama-3.2-1b-b4-verify4 | True | 4 | 1.100 | 1.000 | 1.100 | - | 1.210 "
        "| 1.100 |" in table
    )
    assert "| llama-3.2-1b-b4-verify4 | True | 1.100 | - |" in table
    assert "| llama-3.2-1b-b4-verify4 | True | 1.000 |" not in table  # (a variant)
    assert "| llama-3.2-1b-b1-split | True | 1.000 | 0.800 | 1.250 |" in table
    assert "| llama-3.2-1b-b1-legacy | False | 1.000 | - | - |" in table
    # floor = 2 GB at 4 TB/s = 0.5 ms: 0.5 of the floor, 1.5x the per-op step.
    assert (
        "| llama-3.2-1b-b1 | True | 1.000 | 1.500 | 2.500 | 1.200 | 0.500 | 0.500 "
        "| 1.500 | 1.200 | 3.1e-02 |" in table
    )
    assert "| QKV | 0.100 (3.00) |" in table and "| NOP | 0.010 |" in table
    # The model's step beside the measurement; a case without one has no row.
    assert "| llama-3.2-1b-b1 | 512 | 1.000 | 0.600 / 0.625 / 0.750 | 1.667 |" in table
    assert "| llama-3.2-1b-b1-split | " not in table.split("The cost model")[1]
    assert "4.00 TB/s" in table and "abc1234" in table
    assert table.startswith("verdict: incomplete (racecheck not run")
    assert "planted bugs: m-plant-kv-slot (kv-slot): rejected by KV_APPEND" in table
    assert (
        "sanitizer: memcheck passed on llama-3.2-1b-b1; racecheck not run "
        "(compute-sanitizer not installed)" in table
    )


def builds_of(manifest: dict) -> list[str]:
    return sorted(manifest["builds"])


def test_a_timings_program_record_is_what_calibrate_replans(tmp_path):
    """The program record a GPU timing writes (device_run.program_record of
    the program load_case ran: the case's first layers, here 2 of 16) is
    the one calibrate re-plans from the report's fields: same digest, so
    the next report is not refused by its own programs."""
    from vllm_ext.megakernel.calibrate import fit_case
    from vllm_ext.megakernel.plan import load_spec

    d = _device_run()
    program = plan(load_spec("llama-3.2-1b", torch.bfloat16), 1, DEVICES["h200"],
                   with_lm_head=True)  # fmt: skip
    case = tmp_path / "llama-3.2-1b-b1"
    case.mkdir()
    save_program(case / "program.pt", program,
                 KernelShape.from_program(program, BLOCK_SIZE))  # fmt: skip
    layers = {"layers": {case.name: 2}}
    (tmp_path / "manifest.json").write_text(json.dumps(layers))
    _, ran = d.load_case(case)
    assert ran.spec.num_layers == 2 and ran.digest() != program.digest()
    walk = predict(probe(ran, keep=(), waits=False)).step_s * 1e3
    timing = {"megakernel_ms": 2 * walk, "layers": 2, "context": d.BENCH_CONTEXT,
              "program": d.program_record(ran),
              "breakdown": {"NOP": {"ms": walk}}}  # fmt: skip
    assert fit_case(case.name, timing, DEVICES["h200"], None) is not None
    # (And a record of the whole model's program is refused at 2 layers.)
    timing["program"]["digest"] = program.digest()
    with pytest.raises(ValueError, match="digest differs"):
        fit_case(case.name, timing, DEVICES["h200"], None)


def test_predictions_are_the_cases_programs_at_the_timed_context(tmp_path, monkeypatch):
    """--predict writes, beside each case, the model's step for the program
    the GPU side times: at the timing's context (not the model's nominal
    one), with the case's kernel's lookahead (the legacy control's is
    short), at 1 / 2 / 5 us per dependency; none for a planted bug."""
    d = _device_run()
    bundle = _bundle(tmp_path)
    # (Its program is the 2-layer one under a 1-layer spec: for the order.)
    shutil.rmtree(bundle / "s-b1")
    d.write_predictions(bundle)
    spec = make_spec("llama", torch.bfloat16)
    got = {}
    for case in ("m-b1", "m-b1-wide", "m-b1-legacy", "m-b2"):
        p = json.loads((bundle / case / "predicted.json").read_text())
        assert p["context"] == d.BENCH_CONTEXT == 512
        got[case] = [p["step_ms"][str(us)] for us in (1, 2, 5)]
        assert got[case] == sorted(got[case])  # longer waits, longer steps
    assert not (bundle / "m-b1-plant-kv-slot" / "predicted.json").exists()
    # Recomputed here: the default kernel's ring and L2 pages ahead.
    ring = ring_slots(KernelShape.from_program(plan(spec, 1, DEVICES["h200"]),
                                               BLOCK_SIZE)) * PAGE_BYTES  # fmt: skip
    for i, us in enumerate((1, 2, 5)):
        device = dataclasses.replace(DEVICES["h200"], dependency_latency_s=us * 1e-6)
        program = plan(spec, 1, device, with_lm_head=True)
        at_512 = dataclasses.replace(program, context=512)
        want = predict(at_512, None, ring + L2_AHEAD_PAGES * PAGE_BYTES).step_s * 1e3
        assert got["m-b1"][i] == pytest.approx(want, rel=1e-9)
    # The timing's context, whatever it is (the tiny model's 512-token
    # attention hides in its step; 64k tokens do not).
    monkeypatch.setattr(d, "BENCH_CONTEXT", 1 << 16)
    long = d.predictions(bundle / "m-b1")
    assert long["context"] == 1 << 16 and long["step_ms"]["1"] > 2 * got["m-b1"][0]
    # The model knows programs, not kernel flags: the wide attention's case
    # predicts as its default. The legacy control streams one prefetch ahead
    # (the tiny model's weights fit either window: seen in the call).
    assert got["m-b1-wide"] == got["m-b1"]
    seen = []
    monkeypatch.setattr(d, "predict", lambda p, dev, ahead: seen.append(ahead)
                        or predict(p, dev, ahead))  # fmt: skip
    d.predictions(bundle / "m-b1-legacy")
    assert seen == [PREFETCH_BYTES] * 3


def _bundle(tmp_path: Path, racecheck: tuple = ()) -> Path:
    """Cases as device_check.sh builds them (made in another order than the
    driver must run them), with one planted bug."""
    spec = make_spec("llama", torch.bfloat16)
    bundle = tmp_path / "bundle"
    for name, batch in (("m-b2", 2), ("m-b1-wide", 1), ("m-b1", 1),
                        ("m-b1-legacy", 1), ("m-b1-plant-kv-slot", 1)):  # fmt: skip
        program = plan(spec, batch, DEVICES["h200"], with_lm_head=True)
        shape = KernelShape.from_program(program, BLOCK_SIZE,
                                         legacy_control=name.endswith("legacy"),
                                         wide_attn=name.endswith("wide"))  # fmt: skip
        (bundle / name).mkdir(parents=True)
        save_program(bundle / name / "program.pt", program, shape)
    meta = torch.load(bundle / "m-b1-plant-kv-slot" / "program.pt")
    meta["shape"]["planted_bug"] = "kv-slot"
    torch.save(meta, bundle / "m-b1-plant-kv-slot" / "program.pt")
    # A smaller shape than the planted bugs' twin, which still goes first.
    meta = torch.load(bundle / "m-b1" / "program.pt")
    meta["spec"]["num_layers"] = 1
    (bundle / "s-b1").mkdir()
    torch.save(meta, bundle / "s-b1" / "program.pt")
    manifest = {"commit": "abc", "variant_order": ["m-b1-legacy", "m-b1-wide"],
                "first": "m-b1", "racecheck": racecheck}  # fmt: skip
    for name in racecheck:  # (the kernel's shape does not matter here)
        shutil.copytree(bundle / "m-b1", bundle / name)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


class _Props:
    name, multi_processor_count = "stand-in", 132


def _driver(d, tmp_path, monkeypatch, outcomes: dict, racecheck: tuple = ()):
    """main() on CPU, each child run answered from ``outcomes`` (by what it
    runs, and for the sanitizer by its tool): correct and clean unless told."""
    calls = []

    def run_child(what, case, timeout, prefix=None, log=None):
        tool = prefix[prefix.index("--tool") + 1] if prefix else None
        calls.append((what, case.name, tool))
        if what == "abort":
            # The step ended, its record named the wait, the next step ran.
            return {"seconds": 0.0, "tail": "", **outcomes.get("abort", {"ok": True})}
        if what == "sanitize":
            default = {"ok": True, "tail": "========= ERROR SUMMARY: 0 errors"}
            return {"seconds": 0.0, **outcomes.get(tool, default)}
        if what == "correctness":  # the planted bug
            return {"seconds": 0.0, **outcomes.get("planted", {
                "ok": False, "steps": [{"errors": {
                    "KV_STRAY": {"max": 12, "tol": 0},
                    "QKV": {"max": 0.0, "tol": 0.03}}}]})}  # fmt: skip
        parts = {"correctness": {"ok": True}, "timing": {"megakernel_ms": 1.0}}
        return {"ok": True, "seconds": 0.0, "tail": "",
                **({"parts": parts} if what == "case" else {})}  # fmt: skip

    monkeypatch.setattr(d, "run_child", run_child)
    monkeypatch.setattr(d.torch.cuda, "get_device_properties", lambda i: _Props)
    bundle = _bundle(tmp_path, list(racecheck))
    monkeypatch.setattr(d.sys, "argv", ["device_run.py", str(bundle),
                                        str(tmp_path / "out")])  # fmt: skip
    rc = d.main()
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    return rc, report, calls


def test_driver_order_and_verdict(tmp_path, monkeypatch):
    """main() on CPU with its child runs replaced: first what every figure
    rests on (the planted bug's correct twin, the abort, the planted bug,
    memcheck and racecheck on the twin's kernel), then the other cases
    smallest first, the default before its variants and those as device_check.sh
    listed them (not as they were made). A passed verdict needs all of it."""
    d = _device_run()
    monkeypatch.setattr(d.shutil, "which", lambda name: "/bin/compute-sanitizer")
    rc, report, calls = _driver(d, tmp_path, monkeypatch, {})
    assert calls == [
        ("bandwidth", "m-b1", None), ("case", "m-b1", None), ("abort", "m-b1", None),
        ("correctness", "m-b1-plant-kv-slot", None),
        ("sanitize", "m-b1", "memcheck"), ("sanitize", "m-b1", "racecheck"),
        ("case", "s-b1", None), ("case", "m-b1-legacy", None),
        ("case", "m-b1-wide", None), ("case", "m-b2", None),
    ]  # fmt: skip
    assert rc == 0 and report["verdict"] == "passed" and report["ok"]
    assert report["cases"]["m-b2"] == {"correctness": {"ok": True},
                                       "timing": {"megakernel_ms": 1.0}}  # fmt: skip
    assert "m-b1-plant-kv-slot" not in report["cases"]
    assert report["planted"]["m-b1-plant-kv-slot"]["failing"] == ["KV_STRAY"]
    assert {r["status"] for r in report["sanitizer"].values()} == {"passed"}
    assert "planted bugs: m-b1-plant-kv-slot (kv-slot): rejected by KV_STRAY" in (
        tmp_path / "out" / "device_check.md").read_text()  # fmt: skip


@pytest.mark.parametrize(
    "outcomes, verdict, why",
    [
        # The abort child hung (its time limit ended it), or found the
        # record wrong or the context dead.
        ({"abort": {"ok": False, "why": "timeout after 90 s"}}, "failed",
         "the abort check"),
        # A planted bug that the check passes: the check itself is broken.
        ({"planted": {"ok": True, "steps": []}}, "failed",
         "planted bug m-b1-plant-kv-slot passed the check"),
        # memcheck found an error (exit status 3, its summary).
        ({"memcheck": {"ok": False, "rc": 3,
                       "tail": "Invalid __global__ write\nERROR SUMMARY: 1 error"}},
         "failed", "memcheck found errors"),
        # The sanitizer cannot run on this machine (gVisor): not a pass.
        ({"racecheck": {"ok": False, "rc": 1, "tail": "Device not supported"}},
         "incomplete", "racecheck not run (the sanitizer cannot run here)"),
        ({"memcheck": {"ok": False, "why": "timeout after 120 s"}},
         "incomplete", "memcheck not run (timeout after 120 s)"),
    ],
    ids=["abort", "planted-passes", "memcheck-error", "unsupported", "timeout"],
)  # fmt: skip
def test_verdict_fails_or_is_incomplete(tmp_path, monkeypatch, outcomes, verdict,
                                        why):  # fmt: skip
    d = _device_run()
    monkeypatch.setattr(d.shutil, "which", lambda name: "/bin/compute-sanitizer")
    rc, report, _ = _driver(d, tmp_path, monkeypatch, outcomes)
    assert rc == 1 and not report["ok"]
    assert report["verdict"] == verdict and why in report["why"]


def _rerun_with_a_race(d, tmp_path, monkeypatch, name: str, prefixes=None) -> dict:
    """main() again (after ``_driver``), racecheck now finding a hazard in
    case ``name``; the report. ``prefixes``: every child's, as it ran."""
    answer = d.run_child

    def races(what, case, timeout, prefix=None, log=None):
        if prefixes is not None:
            prefixes.append(prefix)
        if what == "sanitize" and case.name == name:
            return {"seconds": 0.0, "ok": False, "rc": 3,
                    "tail": "RACECHECK SUMMARY: 1 hazard"}  # fmt: skip
        return answer(what, case, timeout, prefix, log)

    monkeypatch.setattr(d, "run_child", races)
    d.main()
    return json.loads((tmp_path / "out" / "device_check.json").read_text())


def test_racecheck_on_other_kernels_is_reported_apart(tmp_path, monkeypatch):
    """DEVICE_CHECK_RACECHECK_ALSO: racecheck on another kernel of the bundle
    (the legacy control, which has no weight ring), its hazards reported
    apart: the verdict stays the first case's sanitizers'."""
    d = _device_run()
    monkeypatch.setattr(d.shutil, "which", lambda name: "/bin/compute-sanitizer")
    monkeypatch.setenv("DEVICE_CHECK_RACECHECK_ALSO", "m-b1-legacy")
    rc, report, calls = _driver(d, tmp_path, monkeypatch, {})
    assert ("sanitize", "m-b1-legacy", "racecheck") in calls
    assert report["racecheck_also"]["m-b1-legacy"]["status"] == "passed"
    assert report["sanitizer"]["racecheck"]["case"] == "m-b1"

    report = _rerun_with_a_race(d, tmp_path, monkeypatch, "m-b1-legacy")
    assert report["racecheck_also"]["m-b1-legacy"]["status"] == "failed"
    assert report["verdict"] == "passed"


def test_racecheck_runs_on_its_own_cases(tmp_path, monkeypatch):
    """A bundle with racecheck cases (device_check.sh: the first case's model
    with a short LM head): racecheck runs on each, one layer deep, and only
    racecheck; memcheck stays on the first case; the worst result counts."""
    d = _device_run()
    monkeypatch.setattr(d.shutil, "which", lambda name: "/bin/compute-sanitizer")
    names = ("m-v64-b1-racecheck", "m-v64-b2-racecheck")
    rc, report, calls = _driver(d, tmp_path, monkeypatch, {}, racecheck=names)
    sanitized = [(case, tool) for what, case, tool in calls if what == "sanitize"]
    assert sanitized == [("m-b1", "memcheck"), (names[0], "racecheck"),
                         (names[1], "racecheck")]  # fmt: skip
    assert not any(case in names for what, case, _ in calls if what != "sanitize")
    assert report["sanitizer"]["racecheck"]["status"] == "passed"
    assert set(report["sanitizer"]["racecheck"]["cases"]) == set(names)
    assert report["verdict"] == "passed"
    prefixes = []
    report = _rerun_with_a_race(d, tmp_path, monkeypatch, names[1], prefixes)
    assert report["sanitizer"]["racecheck"]["status"] == "failed"
    assert report["verdict"] == "failed"
    layers = {p[p.index("--tool") + 1]: p[3] for p in prefixes if p}
    assert layers == {"memcheck": "DEVICE_SANITIZE_LAYERS=2",
                      "racecheck": "DEVICE_SANITIZE_LAYERS=1"}  # fmt: skip


def test_no_sanitizer_is_no_pass(tmp_path, monkeypatch):
    d = _device_run()
    monkeypatch.setattr(d.shutil, "which", lambda name: None)
    rc, report, calls = _driver(d, tmp_path, monkeypatch, {})
    assert rc == 1 and report["verdict"] == "incomplete"
    assert "memcheck not run (compute-sanitizer not installed)" in report["why"]
    assert not any(what == "sanitize" for what, _, _ in calls)


def test_a_case_child_keeps_its_verdict_past_a_later_failure(monkeypatch):
    """A case's child prints its correctness before timing it: a timeout or a
    crash in the timing costs the timing only, and says why."""
    d = _device_run()
    correct = json.dumps({"part": "correctness", "ok": True, "steps": []})

    def timeout(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, 5, output=f"{correct}\n".encode())

    monkeypatch.setattr(d.subprocess, "run", timeout)
    result = d.run_child("case", Path("m-b1"), 5)
    assert result["parts"] == {"correctness": {"ok": True, "steps": []}}
    assert not result["ok"] and result["why"] == "timeout after 5 s"

    timing = json.dumps({"part": "timing", "megakernel_ms": 1.0})
    done = subprocess.CompletedProcess([], 0, f"{correct}\n{timing}\n", "")
    monkeypatch.setattr(d.subprocess, "run", lambda cmd, **kwargs: done)
    result = d.run_child("case", Path("m-b1"), 5)
    assert result["parts"]["timing"] == {"megakernel_ms": 1.0}

    crashed = subprocess.CompletedProcess([], 1, f"{correct}\n", "Traceback")
    monkeypatch.setattr(d.subprocess, "run", lambda cmd, **kwargs: crashed)
    result = d.run_child("case", Path("m-b1"), 5)
    assert not result["ok"] and result["rc"] == 1 and "Traceback" in result["tail"]
    assert list(result["parts"]) == ["correctness"]
