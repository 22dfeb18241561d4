#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""GPU side of scripts/device_check.sh: runs the AOT-built kernel library
with torch + ctypes only (no CuTe DSL, no vLLM on the GPU machine).

    python3 scripts/device_run.py BUNDLE_DIR OUT_DIR

Checks, on fresh random inputs with poisoned outputs: the GEMV tile
instruction against torch (fp32 math), the counter protocol over several
epochs without a reset, and that a broken program traps with a message
instead of hanging. Then times the kernel against torch's GEMV captured in
a CUDA graph and a device-to-device copy of the same bytes (the weight-read
floor), cold L2 (rotating weight copies). Writes OUT_DIR/device_check.json.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

WORDS = 8
OP_GEMV = 100  # the kernel's test-only GEMV tile opcode
NO_COUNTER = -1


def load(bundle: Path) -> ctypes.CDLL:
    major, minor = torch.cuda.get_device_capability()
    arch = {(9, 0): "sm_90a", (10, 0): "sm_100a"}.get((major, minor))
    if arch is None:
        raise SystemExit(f"no kernel for compute capability {major}.{minor}")
    lib = ctypes.CDLL(str(bundle / f"libmegakernel_{arch}.so"))
    lib.megakernel_error_string.restype = ctypes.c_char_p
    torch.cuda.init()
    err = lib.megakernel_load(torch.cuda.current_device())
    if err:
        raise SystemExit(
            f"megakernel_load: {lib.megakernel_error_string(err).decode()}"
        )
    return lib


def two_phase_program(
    num_sms: int, rows: int, tile: int, broken: bool = False, device: str = "cuda"
):
    """Rows [0, rows/2) in phase 1 (signal counter 0), rows [rows/2, rows) in
    phase 2 (each waits for all of phase 1, signals counter 1); tiles dealt
    round robin, phase order kept in every queue."""
    half = rows // 2
    p1 = [(lo, min(lo + tile, half)) for lo in range(0, half, tile)]
    p2 = [(lo, min(lo + tile, rows)) for lo in range(half, rows, tile)]
    wait = len(p1) + (1 if broken else 0)
    queues: list[list[list[int]]] = [[] for _ in range(num_sms)]
    for k, (lo, hi) in enumerate(p1):
        queues[k % num_sms].append([OP_GEMV, 0, lo, hi, NO_COUNTER, 0, 0, 0])
    for k, (lo, hi) in enumerate(p2):
        queues[k % num_sms].append([OP_GEMV, 0, lo, hi, 0, wait, 1, 0])
    max_len = max(len(q) for q in queues)
    table = torch.zeros(num_sms, max_len, WORDS, dtype=torch.int32)
    for sm, q in enumerate(queues):
        if q:
            table[sm, : len(q)] = torch.tensor(q, dtype=torch.int32)
    lengths = torch.tensor([len(q) for q in queues], dtype=torch.int32)
    return table.to(device), lengths.to(device), (len(p1), len(p2))


def launch(lib, table, lengths, counters, w, x, y, epoch, max_spins=1 << 26):
    err = lib.megakernel_launch(
        ctypes.c_void_p(table.data_ptr()), table.shape[0], table.shape[1],
        ctypes.c_void_p(lengths.data_ptr()), ctypes.c_void_p(counters.data_ptr()),
        counters.numel(), ctypes.c_void_p(w.data_ptr()), w.shape[0], w.shape[1],
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), epoch,
        max_spins, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
    )  # fmt: skip
    if err:
        raise RuntimeError(lib.megakernel_error_string(err).decode())


