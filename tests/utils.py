# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the tests: caches in vLLM's layout, random paging."""

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import torch

# vLLM's default decode of the end-to-end prompts, by (model, dtype): one
# run per test session (test_e2e_offline._default).
DEFAULT_RUNS: dict = {}


def make_kv_cache(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype
) -> torch.Tensor:
    """A layer's cache as vLLM allocates it for FlashAttention (LBNHC): the
    logical view ``[blocks, kv_heads, block_size, 2*head_dim]`` over memory
    ordered ``[blocks, block_size, kv_heads, 2*head_dim]``. Filled with NaN,
    so a read of a slot nobody wrote poisons the result."""
    phys = torch.full(
        (num_blocks, block_size, num_kv_heads, 2 * head_dim), float("nan"), dtype=dtype
    )
    return phys.permute(0, 2, 1, 3)


def random_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Disjoint, shuffled physical blocks for each sequence, int32 like vLLM's."""
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start : start + n]
        start += n
    return table


def slots_of(block_table: torch.Tensor, positions: list[int], block_size: int):
    """vLLM's slot mapping of token ``positions[i]`` of sequence ``i``."""
    return torch.tensor(
        [
            int(block_table[i, p // block_size]) * block_size + p % block_size
            for i, p in enumerate(positions)
        ],
        dtype=torch.int64,
    )


def check_logprobs_close(
    outputs_0,
    outputs_1,
    name_0: str,
    name_1: str,
    routing_ties: set[tuple[int, int]] = frozenset(),
) -> None:
    """vLLM's rule for comparing greedy runs at low precision: where two
    sequences first part, each one's token must be among the other's top
    logprobs at that step; after that they are not compared.

    ``outputs_*``: lists of (token_ids, logprobs) with logprobs a list of
    {token_id: logprob} per step. ``routing_ties``: (request, step) pairs
    routed at a near tie (RoutingMargins), where they may part freely.
    """
    for i, ((ids_0, lp_0), (ids_1, lp_1)) in enumerate(
        zip(outputs_0, outputs_1, strict=True)
    ):
        for step, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=True)):
            if t0 == t1:
                continue
            if (i, step) in routing_ties:
                break
            assert t0 in lp_1[step], (
                f"prompt {i} step {step}: {name_0} picked {t0}, which is not in "
                f"{name_1}'s top logprobs {lp_1[step]}"
            )
            assert t1 in lp_0[step], (
                f"prompt {i} step {step}: {name_1} picked {t1}, which is not in "
                f"{name_0}'s top logprobs {lp_0[step]}"
            )
            break


# The project's bf16 rule (stronger than vLLM's, which check_logprobs_close
# keeps for the harness): while two greedy streams agree, the chosen token's
# logprob in each within BF16_LOGPROB_TOL; they may part only at a near tie
# of each stream's own distribution: its pick and the other's within
# BF16_TIE of logprob. Both are two bf16 rounding steps of a logit below 8
# in magnitude (8 significant bits: a step of 2^-5 there), the logits being
# bf16 on both sides and a logprob a logit minus a log-sum-exp. Measured
# (reference mode against vLLM's default decode, the CI demo models): the
# dense models at most 0.031 apart, and parting where the picks are at most
# 0.031 apart.
BF16_LOGPROB_TOL = 2**-4
BF16_TIE = 2**-4
# With FP8 activations (W8A8: every layer's input rounded per token to e4m3,
# 3 mantissa bits) a bf16 step's difference in an input can move it by an
# e4m3 step, 32 times more: both bounds become 2^-2. Measured (the Llama
# demo as compressed-tensors FP8, bf16): vLLM's default decode against
# itself with only its attention's arithmetic changed (the MEGAKERNEL
# attention backend) 0.103 apart at most, parting at gaps up to 0.109;
# reference mode against vLLM's default decode 0.108 and 0.19.
FP8_ACT_TOL = 2**-2


