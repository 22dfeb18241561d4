# SPDX-License-Identifier: Apache-2.0
"""Ahead-of-time build of the persistent kernel, on a machine without a GPU:
CuTe DSL compile for one arch -> ``export_to_c`` -> a shared library that
needs only libc (libcuda is opened at run time), and the kept cubin's
resource usage and SASS facts. The command line is ``build.py``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_ext.megakernel.kernel.shape import CONSUMERS_BARRIER, KernelShape

ARCHS = ("sm_90a", "sm_100a")
HERE = Path(__file__).resolve().parent
PREFIX = "megakernel"

_COMPILE = """
import json, sys, time
from vllm_ext.megakernel.kernel import persistent
from vllm_ext.megakernel.kernel.shape import KernelShape
import cutlass.cute as cute
arch, out, dump, shape = sys.argv[1:5]
shape = KernelShape(**json.loads(shape))
kernel = persistent.Megakernel(shape)
t0 = time.perf_counter()
compiled = cute.compile(
    kernel, *persistent.fake_args(shape),
    options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir={dump}",
)
compiled.export_to_c(out, "megakernel", "megakernel")
print(time.perf_counter() - t0)
"""


def _max_register(sass: str) -> int:
    """Registers the SASS names (the highest Rn plus one): with setmaxnreg,
    the consumers' peak, where cuobjdump reports the launch's grant."""
    return max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1) + 1


def _controller_prefetches(sass: str) -> int:
    """Bulk L2 prefetches between the controller's acquire (the first
    ``CCTL.IVALL``: the controller's code comes first in the kernel) and its
    ``queue_ready`` arrive: control.py's ``prefetch_routed``."""
    lines = sass.splitlines()
    acquire = next((n for n, line in enumerate(lines) if "CCTL.IVALL" in line), None)
    if acquire is None:
        return 0
    publish = next(
        (n for n in range(acquire, len(lines)) if "SYNCS.ARRIVE" in lines[n]),
        len(lines),
    )
    return sum("UBLKPF.L2" in line for line in lines[acquire:publish])


@dataclass(frozen=True)
class BuildResult:
    library: str
    arch: str
    registers: int
    spill_bytes: int  # local memory per thread (cuobjdump LOCAL)
    local_loads: int  # LDL in the SASS: reloads of spilled registers
    calls: int  # CALL.ABS, out of the kernel (vprintf): none (its ABI kept
    # live loop values in the stack; the kernel's own subroutines are fine)
    stack_bytes: int
    shared_bytes: int
    ldg128: int  # 128-bit global loads in the SASS
    acquire_loads: int  # acquire = strong load + L1 invalidate (CCTL.IVALL)
    release_atomics: int  # strong GPU-scope adds on a counter
    release_fences: int  # MEMBAR.ALL.GPU before them
    # Tensor parallel: the signals of a partial sum to every rank's counter
    # (strong system-scope adds, each after a system-scope fence), and
    # ALL_REDUCE's acquire at system scope (strong load, then CCTL.IVALL).
    sys_release_atomics: int
    sys_fences: int  # MEMBAR.ALL.SYS
    sys_acquire_loads: int  # LDG.E.STRONG.SYS
    l2_prefetches: int  # bulk L2 prefetches of weight tiles (UBLKPF.L2)
    async_copies: int  # cp.async into shared memory (LDGSTS): weight staging
    mma_ops: int  # tensor-core MMAs (HMMA): the tensor-core GEMV
    # FP8's conversions (F2FP ... E4M3): the inputs' quantization to e4m3
    # (SATFINITE) and, where ptxas runs the e4m3 MMA as f16 MMAs (sm_90),
    # the codes' unpacking.
    e4m3_converts: int
    bulk_copies: int  # cp.async.bulk into shared memory (UBLKCP): the weight pipe
    page_waits: int  # mbarrier tests (SYNCS.PHASECHK): every ring's waits
    mbarrier_arrives: int  # SYNCS.ARRIVE: full (expect-tx), empty, ready
    cta_barriers: int  # BAR.SYNC of barrier 0: the whole CTA
    consumer_barriers: int  # BAR.SYNC of CONSUMERS_BARRIER: consumers only
    setmaxnreg: int  # USETMAXREG: the warpgroups' register split
    max_register: int  # the highest register the SASS names, plus one
    # The mixture's and the latent attention's own instructions:
    ballots: int  # VOTE.ANY: TOPK's distinct-expert prefix count
    popcounts: int  # POPC: the same count's population counts
    exp2: int  # MUFU.EX2: an online softmax's exponentials on the SFU
    butterflies: int  # SHFL.BFLY: quad and warp reductions
    controller_prefetches: int  # UBLKPF.L2 in the controller's window
    # A wait past its bound records an abort and lets the step end: no trap
    # (it would kill the CUDA context, and the server with it).
    traps: int  # BPT.TRAP
    abort_records: int  # ATOMG.E.CAS: record_abort's claim of the record
    compile_s: float


