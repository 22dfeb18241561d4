# SPDX-License-Identifier: Apache-2.0
"""The GPU check's tensor-parallel case, used by device_run.py; torch only,
like it.

Lent machines have one GPU, so the case runs every rank of a TP program in
one launch whose CTAs split into rank groups (build.py --one-gpu-ranks;
vllm_ext/megakernel/kernel/ranks.py): each rank's partial sums, signals and
ALL_REDUCE go through the same flag and buffer protocol a TP deployment's
kernel runs over its peers' memory. Random weights of the whole model
(its first layers) are cut into the ranks' shards as vLLM's parallel layers
cut them (parallel.shard_weights).

Correctness, three steps (counters never reset; full, then padded): every
rank's final hidden states bit for bit the same (each ALL_REDUCE sums the
ranks in rank order, so every rank must hold the same residual stream);
each rank's against the ranks interpreted directly (RankSetInterpreter, on
the same shards), and the gathered logits against the one-rank program
on the unsharded weights, within the bf16 bound, with greedy agreement
reported. Timing: the one-launch step (CUDA events), and the same step with
its ALL_REDUCE instructions turned into NOPs that keep their waits and
signals (the exchange's data movement, not its synchronisation).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import (
    ProgramInterpreter,
    RankSetInterpreter,
    pad_inputs,
)
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.launcher import KernelLibrary
from vllm_ext.megakernel.kernel.ranks import OneLaunchRanks
from vllm_ext.megakernel.planner import Program, plan
from vllm_ext.parallel import rank_caches, shard_spec, shard_weights
from vllm_ext.testing import BLOCK_SIZE, random_decode_inputs, random_weights

STEPS = 3
CONTEXT = 600  # as device_run's correctness steps
BENCH_CONTEXT = 512  # as device_run's timings
# Each rank's output against the rank set interpreted on the same shards,
# and the gathered logits against the one-rank program: bf16 steps of
# differently ordered fp32 sums (device_run.TOLERANCE's bf16 bound); the
# one-rank comparison also rounds each rank's partial sums once more.
TOL = 2**-5


def is_ranks_case(meta: dict) -> bool:
    return meta["shape"].get("ranks_in_launch", 1) > 1


def load(case_dir: Path, layers: int | None, saved_spec) -> tuple:
    """(the unsharded model, one rank's program) as build.py planned them
    (each rank on its share of the GPU's SMs)."""
    meta = torch.load(case_dir / "program.pt")
    full = saved_spec({"spec": meta["full_spec"]})
    if layers is not None:
        full = full.with_layers(layers)
    shape = meta["shape"]
    tp = shape["tp_size"]
    h200 = DEVICES["h200"]
    device = dataclasses.replace(h200, num_sms=h200.num_sms // shape["ranks_in_launch"])
    program = plan(shard_spec(full, tp), meta["batch"], device, with_lm_head=True,
                   qkv_parts=shape.get("qkv_parts", 1),
                   combine_parts=shape.get("combine_parts", 1))  # fmt: skip
    if layers is None and not torch.equal(program.encode()[0], meta["queues"]):
        raise SystemExit("the program planned here differs from the bundle's")
    return full, program


def shards(full, weights, tp: int) -> list:
    """Each rank's weights as vLLM loads them: its own contiguous tensors."""

    def own(x):
        if isinstance(x, torch.Tensor):
            return x.contiguous()
        if isinstance(x, tuple):
            return tuple(own(v) for v in x)
        if dataclasses.is_dataclass(x):
            return dataclasses.replace(
                x, **{f.name: own(getattr(x, f.name)) for f in dataclasses.fields(x)}
            )
        return x

    return [own(shard_weights(weights, full, tp, r)) for r in range(tp)]


def rank_inputs(inputs, full, tp: int) -> list:
    caches = inputs.kv_caches
    return [
        dataclasses.replace(inputs, kv_caches=rank_caches(caches, full, tp, r))
        for r in range(tp)
    ]


def _to(inputs, dev: str):
    """The step's inputs on ``dev`` (fresh caches there)."""
    moved = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    for name, value in moved.items():
        if isinstance(value, torch.Tensor):
            moved[name] = value.to(dev)
        elif isinstance(value, tuple):
            moved[name] = tuple(c.to(dev) for c in value)
    return dataclasses.replace(inputs, **moved)


def make_ranks(case_dir: Path, program: Program, parts: list, max_blocks: int):
    lib = KernelLibrary(
        case_dir / "libmegakernel_sm_90a.so", torch.cuda.current_device()
    )
    return OneLaunchRanks(program, parts, lib.launch, block_size=BLOCK_SIZE,
                          max_blocks=max_blocks), lib  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)


def correctness(case_dir: Path, layers: int | None, saved_spec, dev: str = "cuda",
                make=make_ranks) -> dict:  # fmt: skip
    full, program = load(case_dir, layers, saved_spec)
    tp, b = program.spec.tp_size, program.batch
    weights = random_weights(full, seed=1, device=dev)
    parts = shards(full, weights, tp)
    ranks, _ = make(case_dir, program, parts, -(-CONTEXT // BLOCK_SIZE))
    direct = RankSetInterpreter(program, parts, seed=0)
    one = ProgramInterpreter(plan(full, b, DEVICES["h200"], with_lm_head=True),
                             weights, seed=0)  # fmt: skip
    steps, ok = [], True
    for step in range(STEPS):
        n = b if step == 0 else max(1, b - step)
        inputs = _to(random_decode_inputs(full, n, seed=100 + step,
                                          max_len=CONTEXT), dev)  # fmt: skip
        mine = rank_inputs(inputs, full, tp)
        ref = rank_inputs(inputs, full, tp)  # (copies of the caches)
        got = ranks.step(mine)
        want = direct.step([pad_inputs(i, b) for i in ref])
        one_out = one.step(pad_inputs(inputs, b))
        logits = torch.cat([ex.logits[:n] for ex in ranks.ranks], dim=1)
        logits = logits[:, : full.vocab_size]
        one_logits = one.logits[:n]
        same = all(torch.equal(got[0], g) for g in got[1:])
        errs = [_rel(g, w[:n]) for g, w in zip(got, want, strict=True)]
        record = {
            "batch": n,
            "ranks_bit_equal": same,
            "vs_rank_set": max(errs),
            "logits_vs_one_rank": _rel(logits, one_logits),
            "out_vs_one_rank": _rel(got[0], one_out[:n]),
            "greedy_agree": f"{int((logits.argmax(1) == one_logits.argmax(1)).sum())}"
            f"/{n}",
            "tol": TOL,
        }
        record["ok"] = same and record["vs_rank_set"] <= TOL
        ok &= record["ok"]
        steps.append(record)
    return {"ok": ok, "tp": tp, "layers": full.num_layers, "steps": steps}


def _nop_reduces(program: Program) -> Program:
    """ALL_REDUCE tiles as NOPs that keep their waits and signals."""
    queues = tuple(
        tuple(dataclasses.replace(i, op=Op.NOP) if i.op == Op.ALL_REDUCE else i
              for i in q)
        for q in program.queues
    )  # fmt: skip
    return dataclasses.replace(program, queues=queues)


def timing(case_dir: Path, layers: int | None, saved_spec, time_ms,
           graphed) -> dict:  # fmt: skip
    """device_run's ``time_ms`` and ``graphed``: each step a CUDA graph's
    replay where it captures (the stacked table's copy included)."""
    full, program = load(case_dir, layers, saved_spec)
    tp, b = program.spec.tp_size, program.batch
    weights = random_weights(full, seed=1, device="cuda")
    parts = shards(full, weights, tp)
    max_blocks = -(-BENCH_CONTEXT // BLOCK_SIZE)
    inputs = _to(random_decode_inputs(full, b, seed=7, max_len=BENCH_CONTEXT), "cuda")
    per_rank = rank_inputs(inputs, full, tp)
    result = {"tp": tp, "batch": b, "layers": full.num_layers,
              "all_reduces": sum(i.op == Op.ALL_REDUCE for q in program.queues
                                 for i in q)}  # fmt: skip
    for key, prog in (("one_launch_ms", program),
                      ("reduces_as_nops_ms", _nop_reduces(program))):  # fmt: skip
        ranks, _ = make_ranks(case_dir, prog, parts, max_blocks)

        def step(r=ranks):
            r.step(per_rank)

        replay = graphed(step)
        result[key.removesuffix("_ms") + "_graph"] = replay is not None
        result[key] = time_ms(replay or step)
    points = 2 * full.num_layers + 1
    result["reduce_us_per_point"] = (
        (result["one_launch_ms"] - result["reduces_as_nops_ms"]) * 1e3 / points
    )
    result["ok"] = True
    return result


def markdown_lines(report: dict) -> list[str]:
    """The report's rows of the tensor-parallel cases (none: no lines)."""
    cases = {n: c for n, c in report["cases"].items()
             if "tp" in (c.get("correctness") or {})}  # fmt: skip
    if not cases:
        return []
    lines = [
        "",
        "Tensor parallel, every rank in one launch on this GPU (CTAs in rank "
        "groups; not a multi-GPU measurement):",
        "",
        "| case | correct | ranks bit-equal | vs rank set | logits vs one rank "
        "| greedy | one launch ms | ALL_REDUCE as NOPs ms | us a point |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in cases.items():
        steps = c["correctness"].get("steps") or [{}]
        s, t = steps[0], c.get("timing") or {}

        def f(x, spec=".3f"):
            return format(x, spec) if isinstance(x, float) else "-"

        lines.append(
            f"| {name} | {c['correctness'].get('ok')} | {s.get('ranks_bit_equal')} "
            f"| {f(s.get('vs_rank_set'), '.1e')} "
            f"| {f(s.get('logits_vs_one_rank'), '.1e')} | {s.get('greedy_agree')} "
            f"| {f(t.get('one_launch_ms'))} | {f(t.get('reduces_as_nops_ms'))} "
            f"| {f(t.get('reduce_us_per_point'), '.2f')} |"
        )
    return lines
