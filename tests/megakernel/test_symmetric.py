# SPDX-License-Identifier: Apache-2.0
"""Tensor parallel as vLLM runs it, one process and one GPU a rank: each
rank's GpuExecutor puts its counters and partial sums in symmetric memory,
exchanged over the TP group (kernel/symmetric.py), and its PEERS lists
every rank's. On CPU: the ranks are threads, the symmetric-memory module a
stand-in whose ``rendezvous`` is a collective over them (each rank blocks
until all have allocated), and each rank's launch goes to
``SeparateRanksStandIn``, which runs the ranks' kernels together once every
rank has launched, reading each rank's peers through its PEERS only. The
outputs must be bit for bit the ranks interpreted directly. (Nothing here
has run on two GPUs.)"""

import dataclasses
import threading
import types

import pytest
import torch
from kernel_standin import SeparateRanksStandIn, bits_equal, register_executor

from tests.megakernel.test_one_launch_ranks import (
    SPECS,
    TP,
    _clone,
    _contiguous,
    _rank_inputs,
)
from vllm_ext.megakernel import build
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import RankSetInterpreter, pad_inputs
from vllm_ext.megakernel.kernel import executor as gpu
from vllm_ext.megakernel.kernel import symmetric
from vllm_ext.megakernel.kernel.launcher import MegakernelError
from vllm_ext.parallel import shard_spec, shard_weights
from vllm_ext.testing import BLOCK_SIZE, random_weights

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=8)
BUCKETS = (1, 2)


