#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fetch the vLLM 0.32.0 source tree (the PyPI sdist) once, as a git repo.

The sdist holds what the wheels lack: ``tests/`` and ``.buildkite/``. It is
found through the package index pip uses (PEP 503 simple API), checked
against a pinned sha256, unpacked and committed as a base commit, so the
series can be applied with ``git am`` (scripts/apply_patches.py --tree).

    scripts/vllm_source.py [--dest .cache/vllm-src]   # prints the tree path
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.32.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
ROOT = Path(__file__).resolve().parent.parent


def sdist_url(index: str) -> str:
    page = urllib.request.urlopen(f"{index.rstrip('/')}/vllm/", timeout=60)
    hrefs = re.findall(r'href="([^"]+)"', page.read().decode())
    for href in hrefs:
        if href.split("#", 1)[0].endswith("/" + SDIST):
            return urllib.request.urljoin(page.geturl(), href.split("#", 1)[0])
    raise SystemExit(f"{SDIST} is not on the index {index}")


def download(dest: Path) -> Path:
    archive = dest / SDIST
    if archive.exists() and _sha256(archive) == SHA256:
        return archive
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    url = sdist_url(index)
    print(f"downloading {url}", file=sys.stderr)
    partial = archive.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as r, open(partial, "wb") as f:
        while chunk := r.read(1 << 20):
            f.write(chunk)
    if _sha256(partial) != SHA256:
        partial.unlink()
        raise SystemExit(f"{SDIST}: sha256 mismatch (expected {SHA256})")
    partial.rename(archive)
    return archive


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def source_tree(dest: Path) -> Path:
    """The pristine v0.32.0 tree as a git repo with one base commit."""
    dest.mkdir(parents=True, exist_ok=True)
    tree = dest / f"vllm-{VERSION}"
    # One maker at a time: parallel test workers ask for the tree at once.
    with open(dest / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tree / ".git").exists():
            _make_tree(dest, tree)
    return tree


def _make_tree(dest: Path, tree: Path) -> None:
    archive = download(dest)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    git = ["git", "-c", "user.name=vllm-megakernel", "-c", "user.email=ci@localhost"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", f"vLLM v{VERSION}"]):
        subprocess.run(git + cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(ROOT / ".cache" / "vllm-src"))
    print(source_tree(Path(parser.parse_args().dest)))


if __name__ == "__main__":
    main()
