#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The full compile grid: the default kernel of every model in
``vllm_ext/configs`` at every batch bucket, for sm_90a and sm_100a, built
ahead of time here (no GPU) and judged from its SASS as CI judges its fixed
subset (tests/megakernel/test_kernel_aot.py): zero spills, no local load
and no call, one CTA-wide barrier (start-up), the
register split (two ``setmaxnreg``), the release signal, no trap (an expired
wait records the abort instead); and each model's
own instructions as CI judges them on demo shapes
(tests/megakernel/test_{moe,mla}_kernel_aot.py, test_gemv_mma_aot.py): a
mixture's TOPK ballot and population counts and the controller's routed
prefetches, a latent attention's tensor-core MMAs, exp2 and quad
reductions, an FP8 model's e4m3 conversions and MMAs, an INT4 model's
MMAs. (The FP8 and INT4 kernels' buckets stop at 16.) Prints a Markdown
table, with the bulk-copy and ``HMMA`` sites (the weight ring and the
tensor-core GEMV; docs/perf.md keeps each grid's summary); exits 1 if any
build fails or breaks a rule.

    .venv/bin/python scripts/compile_grid.py [--batches 1,4,16,64]
        [--archs sm_90a,sm_100a] [--configs llama-3.2-1b,...] [--jobs 2]
        [--whole-heads] [--wide-attn] [--tp N] [--layers N]

``--whole-heads`` builds QKV in whole heads instead (the GPU check's
comparison case), ``--wide-attn`` the experimental attention for many
requests in flight, under the same rules. ``--tp N`` builds one rank's
kernel of N (its partial sums' signals to every rank and ALL_REDUCE's
acquire at system scope: checked), ``--layers N`` plans N layers only (the
kernel is the same; a large model's program takes minutes to plan).

About 3-30 s per build on two cores (the MoE and MLA models longest).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "vllm_ext" / "configs"


def rules(r: dict, moe: bool = False, mla: bool = False, fp8: bool = False,
          int4: bool = False, tp: int = 1) -> list[str]:  # fmt: skip
    """What a default warp-role build must show in its SASS (empty: all),
    with a mixture's (``moe``), a latent attention's (``mla``), FP8's
    (``fp8``) and INT4's (``int4``) ops, and a tensor-parallel rank's
    (``tp``) system-scope signals and acquire."""
    broken = []
    sys_ops = (r["sys_release_atomics"], r["sys_fences"], r["sys_acquire_loads"])
    if sys_ops != ((tp, 1, 1) if tp > 1 else (0, 0, 0)):
        broken.append("system-scope adds, fences, acquires: "
                      f"{sys_ops} at TP {tp}")  # fmt: skip
    if r["spill_bytes"]:
        broken.append(f"{r['spill_bytes']} B spilled")
    if r["local_loads"] or r["calls"]:
        broken.append(f"{r['local_loads']} local loads, {r['calls']} calls")
    if r["cta_barriers"] != 1:
        broken.append(f"{r['cta_barriers']} CTA-wide barriers")
    if r["setmaxnreg"] != 2:
        broken.append(f"{r['setmaxnreg']} setmaxnreg")
    if r["release_atomics"] < 1:
        broken.append("no release signal")
    if r["traps"] or not r["abort_records"]:
        broken.append(f"{r['traps']} traps, {r['abort_records']} abort records")
    if moe and not (r["ballots"] and r["popcounts"]):
        broken.append("TOPK without its ballot and population counts")
    if moe and not r["controller_prefetches"]:
        broken.append("no routed prefetch in the controller")
    if mla and r["mma_ops"] < 68:
        broken.append(f"{r['mma_ops']} HMMA: MLA_ATTN off the tensor cores")
    if mla and not (r["exp2"] and r["butterflies"]):
        broken.append("MLA_ATTN without its exp2 or quad reductions")
    if fp8 and not (r["e4m3_converts"] and r["mma_ops"] >= 24):
        broken.append("FP8 GEMVs without e4m3 conversions or their MMAs")
    if int4 and r["mma_ops"] < 40:  # eight MMAs a k block, five matrices
        broken.append(f"{r['mma_ops']} HMMA: INT4 GEMVs off the tensor cores")
    return broken


def model_ops(config: str) -> dict[str, bool]:
    """Which op families a config's kernel has: ``rules``' keywords."""
    import torch

    from vllm_ext.megakernel.plan import load_spec

    spec = load_spec(config, torch.bfloat16)
    # (Quantized experts alone run on CUDA cores: no rule of their own.)
    dense = spec.quant is not None and not spec.quant.experts_only
    quant = spec.quant.name if dense else ""
    return {"moe": spec.moe is not None, "mla": spec.mla is not None,
            "fp8": quant.startswith("fp8"),
            "int4": quant.startswith("int4")}  # fmt: skip


def build(config: str, batch: int, arch: str, out: Path, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "vllm_ext.megakernel.build", "--config", config,
           "--batch", str(batch), "--arch", arch, "--out", str(out), "--json",
           *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--archs", default="sm_90a,sm_100a")
    parser.add_argument("--configs", default=",".join(
        sorted(p.stem for p in CONFIGS.glob("*.json"))))  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--whole-heads", action="store_true")
    parser.add_argument("--wide-attn", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    flags = tuple(f for f, on in (("--whole-heads", args.whole_heads),
                                  ("--wide-attn", args.wide_attn)) if on)  # fmt: skip
    flags += ("--tp", str(args.tp))
    if args.layers:
        flags += ("--layers", str(args.layers))
    grid = [(c, int(b), a) for c in args.configs.split(",")
            for b in args.batches.split(",")
            for a in args.archs.split(",")]  # fmt: skip
    failed = 0
    print("| model | batch | arch | registers used | spills | local loads "
          "| CTA barriers | setmaxnreg | bulk copies | HMMA "
          "| compile s | verdict |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
          "| --- |")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [
            pool.submit(build, c, b, a, Path(tmp) / f"{c}-b{b}-{a}", *flags)
            for c, b, a in grid
        ]
        for (c, b, a), job in zip(grid, jobs, strict=True):
            r = job.result()
            if "error" in r:
                failed += 1
                print(f"| {c} | {b} | {a} | | | | | | | | | build failed: "
                      f"{r['error']} |")  # fmt: skip
                continue
            broken = rules(r, **model_ops(c), tp=args.tp)
            failed += bool(broken)
            print(f"| {c} | {b} | {a} | {r['max_register']} | {r['spill_bytes']} "
                  f"| {r['local_loads']} | {r['cta_barriers']} "
                  f"| {r['setmaxnreg']} | {r['bulk_copies']} | {r['mma_ops']} "
                  f"| {r['compile_s']} "
                  f"| {'; '.join(broken) or 'ok'} |", flush=True)  # fmt: skip
    print(f"\n{len(grid) - failed} of {len(grid)} builds clean", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
