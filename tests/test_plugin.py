# SPDX-License-Identifier: Apache-2.0
"""The plugin shape: core vLLM holds a decode-backend interface and a registry
that names no backend; ``vllm_ext`` fills it from its ``vllm.general_plugins``
entry point, and so can any other package."""

import os
import pickle
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.test_e2e_offline import MAX_TOKENS, _default, _generate

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"


def test_entry_point_registers_the_backends():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.decode_backend import (
        get_decode_backend_cls,
        registered_decode_backends,
    )

    from vllm_ext.attention import MegakernelAttentionBackend
    from vllm_ext.backend import MegakernelDecodeBackend

    plugins = entry_points(group="vllm.general_plugins")
    (plugin,) = [ep for ep in plugins if ep.name == "megakernel"]
    register = plugin.load()
    register()
    register()  # vLLM may load plugins more than once in a process
    assert "megakernel" in registered_decode_backends()
    assert get_decode_backend_cls("megakernel") is MegakernelDecodeBackend
    # Under its own name: vLLM's one CUSTOM slot stays free for others.
    attention = AttentionBackendEnum["MEGAKERNEL"]
    assert attention.get_class() is MegakernelAttentionBackend
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    # The selection reaches engine processes in a pickled config, before
    # their plugins load: unpickling it loads them (the series' registry
    # fix); where this plugin is not allowed it cannot resolve.
    unpickle = (
        "import pickle, sys; import vllm.v1.attention.backends.registry; "
        "print(pickle.loads(sys.stdin.buffer.read()).name)"
    )
    for allowed, expected in (("megakernel", "MEGAKERNEL"), ("", None)):
        child = subprocess.run(
            [sys.executable, "-c", unpickle], input=pickle.dumps(attention),
            capture_output=True, env={**os.environ, "VLLM_PLUGINS": allowed},
        )  # fmt: skip
        if expected is None:
            assert b"is not a valid AttentionBackendEnum" in child.stderr
        else:
            out = child.stdout.decode().split()
            assert out[-1:] == [expected], child.stderr.decode()[-2000:]


def _patch_lines(patch: Path):
    file = None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            file = line.split(" b/", 1)[1]
        elif file and line.startswith("+") and not line.startswith("+++"):
            yield file, line


def test_the_series_never_names_the_plugin():
    """Nothing the series adds to vLLM (code, tests, CI, docs) names this
    package: vLLM would carry only the interface."""
    touched = set()
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        for file, line in _patch_lines(patch):
            touched.add(file)
            lowered = line.lower()
            for name in ("vllm_ext", "megakernel"):
                assert name not in lowered, f"{patch.name}: {file}: {line}"
    assert not [f for f in touched if f.startswith(".buildkite/")]


def test_register_never_raises_and_says_why(monkeypatch, caplog):
    """vLLM calls the entry point without catching, in every process: beside
    a vLLM it cannot serve, register() logs one warning and does nothing."""
    import logging

    import vllm
    import vllm.envs
    from vllm.v1.worker import decode_backend

    from vllm_ext import plugin

    registry = {}
    monkeypatch.setattr(decode_backend, "_DECODE_BACKENDS", registry)

    def warnings() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.name == plugin.logger.name]
        caplog.clear()
        return found

    caplog.set_level(logging.WARNING, logger=plugin.logger.name)
    with monkeypatch.context() as m:
        m.setattr(vllm, "__version__", "0.33.0")
        plugin.register()
    (message,) = warnings()
    assert "needs vLLM 0.32.0, found 0.33.0" in message
    with monkeypatch.context() as m:  # a stock 0.32.0: no series
        m.delattr(vllm.envs, "register_plugin_environment_variables")
        plugin.register()
    (message,) = warnings()
    assert "lacks the decode-backend interface" in message
    with monkeypatch.context() as m:  # anything else that goes wrong
        m.setattr(plugin, "_register", lambda: 1 / 0)
        plugin.register()
    (message,) = warnings()
    assert "registration failed: ZeroDivisionError" in message
    assert registry == {}
    # Another plugin holds the name: ours stays out, theirs stays.
    registry["megakernel"] = "other_package.Backend"
    plugin.register()
    (message,) = warnings()
    assert "already registered as other_package.Backend" in message
    assert registry == {"megakernel": "other_package.Backend"}
    registry.clear()
    plugin.register()
    assert warnings() == []
    assert registry == {"megakernel": plugin.DECODE_BACKEND_CLASS}


@pytest.fixture
def passthrough_plugin(tmp_path, monkeypatch):
    """Install a plugin as pip would (a dist-info with an entry point on the
    path) and let vLLM load its plugins again, with a registry that forgets
    it after the test."""
    import vllm.plugins
    from vllm.v1.attention.backends import registry as attention_registry
    from vllm.v1.worker import decode_backend

    dist = tmp_path / "passthrough_decode_backend-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: passthrough-decode-backend\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\npassthrough = passthrough_decode_backend:register\n"
    )
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = dict(decode_backend._DECODE_BACKENDS)
    registry.pop("passthrough", None)
    monkeypatch.setattr(decode_backend, "_DECODE_BACKENDS", registry)
    # It takes vLLM's CUSTOM attention slot: forgotten after the test.
    overrides = dict(attention_registry._ATTN_OVERRIDES)
    monkeypatch.setattr(attention_registry, "_ATTN_OVERRIDES", overrides)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)