# A routing near tie: two experts (or the last group kept and the first
# dropped) whose selection scores are within ROUTING_TIE, where bf16 noise
# upstream of the router may pick either. The bound: two bf16 rounding steps
# of a router logit below 4 in magnitude (2 x 2^-6) times the greatest slope
# of a sigmoid or softmax score (1/4). A group scored as the sum of its best
# two counts half its margin (twice the noise). Measured (DeepSeek's demo
# mixture, reference mode against vLLM's default decode): router logits at
# most 0.0195 apart; the two steps that part from vLLM's tokens route at a
# margin of 0.0033 and 0.0014.
ROUTING_TIE = 2**-7
# With FP8 activations upstream of the router, a bf16 step that flips an
# e4m3 rounding (an eighth of the value) moves router logits further.
# Measured (the DeepSeek FP8-block demo, reference mode against vLLM's
# default decode): streams part at routing margins of 0.020 and below; with
# the reference's RMSNorm rounded as vLLM's the same run parts only at
# gaps <= 0.047, vLLM's own noise (its GEMM's fp32 order changed: 0.047).
FP8_ROUTING_TIE = 2**-5


def routing_margin(logits: torch.Tensor, moe, correction_bias=None) -> torch.Tensor:
    """``[B]``: how far each row's routing is from choosing another expert
    (moe.route's selection): the smaller of the last chosen expert's lead
    over the best one left out in the groups kept and, when grouped, the
    last kept group's lead over the first dropped (halved for a top-2 sum)."""
    from vllm_ext.moe import kept_experts, selection

    _, choice, group_scores = selection(logits, moe, correction_bias)
    margin = torch.full(choice.shape[:1], float("inf"))
    if group_scores is not None and moe.topk_groups < moe.num_groups:
        ranked = group_scores.sort(dim=-1, descending=True).values
        lead = ranked[:, moe.topk_groups - 1] - ranked[:, moe.topk_groups]
        margin = lead / (2 if correction_bias is not None else 1)
        choice = choice.masked_fill(~kept_experts(group_scores, moe), float("-inf"))
    ranked = choice.sort(dim=-1, descending=True).values
    return torch.minimum(margin, ranked[:, moe.top_k - 1] - ranked[:, moe.top_k])


