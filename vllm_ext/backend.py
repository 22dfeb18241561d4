# SPDX-License-Identifier: Apache-2.0
"""What vLLM sees: the ``megakernel`` decode backend.

``verify_and_update_config`` runs at start-up (in ``VllmConfig``) and refuses,
with the reason, anything the megakernel cannot serve. The backend object
lives in the model runner and takes every decode-only step it ``accepts``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import vllm.envs as vllm_envs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.worker.decode_backend import (
    DecodeBackend,
    DecodeBackendCapabilities,
    DecodeBatch,
)

from vllm_ext import envs
from vllm_ext.attention import KV_CACHE_LAYOUT
from vllm_ext.megakernel.kernel.launcher import ARCH_OF_CAPABILITY
from vllm_ext.megakernel.kernel.shape import QUANT_MAX_BATCH, quant_refusal
from vllm_ext.megakernel.planner import batch_buckets
from vllm_ext.model_spec import ModelSpec, sliding_window_refusal
from vllm_ext.parallel import shard_spec, stage_spec
from vllm_ext.plugin import ATTENTION_BACKEND
from vllm_ext.quant import FP8_BLOCK
from vllm_ext.runner import MAX_QUERY_LEN, DecodeExecutor, decode_inputs
from vllm_ext.weights import DecodeWeights, stage_layers

if TYPE_CHECKING:
    from vllm.sequence import IntermediateTensors

# Under "vllm." so records go through vLLM's handlers, level and format.
logger = init_logger(f"vllm.{__name__}")

# VLLM_KV_CACHE_LAYOUT's names for the layout the kernel reads (NHD is
# vLLM's legacy alias of LBNHC).
KV_CACHE_LAYOUT_NAMES = (KV_CACHE_LAYOUT.name, "NHD")

# The GPUs the kernel is built for, in words for the error messages.
SUPPORTED_GPUS = "an NVIDIA GPU of compute capability {} (H100/H200, B200)".format(
    " or ".join(f"{a}.{b}" for a, b in ARCH_OF_CAPABILITY)
)
INTERPRET_HINT = (
    "To run the same decode steps through the PyTorch reference executor "
    "(slow, for testing), set VLLM_MEGAKERNEL_INTERPRET=1."
)


def model_spec(vllm_config: VllmConfig, pp_rank: int = 0) -> ModelSpec:
    """The model as a rank of pipeline stage ``pp_rank`` holds it
    (``parallel.shard_spec``, ``parallel.stage_spec``)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    spec = ModelSpec.from_hf_config(
        model_config.hf_text_config, model_config.dtype, model_config.max_model_len
    )
    spec = shard_spec(spec, parallel.tensor_parallel_size)
    return stage_spec(spec, pp_rank, parallel.pipeline_parallel_size)