def test_unknown_backend_is_refused_with_the_registered_names(demo_model, monkeypatch):
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    args = EngineArgs(demo_model("llama"), decode_backend="passthrough")
    message = "Unknown decode backend 'passthrough'; registered: auto, megakernel."
    with pytest.raises(ValueError, match=re.escape(message)):
        args.create_engine_config()


@pytest.mark.e2e
def test_a_second_plugin_beside_ours(demo_model, passthrough_plugin, monkeypatch):
    """Another plugin registers a decode backend and takes vLLM's CUSTOM
    attention backend: its backend is selectable, and ours still starts."""
    from vllm.engine.arg_utils import EngineArgs

    model = demo_model("llama")
    # The backend's own start-up check runs (it refuses bf16)...
    with pytest.raises(ValueError, match="passthrough decode backend runs float32"):
        EngineArgs(
            model, decode_backend="passthrough", dtype="bfloat16"
        ).create_engine_config()
    # ...and it runs every decode step, with vLLM's default tokens, on the
    # attention backend it registered.
    default = _default(model, "float32")
    tokens, (ran, declined, _) = _generate(
        model, "float32", decode_backend="passthrough", attention_backend="CUSTOM"
    )
    assert (ran, declined) == (max(MAX_TOKENS) - 1, {})
    assert [ids for ids, _ in tokens] == [ids for ids, _ in default]
    # Both plugins loaded: the megakernel starts and decodes as well.
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CUSTOM.get_path().startswith("vllm.v1.attention")
    monkeypatch.setenv("VLLM_MEGAKERNEL_INTERPRET", "1")
    tokens, (ran, declined, _) = _generate(
        model, "float32", decode_backend="megakernel"
    )
    assert (ran, declined) == (max(MAX_TOKENS) - 1, {})
    assert [ids for ids, _ in tokens] == [ids for ids, _ in default]


def test_environment_variables_are_known_to_vllm(demo_model, monkeypatch):
    """vLLM checks every VLLM_* variable at start-up against the ones it
    knows (a warning, or an error with fail_on_environ_validation); the
    plugin makes VLLM_MEGAKERNEL_* known, and an unknown one still fails."""
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ext import envs

    # Only ours, and none that an earlier engine in this process left
    # behind (vLLM sets VLLM_DIST_IDENT without declaring it).
    for name in os.environ:
        if name.startswith("VLLM_") and (
            name in envs.environment_variables
            or name not in vllm.envs.environment_variables
        ):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_MEGAKERNEL_INTERPRET", "1")
    monkeypatch.setenv("VLLM_MEGAKERNEL_MAX_BATCH", "4")

    def start():
        EngineArgs(
            demo_model("llama"),
            decode_backend="megakernel",
            dtype="float32",
            fail_on_environ_validation=True,
        ).create_engine_config()

    start()
    monkeypatch.setenv("VLLM_MEGAKERNEL_NO_SUCH_VARIABLE", "1")
    message = "Unknown vLLM environment variable detected: VLLM_MEGAKERNEL_NO_SUCH"
    with pytest.raises(ValueError, match=message):
        start()


def test_no_model_graph_for_decode_sizes_the_backend_takes(demo_model, monkeypatch):
    """The V1 runner captures FULL CUDA graphs of the model for uniform
    decode sizes; those the decode backend takes would never be replayed,
    so it leaves them out. Run on CPU with the runner's own method and
    vLLM's own dispatcher, with the backend's batch buckets 1, 2, 4."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ext.backend import MegakernelDecodeBackend
    from vllm_ext.megakernel.planner import batch_buckets

    config = EngineArgs(demo_model("llama"), dtype="float32").create_engine_config()
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16]
    config.compilation_config.max_cudagraph_capture_size = 16
    config.scheduler_config.max_num_seqs = 16
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE)

    backend = object.__new__(MegakernelDecodeBackend)
    backend.buckets = batch_buckets(4)

    def captured(decode_backend) -> dict:
        runner = SimpleNamespace(
            cudagraph_dispatcher=dispatcher, decode_backend=decode_backend
        )
        descs = GPUModelRunner._cudagraph_capture_descs(runner)
        return {mode: sorted(d.num_tokens for d in ds) for mode, ds in descs}

    everything = {
        CUDAGraphMode.PIECEWISE: [1, 2, 4, 8, 16],
        CUDAGraphMode.FULL: [1, 2, 4, 8, 16],
    }
    assert captured(None) == everything
    assert captured(backend) == {
        CUDAGraphMode.PIECEWISE: [1, 2, 4, 8, 16],
        CUDAGraphMode.FULL: [8, 16],
    }
