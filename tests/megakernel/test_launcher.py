# SPDX-License-Identifier: Apache-2.0
"""The host side of the kernel on CPU: the address table, the static input
buffers with their padding, the device-side step number, the KV binding,
and the refusals, driven through a stand-in for the compiled kernel that
only sees what the kernel sees (see kernel_standin.py)."""

import dataclasses

import pytest
import torch
from kernel_standin import KernelStandIn, bits_equal, register_executor
from test_interpret import SPECS, TOL, make_spec

from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel.launcher import KernelExecutor, MegakernelError
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot
from vllm_ext.megakernel.planner import plan
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    QuantFormat,
)
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.runner import DecodeInputs
from vllm_ext.testing import BLOCK_SIZE, random_decode_inputs, random_weights
from vllm_ext.weights import QUANT_LINEARS

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=16)
MAX_LEN = 3 * BLOCK_SIZE + 5  # random_decode_inputs' default history


def executor(arch: str, bucket: int, with_lm_head: bool = True):
    spec = make_spec(arch, torch.bfloat16)
    weights = random_weights(spec, seed=1)
    program = plan(spec, bucket, DEVICE, with_lm_head=with_lm_head)
    standin = KernelStandIn(program, weights)
    max_blocks = -(-MAX_LEN // BLOCK_SIZE)
    ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                        max_blocks=max_blocks)  # fmt: skip
    return spec, weights, ex, standin


def clone(inputs: DecodeInputs) -> DecodeInputs:
    return dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_steps_match_the_plain_forward(arch):
    """Full and partly padded buckets over three steps (counters never
    reset): the final hidden states, logits and appended K/V of the real
    rows equal the plain PyTorch forward's."""
    spec, weights, ex, standin = executor(arch, bucket=4)
    for step, n in enumerate((4, 3, 1)):
        inputs = random_decode_inputs(spec, n, seed=20 + step)
        register_executor(standin, ex, inputs.kv_caches)
        ref_inputs = clone(inputs)
        got = ex.step(inputs)
        want = ReferenceExecutor(spec, weights).step(ref_inputs)
        assert got.shape == want.shape and not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=TOL[torch.bfloat16])
        for a, b in zip(inputs.kv_caches, ref_inputs.kv_caches, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL[torch.bfloat16])
        lm = got.float() @ weights.lm_head.float().t()
        torch.testing.assert_close(ex.logits[:n], lm, rtol=1e-5, atol=1e-4)
        # Padded rows: no token, no position, no history, no cache slot.
        assert ex.input_ids[n:].eq(0).all() and ex.seq_lens[n:].eq(0).all()
        assert ex.slot_mapping[n:].eq(-1).all()
    assert int(ex.counters[-1]) == 3 and standin.launches == 3


def test_a_refused_launch_leaves_the_next_step_working():
    """A launch the driver refuses (nothing ran) takes its step number back:
    the next step waits on the right counts and matches the reference."""
    spec, weights, ex, standin = executor("llama", bucket=2)
    inputs = random_decode_inputs(spec, 2, seed=31)
    register_executor(standin, ex, inputs.kv_caches)
    launch = ex.launch

    def refused(*args) -> None:
        raise MegakernelError("megakernel launch: too many resources requested")

    ex.launch = refused
    with pytest.raises(MegakernelError, match="too many resources"):
        ex.step(clone(inputs))
    assert int(ex.counters[-1]) == 0 and standin.launches == 0
    ex.launch = launch
    ref_inputs = clone(inputs)
    got = ex.step(inputs)
    want = ReferenceExecutor(spec, weights).step(ref_inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL[torch.bfloat16])
    assert int(ex.counters[-1]) == 1 and standin.launches == 1


def test_table_points_at_the_weights_and_workspace():
    spec, weights, ex, _ = executor("qwen2", bucket=2, with_lm_head=False)
    table, layers = ex.ptrs_host, spec.num_layers
    for i, lw in enumerate(weights.layers):
        assert table[i, LayerSlot.QKV] == lw.qkv.data_ptr()
        assert table[i, LayerSlot.QKV_BIAS] == lw.qkv_bias.data_ptr()
        assert table[i, LayerSlot.Q_NORM] == 0  # qwen2 has no QK norm
        assert table[i, LayerSlot.H_OUT] == table[i + 1, LayerSlot.H_IN]
    assert table[layers, GlobalSlot.H_LAST] == ex.ws["h"][layers].data_ptr()
    assert table[layers, GlobalSlot.LOGITS] == 0  # no LM head in the program
    assert all(int(a) % 16 == 0 for a in table.flatten())


