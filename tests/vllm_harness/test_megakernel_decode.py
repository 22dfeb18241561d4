# SPDX-License-Identifier: Apache-2.0
"""Greedy decoding through `--decode-backend megakernel` must match the
default path, checked with vLLM's own harness (`vllm_runner`,
`example_prompts`, `check_outputs_equal`, `check_logprobs_close`).

Not collected with this project's tests: `scripts/vllm_harness.sh` copies it
into vLLM's v0.32.0 `tests/models/language/generation/` (its relative
imports are vLLM's) and runs it there against the installed, patched vLLM.
The tiny random-weight demo models are built locally (no model hub), one per
supported architecture. On CPU the backend runs its PyTorch reference
executor (`VLLM_MEGAKERNEL_INTERPRET=1`).

Every test also checks that the decode steps really went through the backend
(vLLM's `vllm:decode_backend_steps`: every decode-only step ran, none was
declined), so a silent fallback to `model.forward` cannot pass.
"""

import pytest
import regex as re
from vllm import SamplingParams
from vllm.platforms import current_platform

from vllm_ext import demo_models

from ...utils import check_logprobs_close, check_outputs_equal

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

INTERPRET_ENV = "VLLM_MEGAKERNEL_INTERPRET"
MAX_MODEL_LEN = 512
NUM_LOGPROBS = 5
# The megakernel reads a KV cache of blocks of a multiple of 16 tokens
# (FlashAttention's layout on GPU, the MEGAKERNEL attention backend on CPU).
# Use the smallest, so that decoding crosses as many blocks as possible. The
# default path keeps vllm_runner's block size (CPU_ATTN needs a multiple of 32).
MEGAKERNEL_BLOCK_SIZE = 16

requires_cpu_fp32 = pytest.mark.skipif(
    not current_platform.is_cpu(),
    reason="On GPU the megakernel reads FlashAttention's KV cache, which has "
    "no fp32 kernels; fp32 runs only in the CPU reference executor.",
)


@pytest.fixture(scope="module")
def demo_model_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("megakernel_demo_models")


def _demo_model(root, arch: str) -> str:
    return str(demo_models.build_model(arch, root / arch))


@pytest.fixture
def megakernel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep the engine in this process, so that the test can find the decode
    # backend on the model runner.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if current_platform.is_cpu():
        monkeypatch.setenv(INTERPRET_ENV, "1")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


def _runner_kwargs(dtype: str, megakernel: bool) -> dict:
    kwargs = dict(
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        # vllm:decode_backend_steps, read through LLM.get_metrics().
        disable_log_stats=False,
    )
    if megakernel:
        kwargs.update(decode_backend="megakernel", block_size=MEGAKERNEL_BLOCK_SIZE)
    return kwargs


def _greedy_params(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    # ignore_eos: every request generates exactly `max_tokens` tokens, so the
    # number of decode steps the backend must have run is known.
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True
    )


def _greedy(vllm_model, prompts, max_tokens: int) -> list[tuple[list[int], str]]:
    outputs = vllm_model.generate(prompts, _greedy_params(max_tokens))
    return [(output_ids[0], output_str[0]) for output_ids, output_str in outputs]


def _greedy_logprobs(vllm_model, prompts, max_tokens: int):
    return vllm_model.generate_w_logprobs(
        prompts, _greedy_params(max_tokens, NUM_LOGPROBS)
    )


def _decode_backend(vllm_model):
    llm_engine = vllm_model.get_llm().llm_engine
    runner = llm_engine.model_executor.driver_worker.worker.model_runner
    return runner.decode_backend


def _assert_decoded_by_backend(vllm_model, max_tokens: int):
    backend = _decode_backend(vllm_model)
    assert backend is not None, "--decode-backend megakernel created no backend"
    # All prompts are prefilled in the first step, which yields their first
    # token through model.forward; every later step is decode-only and must
    # have run through the backend (vLLM's count, none declined).
    steps = {
        (m.labels["outcome"], m.labels["reason"]): m.value
        for m in vllm_model.get_llm().get_metrics()
        if m.name == "vllm:decode_backend_steps" and m.value
    }
    assert steps == {("ran", "none"): max_tokens - 1}, steps


