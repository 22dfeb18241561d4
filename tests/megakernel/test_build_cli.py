# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_ext.megakernel.build` for real shapes, both archs."""

import json
import subprocess
import sys

import pytest
import torch

from vllm_ext import configs
from vllm_ext.megakernel.build import cache_key
from vllm_ext.model_spec import ModelSpec


def build(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vllm_ext.megakernel.build", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "name, arch",
    [
        ("llama-3.2-1b", "sm_90a"),
        ("llama-3.2-1b", "sm_100a"),
        ("llama-3.1-8b", "sm_90a"),
        ("qwen3-8b", "sm_100a"),
    ],
)
def test_build_real_shape(tmp_path, name, arch):
    result = build(
        "--config", str(configs.path(name)), "--batch", "4", "--arch", arch,
        "--out", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["arch"] == arch and summary["spill_bytes"] == 0
    assert summary["registers"] > 0 and summary["compile_s"] > 0
    assert (tmp_path / f"libmegakernel_{arch}.so").exists()
    program = torch.load(summary["program"])
    assert int(program["lengths"].sum()) == summary["num_instructions"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == summary


def test_cache_key_separates_shape_bucket_and_arch():
    spec = ModelSpec.from_hf_config(
        configs.hf_config("llama-3.2-1b"), torch.bfloat16, 4096
    )
    other = ModelSpec.from_hf_config(
        configs.hf_config("qwen3-8b"), torch.bfloat16, 4096
    )
    keys = {
        cache_key(spec, 1, "sm_90a"),
        cache_key(spec, 2, "sm_90a"),
        cache_key(spec, 1, "sm_100a"),
        cache_key(other, 1, "sm_90a"),
    }
    assert len(keys) == 4
    assert cache_key(spec, 1, "sm_90a") == cache_key(spec, 1, "sm_90a")


def test_bad_config_exits_2(tmp_path):
    result = build("--config", str(tmp_path / "missing.json"), "--batch", "1",
                   "--arch", "sm_90a", "--out", str(tmp_path))  # fmt: skip
    assert result.returncode == 2 and "no such config" in result.stderr
