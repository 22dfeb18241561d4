# SPDX-License-Identifier: Apache-2.0
"""The ``vllm.general_plugins`` entry point: what vLLM learns of this package.

vLLM runs ``register`` in every process it starts (the front end, the engine
core, each worker) before it checks the configuration, so that
``--decode-backend megakernel`` is a known name everywhere. Nothing heavy is
imported here: the backend and the kernel load only when selected.
"""

from __future__ import annotations

import os

DECODE_BACKEND = "megakernel"
DECODE_BACKEND_CLASS = "vllm_ext.backend.MegakernelDecodeBackend"
# The attention backend that writes the megakernel's cache layout where no
# in-tree one does (CPU reference mode), registered as vLLM's CUSTOM entry:
# the selection travels to the engine and worker processes inside a pickled
# config, which they read before they load plugins, and only a member that
# exists without the plugin (CUSTOM, not a new name) unpickles there.
ATTENTION_BACKEND_CLASS = "vllm_ext.attention.MegakernelAttentionBackend"


def register() -> None:
    """Idempotent: vLLM may load plugins more than once per process."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )
    from vllm.v1.worker.decode_backend import register_decode_backend

    register_decode_backend(DECODE_BACKEND, DECODE_BACKEND_CLASS)
    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != ATTENTION_BACKEND_CLASS:
        raise RuntimeError(
            f"vllm-megakernel registers its attention backend as "
            f"AttentionBackendEnum.CUSTOM, which another plugin took "
            f"({custom.get_path()}); uninstall one of them."
        )
    register_backend(custom, ATTENTION_BACKEND_CLASS)
    _register_environment_variables()


def _register_environment_variables() -> None:
    """Make VLLM_MEGAKERNEL_* known to vLLM, which warns about any VLLM_*
    variable it does not know. vLLM sees each as the raw string: the typed
    values live in ``vllm_ext.envs``, and a bad value is refused there, at
    start-up, with the variable named."""
    import vllm.envs

    from vllm_ext import envs

    for name in (*envs.environment_variables, *envs.SCRIPT_VARIABLES):
        vllm.envs.environment_variables.setdefault(
            name, lambda name=name: os.environ.get(name)
        )
