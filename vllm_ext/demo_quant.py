# SPDX-License-Identifier: Apache-2.0
"""Quantized checkpoints of the demo models, in the layouts vLLM's loaders
read: INT4 weight-only (W4A16), symmetric, group-wise, as compressed-tensors
``pack-quantized`` and as GPTQ; FP8 e4m3 with a scale per output channel
and dynamic per-token activations (W8A8), as compressed-tensors
``float-quantized``.

Every linear layer of the decoder is quantized (attention, dense MLP,
experts); the embedding, LM head, norms and MoE router stay as they are,
as the real checkpoints leave them (``ignore: [lm_head]``, the router in
higher precision). ``pack-quantized-experts`` quantizes a mixture's routed
experts only, as Kimi-K2-Thinking's checkpoint does (its ``ignore`` list
leaves attention, dense MLPs and shared experts in the model dtype).
INT4: a weight is ``q * s``, ``s`` the group's largest magnitude over 7,
rounded to bf16, ``q = round(w / s)`` in [-8, 7]. FP8: ``s`` the output
channel's largest magnitude over 448 (fp32), the weight ``w / s`` rounded
to e4m3.

    python -m vllm_ext.demo_quant --src DEMO_MODEL --out DIR --format gptq
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

FORMATS = ("pack-quantized", "pack-quantized-experts", "gptq", "fp8-channel",
           "fp8-block")  # fmt: skip
# As the real checkpoints.
GROUP_SIZE = {"pack-quantized": 32, "pack-quantized-experts": 32, "gptq": 64}
# Weights left unquantized: vLLM's loaders keep these in the model dtype.
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "e_score_correction_bias")
# compressed-tensors' names of those layers: the LM head, and in a mixture
# the router (a Linear too).
IGNORE = ["lm_head"]
ROUTER = "re:.*mlp[.]gate$"
# Kimi-K2-Thinking's: everything but the routed experts.
EXPERTS_ONLY_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]
# A routed expert's weights (not a shared expert's).
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (codes int8 ``[N, K]`` in [-8, 7], scales bf16
    ``[N, K / group_size]``), symmetric per group of K."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / 7).clamp(min=2**-20).to(torch.bfloat16)
    codes = torch.round(groups / scales.float()[..., None]).clamp(-8, 7)
    return codes.to(torch.int8).view(n, k), scales


def _pack_quantized(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors ``pack-quantized``: eight 4-bit codes (offset by
    8) per int32 along K, scales ``[N, K / g]``, and the original shape."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes, scales = quantize_int4(weight, GROUP_SIZE["pack-quantized"])
    base = name.removesuffix(".weight")
    return {
        f"{base}.weight_packed": pack_to_int32(codes, 4),
        f"{base}.weight_scale": scales,
        f"{base}.weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
    }


def _gptq(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ (v1 format, symmetric, no act-order): unsigned codes (q + 8)
    eight per int32 along K, ``qweight [K / 8, N]``; ``scales [K / g, N]``
    fp16; zero points stored minus one (8 - 1); ``g_idx`` each input's
    group."""
    g = GROUP_SIZE["gptq"]
    codes, scales = quantize_int4(weight, g)
    unsigned = (codes.to(torch.int32) + 8).t().contiguous()  # [K, N]
    k, n = unsigned.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight = (unsigned.view(k // 8, 8, n) << shifts[None, :, None]).sum(dim=1)
    zeros = torch.full((k // g, n // 8), 0x77777777, dtype=torch.int64)
    base = name.removesuffix(".weight")
    return {
        f"{base}.qweight": qweight.to(torch.int32),
        f"{base}.qzeros": zeros.to(torch.int32),
        f"{base}.scales": scales.t().contiguous().to(torch.float16),
        f"{base}.g_idx": torch.arange(k, dtype=torch.int32) // g,
    }


def _fp8_channel(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors ``float-quantized``: e4m3 ``[N, K]``, fp32 scales
    ``[N, 1]``."""
    top = torch.finfo(torch.float8_e4m3fn).max
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / top).clamp(min=2**-20)
    base = name.removesuffix(".weight")
    return {
        name: (weight.float() / scale).to(torch.float8_e4m3fn),
        f"{base}.weight_scale": scale,
    }


def _fp8_block(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's FP8: e4m3 ``[N, K]``, an fp32 scale a 128x128 block
    (``weight_scale_inv`` ``[ceil(N / 128), ceil(K / 128)]``: the
    dequantized weight is codes times it). A last block that is partial (N
    or K not a multiple of 128: DeepSeek-V3's 576-row kv_a) is scaled by
    its own elements' largest magnitude (zero padding, then cut)."""
    n, k = weight.shape
    rows, cols = -(-n // 128) * 128, -(-k // 128) * 128
    padded = torch.zeros(rows, cols)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows // 128, 128, cols // 128, 128)
    top = torch.finfo(torch.float8_e4m3fn).max
    scale = (blocks.abs().amax(dim=(1, 3)) / top).clamp(min=2**-20)
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    codes = codes.view(rows, cols)[:n, :k].contiguous()
    return {name: codes, name.replace(".weight", ".weight_scale_inv"): scale}


def quantization_config(fmt: str, layers: int = 0, mixture: bool = False) -> dict:
    if fmt == "fp8-block":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}  # fmt: skip
        if mixture:  # vLLM's fp8 method names its layers exactly
            config["modules_to_not_convert"] = [
                f"model.layers.{i}.mlp.gate" for i in range(layers)
            ]
        return config
    if fmt == "fp8-channel":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": IGNORE + [ROUTER] * mixture,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": fp8 | {"strategy": "channel", "dynamic": False},
                    "input_activations": fp8 | {"strategy": "token", "dynamic": True},
                    "output_activations": None,
                }
            },
        }
    g = GROUP_SIZE[fmt]
    ignore = IGNORE + [ROUTER] * mixture
    if fmt == "pack-quantized-experts":
        ignore = EXPERTS_ONLY_IGNORE + [ROUTER] * mixture
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": True,
                "desc_act": False, "checkpoint_format": "gptq"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ignore,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": g,
                    "dynamic": False,
                    "actorder": None,
                },  # fmt: skip
                "input_activations": None,
                "output_activations": None,
            }
        },
    }


