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
import sys
from pathlib import Path

import torch

from vllm_ext.megakernel.cost import DEFAULT_DEVICE, DEVICES
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.plan import DTYPES, print_summary, spec_or_exit
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import verify
from vllm_ext.model_spec import ModelSpec

KERNEL_DIR = Path(aot.__file__).resolve().parent


def source_hash() -> str:
    """Hash of the kernel's sources: a change rebuilds every cached library."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.py")) + sorted(KERNEL_DIR.glob("*.c")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(spec: ModelSpec, batch: int, arch: str) -> str:
    fields = {k: str(v) for k, v in dataclasses.asdict(spec).items()}
    blob = json.dumps([fields, batch, arch, source_hash()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--arch", choices=aot.ARCHS, required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--out", required=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spec = spec_or_exit("build", args.config, args.dtype, args.batch)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    program = plan(
        spec, args.batch, DEVICES[DEFAULT_DEVICE[args.arch]], with_lm_head=True
    )
    verify(program)
    table, lengths = program.encode()
    torch.save({"queues": table, "lengths": lengths}, out / "program.pt")
    result = dataclasses.asdict(aot.build(args.arch, out))
    result.update(
        cache_key=cache_key(spec, args.batch, args.arch),
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