class SymmetricMemory:
    """torch.distributed._symmetric_memory's ``empty`` and ``rendezvous``
    for ranks that are threads of one process (``rank.k``: the calling
    thread's rank)."""

    def __init__(self, tp: int) -> None:
        self.rank = threading.local()
        self.meet = threading.Barrier(tp, timeout=60)
        self.buffers: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[int, str, int]] = []

    def empty(self, size: int, dtype, device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def rendezvous(self, buf: torch.Tensor, group: str):
        k = self.rank.k
        self.calls.append((k, group, buf.numel()))
        self.buffers[k] = buf
        self.meet.wait()  # every rank's buffer is in
        ptrs = [self.buffers[r].data_ptr() for r in range(len(self.buffers))]
        self.meet.wait()  # every rank has read them (the next bucket reuses)
        return types.SimpleNamespace(buffer_ptrs=ptrs)


def _ranks(monkeypatch, arch: str):
    """Each rank's GpuExecutor, built in its own thread as vLLM's workers
    build theirs, with the stand-in's launches."""
    spec = SPECS[arch]()
    weights = random_weights(spec, seed=1)
    shards = [_contiguous(shard_weights(weights, spec, TP, r)) for r in range(TP)]
    sharded = shard_spec(spec, TP)
    memory = SymmetricMemory(TP)
    standins: dict[int, SeparateRanksStandIn] = {}  # (made from the programs)
    barriers = []

    class Library:  # the loaded kernel: this rank's launch of the stand-in
        def __init__(self, path, device):
            bucket, k = int(path.stem[1:]), memory.rank.k
            self.launch = lambda *args: standins[bucket].launcher(k)(*args)

    monkeypatch.setattr(gpu, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(gpu, "device_for", lambda device, arch: DEVICE)
    monkeypatch.setattr(build, "library_for",
                        lambda shape, arch, cache_dir, log=None:
                        build.Path(f"b{shape.batch}.so"))  # fmt: skip
    monkeypatch.setattr(gpu, "KernelLibrary", Library)
    monkeypatch.setattr(symmetric, "symm_mem_module", lambda: memory)
    executors: dict[int, gpu.GpuExecutor] = {}
    errors = []

    def rank(k: int) -> None:
        memory.rank.k = k
        group = types.SimpleNamespace(device_group="tp:0",
                                      barrier=lambda: barriers.append(k))  # fmt: skip
        try:
            executors[k] = gpu.GpuExecutor(
                sharded, shards[k], torch.device("cpu"), BUCKETS,
                block_size=BLOCK_SIZE, max_blocks=4, tp_group=group,
            )  # fmt: skip
        except Exception as e:  # reported by the test
            errors.append(e)
            memory.meet.abort()

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for b in BUCKETS:
        standin = SeparateRanksStandIn(executors[0].programs[b], shards)
        standins[b] = standin
        for k in range(TP):
            ex = executors[k].executors[b]
            register_executor(standin, ex)
            standin.register(ex.peers)
    return spec, shards, [executors[k] for k in range(TP)], standins, memory, barriers


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_separate_launches_meet_through_symmetric_memory(monkeypatch, arch):
    """Each bucket's buffer is exchanged once a rank, over the TP group;
    each rank's counters and partial sums are views of its own buffer and
    its PEERS lists every rank's, in rank order; two steps of separate
    launches a bucket equal the ranks interpreted directly, bit for bit."""
    spec, shards, ranks, standins, memory, barriers = _ranks(monkeypatch, arch)
    size, offset, dims = symmetric.layout(ranks[0].programs[2],
                                          ranks[0].executors[2].shape)  # fmt: skip
    assert sorted(memory.calls) == sorted(
        (k, "tp:0", symmetric.layout(ranks[0].programs[b],
                                     ranks[0].executors[b].shape)[0])
        for k in range(TP) for b in BUCKETS
    )  # fmt: skip
    assert sorted(barriers) == sorted(k for k in range(TP) for _ in BUCKETS)
    for g in ranks:
        ex, buf = g.executors[2], g.symmetric[2]
        base = buf.counters.data_ptr()
        assert ex.counters.data_ptr() == base and ex.ws["partial"].data_ptr() == (
            base + offset
        )
        assert tuple(ex.ws["partial"].shape) == dims and offset % 16 == 0
        assert ex.counters.eq(0).all() and ex.ws["partial"].isnan().all()
        bases = [r.symmetric[2].counters.data_ptr() for r in ranks]
        assert ex.peers.tolist() == [bases, [b + offset for b in bases]]
    direct = {b: RankSetInterpreter(standins[b].program, shards, seed=11)
              for b in BUCKETS}  # fmt: skip
    for step, n in enumerate((2, 1, 2)):  # (1: bucket 1's launch)
        inputs = _rank_inputs(spec, n, seed=30 + step)
        want_inputs = _clone(inputs)
        for i in inputs:
            standins[n].register(*i.kv_caches)
        got = [g.step(i) for g, i in zip(ranks, inputs, strict=True)]
        want = direct[n].step([pad_inputs(i, n) for i in want_inputs])
        for k in range(TP):
            assert bits_equal(got[k], want[k][:n]), f"rank {k}, step {step}"
            for a, b in zip(inputs[k].kv_caches, want_inputs[k].kv_caches,
                            strict=True):  # fmt: skip
                assert bits_equal(a, b)
        assert bits_equal(got[0], got[1]) and not got[0].isnan().any()
    assert standins[2].launches == 2 and standins[1].launches == 1
    assert [g.executors[2].counters[-1].item() for g in ranks] == [2] * TP


def test_a_rank_without_its_group_or_with_another_span_refuses(monkeypatch):
    """No TP group: refused at construction, by name; a rendezvous that
    spans another number of ranks than the program: refused."""
    spec = SPECS["llama"]()
    shard = _contiguous(shard_weights(random_weights(spec, seed=1), spec, TP, 0))
    monkeypatch.setattr(gpu, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(gpu, "device_for", lambda device, arch: DEVICE)
    monkeypatch.setattr(build, "library_for",
                        lambda shape, arch, cache_dir, log=None:
                        build.Path("b.so"))  # fmt: skip
    monkeypatch.setattr(
        gpu, "KernelLibrary", lambda path, device: types.SimpleNamespace(launch=None)
    )
    with pytest.raises(MegakernelError, match="TP group"):
        gpu.GpuExecutor(shard_spec(spec, TP), shard, torch.device("cpu"), (1,),
                        block_size=BLOCK_SIZE, max_blocks=4)  # fmt: skip
    lone = types.SimpleNamespace(
        empty=lambda size, dtype, device: torch.empty(size, dtype=dtype),
        rendezvous=lambda buf, group: types.SimpleNamespace(
            buffer_ptrs=[buf.data_ptr()]),
    )  # fmt: skip
    monkeypatch.setattr(symmetric, "symm_mem_module", lambda: lone)
    group = types.SimpleNamespace(device_group="tp:0", barrier=lambda: None)
    with pytest.raises(MegakernelError, match="spans 1 ranks, the program 2"):
        gpu.GpuExecutor(shard_spec(spec, TP), shard, torch.device("cpu"), (1,),
                        block_size=BLOCK_SIZE, max_blocks=4,
                        tp_group=group)  # fmt: skip


def test_the_backend_takes_tp_on_a_gpu(monkeypatch):
    """A TP rank's spec passes the GPU kernel's start-up checks (on a
    Hopper GPU; here the platform's answer is stood in for)."""
    from vllm_ext import backend

    spec = shard_spec(SPECS["llama"](), TP)
    monkeypatch.setattr(backend.current_platform, "get_device_capability",
                        lambda: (9, 0))  # fmt: skip
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
        cache_config=types.SimpleNamespace(block_size=16),
    )
    backend._check_gpu_kernel(config, spec)
