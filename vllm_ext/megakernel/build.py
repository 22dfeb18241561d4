# SPDX-License-Identifier: Apache-2.0
"""Build the megakernel for one model shape, batch bucket and arch, on a
machine without a GPU.

    python -m vllm_ext.megakernel.build --config CONFIG.json --batch B \\
        --arch {sm_90a,sm_100a} --out DIR [--json]

Plans and verifies the program (``program.pt``: the encoded queues), compiles
and links the kernel library (``libmegakernel_<arch>.so``: needs only the
CUDA driver), and writes ``manifest.json`` with the cache key (model shape,
batch bucket, arch, kernel source hash) and the kernel's resource usage.
With ``--json`` the last line is one JSON object. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import torch

from vllm_ext.megakernel.cost import DEFAULT_DEVICE, DEVICES
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.kernel.shape import PLANTED_BUGS, KernelShape, quant_refusal
from vllm_ext.megakernel.plan import print_summary, spec_or_exit
from vllm_ext.megakernel.planner import plan, qkv_parts_to_fill
from vllm_ext.megakernel.variants import Variants
from vllm_ext.megakernel.verify import verify
from vllm_ext.model_spec import UnsupportedModelError
from vllm_ext.parallel import shard_spec

KERNEL_DIR = Path(aot.__file__).resolve().parent
# Under "vllm." as vLLM's init_logger names the backend's: vLLM's handlers
# show it, without importing vLLM on a build machine.
logger = logging.getLogger(f"vllm.{__name__}")


# Everything that decides what the kernel runs, relative to vllm_ext/: the
# kernel (its sources, shape, build flags in aot.py), the instruction
# encoding, the planner and the cost model it plans by, the variants, the
# model's spec, and this module's choices (head parts, block size).
DECIDES = (
    "megakernel/kernel",
    "megakernel/isa.py",
    "megakernel/planner.py",
    "megakernel/cost.py",
    "megakernel/variants.py",
    "megakernel/plan.py",
    "megakernel/build.py",
    "model_spec.py",
)
PACKAGE_DIR = KERNEL_DIR.parent.parent


def source_files(root: Path = PACKAGE_DIR) -> list[Path]:
    files: list[Path] = []
    for name in DECIDES:
        path = root / name
        files += (
            sorted([*path.rglob("*.py"), *path.glob("*.c")])
            if path.is_dir()
            else [path]
        )
    return files


def source_hash(root: Path = PACKAGE_DIR) -> str:
    """Hash of everything that decides what the kernel runs (``DECIDES``)
    and of the compiler's version: a change rebuilds every cached library
    and finds no measured bucket."""
    import importlib.metadata

    h = hashlib.sha256()
    for path in source_files(root):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    try:
        h.update(importlib.metadata.version("nvidia-cutlass-dsl").encode())
    except importlib.metadata.PackageNotFoundError:
        h.update(b"no nvidia-cutlass-dsl")
    return h.hexdigest()[:16]


def cache_key(shape: KernelShape, arch: str) -> str:
    """Model shape, batch bucket (both in ``shape``), arch, kernel sources."""
    blob = json.dumps([shape.as_dict(), arch, source_hash()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "vllm_megakernel"
    )


class LibraryCacheError(RuntimeError):
    """A cached library that must not be loaded and cannot be rebuilt."""


MANIFEST = "manifest.json"
# Folders and libraries the cache creates: never writable by group or others,
# whatever the umask (whoever can write a library we dlopen runs code in the
# server).
DIR_MODE = 0o755
LIBRARY_MODE = 0o755
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def library_record(library: Path) -> dict:
    """What a manifest records of its library, to check it before a load."""
    return {
        "library_file": library.name,
        "library_size": library.stat().st_size,
        "library_sha256": file_sha256(library),
    }


def check_private(path: Path) -> None:
    """Refuse ``path`` unless only this user (or root) can change it."""
    st = path.stat()
    if st.st_uid not in (os.geteuid(), 0):
        raise LibraryCacheError(
            f"megakernel cache: {path} is owned by uid {st.st_uid}, not by this "
            f"process's uid {os.geteuid()}, so its owner could run code in this "
            f"process; use a cache folder of your own (VLLM_MEGAKERNEL_CACHE_DIR) "
            f"or `chown {os.geteuid()} {path}`"
        )
    if st.st_mode & _FOREIGN_WRITE:
        who = " and ".join(
            w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
            if st.st_mode & bit
        )  # fmt: skip
        raise LibraryCacheError(
            f"megakernel cache: {path} is writable by {who} (mode "
            f"{stat.S_IMODE(st.st_mode):o}), so they could run code in this "
            f"process; run `chmod go-w {path}`"
        )


def _make_dirs(path: Path) -> None:
    """``mkdir -p`` with DIR_MODE for each folder made, not the umask's."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)  # the umask can only take bits away
        except FileExistsError:  # a concurrent start made it
            continue
        os.chmod(d, DIR_MODE)