def check_correctness(lib, num_sms: int) -> dict:
    results = {}
    for rows, k in ((4096, 2048), (2048, 8192), (1000, 4104)):
        w = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        x = torch.randn(k, device="cuda").to(torch.bfloat16)
        y = torch.full((rows,), float("nan"), device="cuda", dtype=torch.bfloat16)
        table, lengths, (n1, n2) = two_phase_program(num_sms, rows, 16)
        counters = torch.zeros(2, dtype=torch.int32, device="cuda")
        for epoch in (1, 2, 3):  # counters are never reset
            y.fill_(float("nan"))
            launch(lib, table, lengths, counters, w, x, y, epoch)
            torch.cuda.synchronize()
            expected = (w.float() @ x.float()).to(torch.bfloat16)
            err = (y.float() - expected.float()).abs().max().item()
            # bf16 output rounding of |y| ~ sqrt(k): 1-2 ulps.
            ok = (
                not y.isnan().any().item() and err <= 2e-2 * expected.abs().max().item()
            )
            ok = ok and counters.tolist() == [epoch * n1, epoch * n2]
            results[f"gemv_{rows}x{k}_epoch{epoch}"] = {"ok": ok, "max_abs_err": err}
    return results


def check_trap(bundle: Path) -> dict:
    """A program waiting for one signal too many must trap, not hang."""
    code = (
        "import sys; sys.path.insert(0, 'scripts'); import device_run as d, torch\n"
        f"lib = d.load(__import__('pathlib').Path({str(bundle)!r}))\n"
        "t, l, _ = d.two_phase_program(8, 256, 16, broken=True)\n"
        "c = torch.zeros(2, dtype=torch.int32, device='cuda')\n"
        "w = torch.randn(256, 256, device='cuda').bfloat16(); x = w[0].clone()\n"
        "y = torch.empty(256, device='cuda').bfloat16()\n"
        "d.launch(lib, t, l, c, w, x, y, 1, max_spins=100000)\n"
        "torch.cuda.synchronize()\n"
    )
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    return {
        "ok": proc.returncode != 0 and "wait timeout" in out,
        "seconds": round(time.time() - t0, 2),
        "tail": out[-600:],
    }


def time_ms(fn, iters: int = 50) -> float:
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def benchmark(lib, num_sms: int) -> dict:
    rows, k, copies = 8192, 8192, 4  # 128 MiB per weight copy: > L2, cold
    ws = [torch.randn(rows, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(k, device="cuda").to(torch.bfloat16)
    y = torch.empty(rows, device="cuda", dtype=torch.bfloat16)
    table, lengths, _ = two_phase_program(num_sms, rows, 32)
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    state = {"i": 0, "epoch": 0}

    def kernel():
        state["epoch"] += 1
        launch(
            lib, table, lengths, counters, ws[state["i"] % copies], x, y, state["epoch"]
        )
        state["i"] += 1

    graphs = []
    for w in ws:
        g = torch.cuda.CUDAGraph()
        out = torch.empty(rows, device="cuda", dtype=torch.bfloat16)
        torch.mv(w, x, out=out)
        with torch.cuda.graph(g):
            torch.mv(w, x, out=out)
        graphs.append(g)
    dst = torch.empty_like(ws[0])

    def torch_graph():
        graphs[state["i"] % copies].replay()
        state["i"] += 1

    def copy():
        dst.copy_(ws[state["i"] % copies])
        state["i"] += 1

    nbytes = rows * k * 2
    result = {"weight_bytes": nbytes}
    for name, fn in (("megakernel_gemv", kernel), ("torch_mv_graph", torch_graph)):
        ms = time_ms(fn)
        result[name] = {"ms": ms, "GB_s": nbytes / ms / 1e6}
    ms = time_ms(copy)
    # A copy reads and writes: the read stream alone takes half the time.
    result["d2d_copy"] = {"ms": ms, "read_GB_s": nbytes / (ms / 2) / 1e6}
    return result


def main() -> int:
    bundle, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    lib = load(bundle)
    props = torch.cuda.get_device_properties(0)
    report = {
        "gpu": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "manifest": json.loads((bundle / "manifest.json").read_text()),
    }
    report["correctness"] = check_correctness(lib, props.multi_processor_count)
    report["benchmark"] = benchmark(lib, props.multi_processor_count)
    report["trap"] = check_trap(bundle)
    report["ok"] = all(v["ok"] for v in report["correctness"].values())
    report["ok"] = report["ok"] and report["trap"]["ok"]
    (out / "device_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
