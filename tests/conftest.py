# SPDX-License-Identifier: Apache-2.0
import os
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