def _untrusted(entry: Path, library: Path) -> str | None:
    """Why the cache entry's library does not match its manifest, or None.
    (Integrity, not security: whoever could rewrite the library could
    rewrite the manifest too; check_private keeps them out.)"""
    try:
        if not stat.S_ISREG(library.lstat().st_mode):
            return f"{library.name} is not a regular file"
        size = library.stat().st_size
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError as e:
        return f"no {Path(e.filename).name}"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    if not isinstance(manifest, dict) or "library_sha256" not in manifest:
        return f"{MANIFEST} records no checksum of the library"
    if manifest.get("library_file") != library.name:
        return f"{MANIFEST} is for {manifest.get('library_file')!r}"
    if size != manifest.get("library_size"):
        return (
            f"{library.name} has {size} bytes, {MANIFEST} says "
            f"{manifest.get('library_size')} (truncated or partly copied)"
        )
    try:
        digest = file_sha256(library)
    except OSError as e:
        return f"{library.name} is unreadable ({e})"
    if digest != manifest["library_sha256"]:
        return f"the sha256 of {library.name} is not the one in {MANIFEST}"
    return None


def _publish(tmp: Path, out: Path, library: Path) -> None:
    """Rename the finished build ``tmp`` to ``out``: atomic, so no reader
    ever sees half an entry. A stale ``out`` is moved aside first; a good
    one that another process published meanwhile is kept."""
    for _ in range(3):
        try:
            os.replace(tmp, out)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if _untrusted(out, library) is None:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".stale"))
        with contextlib.suppress(FileNotFoundError):  # another process did
            os.replace(out, aside)
        shutil.rmtree(aside, ignore_errors=True)
    raise LibraryCacheError(f"megakernel cache: could not replace {out}")