def test_refusals():
    spec, weights, ex, _ = executor("llama", bucket=2)
    inputs = random_decode_inputs(spec, 3, seed=1)
    with pytest.raises(MegakernelError, match="does not fit the bucket"):
        ex.step(inputs)
    inputs = random_decode_inputs(spec, 2, seed=1)
    flat = tuple(c.contiguous() for c in inputs.kv_caches)  # not LBNHC
    with pytest.raises(MegakernelError, match="LBNHC"):
        ex.step(dataclasses.replace(inputs, kv_caches=flat))
    fp32 = random_weights(make_spec("llama", torch.float32), seed=1)
    program = plan(make_spec("llama", torch.float32), 2, DEVICE)
    with pytest.raises(MegakernelError, match="bf16 weights"):
        KernelExecutor(program, fp32, None, block_size=BLOCK_SIZE, max_blocks=4)


# compressed-tensors' per-channel FP8 (W8A8, dynamic per-token activations)
# and FP8 with 128 x 128 blocks (activations per token in groups of 128).
FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)
FP8_BLOCKS = QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP)
# INT4 W4A16 in groups of 64 (GPTQ's).
INT4 = QuantFormat(INT4_W4A16, "gptq", 4, 64)


QUANTIZED = [("llama", FP8), ("qwen3", FP8), ("llama", FP8_BLOCKS), ("qwen2", INT4)]