def quantize_checkpoint(src: str | Path, out: str | Path, fmt: str) -> Path:
    """Write ``src`` (a demo model) quantized in format ``fmt`` to ``out``."""
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json", "demo_model.json"):
            shutil.copy(f, out / f.name)
    tensors = {}
    quantize = {"gptq": _gptq, "pack-quantized": _pack_quantized,
                "pack-quantized-experts": _pack_quantized,
                "fp8-channel": _fp8_channel, "fp8-block": _fp8_block}[fmt]  # fmt: skip
    experts_only = fmt == "pack-quantized-experts"
    for name, t in load_file(src / "model.safetensors").items():
        if (
            t.dim() == 2
            and name.endswith(".weight")
            and not any(keep in name for keep in KEEP)
            and (ROUTED_EXPERT.search(name) or not experts_only)
        ):
            tensors.update(quantize(name, t))
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    mixture = any(k in config for k in ("num_experts", "num_local_experts",
                                        "n_routed_experts"))  # fmt: skip
    config["quantization_config"] = quantization_config(
        fmt, config["num_hidden_layers"], mixture
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = json.loads((src / "demo_model.json").read_text()) | {"quant": fmt}
    (out / "demo_model.json").write_text(json.dumps(meta))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="a demo model directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--format", choices=FORMATS, default="pack-quantized")
    args = parser.parse_args()
    print(quantize_checkpoint(args.src, args.out, args.format))


if __name__ == "__main__":
    main()
