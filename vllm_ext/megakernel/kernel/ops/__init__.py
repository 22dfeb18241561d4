# SPDX-License-Identifier: Apache-2.0
"""Device functions of the megakernel's instructions, in CuTe DSL.

Each module's docstring names its PyTorch reference in
``vllm_ext/megakernel/ops`` (kept apart because the references run where
CuTe DSL is not installed: the program interpreter, the GPU check)."""
