# SPDX-License-Identifier: Apache-2.0
"""A second decode backend, registered the way any plugin registers one, to
show that the registry in vLLM is not the megakernel's alone: it runs each
decode-only step through the model's own forward pass."""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.worker.decode_backend import (
    DecodeBackend,
    DecodeBatch,
    register_decode_backend,
)

NAME = "passthrough"
CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (written by the test). It
    also takes vLLM's CUSTOM attention slot (vLLM's own CPU attention), as a
    plugin of an older style would, to show the megakernel's does not need
    it."""
    register_decode_backend(NAME, f"{__name__}.PassthroughDecodeBackend")
    register_backend(AttentionBackendEnum.CUSTOM, CPU_ATTENTION)


class PassthroughDecodeBackend(DecodeBackend):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        # Refuses something, so a test can tell the start-up check ran.
        if vllm_config.model_config.dtype != torch.float32:
            raise ValueError("the passthrough decode backend runs float32 only")

    def __init__(self, vllm_config, model: torch.nn.Module, device) -> None:
        self.model = model

    def accepts(self, num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_tokens == num_reqs

    def forward(self, batch: DecodeBatch) -> torch.Tensor:
        # The model's attention reads the step's metadata from the forward
        # context, which the runner sets around this call too.
        return self.model(input_ids=batch.input_ids, positions=batch.positions)
