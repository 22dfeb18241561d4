# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_ext.megakernel.plan`: the command people run."""

import contextlib
import io
import json
import subprocess
import sys

import pytest

from vllm_ext import configs
from vllm_ext.megakernel.plan import main


def command(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vllm_ext.megakernel.plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def run(*args: str) -> subprocess.CompletedProcess:
    """The command's ``main`` in this process, its output captured (CI time:
    its imports once; test_json_summary runs the command itself)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_json_summary():
    # (--interleavings: test_program_variants_verify_and_interpret; CI time.)
    result = command(
        "--config", str(configs.path("qwen2.5-0.5b")), "--batch", "4",
        "--arch", "sm_90a", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True and "interleavings_ok" not in summary
    assert summary["device"] == "h200" and summary["num_sms"] == 132
    assert summary["num_instructions"] > 0
    assert 0 < summary["floor_us"] < summary["predicted_us"]


def test_whole_heads_verify_and_interpret():
    """--whole-heads: the program of the GPU check's comparison case,
    verified, costed and interpreted under two interleavings, beside the
    default's head parts."""
    for flags, parts in (((), 2), (("--whole-heads",), 1)):
        result = run(
            "--config", "llama-3.2-1b", "--batch", "2", "--arch", "sm_90a",
            "--json", "--interleavings", "2", *flags,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["verified"] is True and summary["interleavings_ok"] is True
        assert summary["qkv_parts"] == parts and summary["combine_parts"] == 4
        assert "fused_combine" not in summary


def test_blackwell_default_device():
    result = run(
        "--config", "llama-3.2-1b", "--batch", "1", "--arch", "sm_100a", "--json"
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and summary["device"] == "b200"
    assert summary["num_sms"] == 148


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
            "not supported",
        ),
        ({"head_dim": 96}, "head dim 96"),
    ],
)
def test_unsupported_config_exits_2(tmp_path, changes, message):
    config = {**configs.load("llama-3.2-1b"), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run("--config", str(path), "--batch", "1", "--arch", "sm_90a")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_mixtures_of_experts_plan_verify_and_cost(config):
    """The real MoE shapes: planned, verified and costed with the experts a
    step reads (expected distinct ones under uniform routing). (The
    interpreter runs MoE programs of the demo models: test_interpret.py.)"""
    result = run("--config", config, "--batch", "4", "--arch", "sm_90a", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["verified"]
    experts, top_k = {"qwen3-30b-a3b": (128, 8), "mixtral-8x7b": (8, 2)}[config]
    assert summary["expert_slots"] == min(4 * top_k, experts)
    # 1 - (1 - k/E)^4 of the experts, per sparse layer.
    assert summary["expected_experts"] == round(
        experts * (1 - (1 - top_k / experts) ** 4), 2
    )
    assert 0 < summary["floor_us"] < summary["predicted_us"]


def test_dependency_latency_is_stated_and_costs_time():
    """Predictions are stated at 1, 2 and 5 us per dependency (none of them
    measured: the GPU measured 7-11 us per phase boundary)."""
    got = {}
    for us in ("1", "5"):
        result = run("--config", "qwen3-30b-a3b", "--batch", "1", "--json",
                     "--no-lm-head", "--dependency-us", us)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        got[us] = json.loads(result.stdout.strip().splitlines()[-1])
        assert got[us]["dependency_us"] == float(us)
        assert got[us]["planned_slots_filled"] == 8
    assert got["1"]["floor_us"] == got["5"]["floor_us"]
    assert got["1"]["predicted_us"] < got["5"]["predicted_us"]
    result = run("--config", "qwen3-30b-a3b", "--batch", "1", "--dependency-us", "-1")
    assert result.returncode == 2 and "at least 0" in result.stderr


@pytest.mark.parametrize(
    "config, heads, experts", [("deepseek-v3", 128, 256), ("kimi-k2", 64, 384)]
)
def test_latent_attention_plans_verifies_and_costs(config, heads, experts):
    """DeepSeek-V3 and Kimi-K2 (multi-head latent attention, DeepSeek's
    mixture with a shared expert): planned, verified and costed, the floor
    printed; at batch 1 the attention fills the SMs (planner.mla_split)."""
    result = run("--config", config, "--batch", "1", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["verified"] and summary["expert_slots"] == 8
    assert "floor_us" in result.stdout.split("{")[0]
    assert summary["mla_head_groups"] * summary["attn_chunks"] == 128
    assert summary["mla_v_parts"] == {128: 1, 64: 2}[heads]
    # About 37B (DeepSeek-V3) / 32B (Kimi-K2) parameters a token reads, bf16.
    params = summary["weight_bytes"] / 2e9
    assert {256: 36 < params < 39, 384: 31 < params < 34}[experts]
    assert 0 < summary["floor_us"] < summary["predicted_us"]


def test_quantized_checkpoints_plan_with_their_bytes():
    """The planner counts a quantized checkpoint's projections at their
    bytes: Llama-3.1-8B's 6.98e9 projection weights at 1 byte (FP8, plus a
    4-byte scale a row) and half a byte (INT4, plus a bf16 scale per 128);
    embedding-free LM head, norms and the rest as in bf16."""
    sizes = {}
    for name in ("llama-3.1-8b", "llama-3.1-8b-fp8", "llama-3.1-8b-w4a16"):
        result = run("--config", name, "--batch", "1", "--arch", "sm_90a", "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        sizes[name] = json.loads(result.stdout.strip().splitlines()[-1])
    bf16 = sizes["llama-3.1-8b"]["weight_bytes"]
    h, inter, layers, kv = 4096, 14336, 32, 1024
    params = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    rows = layers * ((h + 2 * kv) + h + 2 * inter + h)
    rest = bf16 - 2 * params
    assert sizes["llama-3.1-8b-fp8"]["weight_bytes"] == rest + params + 4 * rows
    w4 = (
        rest
        + params // 2
        + layers
        * 2
        * (
            (h + 2 * kv) * h // 128
            + h * h // 128
            + 2 * inter * h // 128
            + h * inter // 128
        )
    )
    assert sizes["llama-3.1-8b-w4a16"]["weight_bytes"] == w4
    floors = [sizes[n]["floor_us"] for n in sizes]
    assert floors[0] > floors[1] > floors[2]


def test_verify_steps_plan_a_row_per_token():
    """``--tokens-per-request``: a verify step of 1 + k tokens a request is
    the program of batch x (1 + k) rows (vllm_ext/runner.py); the weights,
    so the floor, stay those of one step (a dense model)."""
    from vllm_ext.backend import MAX_QUERY_LEN

    out = {}
    for tokens in (1, 4):
        result = run("--config", "llama-3.2-1b", "--batch", "2", "--arch", "sm_90a",
                     "--tokens-per-request", str(tokens), "--json")  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        out[tokens] = json.loads(result.stdout.strip().splitlines()[-1])
    assert (out[1]["rows"], out[4]["rows"]) == (2, 8)
    assert out[1]["weight_bytes"] == out[4]["weight_bytes"]
    assert out[1]["floor_us"] == out[4]["floor_us"]
    bad = run("--config", "llama-3.2-1b", "--batch", "1",
              "--tokens-per-request", str(MAX_QUERY_LEN + 1))  # fmt: skip
    assert bad.returncode == 2 and "--tokens-per-request" in bad.stderr


def test_latent_verify_steps_plan_the_shared_pass(tmp_path):
    """``--tokens-per-request`` 1 + k on a latent attention (DeepSeek-V3's
    first two layers, both dense): the program of batch x (1 + k) rows is
    built for 1 + k rows a request (MLA_ATTN's shared pass), and each k's
    floor and predicted step are printed; the floor stays one step's."""
    config = {**configs.load("deepseek-v3"), "num_hidden_layers": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = {}
    for tokens in (1, 2, 4):
        result = run("--config", str(path), "--batch", "1", "--json",
                     "--tokens-per-request", str(tokens))  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.split("{")[0]
        assert "floor_us" in lines and "predicted_us" in lines
        out[tokens] = json.loads(result.stdout.strip().splitlines()[-1])
        assert out[tokens]["rows"] == out[tokens]["query_rows"] == tokens
        assert 0 < out[tokens]["floor_us"] < out[tokens]["predicted_us"]
    assert out[1]["floor_us"] == out[2]["floor_us"] == out[4]["floor_us"]


@pytest.mark.parametrize("tokens", [1, 3])
def test_latent_verify_steps_interpret(tmp_path, tokens):
    """``--interleavings`` with ``--tokens-per-request``: a latent
    attention's verify step (two requests of ``tokens`` rows: the shared
    pass reads the step's query map) interpreted under two interleavings,
    bit for bit alike and close to the plain forward (a DeepSeek-V3 layout
    shrunk to 4 heads, test_mla_program.py's)."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=256, hidden_size=256,
        intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, rms_norm_eps=1e-6,
        max_position_embeddings=256, q_lora_rank=96,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ).to_json_file(tmp_path / "config.json")  # fmt: skip
    result = run("--config", str(tmp_path / "config.json"), "--batch", "2",
                 "--tokens-per-request", str(tokens), "--interleavings", "2",
                 "--json")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 2 * tokens and summary["query_rows"] == tokens
    assert summary["interleavings_ok"] is True
