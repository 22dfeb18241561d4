# SPDX-License-Identifier: Apache-2.0
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Keep each engine in the test process (so tests can look at the runner) and
# small; set before vLLM reads them.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(
    os.environ.get("VLLM_MEGAKERNEL_MODEL_CACHE", ROOT / ".cache" / "models")
)


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
    at the first use (CI time: ~35 s of nvcc each, one core each)."""

    SCRIPTS = ("build_flashinfer.py", "build_flashinfer_mla.py")

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._started = {}
        for name in self.SCRIPTS:
            out = tmp_path_factory.mktemp(name.removesuffix(".py"))
            cmd = [sys.executable, str(ROOT / "scripts" / "baseline" / name), str(out)]
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            self._started[name] = (proc, out)
        self._done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        """The script's finished run and its output folder."""
        if name not in self._done:
            proc, out = self._started[name]
            stdout, stderr = proc.communicate(timeout=900)
            done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                               stderr)  # fmt: skip
            self._done[name] = done, out
        return self._done[name]

    def close(self) -> None:
        for proc, _ in self._started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def baseline_builds(tmp_path_factory):
    builds = BaselineBuilds(tmp_path_factory)
    yield builds
    builds.close()
