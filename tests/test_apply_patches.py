# SPDX-License-Identifier: Apache-2.0
"""scripts/apply_patches.py: applies cleanly, refuses clearly, never leaves a
target half-patched, and reverses byte for byte."""

import filecmp
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import base_commit

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "apply_patches.py"
PATCHES = ROOT / "patches"


def _touched_files() -> list[str]:
    files = set()
    for patch in (PATCHES / "series").read_text().split():
        text = (PATCHES / patch).read_text()
        files.update(re.findall(r"(?m)^diff --git a/(vllm/\S+) ", text))
    return sorted(files)


@pytest.fixture(scope="module")
def source_tree():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import vllm_source
    finally:
        sys.path.pop(0)
    return vllm_source.source_tree(ROOT / ".cache" / "vllm-src")


@pytest.fixture
def package(tmp_path, source_tree):
    """A stand-in for an installed vllm 0.32.0: the pristine files the series
    touches (that exist before it), plus _version.py."""
    base = base_commit(source_tree)
    root = tmp_path / "site"
    for rel in _touched_files():
        shown = subprocess.run(
            ["git", "show", f"{base}:{rel}"], cwd=source_tree, capture_output=True
        )
        if shown.returncode == 0:  # files the series creates do not exist yet
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(shown.stdout)
    # Generated at build time, so not in git; the series never touches it.
    version = (source_tree / "vllm" / "_version.py").read_bytes()
    (root / "vllm" / "_version.py").write_bytes(version)
    # A regular package, so it shadows the real vllm on PYTHONPATH.
    (root / "vllm" / "__init__.py").write_text("")
    pristine = tmp_path / "pristine"
    subprocess.run(["cp", "-a", str(root), str(pristine)], check=True)
    return root, pristine


def run(action: str, site: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), action, *extra, "--installed"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip


def _same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    stack = [cmp]
    while stack:
        c = stack.pop()
        if c.left_only or c.right_only or c.diff_files or c.funny_files:
            return False
        # dircmp compares shallowly by stat; compare bytes.
        for name in c.same_files:
            if (Path(c.left) / name).read_bytes() != (
                Path(c.right) / name
            ).read_bytes():
                return False
        stack.extend(c.subdirs.values())
    return True


def test_apply_then_reverse_is_byte_identical(package):
    site, pristine = package
    assert run("check", site).returncode == 0
    applied = run("apply", site)
    assert applied.returncode == 0, applied.stderr
    assert (site / "vllm" / "v1" / "worker" / "decode_backend.py").exists()
    assert "patched with current" in run("status", site).stdout
    assert not _same_tree(site, pristine)
    reversed_ = run("reverse", site)
    assert reversed_.returncode == 0, reversed_.stderr
    assert _same_tree(site, pristine)


def test_applying_twice_is_refused_and_changes_nothing(package):
    site, _ = package
    assert run("apply", site).returncode == 0
    snapshot = site.parent / "snapshot"
    subprocess.run(["cp", "-a", str(site), str(snapshot)], check=True)
    again = run("apply", site)
    assert again.returncode == 1
    assert "already applied" in again.stderr
    assert _same_tree(site, snapshot)


def test_other_vllm_version_is_refused(package):
    site, pristine = package
    version = site / "vllm" / "_version.py"
    version.write_text(version.read_text().replace("0.32.0", "0.31.0"))
    result = run("apply", site)
    assert result.returncode == 1
    assert "vLLM 0.31.0" in result.stderr and "fits vLLM 0.32.0 only" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_patch_that_does_not_fit_leaves_nothing_half_patched(package):
    site, pristine = package
    # Break the context of the last patch only; earlier ones still fit.
    target = site / "vllm" / "v1" / "worker" / "cpu_model_runner.py"
    line = "self._setup_eagle3_aux_hidden_state_outputs()"
    assert line in target.read_text()
    target.write_text(target.read_text().replace(line, line + "  # changed"))
    subprocess.run(["cp", "-a", str(site), str(site.parent / "before")], check=True)
    result = run("apply", site)
    assert result.returncode == 1
    assert "does not apply cleanly" in result.stderr
    assert _same_tree(site, site.parent / "before")


def test_series_applies_to_the_source_tree_with_git_am(tmp_path, source_tree):
    tree = tmp_path / "tree"
    subprocess.run(["git", "clone", "-q", str(source_tree), str(tree)], check=True)
    subprocess.run(
        ["git", "checkout", "-q", base_commit(source_tree)], cwd=tree, check=True
    )
    cmd = [sys.executable, str(SCRIPT)]
    applied = subprocess.run(
        [*cmd, "apply", "--tree", str(tree)], capture_output=True, text=True
    )
    assert applied.returncode == 0, applied.stderr
    log = subprocess.run(
        ["git", "log", "--format=%s%n%b", f"{base_commit(source_tree)}..HEAD"],
        cwd=tree, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    n = len((PATCHES / "series").read_text().split())
    assert log.count("Signed-off-by:") == n
    again = subprocess.run(
        [*cmd, "apply", "--tree", str(tree)], capture_output=True, text=True
    )
    assert again.returncode == 1 and "already applied" in again.stderr
    back = subprocess.run(
        [*cmd, "reverse", "--tree", str(tree)], capture_output=True, text=True
    )
    assert back.returncode == 0, back.stderr
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    assert head.stdout.strip() == base_commit(source_tree)
