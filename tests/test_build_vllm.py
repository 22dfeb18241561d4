# SPDX-License-Identifier: Apache-2.0
"""scripts/build_vllm.sh: the vLLM it builds from the series tree is 0.32.0,
a version scripts/apply_patches.py accepts, and it says what the flavour needs
from outside the package registries.

The version comes from `build_vllm.sh --metadata`: vLLM's own setup.py, run
through pip's metadata step with the settings of the real build, compiling
nothing. The first run makes the script's helper venv (.cache/vllm-build-env,
~1 GB, 30-45 s); then each flavour takes ~6 s."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import base_commit

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "build_vllm.sh"

pytestmark = pytest.mark.timeout(900)


def _script_module(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """Run `build_vllm.sh --metadata` once per flavour, on a clone of the
    v0.32.0 tree (so the script's reset and git am leave .cache/vllm-src to
    whoever works in it); gives (version, pip's report, stderr, tree)."""
    vllm_source = _script_module("vllm_source")
    tree = vllm_source.source_tree(ROOT / ".cache" / "vllm-src")
    src = tmp_path_factory.mktemp("vllm-src")
    subprocess.run(["git", "clone", "-q", str(tree), str(src / tree.name)], check=True)
    # A script that took --metadata for an install would fail here at once
    # (no venv can be made under a file), not build into the project's venv.
    blocker = src / "not-a-folder"
    blocker.write_text("")
    done = {}

    def run(flavour: str):
        if flavour not in done:
            out = tmp_path_factory.mktemp(f"metadata-{flavour}")
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("VLLM_", "SETUPTOOLS_"))
            }
            env |= {
                "VLLM_TARGET_DEVICE": flavour,
                "VLLM_MEGAKERNEL_SRC": str(src),
                "VLLM_MEGAKERNEL_VENV": str(blocker / "venv"),
            }
            r = subprocess.run(
                [str(SCRIPT), "--metadata", str(out)],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr[-4000:]
            report = json.loads((out / "report.json").read_text())
            done[flavour] = (r.stdout.strip(), report, r.stderr, src / tree.name)
        return done[flavour]

    return run


@pytest.mark.parametrize("flavour", ["empty", "cpu"])
def test_version_is_the_release(metadata, flavour):
    version, report, _, tree = metadata(flavour)
    apply_patches = _script_module("apply_patches")
    # Built from the series tree: one commit a patch on top of the base.
    count = subprocess.run(
        ["git", "rev-list", "--count", "--no-merges", "HEAD", "^" + base_commit(tree)],
        cwd=tree, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert int(count.stdout) == len(apply_patches.series())
    (meta,) = [i["metadata"] for i in report["install"]]
    assert (meta["name"], meta["version"]) == ("vllm", version)
    # The release, with the suffix vLLM's setup.py gives the flavour (vLLM's
    # CPU platform detection reads "cpu" in the version): not 0.1.devN+g...
    assert version == f"0.32.0+{flavour}"
    assert apply_patches._base_version(version) == apply_patches.VLLM_VERSION
    apply_patches._require_version(version, "the vLLM build_vllm.sh builds")


def test_says_what_the_cpu_flavour_needs_from_outside(metadata):
    _, report, stderr, _ = metadata("cpu")
    needs = stderr.split("needs from outside the package registries:", 1)
    assert len(needs) == 2, stderr[-4000:]
    # The runtime requirements the build itself gives that pip fetches by
    # URL (triton-cpu from a GitHub release) are each said up front.
    (meta,) = [i["metadata"] for i in report["install"]]
    urls = [
        req.split("@", 1)[1].split(";")[0].strip()
        for req in meta["requires_dist"]
        if "@" in req.split(";")[0]
    ]
    assert any("triton-cpu" in url for url in urls), meta["requires_dist"]
    for url in urls:
        assert url in needs[1], url
    assert "torch==2.13.0+cpu" in needs[1]
    assert "oneDNN" in needs[1]
