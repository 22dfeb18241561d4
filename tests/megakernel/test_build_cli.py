# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_ext.megakernel.build` for real shapes, both archs."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from test_kernel_aot import check_sass, demo_shape

from vllm_ext import configs
from vllm_ext.megakernel.build import cache_key, library_for
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.planner import plan
from vllm_ext.model_spec import ModelSpec

BUILD_FIELDS = [f.name for f in dataclasses.fields(aot.BuildResult)]


def build(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vllm_ext.megakernel.build", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "name, arch, batch, variant",
    # Two builds (CI time): the default kernel's shapes are
    # test_kernel_aot.py's, test_gemv_mma_aot.py's and test_planted_bugs.py's,
    # every config and bucket on both archs scripts/compile_grid.py's. Here
    # the wide attention (the one variant) with whole heads (the GPU check's
    # comparison tiling) at the largest shape (registers), and the legacy
    # control (the GPU check's other comparison case) on the default
    # program.
    [
        ("llama-3.1-8b", "sm_90a", 64, ("--wide-attn", "--whole-heads")),
        ("llama-3.1-8b", "sm_100a", 1, ("--legacy-control",)),
    ],
)
def test_build_real_shape(tmp_path, name, arch, batch, variant):
    result = build(
        "--config", str(configs.path(name)), "--batch", str(batch), "--arch", arch,
        "--out", str(tmp_path), "--json", *variant,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["arch"] == arch and summary["compile_s"] > 0
    legacy = "--legacy-control" in variant
    check_sass(aot.BuildResult(**{k: summary[k] for k in BUILD_FIELDS}), legacy)
    assert (tmp_path / f"libmegakernel_{arch}.so").exists()
    program = torch.load(summary["program"])
    assert int(program["lengths"].sum()) == summary["num_instructions"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == summary
    # The tensor-core GEMV: every batch above 1, not the legacy control.
    assert (summary["mma_ops"] > 0) == (batch > 1 and not legacy)
    assert summary["async_copies"] == 0
    # The ring's bulk copies (none in the legacy control); the L2 cursor
    # hints what the ring copies, through the same code: a prefetch beside
    # each bulk-copy site.
    assert (summary["bulk_copies"] > 0) != legacy
    assert summary["l2_prefetches"] >= summary["bulk_copies"]
    # COMBINE instructions (opcode 4) and the one release atomic: the
    # signal.
    assert (program["queues"][..., 0] == 4).any()
    assert summary["release_atomics"] == 1
    assert program["shape"]["wide_attn"] == ("--wide-attn" in variant)
    assert program["shape"]["legacy_control"] == legacy
    # Head parts (the default): twice the Llama shapes' 48 whole heads per
    # layer.
    qkv = int((program["queues"][..., 0] == 2).sum())
    assert qkv == (48 if "--whole-heads" in variant else 96) * program["spec"][
        "num_layers"]  # fmt: skip


def test_cache_key_separates_shape_bucket_and_arch():
    def shape(name, batch):
        spec = ModelSpec.from_hf_config(configs.hf_config(name), torch.bfloat16)
        return KernelShape.from_program(plan(spec, batch, DEVICES["h200"]), 16)

    one, two, other = (
        shape("llama-3.2-1b", 1),
        shape("llama-3.2-1b", 2),
        shape("qwen3-8b", 1),
    )
    keys = {
        cache_key(one, "sm_90a"),
        cache_key(two, "sm_90a"),
        cache_key(one, "sm_100a"),
        cache_key(other, "sm_90a"),
    }
    assert len(keys) == 4
    assert cache_key(one, "sm_90a") == cache_key(shape("llama-3.2-1b", 1), "sm_90a")


def test_library_cache_builds_once(tmp_path):
    shape = demo_shape("mistral", 2)
    logged = []
    first = library_for(shape, "sm_90a", tmp_path, log=logged.append)
    again = library_for(shape, "sm_90a", tmp_path, log=logged.append)
    assert first == again and first.exists() and len(logged) == 1
    assert first.parent.name == cache_key(shape, "sm_90a")


def test_bad_config_exits_2(tmp_path, capsys):
    result = build("--config", str(tmp_path / "missing.json"), "--batch", "1",
                   "--arch", "sm_90a", "--out", str(tmp_path))  # fmt: skip
    assert result.returncode == 2 and "no such config" in result.stderr
    # The rest in-process: the same main(), without a Python start-up each.
    from vllm_ext.megakernel.build import main

    def refused(*args: str) -> str:
        assert main([*args, "--arch", "sm_90a", "--out", str(tmp_path)]) == 2
        return capsys.readouterr().err

    one = ("--config", "llama-3.2-1b", "--batch", "1")
    assert "multiple of 16" in refused(*one, "--block-size", "24")
    assert "multiple of 8" in refused("--config", "llama-3.2-1b", "--batch", "12")
    # The legacy control (and any variant but head parts) refuses a mixture
    # of experts.
    moe = ("--config", "qwen3-30b-a3b", "--batch", "1")
    assert "default kernel" in refused(*moe, "--legacy-control")
    # Quantized checkpoints (FP8, INT4) run in the default kernel only.
    fp8 = ("--config", "llama-3.1-8b-fp8", "--batch", "1")
    assert "FP8 weights run in the default kernel" in refused(*fp8, "--legacy-control")
    int4 = ("--config", "llama-3.1-8b-w4a16", "--batch", "1")
    assert "INT4 weights run in the default kernel" in refused(*int4, "--wide-attn")
    assert not any((tmp_path / n).exists() for n in ("program.pt", "manifest.json"))
