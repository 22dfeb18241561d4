# SPDX-License-Identifier: Apache-2.0
"""A shared library of the GPU check's bundle bound through ctypes: the
FlashInfer baselines (``flashinfer_baseline.py``, ``flashinfer_mla.py``)
declare their file and C signatures; loading, binding and error checks are
here once."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import ClassVar

import torch


class CtypesLibrary:
    """Subclasses set ``LIBRARY`` (the file in the bundle) and
    ``SIGNATURES`` (function name: argument types; every function returns
    a CUDA error code, 0 on success)."""

    LIBRARY: ClassVar[str]
    SIGNATURES: ClassVar[dict[str, list]]

    @classmethod
    def load(cls, bundle: Path):
        """From the GPU check's bundle; None where it lacks the library or
        there is no GPU."""
        path = bundle / cls.LIBRARY
        return cls(path) if path.exists() and torch.cuda.is_available() else None

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        for name, args in self.SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    @staticmethod
    def _check(name: str, err: int) -> None:
        """A CUDA error raises, so a GPU run reports it."""
        if err:
            raise RuntimeError(f"{name}: CUDA error {err}")
