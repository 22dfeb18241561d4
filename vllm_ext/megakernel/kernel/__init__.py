# SPDX-License-Identifier: Apache-2.0
"""The CuTe DSL persistent kernel: the CTA loop (``persistent.py``), one
device function per instruction (``ops/``), the AOT build (``aot.py``) and
the host side (``launcher.py``, ``executor.py``).

Importing this package does not import CuTe DSL: ``aot.build`` compiles in
a subprocess, because ``CUTE_DSL_ARCH`` must be set before ``cutlass`` is
imported and must match the target arch; the host side needs only torch.
"""
