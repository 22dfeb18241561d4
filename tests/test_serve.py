# SPDX-License-Identifier: Apache-2.0
"""``scripts/serve.sh`` (the README's main command) end to end: an
OpenAI-compatible server whose decode runs through the megakernel's
reference executor, answering concurrent requests with vLLM's default
greedy tokens."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_e2e_offline import MAX_TOKENS, PROMPTS, _default

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _serving(
    cmd: list[str], env: dict[str, str], port: int, log: Path
) -> Iterator[str]:
    """Run ``cmd``, a server on ``port``, in its own process group with its
    output in ``log``; yield its base URL once /health answers, and end the
    group on exit. Fails the test if it exits or is not ready in time."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"server not ready:\n{log.read_text()[-4000:]}")
                time.sleep(1)
        yield base
    finally:
        # (The group is gone when the server exited with no children left.)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


# The served path (API server, engine, backend) is the same for every
# architecture (each runs offline in test_e2e_offline.py): Llama served with
# data parallelism, two engine cores, each with its own runner and backend,
# the requests spread over them (vLLM's CPU build runs DP=2 on one NUMA
# node with VLLM_CPU_SIM_MULTI_NUMA=1). (Qwen3-MoE was served here too
# until CI time ran short: its mixture runs offline and at TP 2.)
DATA_PARALLEL = ["--data-parallel-size", "2"]


# The dense Llama demo with 2 data-parallel engines; its FP8 per-channel
# checkpoint (vllm_ext/demo_quant.py), which vLLM's CPU build serves as it
# is (W8A8 through torch's scaled GEMM).
@pytest.fixture(scope="module", params=["llama-dp2", "llama-fp8"])
def server(request, tmp_path_factory, demo_model):
    from vllm_ext.demo_quant import quantize_checkpoint

    arch = request.param.removesuffix("-dp2").removesuffix("-fp8")
    model = demo_model(arch)
    if request.param.endswith("-fp8"):
        out = tmp_path_factory.mktemp("fp8") / "llama-fp8"
        model = str(quantize_checkpoint(model, out, "fp8-channel"))
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MEGAKERNEL_INTERPRET"}
    # serve.sh must turn reference mode on by itself on this GPU-less machine.
    env["VLLM_MEGAKERNEL_VENV"] = str(Path(sys.executable).parent.parent)
    extra = []
    if request.param.endswith("-dp2"):
        extra = DATA_PARALLEL
        env.update(VLLM_CPU_SIM_MULTI_NUMA="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [
        str(ROOT / "scripts" / "serve.sh"), model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "512", *extra,
    ]  # fmt: skip
    with _serving(cmd, env, port, log) as base:
        yield request.param, model, base, log


def test_serve_matches_default_path(server, monkeypatch):
    setup, model, base, log = server
    served = json.loads(urllib.request.urlopen(base + "/v1/models").read())
    name = served["data"][0]["id"]

    def complete(i: int) -> list[int]:
        body = {
            "model": name,
            "prompt": PROMPTS[i],
            "max_tokens": MAX_TOKENS[i],
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return _post(base + "/v1/completions", body)["choices"][0]["token_ids"]

    single = complete(0)  # alone: decode batches of one
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served_ids = list(pool.map(complete, range(len(PROMPTS))))

    monkeypatch.delenv("VLLM_MEGAKERNEL_INTERPRET", raising=False)
    expected = _default(model, "float32")
    assert single == expected[0][0]
    assert served_ids == [ids for ids, _ in expected]

    # vLLM's count on /metrics: every decode-only step of each engine ran
    # through the backend (mixed steps are not decode-only: not counted).
    steps: dict[tuple[str, str, str], float] = {}
    for line in urllib.request.urlopen(base + "/metrics").read().decode().splitlines():
        if line.startswith("vllm:decode_backend_steps_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (labels["engine"], labels["outcome"], labels["reason"])
            steps[key] = float(line.rsplit(" ", 1)[1])
    engines = 2 if setup.endswith("-dp2") else 1
    assert {e for e, _, _ in steps} == {str(i) for i in range(engines)}, steps
    for (engine, outcome, reason), count in steps.items():
        assert count > 0 if outcome == "ran" else count == 0, (engine, reason)

    text = log.read_text()
    assert "reference executor (VLLM_MEGAKERNEL_INTERPRET=1)" in text
    assert "ProgramExecutor" in text
    # One backend per engine core, each of which decoded.
    assert text.count("First decode step through the megakernel backend") == engines
    # The plugin made VLLM_MEGAKERNEL_* known to vLLM (serve.sh sets one).
    assert "VLLM_MEGAKERNEL_INTERPRET=1" in text
    assert "Unknown vLLM environment variable detected: VLLM_MEGAKERNEL" not in text