def _run_default_and_megakernel(
    vllm_runner, model: str, dtype: str, generate, prompts, max_tokens: int
):
    with vllm_runner(model, **_runner_kwargs(dtype, megakernel=False)) as vllm_model:
        assert _decode_backend(vllm_model) is None
        default_outputs = generate(vllm_model, prompts, max_tokens)

    with vllm_runner(model, **_runner_kwargs(dtype, megakernel=True)) as vllm_model:
        megakernel_outputs = generate(vllm_model, prompts, max_tokens)
        _assert_decoded_by_backend(vllm_model, max_tokens)

    return default_outputs, megakernel_outputs


@requires_cpu_fp32
@pytest.mark.cpu_model
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("max_tokens", [32])
def test_megakernel_fp32_greedy_equal(
    vllm_runner,
    example_prompts,
    megakernel_env,
    demo_model_root,
    arch: str,
    max_tokens: int,
) -> None:
    """fp32: exactly the greedy tokens of the default path."""
    default_outputs, megakernel_outputs = _run_default_and_megakernel(
        vllm_runner,
        _demo_model(demo_model_root, arch),
        "float32",
        _greedy,
        example_prompts,
        max_tokens,
    )

    check_outputs_equal(
        outputs_0_lst=default_outputs,
        outputs_1_lst=megakernel_outputs,
        name_0="default",
        name_1="megakernel",
    )


@pytest.mark.cpu_model
@pytest.mark.parametrize("arch", ["qwen3"])
@pytest.mark.parametrize("max_tokens", [32])
def test_megakernel_bf16_logprobs_close(
    vllm_runner,
    example_prompts,
    megakernel_env,
    demo_model_root,
    arch: str,
    max_tokens: int,
) -> None:
    """bf16: greedy tokens may diverge after a rounding difference, but where
    they do, each path's token must be among the other's top logprobs."""
    default_outputs, megakernel_outputs = _run_default_and_megakernel(
        vllm_runner,
        _demo_model(demo_model_root, arch),
        "bfloat16",
        _greedy_logprobs,
        example_prompts,
        max_tokens,
    )

    check_logprobs_close(
        outputs_0_lst=default_outputs,
        outputs_1_lst=megakernel_outputs,
        name_0="default",
        name_1="megakernel",
    )


@pytest.mark.cpu_model
@pytest.mark.parametrize("arch", ["llama"])
# Lengths just below, at and above KV block boundaries. With 40 new tokens
# every request crosses two or more blocks while decoding; seven requests
# make a batch that is not a power of two.
@pytest.mark.parametrize("prompt_lens", [[1, 15, 16, 17, 31, 33, 48]])
@pytest.mark.parametrize("max_tokens", [40])
def test_megakernel_batch_crosses_kv_blocks(
    vllm_runner,
    megakernel_env,
    demo_model_root,
    arch: str,
    prompt_lens: list[int],
    max_tokens: int,
) -> None:
    """Concurrent requests of different lengths decode together in one batch,
    each growing across KV cache blocks. Exact in fp32 (CPU), close in bf16."""
    # Fixed token ids past the special ones (<pad>, <s>, </s>).
    vocab_size = demo_models.VOCAB_SIZE
    prompts = [
        [3 + (7 * n + 13 * i) % (vocab_size - 3) for i in range(n)] for n in prompt_lens
    ]
    exact = current_platform.is_cpu()

    default_outputs, megakernel_outputs = _run_default_and_megakernel(
        vllm_runner,
        _demo_model(demo_model_root, arch),
        "float32" if exact else "bfloat16",
        _greedy if exact else _greedy_logprobs,
        prompts,
        max_tokens,
    )

    check = check_outputs_equal if exact else check_logprobs_close
    check(
        outputs_0_lst=default_outputs,
        outputs_1_lst=megakernel_outputs,
        name_0="default",
        name_1="megakernel",
    )


@pytest.mark.cpu_model
@pytest.mark.skipif(
    not current_platform.is_cpu(), reason="Only a CPU needs the reference executor."
)
def test_megakernel_cpu_requires_interpret(
    vllm_runner,
    monkeypatch: pytest.MonkeyPatch,
    demo_model_root,
) -> None:
    """Without VLLM_MEGAKERNEL_INTERPRET=1 a CPU engine refuses to start, and
    the error says how to run the reference executor instead."""
    model = _demo_model(demo_model_root, "llama")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv(INTERPRET_ENV, raising=False)

    with (
        pytest.raises(ValueError, match=re.escape(f"{INTERPRET_ENV}=1")),
        vllm_runner(model, **_runner_kwargs("float32", megakernel=True)),
    ):
        pass
