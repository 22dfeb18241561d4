# SPDX-License-Identifier: Apache-2.0
"""vllm-megakernel: the `megakernel` decode backend for vLLM 0.32.0.

vLLM reaches it through the patch series (`patches/`): see `backend.py`.
"""
