# SPDX-License-Identifier: Apache-2.0
"""Every VLLM_MEGAKERNEL_* environment variable, typed, with its default.

Read lazily (module ``__getattr__``, as in ``vllm.envs``) so tests can set
them with ``monkeypatch.setenv`` after import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_MEGAKERNEL_INTERPRET: bool = False
    VLLM_MEGAKERNEL_MAX_BATCH: int = 64
    VLLM_MEGAKERNEL_INTERPRET_DEVICE: str = "h200"
    VLLM_MEGAKERNEL_INTERPRET_SEED: int = 0
    VLLM_MEGAKERNEL_CACHE_DIR: str | None = None
    from vllm_ext.megakernel.variants import Variants

    VLLM_MEGAKERNEL_VARIANTS: Variants = Variants()


def _bool(name: str) -> bool:
    value = os.environ.get(name, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (use 1 or 0)")


def _int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    return value


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, "") or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


environment_variables: dict[str, Callable[[], Any]] = {
    # Run decode steps through the PyTorch reference executor instead of the
    # GPU megakernel (like Triton's interpreter mode). The only way to use
    # --decode-backend megakernel without a Hopper-or-newer GPU.
    "VLLM_MEGAKERNEL_INTERPRET": lambda: _bool("VLLM_MEGAKERNEL_INTERPRET"),
    # Largest decode batch (number of requests) the megakernel runs; larger
    # decode steps take vLLM's normal path. Rounded down to a power of two.
    # On a GPU, unset means: the batches measured faster (megakernel/measured.py).
    "VLLM_MEGAKERNEL_MAX_BATCH": lambda: _int(
        "VLLM_MEGAKERNEL_MAX_BATCH", 64, minimum=1
    ),
    # In reference mode: the device whose program is interpreted (a key of
    # megakernel.cost.DEVICES), i.e. the program that GPU would run.
    "VLLM_MEGAKERNEL_INTERPRET_DEVICE": lambda: _choice(
        "VLLM_MEGAKERNEL_INTERPRET_DEVICE", "h200", ("h100", "h200", "b200")
    ),
    # In reference mode: seed of the random interleaving of the SMs' queues.
    "VLLM_MEGAKERNEL_INTERPRET_SEED": lambda: _int(
        "VLLM_MEGAKERNEL_INTERPRET_SEED", 0, minimum=0
    ),
    # Where built kernel libraries are kept, one folder per cache key (model
    # shape, batch bucket, arch, kernel sources); default
    # ~/.cache/vllm_megakernel. A folder filled on a build machine can be
    # shipped to servers without a compiler.
    "VLLM_MEGAKERNEL_CACHE_DIR": lambda: (
        os.environ.get("VLLM_MEGAKERNEL_CACHE_DIR") or None
    ),
    # The experimental kernel variant ("wide_attn"; megakernel/variants.py),
    # comma-separated names. Off by default.
    "VLLM_MEGAKERNEL_VARIANTS": lambda: _variants("VLLM_MEGAKERNEL_VARIANTS"),
}


# Read by this project's scripts and tests, not by the backend; named here so
# that vLLM, which warns about VLLM_* variables it does not know, knows them.
SCRIPT_VARIABLES = (
    "VLLM_MEGAKERNEL_VENV",  # scripts/setup.sh: the virtual environment
    "VLLM_MEGAKERNEL_VLLM",  # scripts/setup.sh: auto, cpu or cuda vLLM
    "VLLM_MEGAKERNEL_STOCK_VENV",  # scripts/stock_vllm.sh: the unpatched venv
    "VLLM_MEGAKERNEL_SRC",  # scripts/build_vllm.sh: the vLLM source tree
    "VLLM_MEGAKERNEL_MODEL_CACHE",  # tests: where demo models are built
)


def _variants(name: str):
    from vllm_ext.megakernel.variants import Variants

    return Variants.parse(os.environ.get(name, ""), name)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
