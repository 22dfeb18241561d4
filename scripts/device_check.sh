#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The one-call GPU check. Here (no GPU needed): build the kernel library for
# sm_90a and sm_100a into .device/ (git-ignored) with a manifest. On the GPU
# machine (Python, torch with CUDA; no CuTe DSL, no vLLM):
#
#   python3 scripts/device_run.py .device "$OUT"
#
# checks correctness, the counter protocol and the trap, times the kernel
# against a CUDA-graph torch baseline and the copy floor, and writes
# $OUT/device_check.json. Record its figures in docs/perf.md.
#
#   scripts/device_check.sh [--dry-run]   # --dry-run: build and report size only
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
BUNDLE=$ROOT/.device
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
for arch in sm_90a sm_100a; do
    "$VENV/bin/python" -m vllm_ext.megakernel.kernel.aot --arch "$arch" \
        --out "$ROOT/.cache/aot/$arch" --json | tail -1 >"$BUNDLE/$arch.json"
    cp "$ROOT/.cache/aot/$arch/libmegakernel_$arch.so" "$BUNDLE/"
done
"$VENV/bin/python" - "$BUNDLE" "$(git -C "$ROOT" rev-parse --short HEAD)" <<'PY'
import json, sys, pathlib
bundle, commit = pathlib.Path(sys.argv[1]), sys.argv[2]
builds = {p.stem: json.loads(p.read_text()) for p in bundle.glob("sm_*.json")}
(bundle / "manifest.json").write_text(json.dumps({"commit": commit, "builds": builds}))
PY
size=$(du -sb "$BUNDLE" | cut -f1)
echo "[device_check] bundle $BUNDLE: $((size / 1024)) KiB (limit 60 MiB)"
if [[ ${1:-} == --dry-run ]]; then
    exit 0
fi
echo "[device_check] now run on the GPU machine, carrying .device:" >&2
echo "  python3 scripts/device_run.py .device \"\$OUT\"" >&2
