# SPDX-License-Identifier: Apache-2.0
"""Planted bugs (``build.py --plant-bug``): deliberately wrong kernels that
the GPU check must reject. Each is the default kernel with one store
changed, and nothing on the served path can select one."""

import argparse
import collections
import dataclasses
import inspect
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_build_cli import BUILD_FIELDS, build
from test_kernel_aot import check_sass

from vllm_ext.megakernel.build import cache_key, main
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.kernel.shape import PLANTED_BUGS, KernelShape
from vllm_ext.megakernel.plan import spec_or_exit
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.variants import KERNEL, Variants

CONFIG, BATCH = "llama-3.2-1b", 1


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The default kernel and each planted one, through the build CLI (about
    15 s each, two at a time): {bug ("" for the default): (folder,
    summary)}."""
    root = tmp_path_factory.mktemp("planted")
    args = {
        bug: ("--config", CONFIG, "--batch", str(BATCH), "--arch", "sm_90a",
              "--out", str(root / (bug or "default")), "--json",
              *(("--plant-bug", bug) if bug else ()))
        for bug in ("", *PLANTED_BUGS)
    }  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        results = {bug: pool.submit(build, *a) for bug, a in args.items()}
    out = {}
    for bug, done in results.items():
        result = done.result()
        folder = root / (bug or "default")
        assert result.returncode == 0, result.stderr[-2000:]
        assert ("deliberately wrong" in result.stderr) == bool(bug)
        out[bug] = folder, json.loads(result.stdout.strip().splitlines()[-1])
    return out


def _ptx(folder: Path) -> collections.Counter:
    """The kernel's PTX instructions, register numbers and labels elided
    (they shift with any change), as a multiset."""
    (path,) = (folder / "dump").glob("*.ptx")
    text = re.sub(r"%([a-z]+)\d+", r"%\1", path.read_text())
    text = re.sub(r"\$L__BB\d+_\d+", "$L", text)
    lines = (" ".join(line.split()) for line in text.splitlines())
    return collections.Counter(x for x in lines if x and not x.startswith(".reg"))


def test_planted_builds_record_the_bug(builds):
    """program.pt's shape names the bug (the GPU check reads it there), the
    cache key differs, and the rest matches the default build."""
    default = torch.load(builds[""][1]["program"])
    keys = {summary["cache_key"] for _, summary in builds.values()}
    assert len(keys) == len(builds)
    for bug, (_, summary) in builds.items():
        # Compiles as cleanly as the default: no spills, same resources.
        check_sass(aot.BuildResult(**{k: summary[k] for k in BUILD_FIELDS}))
        program = torch.load(summary["program"])
        assert program["shape"] == {**default["shape"], "planted_bug": bug}
        assert torch.equal(program["queues"], default["queues"])


def test_planted_bug_changes_only_its_store(builds):
    default = _ptx(builds[""][0])
    hidden = spec_or_exit("test", CONFIG, "bfloat16", BATCH).hidden_size
    # kv-slot: the KV append's address gets an xor (offset ^ 1, the token's
    # row at kv_heads * 2 * head_dim elements) at each of its two store
    # sites, K after RoPE and V; nothing else changes.
    kv = _ptx(builds["kv-slot"][0])
    assert not default - kv
    added = kv - default
    assert set(added) == {"xor.b32 %r, %r, 1024;"} and sum(added.values()) == 2
    # oob-store: one more store, guarded to the last element; at batch 1 the
    # last row starts the buffer, so it lands 2 * hidden bytes in: one bf16
    # past the end of ``out``.
    oob = _ptx(builds["oob-store"][0])
    assert not default - oob
    stores = [x for x in oob - default if x.startswith("st.")]
    assert stores == [f"st.global.b16 [%rd+{2 * hidden}], %rs;"]


def test_an_unknown_bug_is_refused(tmp_path, capsys):
    args = ("--config", CONFIG, "--batch", "1", "--arch", "sm_90a",
            "--out", str(tmp_path))  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main([*args, "--plant-bug", "nope"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert not (tmp_path / "program.pt").exists()
    shape = _shape()
    with pytest.raises(ValueError, match="planted_bug"):
        dataclasses.replace(shape, planted_bug="nope")


def _shape() -> KernelShape:
    spec = spec_or_exit("test", CONFIG, "bfloat16", BATCH)
    return KernelShape.from_program(plan(spec, BATCH, DEVICES["h200"]), 16)


def test_cache_key_separates_planted_builds():
    shape = _shape()
    keys = {cache_key(dataclasses.replace(shape, planted_bug=b), "sm_90a")
            for b in ("", *PLANTED_BUGS)}  # fmt: skip
    assert len(keys) == 1 + len(PLANTED_BUGS)
    assert shape.planted_bug == ""


@pytest.mark.parametrize("name", ["planted_bug", "plant_bug", *PLANTED_BUGS])
def test_served_path_cannot_plant(name):
    """VLLM_MEGAKERNEL_VARIANTS names no planted bug; the flags a command
    parses never carry one into the kernel; from_program (what the executor
    builds from) has no parameter for it."""
    assert name not in KERNEL
    with pytest.raises(ValueError, match="unknown variant"):
        Variants.parse(name)
    args = argparse.Namespace(plant_bug="kv-slot", planted_bug="kv-slot")
    flags = Variants.from_flags(args).kernel_flags()
    assert "planted_bug" not in flags and "plant_bug" not in flags
    assert "planted_bug" not in inspect.signature(KernelShape.from_program).parameters
