# SPDX-License-Identifier: Apache-2.0
"""Real models' config.json files (shapes only), by short name."""

import json
from pathlib import Path
from typing import Any

_DIR = Path(__file__).parent
NAMES = sorted(p.stem for p in _DIR.glob("*.json"))


def path(name: str) -> Path:
    if name not in NAMES:
        raise KeyError(f"no config {name!r}; known: {NAMES}")
    return _DIR / f"{name}.json"


def load(name: str) -> dict[str, Any]:
    return json.loads(path(name).read_text())


def hf_config(name: str):
    """The config as a transformers PretrainedConfig."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path(name)))
