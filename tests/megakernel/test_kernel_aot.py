# SPDX-License-Identifier: Apache-2.0
"""The persistent kernel compiles ahead of time on this GPU-less machine for
Hopper and Blackwell, and its SASS has what the design needs."""

import ctypes
import subprocess

import pytest

from vllm_ext.megakernel.kernel.aot import ARCHS, build

REGISTER_BUDGET = 128  # 128 threads x 128 regs fits one CTA per SM many times


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


def test_no_spills_and_register_budget(built):
    assert built.spill_bytes == 0
    assert 0 < built.registers <= REGISTER_BUDGET


def test_weight_stream_uses_128_bit_loads(built):
    assert built.ldg128 > 0


def test_counter_protocol_in_sass(built):
    # Waits end with an acquire load (strong load + L1 invalidate); signals
    # are a GPU-scope fence then a strong atomic add.
    assert built.acquire_loads >= 1
    assert built.release_fences >= 1 and built.release_atomics >= 1


def test_library_needs_only_libc(built):
    dynamic = subprocess.run(
        ["readelf", "-d", built.library], capture_output=True, text=True, check=True
    ).stdout
    needed = sorted(line.split("[")[1].rstrip("]") for line in dynamic.splitlines()
                    if "(NEEDED)" in line)  # fmt: skip
    assert needed == ["ld-linux-x86-64.so.2", "libc.so.6"]


def test_loading_without_a_gpu_fails_cleanly(built):
    lib = ctypes.CDLL(built.library)
    lib.megakernel_error_string.restype = ctypes.c_char_p
    # Launch before load: cudaErrorInitializationError, no crash.
    assert lib.megakernel_launch(*([None] * 14)) == 3
    error = lib.megakernel_load(0)
    assert error != 0 and lib.megakernel_error_string(error)
