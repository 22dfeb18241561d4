# SPDX-License-Identifier: Apache-2.0
"""The AOT build takes CUDA's headers and libcudart_static.a from the pip
wheels (nvidia-cuda-runtime, -crt, -cccl), never from a system toolkit: a
fresh machine has none."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_kernel_aot import check_sass, demo_shape

from vllm_ext.megakernel.kernel import aot

ROOT = Path(__file__).resolve().parents[2]


def fake_toolkit(root: Path) -> Path:
    for name in ("include/cuda_runtime.h", "include/crt/host_config.h",
                 "include/cccl/nv/target", "lib64/libcudart_static.a"):  # fmt: skip
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    return root


def test_wheels_come_first(monkeypatch, tmp_path):
    wheels = [r.resolve() for r in aot._wheel_roots()]
    monkeypatch.delenv("CUDA_HOME", raising=False)
    pieces = aot.cuda_pieces()
    assert pieces.origin == "wheels", "the wheels are not installed: setup.sh"
    for path in (*pieces.include_dirs, pieces.cudart_static):
        assert "/usr/local/cuda" not in str(path)
        assert any(path.resolve().is_relative_to(r) for r in wheels), path
    # glue.c needs the runtime, crt and cccl headers.
    for header in aot._HEADERS:
        assert any((d / header).is_file() for d in pieces.include_dirs), header
    # Even a valid CUDA_HOME comes after them.
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda")))
    assert aot.cuda_pieces() == pieces


def test_then_cuda_home_then_the_system(monkeypatch, tmp_path):
    monkeypatch.setattr(aot, "_wheel_roots", lambda: [])
    monkeypatch.setattr(aot, "SYSTEM_CUDA", (str(fake_toolkit(tmp_path / "sys")),))
    cuda = fake_toolkit(tmp_path / "cuda")
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    pieces = aot.cuda_pieces()
    assert pieces.origin == "CUDA_HOME"
    assert pieces.include_dirs == (cuda / "include", cuda / "include" / "cccl")
    assert pieces.cudart_static == cuda / "lib64" / "libcudart_static.a"
    monkeypatch.delenv("CUDA_HOME")
    assert aot.cuda_pieces().origin == str(tmp_path / "sys")


def test_nothing_found_names_the_wheels(monkeypatch, tmp_path):
    # Runtime headers without crt/cccl or the library do not count.
    partial = tmp_path / "cu13"
    (partial / "include").mkdir(parents=True)
    (partial / "include" / "cuda_runtime.h").touch()
    monkeypatch.setattr(aot, "_wheel_roots", lambda: [partial])
    monkeypatch.setattr(aot, "SYSTEM_CUDA", (str(tmp_path / "none"),))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        aot.cuda_pieces()
    for name in (*aot.CUDA_WHEELS, "crt/host_config.h", "nv/target"):
        assert name in str(e.value)


def test_nvcc_from_the_wheels(monkeypatch, tmp_path):
    """The FlashInfer baseline's nvcc (scripts/baseline) comes from the
    nvidia-cuda-nvcc and nvidia-nvvm wheels, with cicc, the headers and the
    static runtime beside it (nvcc.profile looks in bin/..)."""
    wheels = [r.resolve() for r in aot._wheel_roots()]
    monkeypatch.delenv("CUDA_HOME", raising=False)
    found = aot.nvcc()
    assert "/usr/local/cuda" not in str(found)
    root = found.resolve().parents[1]
    assert root in wheels, "nvidia-cuda-nvcc is not installed: setup.sh"
    for name in ("nvvm/bin/cicc", "include/cuda_runtime.h",
                 "include/crt/host_config.h", "lib/libcudart_static.a"):  # fmt: skip
        assert (root / name).is_file(), name
    # Even a valid CUDA_HOME comes after them; without them it is used.
    cuda = tmp_path / "cuda"
    for name in ("bin/nvcc", "nvvm/bin/cicc"):
        (cuda / name).parent.mkdir(parents=True)
        (cuda / name).touch()
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    assert aot.nvcc() == found
    monkeypatch.setattr(aot, "_wheel_roots", lambda: [])
    monkeypatch.setattr(aot, "SYSTEM_CUDA", ())
    assert aot.nvcc() == cuda / "bin" / "nvcc"
    # nvcc without cicc (nvidia-nvvm) does not count.
    (cuda / "nvvm" / "bin" / "cicc").unlink()
    with pytest.raises(FileNotFoundError, match="nvidia-nvvm"):
        aot.nvcc()


# In the child: the toolkit must be gone, and the build must still work.
_CHILD = """
import json, sys
from pathlib import Path
from vllm_ext.megakernel.kernel import aot
from vllm_ext.megakernel.kernel.shape import KernelShape
hidden, out, shape = sys.argv[1:4]
for d in json.loads(hidden):
    assert not any(Path(d).iterdir()), f"{d} is not hidden"
assert aot.cuda_pieces().origin == "wheels"
print(json.dumps(aot.build("sm_90a", out, KernelShape(**json.loads(shape))).__dict__))
"""


def test_build_without_a_system_toolkit(tmp_path):
    """One real build (the cheapest of test_kernel_aot.py's) with every
    /usr/local/cuda* directory covered by an empty one, in a private mount
    namespace, and no CUDA_HOME or toolkit on PATH."""
    hidden = sorted({str(Path(d).resolve()) for d in glob.glob("/usr/local/cuda*")
                     if Path(d).is_dir()})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if "/cuda" not in p)  # fmt: skip
    child = [sys.executable, "-c", _CHILD, json.dumps(hidden), str(tmp_path / "b"),
             json.dumps(demo_shape("qwen2", 4).as_dict())]  # fmt: skip
    if hidden:
        # Root in a private mount namespace: bind an empty dir over each.
        empty = tmp_path / "empty"
        empty.mkdir()
        unshare = shutil.which("unshare")
        probe = unshare and subprocess.run(
            [unshare, "--mount", "mount", "--bind", str(empty), hidden[0]],
            capture_output=True,
        )
        if not probe or probe.returncode != 0:
            pytest.skip(
                f"cannot hide the system toolkit {hidden} (needs root and "
                "`unshare --mount`): the wheel-only build is untested"
            )
        mounts = " && ".join(f'mount --bind "$0" "{d}"' for d in hidden)
        child = [unshare, "--mount", "sh", "-c", f'{mounts} && exec "$@"',
                 str(empty), *child]  # fmt: skip
    proc = subprocess.run(
        child, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = aot.BuildResult(**json.loads(proc.stdout.strip().splitlines()[-1]))
    check_sass(built)
