# SPDX-License-Identifier: Apache-2.0
"""MLA_APPEND: the new tokens' latent rows. kv_a_layernorm needs the whole
kv_c row and the row is 576 values per request, so one small instruction
does it all rather than a phase of tiles: kv_a_layernorm on kv_c, GPT-J RoPE
on k_pe, both rounded to the model dtype, stored at each request's slot
(``paged_kv.write_latent``; padded slots skipped)."""

import torch

from vllm_ext.paged_kv import write_latent
from vllm_ext.reference import rms_norm, rope_gptj


def reference(
    kv: torch.Tensor,  # [B, kv_lora_rank + rope_dim]: kv_a's output
    layer,
    spec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    rank, dtype = spec.mla.kv_lora_rank, spec.dtype
    kv_c = rms_norm(kv[:, :rank], layer.mla.kv_a_norm, spec.rms_norm_eps).to(dtype)
    k_pe = rope_gptj(kv[:, None, rank:], cos, sin)[:, 0]
    write_latent(cache, kv_c, k_pe, slot_mapping)
