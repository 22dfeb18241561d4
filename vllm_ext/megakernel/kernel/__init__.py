# SPDX-License-Identifier: Apache-2.0
"""The CuTe DSL persistent kernel (work in progress: the CTA loop, the
counter protocol and a GEMV tile; the other instructions follow).

Importing this package does not import CuTe DSL: ``aot.build`` compiles in
a subprocess, because ``CUTE_DSL_ARCH`` must be set before ``cutlass`` is
imported and must match the target arch.
"""
