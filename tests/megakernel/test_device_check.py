# SPDX-License-Identifier: Apache-2.0
"""The GPU check is ready to run: the bundle builds here, under the size
limit, and the GPU-side script's program obeys the counter protocol."""

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _device_run():
    spec = importlib.util.spec_from_file_location(
        "device_run", ROOT / "scripts" / "device_run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_builds_a_small_bundle():
    proc = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "KiB (limit 60 MiB)" in proc.stdout
    bundle = ROOT / ".device"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["builds"]) == {"sm_90a", "sm_100a"}
    assert all(b["spill_bytes"] == 0 for b in manifest["builds"].values())
    size = sum(p.stat().st_size for p in bundle.iterdir())
    assert size < 60 << 20


def test_gpu_program_counts_match():
    d = _device_run()
    table, lengths, (n1, n2) = d.two_phase_program(8, 256, 16, device="cpu")
    words = [w for sm, n in enumerate(lengths.tolist()) for w in table[sm, :n].tolist()]
    phase2 = [w for w in words if w[4] == 0]
    assert len(phase2) == n2 and all(w[5] == n1 for w in phase2)
    assert sum(1 for w in words if w[6] == 0) == n1  # phase 1 signals counter 0
    # Queues keep phase order, so the program cannot deadlock.
    for sm, n in enumerate(lengths.tolist()):
        waits = [w[4] for w in table[sm, :n].tolist()]
        assert waits == sorted(waits)
    # The trap check's program waits for one signal more than exist.
    broken, blens, _ = d.two_phase_program(8, 256, 16, broken=True, device="cpu")
    rows = [w for sm, n in enumerate(blens.tolist()) for w in broken[sm, :n].tolist()]
    waits = {w[5] for w in rows if w[4] == 0}
    assert waits == {n1 + 1}
