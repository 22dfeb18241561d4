# SPDX-License-Identifier: Apache-2.0
import fcntl
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# Keep each engine in the test process (so tests can look at the runner) and
# small; set before vLLM reads them.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _llvmlite_answers_no_dunder() -> None:
    """vLLM's CPU worker start scans every loaded module's attributes for
    Triton kernels (triton_utils/dispatcher.py: ``hasattr(value,
    "__dict__")`` then ``vars(value)``). llvmlite's library object, loaded
    with numba (the n-gram drafter imports it), answers any attribute name
    with a function wrapper, ``__dict__`` too, so every engine started in a
    process after one with n-gram speculation fails there. One engine a
    process (``vllm serve``) never meets it; tests start many: make the
    object answer no dunder name."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    lookup = ffi._lib_wrapper.__getattr__

    def getattr_(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    ffi._lib_wrapper.__getattr__ = getattr_


_llvmlite_answers_no_dunder()

ROOT = Path(__file__).resolve().parent.parent
# Run inside vLLM's own tests tree by scripts/vllm_harness.sh.
collect_ignore = ["vllm_harness"]
MODEL_CACHE = Path(
    os.environ.get("VLLM_MEGAKERNEL_MODEL_CACHE", ROOT / ".cache" / "models")
)


def pytest_collection_modifyitems(items) -> None:
    """The modules that start vLLM engines (``e2e``) first, in order: CI's
    workers take a module each (``--dist loadscope``) in this order, so the
    longest start at once instead of ending a run on one worker while the
    other idles. (A stable sort: a module's tests stay together.)"""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


@pytest.fixture
def one_thread():
    """One intra-op thread: on tiny models a second one only spins on a
    shared runner (a step ran ~50x slower with two on this 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_model():
    """Build (once) and return the directory of a tiny demo model."""
    from vllm_ext.demo_models import build_model

    def get(arch: str) -> str:
        return str(build_model(arch, MODEL_CACHE / arch))

    return get


class BaselineBuilds:
    """FlashInfer's paged decode and MLA decode libraries, built as
    scripts/device_check.sh builds them (scripts/baseline/), both started
    at the first use (CI time: ~35 s of nvcc each, one core each), once per
    test run: the first worker to ask builds into ``root``, the others wait
    on its lock and take its result."""

    SCRIPTS = ("build_flashinfer.py", "build_flashinfer_mla.py")

    def __init__(self, root: Path):
        self._pool = ThreadPoolExecutor(max_workers=len(self.SCRIPTS))
        self._runs = {
            name: self._pool.submit(self._build, name, root) for name in self.SCRIPTS
        }

    @staticmethod
    def _build(name: str, root: Path) -> tuple[subprocess.CompletedProcess, Path]:
        out = root / name.removesuffix(".py")
        record = root / f"{out.name}.json"
        with open(root / f"{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not record.exists():
                cmd = [sys.executable, str(ROOT / "scripts" / "baseline" / name),
                       str(out)]  # fmt: skip
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                record.write_text(json.dumps([cmd, run.returncode, run.stdout,
                                              run.stderr]))  # fmt: skip
        return subprocess.CompletedProcess(*json.loads(record.read_text())), out

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        """The script's finished run and its output folder."""
        return self._runs[name].result()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="session")
def baseline_builds(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # (the run's, shared by its workers)
    builds = BaselineBuilds(root)
    yield builds
    builds.close()