def library_for(
    shape: KernelShape, arch: str, cache_dir: Path | None = None, log=None
) -> Path:
    """The built library for ``shape`` on ``arch``: from the cache when
    present and intact (its sha256 is the manifest's), else compiled now
    (about 10 s; needs CuTe DSL, not a GPU). Refuses a cache that others
    can write to."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    _make_dirs(root)
    check_private(root)
    out = root / cache_key(shape, arch)
    library = out / f"lib{aot.PREFIX}_{arch}.so"
    why = None
    if out.exists():
        check_private(out)
        if library.exists():
            check_private(library)
        why = _untrusted(out, library)
        if why is None:
            return library
        logger.warning(
            "megakernel cache entry %s is not trusted (%s): rebuilding it", out, why
        )
    if log is not None:
        log(f"compiling the megakernel for {arch}, batch {shape.batch} into {out}")
    # Private until complete (mkdtemp: 0o700); a unique name per build, as
    # buckets build in threads of one process.
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=out.name + ".tmp"))
    try:
        result = dataclasses.asdict(aot.build(arch, tmp, shape))
        built = tmp / library.name
        os.chmod(built, LIBRARY_MODE)  # gcc's mode follows the umask
        result.update(library=str(library), **library_record(built))
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps(result, indent=2))
        os.chmod(manifest, 0o644)
        os.chmod(tmp, DIR_MODE)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if why is None:
            raise
        raise LibraryCacheError(
            f"megakernel cache: {library} cannot be used ({why}) and rebuilding "
            f"it failed: {e}. Delete {out} and start again where the build "
            "can run (nvidia-cutlass-dsl[cu13], the CUDA 13 headers and "
            "libcudart_static.a, gcc), or copy in a complete entry (library "
            "and manifest.json) built elsewhere."
        ) from e
    _publish(tmp, out, library)
    check_private(out)
    check_private(library)
    why = _untrusted(out, library)
    if why is not None:
        raise LibraryCacheError(
            f"megakernel cache: {library} does not match its manifest just after "
            f"the build ({why}); delete {out} and try again"
        )
    return library


def save_program(path: Path, program, shape: KernelShape, full=None) -> None:
    """What the GPU check needs to rebuild and run the program without
    configs or vLLM: the encoded queues, the model shape, the bucket; for a
    tensor-parallel rank's program, the unsharded model (``full``) too."""
    table, lengths = program.encode()

    def fields(spec) -> dict:
        out = dataclasses.asdict(spec)
        out.pop("dtype")  # the kernel runs bf16
        if out["quant"] is not None:  # (torch.load takes no frozenset)
            out["quant"]["unquantized"] = sorted(out["quant"]["unquantized"])
        return out

    meta = {"queues": table, "lengths": lengths, "batch": program.batch,
            "num_counters": program.num_counters, "shape": shape.as_dict(),
            "spec": fields(program.spec)}  # fmt: skip
    if full is not None:
        meta["full_spec"] = fields(full)
    torch.save(meta, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--arch", choices=aot.ARCHS, required=True)
    parser.add_argument("--dtype", choices=["bfloat16"], default="bfloat16")
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="KV cache block size (vLLM's, 16 by default)",
    )
    parser.add_argument(
        "--legacy-control",
        action="store_true",
        help="for the GPU check only: the previous control (thread 0 waits, CTA "
        "barriers, GEMVs from global memory) instead of the warp roles, to time "
        "against the default",
    )
    parser.add_argument(
        "--wide-attn",
        action="store_true",
        help="experimental: attention with 128-bit K/V loads and the batch's "
        "requests side by side",
    )
    parser.add_argument(
        "--whole-heads",
        action="store_true",
        help="for the GPU check only: QKV tiles of whole heads instead of the "
        "parts of heads that fill the SMs (the tiling before 2026-12-02), to "
        "time against the default",
    )
    parser.add_argument(
        "--plant-bug",
        choices=PLANTED_BUGS,
        help="for the GPU check only: build a deliberately wrong kernel that "
        "the check must reject (kv-slot: the KV append writes the wrong slot; "
        "oob-store: a store one element past the end of the final-norm output). "
        "Never serve it",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: build one rank's kernel (vllm_ext/parallel.py)",
    )
    parser.add_argument(
        "--one-gpu-ranks",
        action="store_true",
        help="for the GPU check only: every rank in one launch, the CTAs split "
        "into rank groups (a single GPU runs the ranks' exchange)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="plan only the first N layers: the kernel is the same for any "
        "number (its table has a row a layer), and a large model's program "
        "takes minutes to plan and verify",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spec = spec_or_exit("build", args.config, args.dtype, args.batch)
    if args.tp < 1 or (args.one_gpu_ranks and args.tp == 1):
        print("build: --tp must be at least 1 (2 with --one-gpu-ranks)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.layers is not None and not 1 <= args.layers <= spec.num_layers:
        print(f"build: --layers must be 1 to {spec.num_layers}", file=sys.stderr)
        return 2
    if args.layers is not None:
        spec = spec.with_layers(args.layers)
    full = spec
    try:
        spec = shard_spec(spec, args.tp)
    except UnsupportedModelError as e:
        print(f"build: {e}", file=sys.stderr)
        return 2
    refused = quant_refusal(spec.quant)
    if refused:
        # The plan CLI counts its bytes; the kernel has no device functions
        # for it yet. (Those it has: KernelShape.fp8 / int4_group, which
        # refuse a variant, a mixture, a latent attention or tensor parallel.)
        print(f"build: {refused}", file=sys.stderr)
        return 2
    if args.block_size < 16 or args.block_size % 16:
        print("build: --block-size must be a multiple of 16", file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = DEVICES[DEFAULT_DEVICE[args.arch]]
    ranks = args.tp if args.one_gpu_ranks else 1
    if ranks > 1:  # each rank's program on its group of the GPU's SMs
        device = dataclasses.replace(device, num_sms=device.num_sms // ranks)
    variants = Variants.from_flags(args)
    try:
        # Not a variant (Variants cannot name it): only this flag sets it.
        parts = 1 if args.whole_heads else None
        if args.whole_heads and qkv_parts_to_fill(spec, device.num_sms) == 1:
            raise ValueError("--whole-heads: this model's default program "
                             "already has whole heads")  # fmt: skip
        program = plan(spec, args.batch, device, with_lm_head=True, qkv_parts=parts)
        verify(program)
        # (The legacy control is not a variant either: only this flag sets it.)
        shape = KernelShape.from_program(program, args.block_size,
                                         legacy_control=args.legacy_control,
                                         ranks_in_launch=ranks,
                                         **variants.kernel_flags())  # fmt: skip
        if args.plant_bug:
            # Not a variant (Variants cannot name it): only this flag sets it.
            shape = dataclasses.replace(shape, planted_bug=args.plant_bug)
            print(f"build: planting bug {args.plant_bug!r}: a deliberately wrong "
                  "kernel, for the GPU check only", file=sys.stderr)  # fmt: skip
    except ValueError as e:
        print(f"build: {e}", file=sys.stderr)
        return 2
    save_program(out / "program.pt", program, shape,
                 full if args.tp > 1 else None)  # fmt: skip
    result = dataclasses.asdict(aot.build(args.arch, out, shape))
    result.update(
        cache_key=cache_key(shape, args.arch),
        source_hash=source_hash(),
        batch=args.batch,
        num_instructions=program.num_instructions,
        program=str(out / "program.pt"),
        **library_record(Path(result["library"])),
    )
    (out / "manifest.json").write_text(json.dumps(result, indent=2))
    print_summary(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
