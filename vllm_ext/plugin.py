# SPDX-License-Identifier: Apache-2.0
"""The ``vllm.general_plugins`` entry point: what vLLM learns of this package.

vLLM runs ``register`` in every process it starts (the front end, the engine
core, each worker) before it checks the configuration, so that
``--decode-backend megakernel`` is a known name everywhere. Nothing heavy is
imported here: the backend and the kernel load only when selected.

vLLM does not catch what ``register`` raises, and runs it whatever the user
selected: it never raises. Beside a vLLM without the decode-backend series
(a stock vLLM) or of another version, it logs one warning and registers
nothing, and that vLLM runs as if this package were not installed.
"""

from __future__ import annotations

import importlib.util
import logging

DECODE_BACKEND = "megakernel"
DECODE_BACKEND_CLASS = "vllm_ext.backend.MegakernelDecodeBackend"
# The attention backend that writes the megakernel's cache layout where no
# in-tree one does (CPU reference mode), under its own name.
ATTENTION_BACKEND = "MEGAKERNEL"
ATTENTION_BACKEND_CLASS = "vllm_ext.attention.MegakernelAttentionBackend"
VLLM_VERSION = "0.32.0"

# Under "vllm." so the record goes through vLLM's handlers once it has set
# them up (the front end loads plugins while it parses the command line,
# before that: there the warning prints bare). Not vllm.logger.init_logger,
# which a broken vLLM may not have.
logger = logging.getLogger(f"vllm.{__name__}")


def register() -> None:
    """Idempotent: vLLM may load plugins more than once per process."""
    try:
        why = incompatibility()
        if why is None:
            why = _register()
    except Exception as e:  # never take vLLM down with us
        why = f"registration failed: {type(e).__name__}: {e}"
    if why is not None:
        logger.warning(
            "vllm-megakernel is installed but inactive: %s. vLLM runs without "
            "it (--decode-backend megakernel is unknown).",
            why,
        )


def incompatibility() -> str | None:
    """Why the vLLM found cannot take the backend, or None."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != VLLM_VERSION:
        return f"it needs vLLM {VLLM_VERSION}, found {version}"
    import vllm.envs

    if importlib.util.find_spec("vllm.v1.worker.decode_backend") is None or not (
        hasattr(vllm.envs, "register_plugin_environment_variables")
    ):
        return (
            f"this vLLM {version} lacks the decode-backend interface (the "
            "vllm-megakernel patch series is not applied to it)"
        )
    return None


def _register() -> str | None:
    import vllm.envs
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )
    from vllm.v1.worker.decode_backend import register_decode_backend

    from vllm_ext import envs

    attention = AttentionBackendEnum.__members__.get(ATTENTION_BACKEND)
    if attention is None:
        register_backend(ATTENTION_BACKEND, ATTENTION_BACKEND_CLASS)
    elif attention.get_path() != ATTENTION_BACKEND_CLASS:
        return (
            f"another plugin registered the attention backend {ATTENTION_BACKEND} "
            f"({attention.get_path()})"
        )
    # (Raises, caught by register, if another plugin took the name.)
    register_decode_backend(DECODE_BACKEND, DECODE_BACKEND_CLASS)
    vllm.envs.register_plugin_environment_variables(
        *envs.environment_variables, *envs.SCRIPT_VARIABLES
    )
    return None