@pytest.mark.parametrize("arch, fmt", QUANTIZED)
def test_quantized_layers_through_the_table(arch, fmt):
    """A quantized model (KernelShape.quantized: FP8 per channel or in
    blocks, INT4): the table holds each linear layer's codes where its bf16
    weight would be and its scales in the last four columns; the stand-in
    reads only those (no dense weight is registered), and steps at batch 1
    and a padded bucket equal the plain forward's with the reference's
    input quantization over the dequantized weights."""
    spec = dataclasses.replace(make_spec(arch, torch.bfloat16), quant=fmt)
    weights = random_weights(spec, seed=1)
    f = weights.layers[0].quant
    codes = torch.uint8 if fmt is INT4 else torch.float8_e4m3fn
    assert f.gate_up.codes.dtype == codes
    assert torch.equal(weights.layers[0].gate_up, f.gate_up.dequantize())
    for bucket, n in ((1, 1), (4, 3)):
        program = plan(spec, bucket, DEVICE, with_lm_head=True)
        standin = KernelStandIn(program, weights)
        ex = KernelExecutor(program, weights, standin, block_size=BLOCK_SIZE,
                            max_blocks=-(-MAX_LEN // BLOCK_SIZE))  # fmt: skip
        assert ex.shape.quantized and ex.shape.fp8_block == (fmt is FP8_BLOCKS)
        assert ex.shape.int4_group == (64 if fmt is INT4 else 0)
        for i, lw in enumerate(weights.layers):
            for name, codes, scale in (
                ("qkv", LayerSlot.QKV, LayerSlot.QKV_SCALE),
                ("o_proj", LayerSlot.O_PROJ, LayerSlot.O_PROJ_SCALE),
                ("gate_up", LayerSlot.GATE_UP, LayerSlot.GATE_UP_SCALE),
                ("down", LayerSlot.DOWN, LayerSlot.DOWN_SCALE),
            ):
                w = getattr(lw.quant, name)
                assert ex.ptrs_host[i, codes] == w.codes.data_ptr()
                assert ex.ptrs_host[i, scale] == w.scale.data_ptr()
        inputs = random_decode_inputs(spec, n, seed=40)
        # The dense fields unregistered: a table entry pointing at one fails.
        dense = [getattr(lw, m) for lw in weights.layers for m in QUANT_LINEARS]
        register_executor(standin, ex, inputs.kv_caches)
        for t in dense:
            standin.tensors.pop(t.data_ptr(), None)
        ref_inputs = clone(inputs)
        got = ex.step(inputs)
        want = ReferenceExecutor(spec, weights).step(ref_inputs)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=TOL[torch.bfloat16])


def test_fp8_refusals():
    """An FP8 kernel without codes, or with codes in vLLM's [K, N] view
    rather than the row-major [N, K] storage under it, is refused by name;
    so is a quantized layout the kernel has no device functions for."""
    spec = dataclasses.replace(make_spec("llama", torch.bfloat16), quant=FP8)
    weights = random_weights(spec, seed=1)
    program = plan(spec, 1, DEVICE)
    bare = dataclasses.replace(
        weights,
        layers=tuple(dataclasses.replace(lw, quant=None) for lw in weights.layers),
    )
    with pytest.raises(MegakernelError, match="codes and scales"):
        KernelExecutor(program, bare, None, block_size=BLOCK_SIZE, max_blocks=4)
    lw = weights.layers[0]
    view = dataclasses.replace(
        lw.quant.down, codes=lw.quant.down.codes.t().contiguous().t()
    )
    bad = dataclasses.replace(lw, quant=dataclasses.replace(lw.quant, down=view))
    swapped = dataclasses.replace(weights, layers=(bad, *weights.layers[1:]))
    with pytest.raises(
        MegakernelError, match="layer 0 down: the kernel reads torch.fl"
    ):
        KernelExecutor(program, swapped, None, block_size=BLOCK_SIZE, max_blocks=4)
    # (INT4 with a scale a whole row: no device function takes it yet.)
    int4 = dataclasses.replace(spec, quant=QuantFormat(INT4_W4A16, "gptq", 4, -1))
    with pytest.raises(ValueError, match="group size of -1: the kernel"):
        KernelShape.from_program(plan(int4, 1, DEVICE), BLOCK_SIZE)


def test_a_block_table_padded_past_max_model_len_is_read_up_to_it():
    """vLLM pads its block tables to 128-token multiples, past the blocks of
    max_model_len that the executor holds; those columns are never needed."""
    spec, weights, ex, standin = executor("llama", bucket=2)
    inputs = random_decode_inputs(spec, 2, seed=1)
    register_executor(standin, ex, inputs.kv_caches)
    expected = ex.step(inputs).clone()
    n, width = inputs.block_table.shape
    wide = torch.full((n, ex.block_table.shape[1] + 8), 2**30, dtype=torch.int32)
    wide[:, :width] = inputs.block_table
    got = ex.step(dataclasses.replace(inputs, block_table=wide))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# (The variant's builds: test_build_cli.py; CI time.)
def test_gpu_executor_builds_every_bucket_and_picks_one(tmp_path, monkeypatch):
    """GpuExecutor on CPU with only the GPU queries and the library load
    replaced: it plans, builds (really, into a fresh cache) and prepares
    every bucket at construction, and routes each step to the smallest
    bucket that fits."""
    from vllm_ext.megakernel.kernel import executor as gpu

    spec = make_spec("mistral", torch.bfloat16)
    weights = random_weights(spec, seed=1)
    loaded = []

    class Library:  # the loaded module: its launch is the stand-in
        def __init__(self, path, device):
            loaded.append(path)
            self.path = path

        def launch(self, *args):  # routed by the program's queue
            standins[args[0].data_ptr()](*args)

    monkeypatch.setattr(gpu, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(gpu, "device_for", lambda device, arch: DEVICE)
    monkeypatch.setattr(gpu, "KernelLibrary", Library)
    standins = {}
    ex = gpu.GpuExecutor(spec, weights, torch.device("cpu"), (1, 2),
                         block_size=BLOCK_SIZE, max_blocks=4,
                         cache_dir=tmp_path)  # fmt: skip
    assert sorted(ex.executors) == [1, 2] and len(set(loaded)) == 2
    for kex in ex.executors.values():
        assert not kex.shape.wide_attn and not kex.shape.legacy_control
        # (Head and dim parts: the planner's, as every bucket fills the SMs.)
        assert kex.shape.qkv_parts == kex.program.qkv_parts == 4
        assert kex.shape.combine_parts == kex.program.combine_parts > 1
    assert all(p.exists() and p.parent.parent == tmp_path for p in loaded)
    for kex in ex.executors.values():
        standins[kex.queue.data_ptr()] = KernelStandIn(kex.program, weights)
    for n in (1, 2):
        inputs = random_decode_inputs(spec, n, seed=n)
        register_executor(standins[ex.executors[n].queue.data_ptr()],
                          ex.executors[n], inputs.kv_caches)  # fmt: skip
        ref_inputs = clone(inputs)
        got = ex.step(inputs)
        want = ReferenceExecutor(spec, weights).step(ref_inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL[torch.bfloat16])
        assert standins[ex.executors[n].queue.data_ptr()].launches == 1
    with pytest.raises(MegakernelError, match="above the largest bucket"):
        ex.step(random_decode_inputs(spec, 3, seed=3))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_workspace_is_the_interpreters_buffers(arch):
    """The kernel's buffers (shape.workspace_sizes) have, layer by layer, the
    exact shapes of the interpreter's: the GPU check compares them one to
    one, and the stand-in copies between them (a broadcast would hide a
    mismatch there)."""
    from vllm_ext.megakernel.interpret import ProgramInterpreter
    from vllm_ext.megakernel.kernel.shape import KernelShape, workspace_sizes

    spec = make_spec(arch, torch.bfloat16)
    weights = random_weights(spec, seed=1)
    program = plan(spec, 4, DEVICE, with_lm_head=True)
    interp = ProgramInterpreter(program, weights)
    interp.step(random_decode_inputs(spec, 4, seed=1))
    sizes = workspace_sizes(KernelShape.from_program(program, BLOCK_SIZE),
                            spec.num_layers)  # fmt: skip
    for name, dims in sizes.items():
        if name == "logits":
            assert tuple(interp.logits.shape) == dims
        elif name == "out":
            assert tuple(interp.buf["out"].shape) == dims
        else:
            per_layer = interp.buf[name]
            assert len(per_layer) == dims[0]
            assert all(tuple(t.shape) == dims[1:] for t in per_layer), name


def test_gpu_executor_names_the_variants_of_a_refused_shape(monkeypatch):
    from vllm_ext.megakernel.kernel import executor as gpu
    from vllm_ext.megakernel.variants import Variants

    monkeypatch.setattr(gpu, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(gpu, "device_for", lambda device, arch: DEVICE)
    spec = make_spec("llama", torch.bfloat16)
    # (Heads of 96: the kernel's attention takes 64 or 128.)
    spec = dataclasses.replace(spec, head_dim=96)
    with pytest.raises(MegakernelError, match="VARIANTS=wide_attn: "
                       "head_dim must be 64 or 128"):  # fmt: skip
        gpu.GpuExecutor(spec, random_weights(spec, seed=1), torch.device("cpu"),
                        (1,), block_size=BLOCK_SIZE, max_blocks=4,
                        variants=Variants.parse("wide_attn"))  # fmt: skip


def test_gpu_executor_names_what_a_failed_build_needs(tmp_path, monkeypatch):
    from vllm_ext.megakernel.kernel import aot
    from vllm_ext.megakernel.kernel import executor as gpu

    def no_toolkit(arch, out, shape):
        raise FileNotFoundError("CUDA 13 toolkit with libcudart_static.a not found")

    monkeypatch.setattr(gpu, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(gpu, "device_for", lambda device, arch: DEVICE)
    monkeypatch.setattr(aot, "build", no_toolkit)
    spec = make_spec("llama", torch.bfloat16)
    with pytest.raises(MegakernelError, match="VLLM_MEGAKERNEL_CACHE_DIR"):
        gpu.GpuExecutor(spec, random_weights(spec, seed=1), torch.device("cpu"),
                        (1,), block_size=BLOCK_SIZE, max_blocks=4,
                        cache_dir=tmp_path)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pipeline_stages_through_the_table(arch):
    """Two pipeline stages of a layer each, an executor and a stand-in each
    with the stage's weights as vLLM's stage workers hold them (the first
    embeds; the last has the final norm and LM head): the later stage starts
    from the earlier one's residual stream (copied into H0, the padded rows
    zero). The last stage's output and logits are the whole model's
    executor's bit for bit; a later stage without hidden states is refused."""
    from vllm.distributed.utils import get_pp_indices

    from vllm_ext.parallel import stage_spec

    spec, weights, whole, standin = executor(arch, bucket=4)
    inputs = random_decode_inputs(spec, 3, seed=21)
    ref = clone(inputs)
    register_executor(standin, whole, ref.kv_caches)
    want = whole.step(ref).clone()
    hidden, max_blocks = None, -(-MAX_LEN // BLOCK_SIZE)
    for stage in range(2):
        first, last = stage == 0, stage == 1
        start, end = get_pp_indices(spec.num_layers, stage, 2)
        w = dataclasses.replace(
            weights, layers=weights.layers[start:end],
            embed=weights.embed if first else None,
            final_norm=weights.final_norm if last else None,
            lm_head=weights.lm_head if last else None,
        )  # fmt: skip
        program = plan(stage_spec(spec, stage, 2), 4, DEVICE, with_lm_head=True)
        standin = KernelStandIn(program, w)
        ex = KernelExecutor(program, w, standin, block_size=BLOCK_SIZE,
                            max_blocks=max_blocks)  # fmt: skip
        stage_in = dataclasses.replace(
            inputs, kv_caches=inputs.kv_caches[start:end], hidden_in=hidden
        )
        register_executor(standin, ex, stage_in.kv_caches)
        if last:
            with pytest.raises(MegakernelError, match="previous stage's hidden"):
                ex.step(dataclasses.replace(stage_in, hidden_in=None))
        hidden = ex.step(stage_in)
        assert hidden.shape == (3, spec.hidden_size)
        if last:
            assert ex.ws["h"][0][3:].eq(0).all()
    assert bits_equal(hidden, want)
    assert bits_equal(ex.logits[:3], whole.logits[:3])
