# SPDX-License-Identifier: Apache-2.0
"""The GPU executor vLLM's decode steps go through: one built kernel per
batch bucket, each with its own ``KernelExecutor``.

Everything is prepared when the model loads (programs planned and
verified, libraries compiled or taken from the cache, buffers allocated),
so no decode step compiles, allocates or copies from the host, and every
step can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from vllm_ext.megakernel.cost import DEFAULT_DEVICE, DEVICES, Device
from vllm_ext.megakernel.kernel.launcher import (
    KernelExecutor,
    KernelLibrary,
    MegakernelError,
    arch_for_device,
    describe_abort,
    new_abort_record,
)
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.kernel.symmetric import RankBuffers, rank_buffers
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.variants import Variants
from vllm_ext.megakernel.verify import verify
from vllm_ext.model_spec import ModelSpec
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights


def device_for(device: torch.device, arch: str) -> Device:
    """The cost-model device of ``arch`` with this GPU's SM count: the
    program has one queue per SM, and a cooperative launch needs them all
    resident."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return dataclasses.replace(DEVICES[DEFAULT_DEVICE[arch]], num_sms=sms)


class GpuExecutor:
    def __init__(
        self,
        spec: ModelSpec,
        weights: DecodeWeights,
        device: torch.device,
        buckets: tuple[int, ...],
        *,
        block_size: int,
        max_blocks: int,
        cache_dir: str | Path | None = None,
        logger: logging.Logger | None = None,
        variants: Variants | None = None,
        tp_group: Any = None,
        query_rows: int = 1,
    ) -> None:
        """``tp_group``: a tensor-parallel rank's vLLM TP group
        (``GroupCoordinator``), over which each bucket's counters and partial
        sums are exchanged in symmetric memory (kernel/symmetric.py).
        ``query_rows``: a verify step's rows a request (planner.plan)."""
        from vllm_ext.megakernel.build import library_for

        if spec.dtype != torch.bfloat16:
            raise MegakernelError(
                f"the megakernel runs bf16 models; this one is {spec.dtype} "
                "(use --dtype bfloat16)"
            )
        arch = arch_for_device(device)
        target = device_for(device, arch)
        log = logger.info if logger else None
        variants = variants or Variants()
        programs = {}
        for bucket in buckets:
            program = plan(spec, bucket, target, query_rows=query_rows)
            verify(program)
            programs[bucket] = program
        try:
            shapes = {
                b: KernelShape.from_program(p, block_size, **variants.kernel_flags())
                for b, p in programs.items()
            }
        except ValueError as e:
            raise MegakernelError(f"VLLM_MEGAKERNEL_VARIANTS={variants}: {e}") from e
        cache_dir = Path(cache_dir) if cache_dir else None

        def build(shape: KernelShape) -> Path:
            try:
                return library_for(shape, arch, cache_dir, log=log)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                raise MegakernelError(
                    f"building the megakernel for {arch} (batch {shape.batch}) "
                    f"failed: {e}. A build needs this package's dependencies "
                    "(nvidia-cutlass-dsl[cu13] and the nvidia-cuda-runtime, "
                    "-crt and -cccl 13.0 wheels) and gcc; or point "
                    "VLLM_MEGAKERNEL_CACHE_DIR at libraries built elsewhere."
                ) from e

        # Builds are separate compiler processes: run the missing ones at once.
        with ThreadPoolExecutor(
            max_workers=min(len(shapes), os.cpu_count() or 1)
        ) as pool:
            paths = dict(zip(shapes, pool.map(build, shapes.values()), strict=True))
        self.programs = programs
        # One abort record for every bucket: a step of any bucket that
        # aborts leaves it set (shape.AbortWord), and the backend reads it
        # with each step's sampled tokens (step_status).
        self.abort = new_abort_record(device)
        self.executors: dict[int, KernelExecutor] = {}
        self.symmetric: dict[int, RankBuffers] = {}
        if spec.tp_size > 1 and tp_group is None:
            raise MegakernelError("a tensor-parallel rank needs its TP group")
        for bucket, program in programs.items():
            library = KernelLibrary(paths[bucket], device.index or 0)
            mine = {}
            if spec.tp_size > 1:
                # (A collective: every rank, each bucket in the same order.)
                buffers = rank_buffers(program, shapes[bucket], tp_group.device_group,
                                       device, barrier=tp_group.barrier)  # fmt: skip
                self.symmetric[bucket] = buffers
                mine = {"counters": buffers.counters, "partial": buffers.partial}
            ex = KernelExecutor(
                program, weights, library.launch,
                block_size=block_size, max_blocks=max_blocks, abort=self.abort,
                **mine,
            )  # fmt: skip
            if spec.tp_size > 1:
                ex.set_peers(self.symmetric[bucket].peers)
            self.executors[bucket] = ex

    def failure(self, record: torch.Tensor) -> str | None:
        """The host copy of ``self.abort``, in words (None: no step aborted)."""
        return describe_abort(record, self.programs)

    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        n = inputs.batch_size
        bucket = next((b for b in self.executors if b >= n), None)
        if bucket is None:
            raise MegakernelError(f"batch {n} is above the largest bucket")
        self._last = self.executors[bucket], n
        return self.executors[bucket].step(inputs)

    def residual_stream(self, layer: int) -> torch.Tensor:
        executor, n = self._last
        return executor.ws["h"][layer][:n].clone()