class RoutingMargins:
    """Records, in reference mode, each decode step's routing margins per
    request: the smallest over the step's sparse layers. ``install`` wraps
    the interpreter's step and TOPK (in the engine's process: tests run
    vLLM in-process); ``near_ties`` names the (request, step) pairs routed
    at a near tie."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, int], float] = {}  # (position, token)
        self._rows: list[tuple[int, int]] = []

    def install(self, monkeypatch) -> None:
        from vllm_ext.megakernel import interpret
        from vllm_ext.megakernel.ops import topk

        step, reference = interpret.ProgramExecutor.step, topk.reference

        def recording_step(executor, inputs):
            self._rows = list(
                zip(inputs.positions.tolist(), inputs.input_ids.tolist(), strict=True)
            )
            return step(executor, inputs)

        def recording_topk(logits, layer, spec, seq_lens, num_slots):
            margins = routing_margin(logits, spec.moe, layer.moe.correction_bias)
            for row, margin in zip(self._rows, margins.tolist(), strict=False):
                self.steps[row] = min(self.steps.get(row, float("inf")), margin)
            return reference(logits, layer, spec, seq_lens, num_slots)

        monkeypatch.setattr(interpret.ProgramExecutor, "step", recording_step)
        monkeypatch.setattr(topk, "reference", recording_topk)

    def near_ties(
        self, outputs, prompt_lens: list[int], bound: float = ROUTING_TIE
    ) -> set[tuple[int, int]]:
        """(request, step) pairs of ``outputs`` (the recorded run's) whose
        decode step routed some layer within ``bound``. Step ``s`` of a
        request fed its token ``s - 1`` at position prompt length + s - 1."""
        ties: set[tuple[int, int]] = set()
        if not self.steps:  # no sparse layer ran
            return ties
        for i, ((ids, _), length) in enumerate(zip(outputs, prompt_lens, strict=True)):
            for step in range(1, len(ids)):
                margin = self.steps[length + step - 1, ids[step - 1]]
                if margin < bound:
                    ties.add((i, step))
        return ties


def check_bf16_close(
    reference,
    outputs,
    name_ref: str,
    name_out: str,
    routing_ties: set[tuple[int, int]] = frozenset(),
    tol: float | None = None,
) -> dict:
    """The project's bf16 rule (above) on lists of (token_ids, logprobs),
    logprobs a list of {token_id: logprob} per step holding at least the
    top ones. ``routing_ties``: (request, step) pairs where ``outputs``
    routed at a near tie (RoutingMargins): there, and only there, the
    streams may differ beyond the rule, and nothing later is compared.
    ``tol``: both bounds at once, for a model the rule's bf16 bounds do not
    fit (FP8_ACT_TOL). Returns what it compared: tokens compared, streams
    that parted (at a routing tie among them), the largest logprob
    difference and tie gap."""
    logprob_tol = BF16_LOGPROB_TOL if tol is None else tol
    tie = BF16_TIE if tol is None else tol
    stats = {"compared": 0, "parted": 0, "at_routing_tie": 0,
             "max_logprob_diff": 0.0, "max_gap": 0.0}  # fmt: skip
    for i, ((ids_r, lp_r), (ids_o, lp_o)) in enumerate(
        zip(reference, outputs, strict=True)
    ):
        for step, (tr, to) in enumerate(zip(ids_r, ids_o, strict=True)):
            where = f"prompt {i} step {step}"
            if (i, step) in routing_ties and (
                tr != to or abs(lp_r[step][tr] - lp_o[step][to]) > logprob_tol
            ):
                stats["parted"] += 1
                stats["at_routing_tie"] += 1
                break
            if tr == to:
                diff = abs(lp_r[step][tr] - lp_o[step][to])
                stats["compared"] += 1
                stats["max_logprob_diff"] = max(stats["max_logprob_diff"], diff)
                assert diff <= logprob_tol, (
                    f"{where}: both picked {tr}, with logprobs {lp_r[step][tr]:.4f} "
                    f"({name_ref}) and {lp_o[step][to]:.4f} ({name_out})"
                )
                continue
            for picked, other, lp, name in ((tr, to, lp_r, name_ref),
                                             (to, tr, lp_o, name_out)):  # fmt: skip
                assert other in lp[step], (
                    f"{where}: the streams part ({name_ref} {tr}, {name_out} {to}) "
                    f"and {other} is not in {name}'s top logprobs {lp[step]}"
                )
                gap = lp[step][picked] - lp[step][other]
                stats["max_gap"] = max(stats["max_gap"], gap)
                assert gap <= tie, (
                    f"{where}: the streams part ({name_ref} {tr}, {name_out} {to}) "
                    f"where {name} is not near a tie: {picked} leads {other} by "
                    f"{gap:.4f} > {tie}"
                )
            stats["parted"] += 1
            break
    return stats


def base_commit(tree: Path) -> str:
    """The vLLM source tree's base commit (the pristine sdist)."""
    out = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"],
        cwd=tree, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.split()[0]


def load_script(path: str) -> ModuleType:
    """A script of the repository (``scripts/...``, not a package) as a
    module, e.g. ``load_script("scripts/device_run.py")``."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(Path(path).stem, root / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_backend_steps(llm) -> tuple[float, dict[str, float]]:
    """vLLM's count of decode-only steps (vllm:decode_backend_steps, through
    LLM.get_metrics; the engine needs disable_log_stats=False): those that
    ran through the decode backend, and the reasons of those that did not
    (only reasons that occurred)."""
    ran, declined = 0.0, {}
    for (outcome, reason), value in decode_backend_outcomes(llm).items():
        if outcome == "ran":
            ran += value
        elif outcome == "declined" and value:
            declined[reason] = value
    return ran, declined


def decode_backend_outcomes(llm) -> dict[tuple[str, str], float]:
    """vllm:decode_backend_steps by (outcome, reason): ``ran``, ``failed``
    (a step the backend could not complete) or ``declined`` with the
    reason."""
    return {
        (m.labels["outcome"], m.labels["reason"]): m.value
        for m in llm.get_metrics()
        if m.name == "vllm:decode_backend_steps"
    }
