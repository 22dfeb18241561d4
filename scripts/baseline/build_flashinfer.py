#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build the per-op baseline's attention kernels for the GPU check, here (no
GPU): ``flashinfer_decode.cu`` (FlashInfer's split-KV paged decode, its
merge and its host planner; the KV-append kernel) against the headers of
flashinfer-python 0.7.0.post1 (what vLLM 0.32.0 pins) and the CCCL they
need, with nvcc from the nvidia-cuda-nvcc wheel (pyproject.toml's test
extra; else $CUDA_HOME or a system CUDA 13 toolkit), into
``OUT/libflashinfer_decode_sm_90a.so`` (loaded by ``flashinfer_baseline.py``).

    python scripts/baseline/build_flashinfer.py OUT
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm_ext.megakernel.kernel.aot import nvcc  # noqa: E402

WHEELS = {"flashinfer-python": "0.7.0.post1", "nvidia-cuda-cccl": "13.3.5.0.6"}
# What each wheel contributes: headers only.
PREFIXES = {
    "flashinfer-python": "flashinfer/data/include/",
    "nvidia-cuda-cccl": "nvidia/cu13/include/cccl/",
}
CACHE = ROOT / ".cache" / "flashinfer"


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    """The cache, one process at a time: two builds may start together (the
    test suite builds this library and the MLA one at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def fetch() -> tuple[Path, Path]:
    """(FlashInfer's include dir, CCCL's include dir), unpacked once."""
    with cache_lock():
        _fetch()
    return (
        CACHE / "flashinfer-python" / "flashinfer" / "data" / "include",
        CACHE / "nvidia-cuda-cccl" / "nvidia" / "cu13" / "include" / "cccl",
    )


def _fetch() -> None:
    for name, version in WHEELS.items():
        stamp = CACHE / f"{name}-{version}.done"
        if stamp.exists():
            continue
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
             f"{name}=={version}", "-d", str(CACHE / "wheels")],
            check=True,
        )  # fmt: skip
        wheel = next(
            (CACHE / "wheels").glob(f"{name.replace('-', '_')}-{version}-*.whl")
        )
        with zipfile.ZipFile(wheel) as z:
            z.extractall(
                CACHE / name, [n for n in z.namelist() if n.startswith(PREFIXES[name])]
            )
        stamp.touch()


def compile_library(source: Path, library: Path, includes: tuple = ()) -> None:
    """``source`` (beside this script) against FlashInfer's and CCCL's
    headers (and ``includes``) into the shared library ``library``, for
    sm_90a, with nvcc from the wheels; needs only libc/libstdc++ there."""
    flashinfer, cccl = fetch()
    compiler = nvcc()
    # nvcc.profile links from lib64; the wheels have lib (libcudart_static.a,
    # libcudadevrt.a).
    lib = compiler.parents[1] / "lib"
    subprocess.run(
        [str(compiler), "-std=c++17", "-O3", "-DNDEBUG",
         "-use_fast_math", "--expt-relaxed-constexpr", "-DFLASHINFER_ENABLE_BF16",
         "-arch=sm_90a", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-shared",
         "-cudart", "static", f"-L{lib}", f"-I{cccl}", f"-I{flashinfer}",
         *(f"-I{d}" for d in includes), str(source), "-o", str(library)],
        check=True,
    )  # fmt: skip


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    library = out / "libflashinfer_decode_sm_90a.so"
    compile_library(Path(__file__).with_name("flashinfer_decode.cu"), library)
    print(library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
