# SPDX-License-Identifier: Apache-2.0
"""The library cache loads only the library that was built: checked against
its manifest's sha256, in folders no one else can write to. No real kernel
compiles here: ``aot.build`` is replaced by one that writes a small file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel import build
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.planner import plan
from vllm_ext.model_spec import ModelSpec

ARCH = "sm_90a"
CONTENT = b"\x7fELF not really a kernel library\n" * 64
NOBODY = 65534


@pytest.fixture(scope="module")
def shape() -> KernelShape:
    spec = ModelSpec.from_hf_config(hf_config("llama"), torch.bfloat16)
    return KernelShape.from_program(plan(spec, 1, DEVICES["h200"]), 16)


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """Stand in for the compiler: each call writes the library into ``out``
    and is recorded."""
    calls: list[Path] = []

    def fake_build(arch: str, out, shape: KernelShape) -> aot.BuildResult:
        out = Path(out)
        (out / "dump").mkdir(parents=True)  # as aot.build does, under the umask
        library = out / f"lib{aot.PREFIX}_{arch}.so"
        library.write_bytes(CONTENT)
        calls.append(out)
        fields = {f.name: 0 for f in dataclasses.fields(aot.BuildResult)}
        return aot.BuildResult(**{**fields, "library": str(library), "arch": arch})

    monkeypatch.setattr(aot, "build", fake_build)
    return calls


@pytest.fixture
def warnings(caplog):
    """The module's warnings (vLLM's logging may stop them propagating)."""
    build.logger.addHandler(caplog.handler)
    yield caplog
    build.logger.removeHandler(caplog.handler)


def warned(caplog) -> str:
    return "\n".join(
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )


def manifest_of(library: Path) -> dict:
    return json.loads((library.parent / "manifest.json").read_text())


def assert_verifies(library: Path) -> None:
    manifest = manifest_of(library)
    assert library.read_bytes() == CONTENT
    assert manifest["library_file"] == library.name
    assert manifest["library_size"] == len(CONTENT)
    assert manifest["library_sha256"] == hashlib.sha256(CONTENT).hexdigest()


def test_fresh_build_records_sha256_and_is_reused(tmp_path, shape, builds):
    logged: list[str] = []
    root = tmp_path / "cache"
    first = build.library_for(shape, ARCH, root, log=logged.append)
    assert_verifies(first)
    assert first.parent == root / build.cache_key(shape, ARCH)
    again = build.library_for(shape, ARCH, root, log=logged.append)
    assert again == first and len(builds) == 1 and len(logged) == 1
    # Nothing left behind by the build (tmp folders are renamed or removed).
    assert [p.name for p in root.iterdir()] == [first.parent.name]


def test_new_folders_are_not_writable_by_others_whatever_the_umask(
    tmp_path, shape, builds
):
    old = os.umask(0)
    try:
        library = build.library_for(shape, ARCH, tmp_path / "a" / "cache")
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "cache", library.parent, library):
        assert path.stat().st_mode & 0o022 == 0, path


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_damaged_library_is_rebuilt(tmp_path, shape, builds, warnings, damage):
    library = build.library_for(shape, ARCH, tmp_path)
    if damage == "truncated":
        library.write_bytes(CONTENT[:100])
    else:
        library.write_bytes(CONTENT[:-1] + b"!")  # same size, other bytes
    again = build.library_for(shape, ARCH, tmp_path)
    assert again == library and len(builds) == 2
    assert_verifies(again)
    message = warned(warnings)
    assert str(library.parent) in message
    assert ("truncated" if damage == "truncated" else "sha256") in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [library.parent.name]


def test_missing_manifest_is_rebuilt(tmp_path, shape, builds, warnings):
    library = build.library_for(shape, ARCH, tmp_path)
    (library.parent / "manifest.json").unlink()
    assert build.library_for(shape, ARCH, tmp_path) == library
    assert len(builds) == 2
    assert_verifies(library)
    assert "no manifest.json" in warned(warnings)


def test_entry_from_before_checksums_is_rebuilt(tmp_path, shape, builds, warnings):
    """The manifest the old cache wrote: the build result, no checksum."""
    library = build.library_for(shape, ARCH, tmp_path)
    manifest = manifest_of(library)
    for key in ("library_file", "library_size", "library_sha256"):
        del manifest[key]
    (library.parent / "manifest.json").write_text(json.dumps(manifest))
    assert build.library_for(shape, ARCH, tmp_path) == library
    assert len(builds) == 2 and "no checksum" in warned(warnings)
    assert_verifies(library)


def test_damaged_entry_that_cannot_be_rebuilt_is_a_clear_error(
    tmp_path, shape, builds, monkeypatch
):
    library = build.library_for(shape, ARCH, tmp_path)
    library.write_bytes(CONTENT[:100])

    def no_toolkit(arch, out, shape):
        raise FileNotFoundError("CUDA 13 headers and libcudart_static.a not found")

    monkeypatch.setattr(aot, "build", no_toolkit)
    with pytest.raises(build.LibraryCacheError) as raised:
        build.library_for(shape, ARCH, tmp_path)
    message = str(raised.value)
    assert str(library) in message and "truncated" in message
    assert f"Delete {library.parent}" in message and "libcudart_static" in message
    # The failed rebuild leaves the entry as it was and no tmp folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == [library.parent.name]


def entry_path(root: Path, shape: KernelShape, which: str) -> Path:
    entry = root / build.cache_key(shape, ARCH)
    return {
        "root": root,
        "entry": entry,
        "library": entry / f"libmegakernel_{ARCH}.so",
    }[which]


@pytest.mark.parametrize("which", ["root", "entry", "library"])
@pytest.mark.parametrize("mode_bits", [0o020, 0o002], ids=["group", "others"])
def test_foreign_writable_cache_is_refused(tmp_path, shape, builds, which, mode_bits):
    root = tmp_path / "cache"
    build.library_for(shape, ARCH, root)
    path = entry_path(root, shape, which)
    path.chmod(path.stat().st_mode | mode_bits)
    with pytest.raises(build.LibraryCacheError) as raised:
        build.library_for(shape, ARCH, root)
    assert f"chmod go-w {path}" in str(raised.value)
    assert len(builds) == 1  # refused, not rebuilt over


def test_new_cache_in_a_foreign_writable_folder_is_refused(tmp_path, shape, builds):
    tmp_path.chmod(0o777)
    with pytest.raises(build.LibraryCacheError, match=f"chmod go-w {tmp_path}"):
        build.library_for(shape, ARCH, tmp_path)
    assert not builds


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
@pytest.mark.parametrize("which", ["root", "entry", "library"])
def test_cache_owned_by_another_user_is_refused(tmp_path, shape, builds, which):
    root = tmp_path / "cache"
    build.library_for(shape, ARCH, root)
    path = entry_path(root, shape, which)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(build.LibraryCacheError) as raised:
        build.library_for(shape, ARCH, root)
    assert str(path) in str(raised.value) and f"uid {NOBODY}" in str(raised.value)
    assert len(builds) == 1