# Where the AOT build's CUDA 13 headers and libcudart_static.a come from, in
# order: the pip wheels (pyproject.toml pins them), $CUDA_HOME, then these.
SYSTEM_CUDA = ("/usr/local/cuda-13.0", "/usr/local/cuda")
# 13.0: the driver generation the kernel targets (exact pins: pyproject.toml).
CUDA_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl")
# One header of each piece glue.c needs: runtime, crt (host_config.h, which
# cuda_runtime.h includes) and cccl (nv/target).
_HEADERS = ("cuda_runtime.h", "crt/host_config.h", "nv/target")


@dataclass(frozen=True)
class CudaPieces:
    origin: str  # "wheels", "CUDA_HOME" or the system directory
    include_dirs: tuple[Path, ...]  # gcc -I, in order
    cudart_static: Path


def _wheel_roots() -> list[Path]:
    """``nvidia/cu13`` in each place the ``nvidia`` namespace package (the
    nvidia-cuda-* wheels) is installed."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    locations = dict.fromkeys(spec.submodule_search_locations)  # may repeat
    return [Path(loc) / "cu13" for loc in locations]


def _pieces(origin: str, roots: list[Path]) -> CudaPieces | str:
    """The pieces under ``roots`` (the wheels may sit in several), or what is
    missing there."""
    includes = tuple(d for root in roots
                     for d in (root / "include", root / "include" / "cccl")
                     if d.is_dir())  # fmt: skip
    missing = [h for h in _HEADERS if not any((d / h).is_file() for d in includes)]
    libs = [root / sub / "libcudart_static.a"
            for root in roots for sub in ("lib", "lib64")]  # fmt: skip
    lib = next((f for f in libs if f.is_file()), None)
    if lib is None:
        missing.append("libcudart_static.a")
    if missing:
        where = ", ".join(map(str, roots)) or "not installed"
        where = "" if where == origin else f" ({where})"
        return f"{origin}{where}: no {', '.join(missing)}"
    return CudaPieces(origin, includes, lib)


def cuda_pieces() -> CudaPieces:
    """The CUDA 13 headers and static runtime the glue is built with: the pip
    wheels first, so that a build needs no system toolkit."""
    tried = []
    candidates = [("wheels", _wheel_roots())]
    if os.environ.get("CUDA_HOME"):
        candidates.append(("CUDA_HOME", [Path(os.environ["CUDA_HOME"])]))
    candidates += [(d, [Path(d)]) for d in SYSTEM_CUDA]
    for origin, roots in candidates:
        found = _pieces(origin, roots)
        if isinstance(found, CudaPieces):
            return found
        tried.append(found)
    raise FileNotFoundError(
        "CUDA 13 headers and libcudart_static.a not found; install them with "
        f"`pip install {' '.join(w + '==13.0.*' for w in CUDA_WHEELS)}` "
        "(scripts/setup.sh installs the versions pyproject.toml pins) or set "
        "CUDA_HOME to a CUDA 13 toolkit. Tried: " + "; ".join(tried)
    )


def nvcc() -> Path:
    """nvcc for tools beyond the kernel build (scripts/baseline): the
    nvidia-cuda-nvcc and nvidia-nvvm wheels first (pyproject.toml's test
    extra pins them), then $CUDA_HOME, then the system toolkits. nvcc.profile
    finds cicc (nvvm/bin) and the headers from bin/..: one root has all."""
    roots = [*_wheel_roots()]
    if os.environ.get("CUDA_HOME"):
        roots.append(Path(os.environ["CUDA_HOME"]))
    roots += [Path(d) for d in SYSTEM_CUDA]
    for root in roots:
        if (root / "bin" / "nvcc").is_file() and (
            root / "nvvm" / "bin" / "cicc"
        ).is_file():
            return root / "bin" / "nvcc"
    raise FileNotFoundError(
        "nvcc (with nvvm/bin/cicc) not found; install it with `pip install "
        "nvidia-cuda-nvcc==13.0.* nvidia-nvvm==13.0.*` (scripts/setup.sh installs "
        "the versions pyproject.toml pins) or set CUDA_HOME to a CUDA 13 toolkit. "
        "Tried: " + ", ".join(map(str, roots))
    )


def _dsl_runtime() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-cutlass-dsl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    lib = root / "cu13" / "lib" / "libcuda_dialect_runtime_static.a"
    if not lib.exists():
        raise FileNotFoundError(f"{lib} missing: install nvidia-cutlass-dsl[cu13]")
    return lib


def sass_tool(name: str) -> str:
    """cuobjdump / nvdisasm: on PATH, or the copy Triton ships."""
    found = shutil.which(name)
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0])
        path = path / "backends" / "nvidia" / "bin" / name
        if path.exists():
            return str(path)
    raise FileNotFoundError(
        f"{name} not found: put a CUDA toolkit's bin on PATH, or pip install "
        "triton (its NVIDIA backend ships one)"
    )


def build(arch: str, out: str | Path, shape: KernelShape) -> BuildResult:
    """Compile the kernel for ``shape`` on ``arch`` into ``out``."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    out = Path(out)
    dump = out / "dump"
    shutil.rmtree(dump, ignore_errors=True)  # one build per directory
    dump.mkdir(parents=True)
    env = {**os.environ, "CUTE_DSL_ARCH": arch}  # must match --gpu-arch
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, arch, str(out), str(dump),
         json.dumps(shape.as_dict())],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"CuTe DSL compile for {arch} failed:\n{proc.stderr[-4000:]}"
        )
    compile_s = float(proc.stdout.strip().splitlines()[-1])

    cuda = cuda_pieces()
    library = out / f"lib{PREFIX}_{arch}.so"
    glue_o = out / "glue.o"
    subprocess.run(
        ["gcc", "-O2", "-fPIC", "-fvisibility=hidden",
         *(f"-I{d}" for d in cuda.include_dirs),
         f'-DMEGAKERNEL_HEADER="{out / (PREFIX + ".h")}"', "-c", str(HERE / "glue.c"),
         "-o", str(glue_o)],
        check=True,
    )  # fmt: skip
    subprocess.run(
        ["gcc", "-shared", "-o", str(library), str(glue_o), str(out / f"{PREFIX}.o"),
         str(_dsl_runtime()), str(cuda.cudart_static), "-ldl", "-lpthread", "-lrt",
         "-Wl,--exclude-libs,ALL", "-Wl,-z,defs"],
        check=True,
    )  # fmt: skip

    cubin = sorted(glob.glob(str(dump / "*.cubin")))[0]
    usage = subprocess.run(
        [sass_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True
    ).stdout
    sass = subprocess.run(
        [sass_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True
    ).stdout

    def field(name: str) -> int:
        m = re.search(rf"{name}:(\d+)", usage)
        return int(m.group(1)) if m else -1

    return BuildResult(
        library=str(library),
        arch=arch,
        registers=field("REG"),
        spill_bytes=field("LOCAL"),
        stack_bytes=field("STACK"),
        shared_bytes=field("SHARED"),
        local_loads=len(re.findall(r"\bLDL\b", sass)),
        calls=len(re.findall(r"\bCALL\.ABS\b", sass)),
        ldg128=len(re.findall(r"LDG\.E\.128", sass)),
        acquire_loads=sass.count("CCTL.IVALL"),
        release_atomics=len(
            re.findall(r"(?:REDG|ATOMG)\.E\.ADD\S*\.STRONG\.GPU", sass)
        ),
        release_fences=sass.count("MEMBAR.ALL.GPU"),
        sys_release_atomics=len(
            re.findall(r"(?:REDG|ATOMG)\.E\.ADD\S*\.STRONG\.SYS", sass)
        ),
        sys_fences=sass.count("MEMBAR.ALL.SYS"),
        sys_acquire_loads=len(re.findall(r"\bLDG\.E\S*\.STRONG\.SYS\b", sass)),
        l2_prefetches=sass.count("UBLKPF.L2"),
        async_copies=sass.count("LDGSTS"),
        mma_ops=sass.count("HMMA"),
        e4m3_converts=len(re.findall(r"\bF2FP\.\S*E4M3", sass)),
        bulk_copies=sass.count("UBLKCP"),
        page_waits=sass.count("SYNCS.PHASECHK"),
        mbarrier_arrives=len(re.findall(r"\bSYNCS\.ARRIVE", sass)),
        cta_barriers=len(re.findall(r"\bBAR\.SYNC\S* 0x0\b", sass)),
        consumer_barriers=len(
            re.findall(rf"\bBAR\.SYNC\S* {CONSUMERS_BARRIER:#x}\b", sass)
        ),
        setmaxnreg=sass.count("USETMAXREG"),
        max_register=_max_register(sass),
        ballots=len(re.findall(r"\bVOTE\.ANY\b", sass)),
        popcounts=len(re.findall(r"\bPOPC\b", sass)),
        exp2=len(re.findall(r"\bMUFU\.EX2\b", sass)),
        butterflies=len(re.findall(r"\bSHFL\.BFLY\b", sass)),
        controller_prefetches=_controller_prefetches(sass),
        traps=len(re.findall(r"\bBPT\.TRAP\b", sass)),
        abort_records=len(re.findall(r"\bATOMG\.E\.CAS\b", sass)),
        compile_s=round(compile_s, 3),
    )
