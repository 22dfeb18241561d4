# SPDX-License-Identifier: Apache-2.0
"""Small random-weight models built from real architectures' configs.

No model hub is needed: the weights are drawn from a seeded generator, the
tokenizer is a byte-level BPE trained on text that ships with Python. The
models are tiny (a few MB) so the whole decode path runs in tests on a CPU,
yet each one exercises a feature of the architecture it is named for.

    python -m vllm_ext.demo_models --arch qwen3 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB_SIZE = 1024

# Text to train the tokenizer on: docstrings of a few stdlib modules, so the
# vocabulary is the same on every machine with the same Python.
_CORPUS_MODULES = ("argparse", "json", "pathlib", "dataclasses", "textwrap", "string")


@dataclass(frozen=True)
class DemoArch:
    """One tiny model: the HF config class and what it exercises."""

    name: str
    config_cls: str
    features: str
    overrides: dict[str, Any] = field(default_factory=dict)


_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# DeepSeek-V3's attention and MoE fields, small. vLLM reads topk_method and
# scoring_func (without them it creates no correction bias); its CPU MoE
# needs the hidden size a multiple of 32.
_MLA: dict[str, Any] = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    # DeepSeek-V3's YaRN (frequencies, and mscale in the softmax scale).
    # Not the default rope: vLLM's CPU rotary op misrotates the [tokens,
    # heads, 64] q_pe the MLA layer hands it (it is right on [tokens,
    # heads * 64] or one head), so vLLM's own decode of such a model is not
    # HF's; YaRN's rope runs in PyTorch (docs/design.md).
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

DEMO_ARCHS: dict[str, DemoArch] = {
    a.name: a
    for a in (
        DemoArch(
            "llama",
            "LlamaConfig",
            "GQA (4 q / 2 kv heads), head dim 64, untied LM head",
            dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        ),
        DemoArch(
            "mistral",
            "MistralConfig",
            "GQA (2 q / 1 kv head), head dim 128, untied LM head",
            dict(
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=128,
                sliding_window=None,
            ),
        ),
        DemoArch(
            "qwen2",
            "Qwen2Config",
            "QKV bias, MHA (4 q / 4 kv heads), head dim 64, tied embeddings",
            dict(
                num_attention_heads=4,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                use_sliding_window=False,
            ),
        ),
        DemoArch(
            "qwen3",
            "Qwen3Config",
            "QK norm, GQA (4 q / 2 kv heads), head dim 128, tied embeddings",
            dict(
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=128,
                tie_word_embeddings=True,
            ),
        ),
        DemoArch(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "mixture of experts (8 experts, top 2, renormalised) after a dense "
            "first layer (mlp_only_layers), QK norm, GQA (4 q / 2 kv heads)",
            dict(
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[0],
            ),
        ),
        DemoArch(
            "mixtral",
            "MixtralConfig",
            "mixture of experts in every layer (4 experts, top 2), GQA "
            "(4 q / 2 kv heads), head dim 64",
            dict(
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=256,
                sliding_window=None,
            ),
        ),
        # Multi-head latent attention: kv_lora_rank 512 and rope dims 64 (a
        # 576-wide latent row) are what vLLM's CPU MLA decode kernel takes.
        DemoArch(
            "deepseek_v3",
            "DeepseekV3Config",
            "multi-head latent attention (4 heads, q_proj without a q LoRA, "
            "YaRN, 576-wide latent cache rows), every layer's MLP dense",
            dict(_MLA, q_lora_rank=None, first_k_dense_replace=2),
        ),
        DemoArch(
            "deepseek_v3_moe",
            "DeepseekV3Config",
            "multi-head latent attention with a q LoRA (fused with kv_a), YaRN, "
            "a dense first layer then a mixture (8 experts in 4 groups, top 2 "
            "of the best 2 groups, sigmoid scores, correction bias, a shared "
            "expert)",
            dict(_MLA, q_lora_rank=96, first_k_dense_replace=1),
        ),
        # DeepSeek-V3's shapes as its FP8 checkpoint has them
        # (demo_quant.py's fp8-block): vLLM's FP8 loader wants whole
        # 128x128 blocks in a fused layer's every part but the last and in
        # the experts' width, so a q LoRA and experts of 128; kv_a's 576
        # rows end in half a block, as DeepSeek-V3's do.
        DemoArch(
            "deepseek_v3_fp8",
            "DeepseekV3Config",
            "deepseek_v3_moe with a q LoRA of 128 and experts (and the shared "
            "expert) 128 wide, the shapes of DeepSeek-V3's FP8 blocks",
            dict(
                _MLA,
                q_lora_rank=128,
                moe_intermediate_size=128,
                first_k_dense_replace=1,
            ),
        ),
    )
}


def _corpus() -> list[str]:
    import importlib

    lines: list[str] = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc:
                lines.extend(doc.splitlines())
    return lines


def build_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Train a byte-level BPE tokenizer of VOCAB_SIZE tokens and save it,
    padded with reserved special tokens up to ``vocab_size`` (as real models
    pad theirs), so every id the model can produce decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(fast))]
    if reserved:
        fast.add_special_tokens({"additional_special_tokens": reserved})
    fast.save_pretrained(out)


def hf_config(arch: str, vocab_size: int = VOCAB_SIZE):
    """The HF config of demo architecture ``arch`` (no files written)."""
    import transformers

    spec = DEMO_ARCHS[arch]
    model_cls = spec.config_cls.replace("Config", "ForCausalLM")
    # (A copy: a config class may normalise nested dicts in place.)
    overrides = copy.deepcopy(spec.overrides)
    return getattr(transformers, spec.config_cls)(
        **{**_COMMON, **overrides, "vocab_size": vocab_size},
        architectures=[model_cls],
    )


def build_model(
    arch: str, out: str | Path, seed: int = 0, vocab_size: int = VOCAB_SIZE
) -> Path:
    """Write a tiny random-weight model of `arch` (a DEMO_ARCHS key) to `out`.

    ``vocab_size`` above the tokenizer's 1024 pads the vocabulary (for tools
    that draw random token ids, like ``vllm bench latency``: ids < 10000).

    Idempotent: a directory that already holds this model is left alone.
    """
    if arch not in DEMO_ARCHS:
        raise ValueError(
            f"unknown demo architecture {arch!r}; choose one of {sorted(DEMO_ARCHS)}"
        )
    spec = DEMO_ARCHS[arch]
    out = Path(out)
    stamp = out / "demo_model.json"
    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {VOCAB_SIZE}")
    meta = {"arch": arch, "seed": seed, "features": spec.features}
    if vocab_size != VOCAB_SIZE:
        meta["vocab_size"] = vocab_size
    if stamp.exists() and json.loads(stamp.read_text()) == meta:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # One writer at a time: parallel test workers ask for the same models.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.exists() and json.loads(stamp.read_text()) == meta):
            _write_model(arch, out, seed, vocab_size)
            # Whole or absent to readers that do not take the lock.
            stamp.with_suffix(".tmp").write_text(json.dumps(meta))
            stamp.with_suffix(".tmp").replace(stamp)
    return out


def _write_model(arch: str, out: Path, seed: int, vocab_size: int) -> None:
    import torch
    import transformers

    config = hf_config(arch, vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Norm weights start at 1; draw them too, so a wrong norm cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        # DeepSeek's routing correction bias starts at 0: draw it, so that
        # selecting with it and weighting without it are both exercised.
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(out)
    build_tokenizer(out, vocab_size)


def with_mtp_layer(src: str | Path, out: str | Path, seed: int = 1) -> Path:
    """Copy DeepSeek-V3 demo model ``src`` to ``out`` with one multi-token
    prediction layer (``num_nextn_predict_layers: 1``), as DeepSeek-V3 ships
    it: at index ``num_hidden_layers``, a decoder layer (a copy of the last
    one, in the same tensors' shapes) with ``enorm``, ``hnorm``, ``eh_proj``
    and ``shared_head`` (norm and LM head) of its own, drawn at random."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = load_file(src / "model.safetensors")
    prefix = f"model.layers.{last}."
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            tensors[f"model.layers.{mtp}." + name[len(prefix) :]] = t.clone()
    gen = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    head = f"model.layers.{mtp}."
    tensors[head + "enorm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors[head + "hnorm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors[head + "eh_proj.weight"] = draw(hidden, 2 * hidden)
    tensors[head + "shared_head.norm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors[head + "shared_head.head.weight"] = draw(vocab, hidden)
    save_file(tensors, out / "model.safetensors")
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def eagle_drafter(
    target: str | Path, out: str | Path, seed: int = 2,
    aux_layers: tuple[int, ...] | None = None,
) -> Path:  # fmt: skip
    """Write an EAGLE drafter for Llama demo model ``target`` to ``out``, as
    the checkpoints ship: the target's config with one decoder layer and
    ``fc`` over what it reads of the target; no embedding and no LM head,
    so vLLM shares the target's. EAGLE-1 (``aux_layers`` None): the layer
    has no input norm, ``fc`` reads [embedding | target hidden state].
    EAGLE-3: ``fc`` reads the target's residual streams at ``aux_layers``
    (``eagle_aux_hidden_state_layer_ids``; 0 is the embedding, the number
    of layers the stream before the final norm), the layer's attention
    [embedding | hidden state] (``midlayer``), with a final norm.

    Random weights would propose tokens the target never takes; here ``fc``
    passes the last stream it reads on (plus a tenth of a random draw of the
    rest, as do the layer's output projections), so the first draft is near
    the target's last token and repeats get accepted: acceptance counts a
    test can compare."""
    import torch
    from safetensors.torch import save_file

    target, out = Path(target), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return torch.rand(hidden, generator=gen) + 0.5

    eagle3 = aux_layers is not None
    inputs = len(aux_layers) if eagle3 else 2  # fc's inputs, each [hidden]
    qkv_in = 2 * hidden if eagle3 else hidden
    fc = [draw(hidden, hidden) / 10 for _ in range(inputs)]
    fc[-1] += torch.eye(hidden)
    layer = "midlayer." if eagle3 else "layers.0."
    tensors = {
        "fc.weight": torch.cat(fc, dim=1),
        layer + "self_attn.q_proj.weight": draw(heads * head_dim, qkv_in),
        layer + "self_attn.k_proj.weight": draw(kv_heads * head_dim, qkv_in),
        layer + "self_attn.v_proj.weight": draw(kv_heads * head_dim, qkv_in),
        layer + "self_attn.o_proj.weight": draw(hidden, heads * head_dim) / 10,
        layer + "post_attention_layernorm.weight": norm(),
        layer + "mlp.gate_proj.weight": draw(inter, hidden),
        layer + "mlp.up_proj.weight": draw(inter, hidden),
        layer + "mlp.down_proj.weight": draw(hidden, inter) / 10,
    }
    if eagle3:
        tensors[layer + "input_layernorm.weight"] = norm()
        tensors[layer + "hidden_norm.weight"] = norm()
        tensors["norm.weight"] = norm()
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    save_file(tensors, out / "model.safetensors")
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(DEMO_ARCHS), default="llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    print(build_model(args.arch, args.out, args.seed, args.vocab_size))


if __name__ == "__main__":
    main()
