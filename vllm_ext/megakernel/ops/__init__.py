# SPDX-License-Identifier: Apache-2.0
"""One module per instruction. Each holds the instruction's PyTorch
``reference`` (what the program interpreter runs); the CuTe DSL device
function joins it in the same module, and tests compare the two."""