class MegakernelDecodeBackend(DecodeBackend):
    @classmethod
    def capabilities(cls, vllm_config: VllmConfig) -> DecodeBackendCapabilities:
        # A decoder on one GPU or a rank of tensor and pipeline parallel
        # groups (parallel.py; data parallel ranks each run their own),
        # decode steps and, with speculative decoding, verify
        # steps of 1 + k rows a request (each token a row: runner.py),
        # uniform or ragged; vLLM refuses every other feature at start-up.
        # Only as many rows as the drafts need: vLLM's step rule tells a
        # verify step by its shape, so a prefill of at most 1 + k tokens a
        # request runs here too (the same computation); none without
        # speculation.
        spec = vllm_config.speculative_config
        if spec is None:
            return DecodeBackendCapabilities(**PARALLEL)
        # (More drafts than MAX_QUERY_LEN - 1: vLLM refuses them, named.)
        rows = min(1 + spec.num_speculative_tokens, MAX_QUERY_LEN)
        # EAGLE-3's auxiliary hidden states are residual streams the program
        # keeps anyway (h[l]: forward); DFlash, which reads them too, is
        # untested, so vLLM refuses it by name.
        return DecodeBackendCapabilities(
            max_query_len=rows, ragged_query_lens=True,
            aux_hidden_states=spec.method == "eagle3", **PARALLEL,
        )  # fmt: skip

    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        spec = model_spec(vllm_config)  # raises UnsupportedModelError
        for stage in range(1, vllm_config.parallel_config.pipeline_parallel_size):
            model_spec(vllm_config, stage)  # each stage holds a layer
        _check_deployment(vllm_config, spec)
        interpret = envs.VLLM_MEGAKERNEL_INTERPRET
        if spec.mla is not None:
            # vLLM's own MLA backend writes the latent cache the program reads
            # (one row per token, no heads: no layout to record).
            vllm_config.attention_config.backend = _check_mla_attention(
                vllm_config, spec, interpret
            )
        else:
            attention = _attention_backend_for_platform(interpret)
            chosen = vllm_config.attention_config.backend
            if chosen is not None and chosen != attention:
                raise ValueError(
                    f"--decode-backend megakernel reads the KV cache as the "
                    f"{attention.get_class().__name__} attention backend writes "
                    f"it, but --attention-backend {chosen.name} was given; drop "
                    "--attention-backend."
                )
            vllm_config.attention_config.backend = attention
            # The layout the kernel reads, for every attention backend and
            # every process (vLLM would otherwise resolve it later, by
            # preference).
            record_kv_cache_layout(vllm_config.cache_config, KV_CACHE_LAYOUT.name)
        if current_platform.is_cuda() and not interpret:
            _check_gpu_kernel(vllm_config, spec)
        if interpret and current_platform.is_cuda():
            # The interpreter reads sequence lengths on the host: it cannot be
            # captured in a CUDA graph.
            from vllm.config.compilation import CUDAGraphMode

            if vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
                logger.warning(
                    "VLLM_MEGAKERNEL_INTERPRET=1: CUDA graphs are turned off "
                    "(the reference executor syncs with the host)."
                )
                vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        if interpret:
            logger.warning(
                "VLLM_MEGAKERNEL_INTERPRET=1: decode steps run through the "
                "megakernel's PyTorch reference executor (slow; for testing)."
            )
        variants = envs.VLLM_MEGAKERNEL_VARIANTS  # raises on an unknown name
        if variants.names:
            logger.warning(
                "VLLM_MEGAKERNEL_VARIANTS=%s: an experimental kernel variant, "
                "not yet measured on a GPU%s.",
                variants,
                " (reference mode runs the program, the same for every variant)"
                if interpret
                else "",
            )

    def __init__(
        self, vllm_config: VllmConfig, model: torch.nn.Module, device: torch.device
    ) -> None:
        self.spec = model_spec(vllm_config, _pp_rank(vllm_config))
        self.vllm_config = vllm_config
        if self.spec.mla is not None:
            attentions = _mla_attention_layers(model, self.spec)
        else:
            attentions = [layer.self_attn.attn for layer in stage_layers(model)]
        max_len = vllm_config.model_config.max_model_len
        for attn in attentions:
            # The layers as vLLM built them (FlashAttention would run a
            # window in prefill that the kernel does not): the same rule as
            # the config's at start-up.
            refusal = sliding_window_refusal(attn.sliding_window, max_len)
            if refusal is not None:
                raise ValueError(
                    f"--decode-backend megakernel does not support {refusal} "
                    f"({attn.layer_name})."
                )
        self.attentions = attentions
        self.layer_names = tuple(attn.layer_name for attn in attentions)
        # The blocks the executor is built for (vLLM sets the config's again
        # after loading the model: to this value, _check_mla_attention), and
        # the first step checks a latent cache's against.
        self.block_size = vllm_config.cache_config.block_size
        # A verify step's rows a request (1 without speculation), which a
        # latent attention's MLA_ATTN passes over together.
        self.query_rows = self.capabilities(vllm_config).max_query_len
        self._caches_checked = False
        max_batch, why = decode_batches(self.spec, device)
        if max_batch:
            self.description = (
                f"decode batches of up to {max_batch} requests ({why}); larger "
                "ones run through vLLM's default decode"
            )
        else:
            self.description = (
                f"no decode batch: {why}. Decode runs through vLLM's default "
                "path; VLLM_MEGAKERNEL_MAX_BATCH=N sends batches of up to N "
                "requests through the kernel regardless"
            )
        self.buckets = batch_buckets(max_batch) if max_batch else ()
        self.model = model
        self.executor = self._make_executor(model) if self.buckets else None
        self._ran_a_step = False

    def _make_executor(self, model: torch.nn.Module) -> DecodeExecutor:
        # (The GPU route keeps no dense copy of a quantized layer's weights:
        # the kernel reads its codes.)
        weights = DecodeWeights.from_vllm_model(
            model, self.spec, dense=bool(envs.VLLM_MEGAKERNEL_INTERPRET)
        )
        if envs.VLLM_MEGAKERNEL_INTERPRET:
            # The instruction program the GPU would run, interpreted.
            from vllm_ext.megakernel.cost import DEVICES
            from vllm_ext.megakernel.interpret import ProgramExecutor

            return ProgramExecutor(
                self.spec,
                weights,
                DEVICES[envs.VLLM_MEGAKERNEL_INTERPRET_DEVICE],
                self.buckets,
                seed=envs.VLLM_MEGAKERNEL_INTERPRET_SEED,
                query_rows=self.query_rows,
            )
        # verify_and_update_config refused every other case at start-up.
        from vllm_ext.megakernel.kernel.executor import GpuExecutor

        block_size = self.block_size
        max_len = self.vllm_config.model_config.max_model_len
        return GpuExecutor(
            self.spec,
            weights,
            weights.cos_sin.device,
            self.buckets,
            block_size=block_size,
            max_blocks=-(-max_len // block_size),
            cache_dir=envs.VLLM_MEGAKERNEL_CACHE_DIR,
            logger=logger,
            variants=envs.VLLM_MEGAKERNEL_VARIANTS,
            tp_group=_tp_group() if self.spec.tp_size > 1 else None,
            query_rows=self.query_rows,
        )

    def describe(self) -> str:
        return self.description

    def weights_updated(self) -> None:
        # The executor holds its own copy of the weights (read back from
        # vLLM's prepacked layers on a CPU, packed for the kernel on a
        # GPU): build it again from the reloaded model.
        if self.buckets:
            self.executor = self._make_executor(self.model)

    def step_status(self) -> torch.Tensor | None:
        # The kernel's abort record (kernel/shape.py, AbortWord), shared by
        # every bucket; reference mode's interpreter has no waits to expire.
        return getattr(self.executor, "abort", None)

    def step_failed(self, status: torch.Tensor) -> str | None:
        why = self.executor.failure(status)
        if why is not None:
            # vLLM logs it as an error and fails the step's requests.
            why += ". The megakernel is off for this process until a restart"
        return why

    def accepts(self, num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
        if max_query_len > MAX_QUERY_LEN or num_tokens < num_reqs or num_reqs < 1:
            return False
        if not self.buckets:
            return False
        if num_tokens > self.buckets[-1]:
            # (A bucket holds rows: a verify step's tokens each take one.)
            logger.info_once(
                "Decode steps of more than %d tokens run through vLLM's default path.",
                self.buckets[-1],
            )
            return False
        return True

    def forward(
        self, batch: DecodeBatch
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]] | IntermediateTensors:
        # The caches vLLM bound to the layers come with the step: they are
        # allocated after the backend is made.
        inputs = decode_inputs(batch, self.layer_names)
        if not self._caches_checked and self.spec.mla is not None:
            _check_latent_caches(
                self.attentions, inputs.kv_caches, self.spec, self.block_size
            )
            self._caches_checked = True
        hidden = self.executor.step(inputs)
        # EAGLE-3: the residual streams entering those layers, which the
        # program keeps (h[l]; the number of layers: before the final norm).
        aux = [self.executor.residual_stream(layer)
               for layer in batch.aux_hidden_state_layers]  # fmt: skip
        if not self._ran_a_step:
            # vLLM counts the steps (vllm:decode_backend_steps).
            logger.info(
                "First decode step through the megakernel backend "
                "(%s executor, batch %d).",
                type(self.executor).__name__,
                batch.num_reqs,
            )
            self._ran_a_step = True
        num_tokens = batch.positions.shape[-1]

        def padded(rows: torch.Tensor) -> torch.Tensor:
            if rows.shape[0] == num_tokens:
                return rows
            out = rows.new_zeros(num_tokens, rows.shape[1])
            out[: rows.shape[0]] = rows
            return out

        out = padded(hidden)
        if aux:
            return out, [padded(rows) for rows in aux]
        if self.spec.pp_last:
            return out
        # A stage before the last: its residual stream, as vLLM's layers
        # hand it on (hidden states and residual; their sum is the stream).
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors(
            {"hidden_states": out, "residual": torch.zeros_like(out)}
        )


# What the backend declares beyond one GPU (a GPU refuses tensor parallel
# at start-up, _check_gpu_kernel).
PARALLEL = dict(tensor_parallel=True, pipeline_parallel=True)


def decode_batches(spec: ModelSpec, device: torch.device) -> tuple[int, str]:
    """The largest decode batch the backend takes, and why. The compiled
    kernel takes only the batches a GPU check measured it faster on, against
    vLLM's own decode (``megakernel/measured.py``), unless the user says
    otherwise; reference mode is for testing and is not gated."""
    if envs.VLLM_MEGAKERNEL_INTERPRET:
        return envs.VLLM_MEGAKERNEL_MAX_BATCH, "reference mode, not gated"
    if os.environ.get("VLLM_MEGAKERNEL_MAX_BATCH"):
        asked = envs.VLLM_MEGAKERNEL_MAX_BATCH
        if spec.quant is not None and asked > QUANT_MAX_BATCH:
            return QUANT_MAX_BATCH, (
                "VLLM_MEGAKERNEL_MAX_BATCH, and quantized kernels' largest bucket"
            )
        return asked, "VLLM_MEGAKERNEL_MAX_BATCH"
    from vllm_ext.megakernel import build, measured

    gpu = torch.cuda.get_device_name(device)
    return measured.max_batch(gpu, spec, build.source_hash())


def _attention_backend_for_platform(interpret: bool) -> AttentionBackendEnum:
    """The attention backend that writes the cache layout the megakernel
    reads: FlashAttention on a GPU, our PyTorch one in CPU reference mode."""
    if current_platform.is_cuda():
        # Which GPUs the compiled kernel runs on: _check_gpu_kernel.
        return AttentionBackendEnum.FLASH_ATTN
    if current_platform.is_cpu():
        if not interpret:
            raise ValueError(
                f"--decode-backend megakernel needs {SUPPORTED_GPUS}, and this "
                "machine has none (vLLM platform: cpu). " + INTERPRET_HINT
            )
        # MegakernelAttentionBackend, which the plugin registers under its
        # own name in every process.
        return AttentionBackendEnum[ATTENTION_BACKEND]
    raise ValueError(
        f"--decode-backend megakernel does not support the "
        f"{current_platform.device_name!r} platform; it needs {SUPPORTED_GPUS}, "
        "or a CPU with VLLM_MEGAKERNEL_INTERPRET=1."
    )


@dataclass(frozen=True)
class LatentBackend:
    """A vLLM MLA attention backend whose latent cache the program reads:
    the rows of ``paged_kv.write_latent`` (``[num_blocks, block_size,
    kv_lora_rank + qk_rope_head_dim]``, token t at ``block_table[t //
    block_size]``, offset ``t % block_size``), which its prefill writes; and
    the block sizes its decode kernel takes, the first its default."""

    backend: AttentionBackendEnum
    blocks: tuple[int, ...]
    any_multiple: bool = False  # or any multiple of blocks[0]

    def takes(self, block_size: int) -> bool:
        if self.any_multiple:
            return block_size % self.blocks[0] == 0
        return block_size in self.blocks

    @property
    def blocks_text(self) -> str:
        if self.any_multiple:
            return f"blocks of a multiple of {self.blocks[0]} tokens"
        return f"blocks of {' or '.join(map(str, self.blocks))} tokens"


# What vLLM 0.32.0 picks first for a bf16 latent cache on each platform
# (its platforms' priority lists), pinned so that prefill writes the rows
# the program reads: on a CPU, CPU_MLA (the platform forces blocks of 16);
# on Hopper (compute capability 9.x), FLASH_ATTN_MLA; on Blackwell (10.x),
# FLASHINFER_MLA (32 when no block size is given, as vLLM would choose).
CPU_LATENT = LatentBackend(AttentionBackendEnum.CPU_MLA, (16,))
GPU_LATENT = {
    9: LatentBackend(AttentionBackendEnum.FLASH_ATTN_MLA, (16,), any_multiple=True),
    10: LatentBackend(AttentionBackendEnum.FLASHINFER_MLA, (32, 64)),
}


def latent_backend(interpret: bool) -> LatentBackend:
    """The latent-cache backend of this platform (``CPU_LATENT``,
    ``GPU_LATENT``); a platform the kernel does not run on is refused as for
    a GQA model."""
    if current_platform.is_cuda():
        capability = current_platform.get_device_capability()
        major = capability.major if capability is not None else None
        if major not in GPU_LATENT:
            raise ValueError(
                f"--decode-backend megakernel reads vLLM's latent cache (multi-"
                f"head latent attention) on {SUPPORTED_GPUS}; this GPU has "
                f"{tuple(capability or ())}"
            )
        return GPU_LATENT[major]
    _attention_backend_for_platform(interpret)  # refuses what needs a GPU
    return CPU_LATENT


def _check_mla_attention(
    vllm_config: VllmConfig, spec: ModelSpec, interpret: bool
) -> AttentionBackendEnum:
    """The attention backend of a multi-head latent attention model: vLLM's
    own for this platform (``latent_backend``), whose prefill writes the
    latent rows the program's decode steps read and append to. Without
    ``--block-size`` the block size is set now to the one vLLM would set
    after loading the model (``Platform.update_block_size_for_backend``:
    16 where the backend takes it, else its smallest), so that the kernel,
    built while the model loads, is built for the blocks the cache gets."""
    latent = latent_backend(interpret)
    why = _mla_attention_refusal(vllm_config, spec, latent)
    if why is not None:
        raise ValueError(
            f"--decode-backend megakernel on {spec.architecture} (multi-head "
            f"latent attention): {why}"
        )
    cache = vllm_config.cache_config
    if not cache.user_specified_block_size:
        cache.block_size = latent.blocks[0]
    return latent.backend


def _mla_attention_refusal(
    vllm_config: VllmConfig, spec: ModelSpec, latent: LatentBackend
) -> str | None:
    name = latent.backend.name
    if not vllm_config.model_config.use_mla:
        # VLLM_MLA_DISABLE: vLLM builds per-head K/V attention instead.
        return (
            "vLLM was told not to use MLA (VLLM_MLA_DISABLE=1), and the "
            "backend runs the latent form only; unset VLLM_MLA_DISABLE"
        )
    chosen = vllm_config.attention_config.backend
    if chosen is not None and chosen != latent.backend:
        return (
            f"the backend reads the latent cache as vLLM's {name} attention "
            f"backend writes it, but --attention-backend {chosen.name} was "
            f"given; pass --attention-backend {name} or drop it"
        )
    if latent is CPU_LATENT and chosen is None and _cpu_has_amx():
        # vLLM prefers AMX_MLA there (bf16 only, blocks of 32): not checked
        # against the program; the platform decided its block size and
        # scheduling before this hook, so only the user can pin CPU_MLA.
        # A drafter's config is checked too, and vLLM never passes the
        # target's attention backend on to it.
        spec_config = vllm_config.speculative_config
        drafter = (
            f', and "attention_backend": "{name}" in --speculative-config'
            if getattr(spec_config, "draft_model_config", None) is not None
            else ""
        )
        return (
            "on a CPU with AMX vLLM picks its AMX_MLA attention backend, whose "
            "cache the backend does not read; pass --attention-backend "
            f"{name} (its block size {latent.blocks[0]} is then forced){drafter}"
        )
    cache = vllm_config.cache_config
    if cache.user_specified_block_size and not latent.takes(cache.block_size):
        return (
            f"vLLM's {name} backend runs {latent.blocks_text}, not "
            f"--block-size {cache.block_size}"
        )
    if latent is CPU_LATENT:
        widths = latent.backend.get_class().get_supported_head_sizes()
        if spec.mla.latent_width not in widths:
            # (Its decode kernel; vLLM itself would fail later, in a step.)
            return (
                f"vLLM's {name} backend takes latent rows of {widths} "
                f"(kv_lora_rank + qk_rope_head_dim), not {spec.mla.latent_width}"
            )
    # (A GPU backend checks its own combination when vLLM builds the layers,
    # and refuses it there, named, at start-up.)
    return None


def _cpu_has_amx() -> bool:
    # The condition vLLM's CPU platform prefers AMX_MLA under.
    from vllm.platforms.interface import CpuArchEnum

    return (
        current_platform.get_cpu_architecture() == CpuArchEnum.X86
        and torch.cpu._is_amx_tile_supported()
    )


def _mla_attention_layers(
    model: torch.nn.Module, spec: ModelSpec
) -> list[torch.nn.Module]:
    """Each layer's ``MLAAttention`` (inside ``DeepseekV2MLAAttention``),
    checked to run the backend the start-up check chose: its ``kv_cache``
    is the latent cache the program reads."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    name = latent_backend(envs.VLLM_MEGAKERNEL_INTERPRET).backend.name
    found = []
    for i, layer in enumerate(stage_layers(model)):
        attns = [m for m in layer.self_attn.modules() if isinstance(m, MLAAttention)]
        if len(attns) != 1:
            raise ValueError(
                f"--decode-backend megakernel: layer {i} of {spec.architecture} "
                f"has {len(attns)} MLA attention modules, expected one"
            )
        (attn,) = attns
        backend = attn.attn_backend.get_name()
        unexpected = {
            f"attention backend {backend} (expected {name})": backend != name,
            f"latent rows of {attn.head_size} (expected "
            f"{spec.mla.latent_width})": attn.head_size != spec.mla.latent_width,
            f"KV cache dtype {attn.kv_cache_dtype}": attn.kv_cache_dtype != "auto",
        }
        named = [what for what, present in unexpected.items() if present]
        if named:
            raise ValueError(
                f"--decode-backend megakernel: {attn.layer_name} was built with "
                f"{', '.join(named)}."
            )
        found.append(attn)
    return found


def _check_latent_caches(
    attentions: list[torch.nn.Module],
    kv_caches: tuple[torch.Tensor, ...],
    spec: ModelSpec,
    block_size: int,
) -> None:
    """vLLM binds the caches after the backend is made: check, at the first
    step, that each is the latent layout the program reads, in blocks of the
    size the program was built for."""
    for attn, cache in zip(attentions, kv_caches, strict=True):
        shape = tuple(cache.shape)
        if (
            cache.dim() != 3
            or shape[1:] != (block_size, spec.mla.latent_width)
            or cache.dtype != spec.dtype
        ):
            raise ValueError(
                f"--decode-backend megakernel: {attn.layer_name}'s latent cache "
                f"is {shape} {cache.dtype}, expected [num_blocks, "
                f"{block_size}, {spec.mla.latent_width}] {spec.dtype}."
            )


def _pp_rank(vllm_config: VllmConfig) -> int:
    # vLLM builds the PP group even at size 1, but tests (and tools) build the
    # backend without one.
    if vllm_config.parallel_config.pipeline_parallel_size == 1:
        return 0
    from vllm.distributed import get_pp_group

    return get_pp_group().rank_in_group


def _tp_group():
    """vLLM's TP group: the kernel's all-reduce exchanges its counters and
    partial sums in symmetric memory over it (kernel/symmetric.py)."""
    from vllm.distributed import get_tp_group

    return get_tp_group()


def _check_gpu_kernel(vllm_config: VllmConfig, spec: ModelSpec) -> None:
    """What the compiled kernel (not the reference) needs."""
    # (INT4 latent attention is refused with the spec, reference mode too:
    # an INT4 latent-attention model here keeps its attention in bf16.)
    refused = quant_refusal(spec.quant)
    if refused:
        raise ValueError(
            f"--decode-backend megakernel runs {spec.quant.name} checkpoints of "
            f"this model in reference mode only: {refused}. {INTERPRET_HINT}"
        )
    capability = tuple(current_platform.get_device_capability() or ())
    if capability not in ARCH_OF_CAPABILITY:
        raise ValueError(
            f"--decode-backend megakernel needs {SUPPORTED_GPUS}; this GPU has "
            f"{capability}. " + INTERPRET_HINT
        )
    dtype = vllm_config.model_config.dtype
    if dtype != torch.bfloat16:
        raise ValueError(
            f"--decode-backend megakernel runs bf16 models on the GPU; this one "
            f"is {dtype}: use --dtype bfloat16. " + INTERPRET_HINT
        )
    block_size = vllm_config.cache_config.block_size
    if block_size is not None and block_size % 16:
        raise ValueError(
            f"--decode-backend megakernel needs a KV block size that is a "
            f"multiple of 16, not {block_size}"
        )


def _quantized_tp_refusal(spec: ModelSpec) -> str | None:
    """The kind of quantized checkpoint the backend refuses at this tensor
    parallel size, or None. (A mixture whatever this stage's layers: with
    pipeline parallelism too, a later stage may hold its experts.)"""
    quant = spec.quant
    if quant is None or spec.tp_size == 1:
        return None
    if quant.name == FP8_BLOCK:
        return quant.name
    if spec.moe is not None:
        return f"{quant.name} mixture-of-experts"
    if spec.mla is not None:
        return f"{quant.name} latent-attention"
    return None


def _check_deployment(vllm_config: VllmConfig, spec: ModelSpec) -> None:
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    layout = vllm_envs.VLLM_KV_CACHE_LAYOUT
    moe = spec.moe is not None and any(spec.moe.sparse_layers)
    moe_backend = getattr(vllm_config.kernel_config, "moe_backend", "auto")
    speculative = vllm_config.speculative_config
    aux_drafter = speculative is not None and speculative.method == "eagle3"
    quant_tp = _quantized_tp_refusal(spec)
    unsupported = {
        # vLLM shards a mixture's experts over the data-parallel ranks and
        # exchanges tokens between them in each MoE layer; the kernel runs
        # one rank's whole mixture.
        "data parallelism with mixture-of-experts layers": (
            moe and parallel.data_parallel_size > 1
        ),
        # The kernel reads the experts in the layout the Triton backend
        # keeps (weights.moe_layout_refusal checks the layers as built).
        f"--moe-backend {moe_backend} (use auto or triton)": (
            moe and moe_backend not in ("auto", "triton")
        ),
        # Level 2 would drop the kernel's program and address table.
        "sleep mode (--enable-sleep-mode)": model.enable_sleep_mode,
        f"VLLM_KV_CACHE_LAYOUT={layout} (the kernel reads {KV_CACHE_LAYOUT.name})": (
            layout is not None and layout not in KV_CACHE_LAYOUT_NAMES
        ),
        # A checkpoint's own format is spec.quant (quant.py, refused or
        # taken by name); vLLM quantizing an unquantized one as it loads is not.
        f"--quantization {model.quantization}": (
            model.quantization is not None and spec.quant is None
        ),
        # A rank reads its shard's codes and scales as vLLM loaded them;
        # checked against vLLM's TP 2 for dense GQA models with FP8
        # per-channel and INT4 checkpoints (tests/test_e2e_parallel.py).
        # Not the rest: vLLM's CPU workers run FP8 blocks W8A16 and INT4
        # experts W4A8, not a GPU's numerics, and take no per-channel FP8
        # experts; quantized latent attention at TP has not run.
        f"{quant_tp} checkpoints with tensor parallelism": quant_tp is not None,
        # (A stage's streams are its own layers', which vLLM relays between
        # stages; not built, nor checked at TP.)
        "EAGLE-3 with tensor or pipeline parallelism": (
            aux_drafter and (spec.tp_size > 1 or not (spec.pp_first and spec.pp_last))
        ),
    }
    named = [name for name, present in unsupported.items() if present]
    if named:
        raise ValueError(
            f"--decode-backend megakernel does not support: {', '.join(named)}."
        )
