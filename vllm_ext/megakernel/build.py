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
import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from vllm_ext.megakernel import isa
from vllm_ext.megakernel.cost import DEFAULT_DEVICE, DEVICES
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.plan import print_summary, spec_or_exit
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.variants import Variants
from vllm_ext.megakernel.verify import verify

KERNEL_DIR = Path(aot.__file__).resolve().parent


def source_hash() -> str:
    """Hash of the kernel's sources: a change rebuilds every cached library."""
    h = hashlib.sha256()
    sources = sorted(KERNEL_DIR.rglob("*.py")) + sorted(KERNEL_DIR.glob("*.c"))
    for path in sources + [Path(isa.__file__)]:
        h.update(str(path.relative_to(KERNEL_DIR.parent)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(shape: KernelShape, arch: str) -> str:
    """Model shape, batch bucket (both in ``shape``), arch, kernel sources."""
    blob = json.dumps([shape.as_dict(), arch, source_hash()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "vllm_megakernel"
    )


def library_for(
    shape: KernelShape, arch: str, cache_dir: Path | None = None, log=None
) -> Path:
    """The built library for ``shape`` on ``arch``: from the cache when
    present, else compiled now (about 10 s; needs CuTe DSL, not a GPU)."""
    out = (cache_dir or default_cache_dir()) / cache_key(shape, arch)
    library = out / f"lib{aot.PREFIX}_{arch}.so"
    if library.exists():
        return library
    if log is not None:
        log(f"compiling the megakernel for {arch}, batch {shape.batch} into {out}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    result = aot.build(arch, tmp, shape)
    (tmp / "manifest.json").write_text(json.dumps(dataclasses.asdict(result)))
    try:
        os.replace(tmp, out)  # atomic: no reader ever sees half a build
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return library


def save_program(path: Path, program, shape: KernelShape) -> None:
    """What the GPU check needs to rebuild and run the program without
    configs or vLLM: the encoded queues, the model shape, the bucket."""
    table, lengths = program.encode()
    spec = dataclasses.asdict(program.spec)
    spec.pop("dtype")  # the kernel runs bf16
    torch.save(
        {"queues": table, "lengths": lengths, "batch": program.batch,
         "num_counters": program.num_counters, "shape": shape.as_dict(),
         "spec": spec},
        path,
    )  # fmt: skip


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
        "--stage-weights",
        action="store_true",
        help="experimental: copy each GEMV tile's weights into shared memory "
        "before its wait (a variant to time against the default)",
    )
    parser.add_argument(
        "--stage-queue",
        action="store_true",
        help="experimental: copy the SM's instruction queue into shared memory "
        "at launch",
    )
    parser.add_argument(
        "--mma-gemv",
        action="store_true",
        help="experimental: GEMVs on tensor cores (mma.sync); not with --stage-weights",
    )
    parser.add_argument(
        "--weight-pipe",
        action="store_true",
        help="experimental: a ring of shared-memory pages kept filled with the "
        "queue's weights by bulk copies, through waits; alone",
    )
    parser.add_argument(
        "--l2-ahead",
        action="store_true",
        help="experimental: with --weight-pipe, hint the ring's next pages into "
        "L2 ahead of it",
    )
    parser.add_argument(
        "--wide-attn",
        action="store_true",
        help="experimental: attention with 128-bit K/V loads and the batch's "
        "requests side by side",
    )
    parser.add_argument(
        "--fused-combine",
        action="store_true",
        help="experimental: no COMBINE instructions; the last ATTN chunk of each "
        "kv head merges the head's partials",
    )
    parser.add_argument(
        "--split-qkv",
        action="store_true",
        help="experimental: QKV tiles are parts of heads (RoPE pairs), as many "
        "parts as keep one tile per SM; not with --stage-weights",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spec = spec_or_exit("build", args.config, args.dtype, args.batch)
    if args.block_size < 16 or args.block_size % 16:
        print("build: --block-size must be a multiple of 16", file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = DEVICES[DEFAULT_DEVICE[args.arch]]
    variants = Variants.from_flags(args)
    try:
        options = variants.plan_options(spec, device.num_sms, strict=True)
        program = plan(spec, args.batch, device, with_lm_head=True, **options)
        verify(program)
        shape = KernelShape.from_program(
            program, args.block_size, **variants.kernel_flags()
        )
    except ValueError as e:
        print(f"build: {e}", file=sys.stderr)
        return 2
    save_program(out / "program.pt", program, shape)
    result = dataclasses.asdict(aot.build(args.arch, out, shape))
    result.update(
        cache_key=cache_key(shape, args.arch),
        source_hash=source_hash(),
        batch=args.batch,
        num_instructions=program.num_instructions,
        program=str(out / "program.pt"),
    )
    (out / "manifest.json").write_text(json.dumps(result, indent=2))
    print_summary(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
