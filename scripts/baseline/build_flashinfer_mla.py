#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build FlashInfer's MLA paged decode for the GPU check's MLA cases, here
(no GPU): ``flashinfer_mla.cu`` against the headers of flashinfer-python
0.7.0.post1 (what vLLM 0.32.0 pins), the CUTLASS headers that wheel carries
(its Hopper MLA kernel uses them) and CCCL, with nvcc from the
nvidia-cuda-nvcc wheel, into ``OUT/libflashinfer_mla_sm90a.so`` (loaded by
``flashinfer_mla.py``). Measured here (2026-12-01): 29 s, 1.2 MB.

    python scripts/baseline/build_flashinfer_mla.py OUT
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_flashinfer import (  # noqa: E402
    CACHE,
    WHEELS,
    cache_lock,
    compile_library,
    fetch,
)
from flashinfer_mla import LIBRARY  # noqa: E402

CUTLASS_PREFIX = "flashinfer/data/cutlass/include/"


def cutlass_headers() -> Path:
    """The CUTLASS (and CuTe) headers of the FlashInfer wheel, unpacked once."""
    version = WHEELS["flashinfer-python"]
    stamp = CACHE / f"cutlass-{version}.done"
    root = CACHE / "cutlass-headers"
    with cache_lock():
        if not stamp.exists():
            wheel = next((CACHE / "wheels").glob(f"flashinfer_python-{version}-*.whl"))
            with zipfile.ZipFile(wheel) as z:
                names = [n for n in z.namelist() if n.startswith(CUTLASS_PREFIX)]
                z.extractall(root, names)
            stamp.touch()
    return root / CUTLASS_PREFIX


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    fetch()  # the wheels, before their CUTLASS headers are unpacked
    library = out / LIBRARY
    compile_library(Path(__file__).with_name("flashinfer_mla.cu"), library,
                    (cutlass_headers(),))  # fmt: skip
    print(library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
