# SPDX-License-Identifier: Apache-2.0
"""Plan, verify and cost the megakernel program of a model.

    python -m vllm_ext.megakernel.plan --config CONFIG.json --batch B \\
        --arch sm_90a [--device h100|h200|b200] [--json] [--interleavings N] \\
        [--tokens-per-request 1+k]

``--config`` takes a Hugging Face config.json (or the name of one in
vllm_ext/configs). ``--tokens-per-request`` plans a speculative verify step
of k drafts: B x (1 + k) rows, a latent attention's rows of a request
sharing its passes over the cache (``query_rows``); the floor and the
predicted step printed are that step's. ``--interleavings N`` also runs the
program through the reference interpreter on random weights under N random
interleavings (on a verify step's inputs with ``--tokens-per-request``) and
checks each against a plain PyTorch forward (and the interleavings against
each other, bit for bit). With ``--json`` the last line is one JSON object.
Exit codes: 0 verified (and interleavings agree), 1 not, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from vllm_ext.megakernel.cost import DEFAULT_DEVICE, DEVICES, predict
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import VerificationError, verify
from vllm_ext.model_spec import ModelSpec, UnsupportedModelError
from vllm_ext.parallel import rank_caches, shard_spec, shard_weights
from vllm_ext.runner import MAX_QUERY_LEN

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Interleaving runs on CPU: at most this many layers of the real shapes, and
# an embedding of this many rows (only the sampled ids' rows are read).
INTERPRET_LAYERS = 2
INTERPRET_VOCAB = 1024


def load_spec(config: str, dtype: torch.dtype) -> ModelSpec:
    from transformers import AutoConfig

    from vllm_ext import configs

    path = Path(config)
    if not path.exists() and config in configs.NAMES:
        path = configs.path(config)
    if not path.exists():
        raise UnsupportedModelError(f"no such config: {config}")
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from e
    return ModelSpec.from_hf_config(hf_config, dtype)


def spec_or_exit(prog: str, config: str, dtype: str, batch: int) -> ModelSpec:
    """The commands' shared input check: a clear message and exit code 2."""
    if batch < 1:
        print(f"{prog}: --batch must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    try:
        spec = load_spec(config, DTYPES[dtype])
    except UnsupportedModelError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return spec


def print_summary(result: dict, as_json: bool) -> None:
    """One line per field; with ``as_json`` the last line is the JSON."""
    for key, value in result.items():
        print(f"{key:>26}: {value}")
    if as_json:
        print(json.dumps(result))


def check_interleavings(
    program, n: int, full_spec: ModelSpec, seed: int = 0, tokens: int = 1
) -> tuple[bool, float]:
    """Interpret ``program`` (shrunk to INTERPRET_LAYERS layers; with
    tensor parallel, every rank of it) on random weights under ``n``
    interleavings, on a verify step's inputs of ``tokens`` rows a request
    (1: a decode step); compare with ReferenceExecutor of ``full_spec`` (the
    whole model). Returns (all bitwise-equal and close to the reference,
    max abs error)."""
    import dataclasses

    from vllm_ext.megakernel.interpret import RankSetInterpreter
    from vllm_ext.reference import ReferenceExecutor
    from vllm_ext.testing import random_verify_inputs, random_weights

    spec = dataclasses.replace(
        full_spec.with_layers(min(full_spec.num_layers, INTERPRET_LAYERS)),
        vocab_size=min(full_spec.vocab_size, INTERPRET_VOCAB),
    )
    tp = program.spec.tp_size
    small = plan(shard_spec(spec, tp), program.batch, program.device,
                 qkv_parts=program.qkv_parts, combine_parts=program.combine_parts,
                 query_rows=program.query_rows)  # fmt: skip
    verify(small)
    weights = random_weights(spec, seed=seed)
    # Every rank (one, without tensor parallel) in one process, each on its
    # shard of the weights and its copy of the cache (paged_kv: heads).
    shards = [shard_weights(weights, spec, tp, r) for r in range(tp)]
    outs = []
    for k in range(n):
        inputs = random_verify_inputs(spec, program.batch, tokens, seed=seed)
        ranks = [
            dataclasses.replace(
                inputs, kv_caches=rank_caches(inputs.kv_caches, spec, tp, r)
            )
            for r in range(tp)
        ]
        outs.append(RankSetInterpreter(small, shards, seed=k).step(ranks)[0])
    # (The plain forward appends every row's entry before it attends, each
    # row over its own length: a verify step in one call.)
    expected = ReferenceExecutor(spec, weights).step(
        random_verify_inputs(spec, program.batch, tokens, seed=seed)
    )
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    err = float((outs[0].float() - expected.float()).abs().max())
    # fp32 sums in another order (split-KV attention) vs the plain forward.
    tol = 1e-3 if spec.dtype == torch.float32 else 0.1
    return same and err <= tol and not outs[0].isnan().any(), err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--arch", choices=sorted(DEFAULT_DEVICE), default="sm_90a")
    parser.add_argument("--device", choices=sorted(DEVICES))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--no-lm-head",
        dest="lm_head",
        action="store_false",
        help="stop at the final norm (vLLM's LM head computes the logits)",
    )
    parser.add_argument(
        "--whole-heads",
        action="store_true",
        help="QKV tiles of whole heads instead of the parts that fill the SMs "
        "(the GPU check's comparison case)",
    )
    parser.add_argument(
        "--dependency-us",
        type=float,
        help="the cost model's wait latency per dependency, in us (the "
        "device table's by default)",
    )
    parser.add_argument(
        "--tokens-per-request",
        type=int,
        default=1,
        help="query rows a request: 1 + the drafts of a speculative verify "
        "step (each token a row of the program: vllm_ext/runner.py)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: plan one rank's program (vllm_ext/parallel.py)",
    )
    parser.add_argument("--interleavings", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.tokens_per_request <= MAX_QUERY_LEN:
        print(f"plan: --tokens-per-request must be 1 to {MAX_QUERY_LEN}",
              file=sys.stderr)  # fmt: skip
        return 2

    device = DEVICES[args.device or DEFAULT_DEVICE[args.arch]]
    if device.arch != args.arch:
        print(f"plan: --device {device.name} is {device.arch}", file=sys.stderr)
        return 2
    if args.dependency_us is not None:
        if args.dependency_us < 0:
            print("plan: --dependency-us must be at least 0", file=sys.stderr)
            return 2
        latency = args.dependency_us * 1e-6
        device = dataclasses.replace(device, dependency_latency_s=latency)
    full = spec = spec_or_exit("plan", args.config, args.dtype, args.batch)
    if args.tp < 1:
        print("plan: --tp must be at least 1", file=sys.stderr)
        return 2
    try:
        spec = shard_spec(spec, args.tp)
    except UnsupportedModelError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2

    parts = 1 if args.whole_heads else None
    rows = args.batch * args.tokens_per_request
    t0 = time.perf_counter()
    try:
        # (plan() keeps query_rows 1 without a latent attention: a
        # grouped-query ATTN reads a request's cache once a row.)
        program = plan(spec, rows, device, with_lm_head=args.lm_head,
                       qkv_parts=parts,
                       query_rows=args.tokens_per_request)  # fmt: skip
    except ValueError as e:  # whole heads the model cannot take (planner.py)
        print(f"plan: {e}", file=sys.stderr)
        return 2
    plan_s = time.perf_counter() - t0
    try:
        verify(program)
        verified, problem = True, None
    except VerificationError as e:
        verified, problem = False, str(e)
    pred = predict(program) if verified else None
    counts = [len(q) for q in program.queues]
    result = {
        "config": args.config,
        "arch": args.arch,
        "device": device.name,
        "batch": args.batch,
        "tokens_per_request": args.tokens_per_request,
        "tp": args.tp,
        "rows": rows,
        "dtype": args.dtype,
        "verified": verified,
        "num_sms": device.num_sms,
        "num_instructions": program.num_instructions,
        "num_counters": program.num_counters,
        "attn_chunks": program.attn_chunks,
        "qkv_parts": program.qkv_parts,
        "combine_parts": program.combine_parts,
        "instructions_per_sm": [min(counts), max(counts)],
        "weight_bytes": program.weight_bytes(),
        "plan_s": round(plan_s, 3),
    }
    if spec.mla is not None:
        # The latent attention's split (planner.mla_split) and the rows a
        # request its MLA_ATTN passes over the cache together.
        result.update(
            mla_head_groups=program.mla_head_groups,
            mla_v_parts=program.mla_v_parts,
            query_rows=program.query_rows,
        )
    if spec.moe is not None:
        # What a step of a mixture reads depends on the routing: each sparse
        # layer's experts are counted at the expected number of distinct
        # ones under uniform routing (weight_bytes and the floor).
        result.update(
            expert_slots=program.num_slots,
            expected_experts=round(program.expected_experts, 2),
            planned_slots_filled=program.occupied_slots,
        )
    if pred is not None:
        result.update(
            dependency_us=round(device.dependency_latency_s * 1e6, 2),
            predicted_us=round(pred.step_s * 1e6, 1),
            floor_us=round(pred.floor_s * 1e6, 1),
            fraction_of_floor=round(pred.fraction_of_floor, 3),
            critical_path_us=round(pred.critical_path_s * 1e6, 1),
            weight_bytes_per_sm=[min(pred.sm_weight_bytes), max(pred.sm_weight_bytes)],
        )
    if args.interleavings and verified:
        ok, err = check_interleavings(
            program, args.interleavings, full, tokens=args.tokens_per_request
        )
        result.update(interleavings_ok=ok, interleavings=args.interleavings)
        result["interleavings_max_abs_err"] = err

    if problem:
        print(f"NOT VERIFIED: {problem}")
    print_summary(result, args.json)
    return 0 if verified and result.get("interleavings_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
