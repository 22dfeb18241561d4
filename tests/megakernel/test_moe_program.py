# SPDX-License-Identifier: Apache-2.0
"""Mixtures of experts in the instruction program: planned, verified, and
interpreted bit for bit under every interleaving, matching the plain
forward (reference.moe_mlp); expert slots filled at run time; a shared
expert beside the routing; the cost model's routed rows (streamed from
the routing on, beside an in-order stream that never waits for them)."""

import dataclasses
import itertools
import random

import pytest
import torch

from vllm_ext.demo_models import hf_config
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.interpret import ProgramExecutor, ProgramInterpreter
from vllm_ext.megakernel.isa import Op, unpack_cols
from vllm_ext.megakernel.planner import plan
from vllm_ext.megakernel.verify import VerificationError, verify
from vllm_ext.model_spec import ModelSpec
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import random_decode_inputs, random_weights

DEVICE = dataclasses.replace(DEVICES["h200"], num_sms=16)
# qwen3_moe: a dense layer, then 8 experts top 2; mixtral: 4 experts top 2.
ARCHS = ["qwen3_moe", "mixtral"]
# fp32: split-KV attention sums in another order than the plain forward.
FP32_TOL = 1e-5
# bf16: the program and the plain forward sum in fp32 in different orders
# (and the CPU's matmul kernels pick their own order: AVX-512 bf16 machines
# differ from others), so a bf16 rounding of a layer's output may go the
# other way: at most one rounding step of the output's largest magnitude
# per layer (two layers here). Equal on some machines, never required.
BF16_ROUNDINGS = 2


def bf16_tolerance(expected: torch.Tensor) -> float:
    """BF16_ROUNDINGS rounding steps (bf16: 8 significant bits) at the
    largest magnitude of ``expected``."""
    top = expected.abs().max().float()
    return BF16_ROUNDINGS * 2.0 ** (torch.floor(torch.log2(top)).item() - 7)


def spec_of(arch: str, dtype) -> ModelSpec:
    if arch == "deepseek_routing":
        return deepseek_routing(dtype)
    return ModelSpec.from_hf_config(hf_config(arch), dtype, 512)


def deepseek_routing(dtype) -> ModelSpec:
    """qwen3_moe with DeepSeek-V3's mixture: sigmoid scores, a correction
    bias, grouped top-k, scaled weights, and a shared expert twice an
    expert's width (the program's MoE does not depend on the attention)."""
    spec = ModelSpec.from_hf_config(hf_config("qwen3_moe"), dtype, 512)
    moe = dataclasses.replace(
        spec.moe, scoring="sigmoid", correction_bias=True, grouped=True,
        num_groups=4, topk_groups=2, routed_scaling=2.5,
        shared_intermediate=2 * spec.moe.expert_intermediate,
    )  # fmt: skip
    return dataclasses.replace(spec, moe=moe)


@pytest.mark.parametrize("arch", ARCHS + ["deepseek_routing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 4])
def test_interleavings_agree_bitwise_and_match_reference(arch, dtype, batch):
    spec = spec_of(arch, dtype)
    weights = random_weights(spec, seed=1)
    program = plan(spec, batch, DEVICE, with_lm_head=True)
    verify(program)
    outs = []
    for seed in range(3):
        interp = ProgramInterpreter(program, weights, seed=seed)
        outs.append(interp.step(random_decode_inputs(spec, batch, seed=7)))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    expected = ReferenceExecutor(spec, weights).step(
        random_decode_inputs(spec, batch, seed=7)
    )
    assert not outs[0].isnan().any()
    tol = FP32_TOL if dtype == torch.float32 else bf16_tolerance(expected)
    torch.testing.assert_close(outs[0], expected, rtol=0, atol=tol)


@pytest.mark.parametrize("arch", ARCHS)
def test_slots_are_filled_at_run_time(arch):
    """Bucket 4 with 3 real requests (the fourth is padding, routed to no
    expert): the slots hold the distinct experts of the real rows,
    ascending, the rest empty; every output matches the plain forward."""
    spec = spec_of(arch, torch.float32)
    weights = random_weights(spec, seed=2)
    executor = ProgramExecutor(spec, weights, DEVICE, (4,), seed=3)
    inputs = random_decode_inputs(spec, 3, seed=11)
    got = executor.step(inputs)
    expected = ReferenceExecutor(spec, weights).step(
        random_decode_inputs(spec, 3, seed=11)
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=FP32_TOL)
    interp = executor.interpreters[4]
    moe = spec.moe
    for layer, routing in enumerate(interp.routing):
        if not moe.sparse_layers[layer]:
            assert routing is None
            continue
        real = routing.slots[:3]
        assert routing.slots[3].eq(-1).all()  # the padding row
        chosen = routing.experts[real].unique()
        used = len(chosen)
        assert routing.experts[:used].tolist() == chosen.tolist()
        assert routing.experts[used:].eq(-1).all()
        assert interp.program.num_slots == min(4 * moe.top_k, moe.num_experts)


def test_expected_experts_and_weight_bytes():
    """A step reads the experts it routes to: the floor counts the expected
    distinct ones under uniform routing, not every slot."""
    spec = ModelSpec.from_hf_config(hf_config("qwen3_moe"), torch.bfloat16, 512)
    moe = spec.moe
    one = plan(spec, 1, DEVICE)
    many = plan(spec, 64, DEVICE)
    assert (one.num_slots, many.num_slots) == (moe.top_k, moe.num_experts)
    assert one.expected_experts == pytest.approx(moe.top_k)
    assert many.expected_experts == pytest.approx(
        moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** 64)
    )
    e, h, inter = spec.dtype.itemsize, spec.hidden_size, moe.expert_intermediate
    expert_bytes = 3 * h * inter * e  # gate, up and down rows of one expert
    sparse = sum(moe.sparse_layers)
    gap = many.weight_bytes() - one.weight_bytes()
    # Only the experts read differ (the rest is the same weights), give or
    # take the RMSNorm weight every EXPERT_UP tile re-reads.
    assert gap == pytest.approx(
        sparse * (many.expected_experts - one.expected_experts) * expert_bytes,
        rel=0.02,
    )


def _layer_queues(program, layer, change):
    """The program's queues with ``change(instr)`` applied to ``layer``'s
    instructions."""
    return tuple(
        tuple(change(i) if i.layer == layer else i for i in q) for q in program.queues
    )


def test_an_expert_read_before_its_routing_is_caught():
    """A routed EXPERT_UP made to wait for O_PROJ instead of ROUTE: it
    computes the routing from logits not known to exist."""
    spec = spec_of("mixtral", torch.bfloat16)
    program = plan(spec, 2, DEVICE)
    topk = next(i for _, _, i in program.in_global_order() if i.op == Op.TOPK)
    route = next(i for _, _, i in program.in_global_order()
                 if i.op == Op.ROUTE and i.layer == topk.layer)  # fmt: skip
    queues = _layer_queues(program, topk.layer, lambda i: dataclasses.replace(
        i, wait_counter=route.wait_counter, wait_count=route.wait_count,
    ) if i.op == Op.EXPERT_UP else i)  # fmt: skip
    with pytest.raises(VerificationError, match="reads router"):
        verify(dataclasses.replace(program, queues=queues))


def test_a_routing_table_read_before_topk_is_caught():
    """TOPK made to signal a counter nobody waits for, moved behind its SM's
    EXPERT_UP tiles of the layer (so no later signal of its SM covers its
    stores), and EXPERT_DOWN waiting for the expert tiles alone:
    EXPERT_DOWN reads the routing table before TOPK is known to have
    written it."""
    spec = spec_of("mixtral", torch.bfloat16)
    program = plan(spec, 2, DEVICE)
    topk = next(i for _, _, i in program.in_global_order() if i.op == Op.TOPK)
    spare = program.num_counters
    moved = dataclasses.replace(topk, signal_counter=spare)
    queues = []
    for q in program.queues:
        if topk in q:
            q = [i for i in q if i != topk]
            at = max(n + 1 for n, i in enumerate(q)
                     if i.layer < topk.layer or i.op == Op.EXPERT_UP
                     and i.layer == topk.layer)  # fmt: skip
            q.insert(at, moved)
        queues.append(tuple(
            dataclasses.replace(i, wait_count=i.wait_count - 1)
            if i.op == Op.EXPERT_DOWN and i.layer == topk.layer else i
            for i in q
        ))  # fmt: skip
    program = dataclasses.replace(
        program, queues=tuple(queues),
        counter_names=(*program.counter_names, "spare"),
    )  # fmt: skip
    with pytest.raises(VerificationError, match="reads route"):
        verify(program)


def test_expert_tiles_cover_each_slot():
    spec = spec_of("qwen3_moe", torch.bfloat16)
    program = plan(spec, 1, DEVICE)
    ups = [i for _, _, i in program.in_global_order() if i.op == Op.EXPERT_UP]
    covered: dict[int, int] = {}
    for i in ups:
        lo, hi = unpack_cols(i.arg1)
        covered[i.arg0] = covered.get(i.arg0, 0) + hi - lo
    assert covered == dict.fromkeys(range(program.num_slots),
                                    spec.moe.expert_intermediate)  # fmt: skip


def test_the_shared_expert_runs_beside_the_routing():
    """Its tiles wait for O_PROJ, not ROUTE, and precede TOPK in every queue
    that holds both; EXPERT_DOWN waits for them, TOPK and the routed tiles;
    the floor counts its weights every step."""
    spec = spec_of("deepseek_routing", torch.bfloat16)
    program = plan(spec, 1, DEVICE)
    shared = program.shared_slot
    assert shared == program.num_slots
    o_proj = {i.signal_counter for _, _, i in program.in_global_order()
              if i.op == Op.O_PROJ}  # fmt: skip
    for q in program.queues:
        ops = [(i.op, i.arg0) for i in q]
        for n, i in enumerate(q):
            if i.op == Op.EXPERT_UP and i.arg0 == shared:
                assert i.wait_counter in o_proj
                assert (Op.TOPK, 0) not in ops[:n]
    ups = [i for _, _, i in program.in_global_order() if i.op == Op.EXPERT_UP]
    width = sum(unpack_cols(i.arg1)[1] - unpack_cols(i.arg1)[0]
                for i in ups if i.arg0 == shared)  # fmt: skip
    assert width == spec.moe.shared_intermediate * sum(spec.moe.sparse_layers)
    downs = [i for _, _, i in program.in_global_order() if i.op == Op.EXPERT_DOWN]
    per_layer = len(ups) // sum(spec.moe.sparse_layers)
    assert {i.wait_count for i in downs} == {per_layer + 1}  # (+ TOPK)
    plain = dataclasses.replace(spec, moe=dataclasses.replace(
        spec.moe, shared_intermediate=0))  # fmt: skip
    e, h = spec.dtype.itemsize, spec.hidden_size
    tiles = sum(1 for i in ups if i.arg0 == shared)
    # Its gate, up and down rows, and the RMSNorm weight each tile reads.
    extra = 3 * h * spec.moe.shared_intermediate * e * sum(spec.moe.sparse_layers)
    gap = program.weight_bytes() - plan(plain, 1, DEVICE).weight_bytes()
    assert gap == extra + tiles * h * e


def test_a_shared_expert_skipped_by_expert_down_is_caught():
    """EXPERT_DOWN made to wait for the routed tiles only: it reads the
    shared expert's activations before they are known to exist."""
    spec = spec_of("deepseek_routing", torch.bfloat16)
    program = plan(spec, 1, DEVICE)
    shared = program.shared_slot
    queues = tuple(
        tuple(i for i in q if not (i.op == Op.EXPERT_UP and i.arg0 == shared))
        for q in program.queues
    )
    n = sum(1 for q in queues for i in q if i.op == Op.EXPERT_UP)
    layers = sum(spec.moe.sparse_layers)
    queues = tuple(
        tuple(dataclasses.replace(i, wait_count=n // layers + 1)  # (+ TOPK)
              if i.op == Op.EXPERT_DOWN else i for i in q)
        for q in queues
    )  # fmt: skip
    with pytest.raises(VerificationError, match="xact_shared"):
        verify(dataclasses.replace(program, queues=queues))


class TinyProgram:
    """Two SMs, hand-built for the cost model (the planner.Program methods
    predict() reads): SM 0 runs a sparse layer's ROUTE, whose execution
    takes ``route_bytes`` of activations; SM 1 runs a routed EXPERT_UP of
    ``routed`` bytes (waiting for ROUTE; computing the routing first, as
    long as a TOPK of ``routing_bytes`` takes), then the next layer's QKV
    of ``paged`` bytes (waiting for the EXPERT_UP)."""

    def __init__(self, device, route_bytes: int, routed: int, paged: int,
                 routing_bytes: int = 0):  # fmt: skip
        from vllm_ext.megakernel.isa import Instruction

        self.device = device
        route = Instruction(Op.ROUTE, 0, 0, 16, signal_counter=0)
        up = Instruction(Op.EXPERT_UP, 0, 0, 0, 0, 1, signal_counter=1)
        qkv = Instruction(Op.QKV, 1, 0, 1, 1, 1, signal_counter=2)
        self.queues = ((route,), (up, qkv))
        self.order = ((0, 0), (1, 0), (1, 1))
        self._bytes = {route: (0, route_bytes), up: (routed, 0), qkv: (paged, 0),
                       Instruction(Op.TOPK, 0, 0, 0): (0, routing_bytes)}  # fmt: skip
        self._routed = {up: routed}
        self.shared_slot = None

    def cost(self, instr):
        from vllm_ext.megakernel.cost import Cost

        return Cost(*self._bytes[instr])

    step_cost = cost

    def routed_weight_bytes(self, instr) -> int:
        return self._routed.get(instr, 0)

    def weight_bytes(self) -> int:
        return sum(w for w, _ in self._bytes.values())

    def in_global_order(self):
        for sm, idx in self.order:
            yield sm, idx, self.queues[sm][idx]


# 1 GB/s per SM (1 byte per ns), 1 us per dependency, 0.5 us per
# instruction, a lookahead that never binds.
TINY = dataclasses.replace(
    DEVICE, name="tiny", num_sms=2, hbm_bytes_per_s=2e9, smem_bytes=1 << 20,
    dependency_latency_s=1e-6, instruction_overhead_s=0.5e-6,
)  # fmt: skip


def test_the_paged_stream_goes_on_through_the_routing_gap():
    """ROUTE ends at 10.5 us; the routing takes EXPERT_UP from its signal's
    arrival, 11.5 us, to 12.0; the routed rows (4 us) stream to 16.0;
    EXPERT_UP runs to 16.5; QKV, whose 6 us of weights streamed at once
    (not behind the routed rows: that would end at 22.0), runs from its
    wait, 17.5, to 18.0."""
    from vllm_ext.megakernel.cost import predict

    pred = predict(TinyProgram(TINY, route_bytes=10_000, routed=4_000, paged=6_000))
    assert pred.sm_finish_s[0] == pytest.approx(10.5e-6)
    assert pred.sm_finish_s[1] == pytest.approx(18.0e-6)


def test_routed_rows_start_after_the_routing_and_share_the_bandwidth():
    from vllm_ext.megakernel.cost import predict

    # No earlier than ROUTE's signal plus a dependency's latency plus the
    # routing: a cheaper ROUTE (ends at 0.5 us) moves the routed rows, not
    # the latency; a routing of 2000 bytes takes 2 us longer.
    pred = predict(TinyProgram(TINY, route_bytes=0, routed=4_000, paged=1_000))
    assert pred.sm_finish_s[1] == pytest.approx(
        (0.5 + 1 + 0.5 + 4 + 0.5 + 1 + 0.5) * 1e-6
    )
    pred = predict(TinyProgram(TINY, route_bytes=0, routed=4_000, paged=1_000,
                               routing_bytes=2_000))  # fmt: skip
    assert pred.sm_finish_s[1] == pytest.approx(
        (0.5 + 1 + 2.5 + 4 + 0.5 + 1 + 0.5) * 1e-6
    )
    # QKV's 20 us of weights are in flight when the routed rows take the
    # SM's share for 4 us: they arrive at 24 us, not 20.
    pred = predict(TinyProgram(TINY, route_bytes=10_000, routed=4_000, paged=20_000))
    assert pred.sm_finish_s[1] == pytest.approx(24.5e-6)


def test_a_calibrated_kind_pays_for_every_byte_it_moves():
    """``exec_s_per_byte`` (calibrate's figure for a kind a GPU ran slower
    than its stream): ROUTE's 10 us of activations cost 1 ns a byte more,
    so it ends at 20.5 us, not 10.5; the chain after it moves with it
    (EXPERT_UP's wait at 21.5, the routing to 22.0, its rows to 26.0, it
    runs to 26.5); QKV, at 0.5 ns a byte of its 6 us of weights, runs from
    its wait at 27.5 for 0.5 + 3 us. Kinds without a figure pay nothing."""
    from vllm_ext.megakernel.cost import predict

    device = dataclasses.replace(
        TINY, exec_s_per_byte=(("ROUTE", 1e-9), ("QKV", 0.5e-9), ("ATTN", 1.0))
    )
    pred = predict(TinyProgram(device, route_bytes=10_000, routed=4_000,
                               paged=6_000))  # fmt: skip
    assert pred.sm_finish_s[0] == pytest.approx(20.5e-6)
    assert pred.sm_finish_s[1] == pytest.approx(31.0e-6)


class TinyDown(TinyProgram):
    """TinyProgram with SM 1 running, after its routed EXPERT_UP (4 us of
    rows), the layer's EXPERT_DOWN (3 us of rows) waiting for it; with
    ``between``, an instruction of no bytes between the two."""

    def __init__(self, device, between: bool):
        from vllm_ext.megakernel.isa import Instruction

        super().__init__(device, route_bytes=0, routed=4_000, paged=0)
        up = self.queues[1][0]
        down = Instruction(Op.EXPERT_DOWN, 0, 0, 16, 1, 1, signal_counter=2)
        other = Instruction(Op.ROUTE, 1, 0, 16)
        sm1 = (up, other, down) if between else (up, down)
        self.queues = (self.queues[0], sm1)
        self.order = ((0, 0), *((1, i) for i in range(len(sm1))))
        self._bytes |= {down: (3_000, 0), other: (0, 0)}
        self._routed[down] = 3_000


def test_expert_down_rows_stream_behind_the_expert_up_rows():
    """ROUTE ends at 0.5 us; the routing takes EXPERT_UP to 2.0, its rows
    stream to 6.0 and it runs to 6.5. The EXPERT_DOWN right after it had
    its rows hinted with them: in at 9.0, so it runs from 9.0 to 9.5, not
    from its own wait (7.5) plus its 3 us of rows. Another instruction
    between the two: the rows start at the EXPERT_DOWN's publish, 7.5, and
    it ends at 11.0."""
    from vllm_ext.megakernel.cost import predict

    assert predict(TinyDown(TINY, between=False)).sm_finish_s[1] == pytest.approx(
        9.5e-6
    )
    assert predict(TinyDown(TINY, between=True)).sm_finish_s[1] == pytest.approx(
        11.0e-6
    )


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_expert_down_tiles_follow_a_routed_expert_up(batch):
    """Every EXPERT_DOWN tile comes right after a routed EXPERT_UP of its
    layer (or another such EXPERT_DOWN) in its SM's queue: that tile's
    consumers hint its rows with the routing they computed. The layer's
    routed bytes per SM that runs its routed tiles (a step's) stay within
    one tile of each other's.
    (Qwen3-30B-A3B's real shape on all of an H200's SMs.)"""
    from vllm_ext.megakernel.build import spec_or_exit

    device = DEVICES["h200"]
    program = plan(spec_or_exit("test", "qwen3-30b-a3b", "bfloat16", batch), batch,
                   device)  # fmt: skip
    routed = {}
    for sm, q in enumerate(program.queues):
        for k, i in enumerate(q):
            if i.op == Op.EXPERT_DOWN:
                before = q[k - 1]
                assert before.layer == i.layer and (
                    before.op == Op.EXPERT_DOWN
                    or (before.op == Op.EXPERT_UP and before.arg0 < program.num_slots)
                )
            if program.routed_weight_bytes(i):
                key = (i.layer, sm)
                routed[key] = routed.get(key, 0) + program.step_cost(i).weight_bytes
    tile = max(program.step_cost(i).weight_bytes for q in program.queues for i in q
               if program.routed_weight_bytes(i))  # fmt: skip
    for layer in {k[0] for k in routed}:
        sizes = [b for (at, _), b in routed.items() if at == layer]
        assert max(sizes) - min(sizes) <= tile


@pytest.mark.parametrize("batch, tiles", [(1, 16), (4, 4), (16, 8)])
def test_expert_tiles_spread_the_filled_slots(batch, tiles):
    """Qwen3-30B-A3B on an H200: each routed slot's EXPERT_UP in ``tiles``
    column tiles (planner.expert_split): one per SM at batch 1; at batch 16
    (82 of 128 slots filled) eighths of an expert, so that the busiest SM's
    filled EXPERT_UP rows stay within a quarter of the average (with a
    whole expert per tile, 1.6 times it)."""
    from vllm_ext.megakernel.build import spec_or_exit

    device = DEVICES["h200"]
    program = plan(spec_or_exit("test", "qwen3-30b-a3b", "bfloat16", batch), batch,
                   device)  # fmt: skip
    layer = program.spec.num_layers - 1
    up = [(sm, i) for sm, q in enumerate(program.queues) for i in q
          if i.op == Op.EXPERT_UP and i.layer == layer]  # fmt: skip
    assert sum(1 for _, i in up if i.arg0 == 0) == tiles
    rows = [0] * device.num_sms
    for sm, i in up:
        rows[sm] += program.step_cost(i).weight_bytes
    assert max(rows) <= 1.25 * sum(rows) / len(rows)


@pytest.mark.parametrize("name, batch", [("mixtral-8x7b", 4), ("qwen3-30b-a3b", 16)])
def test_a_steps_reads_stay_even_over_the_sms(name, batch):
    """Every SM's bytes in an expected step (step_cost) within 5% of each
    other. The planner weighs a tile by what a step reads: weighing every
    slot's rows, Mixtral's batch-4 loads drift apart layer by layer under
    the placement caps (design.md, "Placement")."""
    from vllm_ext.megakernel.build import spec_or_exit

    program = plan(spec_or_exit("test", name, "bfloat16", batch), batch,
                   DEVICES["h200"], with_lm_head=True)  # fmt: skip
    reads = [sum(program.step_cost(i).weight_bytes + program.step_cost(i).other_bytes
                 for i in q) for q in program.queues]  # fmt: skip
    assert max(reads) < 1.05 * min(reads)


def test_routed_rows_delay_only_the_stream_in_flight():
    """cost._Stream.yield_to: loads of 1 s each (10 bytes/s); routed rows
    over [1.5, 3.5) push back the load in flight and what follows it back to
    back, but not a load the lookahead had already held back past 3.5."""
    from vllm_ext.megakernel import cost

    cum = [10, 20, 30, 40, 50]
    s = cost._Stream(cum, 10.0)
    s.yield_to(1, 1.5, 2.0)
    assert [s.done(k) for k in range(1, 5)] == [4.0, 5.0, 6.0, 7.0]
    s = cost._Stream(cum, 10.0)
    s.stall(0, 8.0, 10)  # loads 2.. held back: 10 bytes of lookahead
    assert [s.done(k) for k in range(1, 5)] == [2.0, 9.0, 10.0, 11.0]
    s.yield_to(1, 1.5, 2.0)
    assert [s.done(k) for k in range(1, 5)] == [4.0, 9.0, 10.0, 11.0]


def test_the_stream_as_steps_matches_the_plain_list():
    """cost._Stream against the plain list it stands for (every load a
    number, each event walking the rest of the queue; the lookahead bound
    skipping the loads inside the window), on random streams and events."""
    from vllm_ext.megakernel import cost

    def stall(done, cum, executed, now, window, bw):
        consumed = cum[executed]
        for k in range(executed + 1, len(done)):
            excess = cum[k] - consumed - window
            if excess <= 0:
                continue  # within the window
            t = max(done[k], now + excess / bw)
            if k > executed + 1:
                t = max(t, done[k - 1] + (cum[k] - cum[k - 1]) / bw)
            if t == done[k]:
                break
            done[k] = t

    def yield_to(done, cum, k, start, dt, bw):
        free, prev = start + dt, None
        for j in range(k, len(done)):
            t = done[j]
            if t > start:
                b = (cum[j] - (cum[j - 1] if j > 0 else 0)) / bw
                t = t + dt if t - b < start else max(t, free + b)
                if prev is not None:
                    t = max(t, prev + b)
                if t == done[j]:
                    break
                done[j] = t
            prev = t

    rng = random.Random(0)
    for _ in range(200):
        n, bw, window = rng.randint(1, 40), 8.0, rng.choice((0, 16, 32, 64))
        cum = list(itertools.accumulate(rng.choice((8, 16, 24)) for _ in range(n)))
        plain, stream = [c / bw for c in cum], cost._Stream(cum, bw)
        now = 0.0
        for k in range(n):
            assert stream.done(k) == pytest.approx(plain[k], rel=1e-12)
            if rng.random() < 0.4:
                start, dt = rng.uniform(0.0, now + 4.0), rng.choice((0.5, 2.0))
                yield_to(plain, cum, k, start, dt, bw)
                stream.yield_to(k, start, dt)
                assert stream.done(k) == pytest.approx(plain[k], rel=1e-12)
            now = max(now, plain[k]) + rng.choice((0.0, 0.1, 1.0, 4.0))
            stall(plain, cum, k, now, window, bw)
            stream.stall(k, now, window)
            for j in range(k + 1, n):
                assert stream.done(j) == pytest.approx(plain[j], rel=1e-12)


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_a_step_reads_the_filled_slots_only(batch):
    spec = spec_of("qwen3_moe", torch.bfloat16)
    program = plan(spec, batch, DEVICE)
    filled = program.occupied_slots
    assert filled == min(program.num_slots, round(program.expected_experts))
    for i in (i for _, _, i in program.in_global_order() if i.op == Op.EXPERT_UP):
        empty = i.arg0 >= filled
        assert (program.step_cost(i).weight_bytes == 0) == empty
    total = sum(program.step_cost(i).weight_bytes
                for _, _, i in program.in_global_order())  # fmt: skip
    # weight_bytes() counts the expected (fractional) number of experts.
    e, h, inter = spec.dtype.itemsize, spec.hidden_size, spec.moe.expert_intermediate
    per_expert = 3 * h * inter * e * sum(spec.moe.sparse_layers)
    gap = abs(total - program.weight_bytes())
    assert gap <= per_expert * abs(filled - program.expected_experts) + 64 * h * e


def test_a_step_reads_the_floors_expert_bytes():
    """A step's reads (``step_cost``) count the expected experts with their
    fraction, as the floor does: Mixtral-8x7B at batch 4 expects 5.47, and
    read as 5 filled slots its prediction came out under its floor."""
    from vllm_ext.megakernel.build import spec_or_exit

    program = plan(spec_or_exit("test", "mixtral-8x7b", "bfloat16", 4), 4,
                   DEVICES["h200"])  # fmt: skip
    step = sum(program.step_cost(i).weight_bytes for q in program.queues for i in q)
    assert step == pytest.approx(program.weight_bytes(), rel=1e-4)


@pytest.mark.parametrize("name, batch", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 16),
                                         ("mixtral-8x7b", 4)])  # fmt: skip
def test_routed_rows_are_hinted_once_ahead_of_their_tile(name, batch):
    """The rule of kernel/ops/expert_up.py's hint_routed (cost._hinted_by)
    on real programs: each SM's first routed tile of a layer computes the
    routing; every routed tile and every EXPERT_DOWN tile after them is
    hinted exactly once, by a routed tile of its layer at or before it and
    at most ROUTED_AHEAD instructions before it or before the EXPERT_DOWN
    tiles' routed tile; nothing else is."""
    from vllm_ext.megakernel import cost
    from vllm_ext.megakernel.build import spec_or_exit

    program = plan(spec_or_exit("test", name, "bfloat16", batch), batch,
                   DEVICES["h200"])  # fmt: skip
    checked = 0
    for q in program.queues:
        routing = cost._routing_times(program, q, program.device)
        hints: dict[int, list[int]] = {}
        for k, i in enumerate(q):
            if cost._routed_up(program, i):
                for j in cost._hinted_by(program, q, k, routing):
                    hints.setdefault(j, []).append(k)
        firsts = {}
        for k, i in enumerate(q):
            if cost._routed_up(program, i):
                firsts.setdefault(i.layer, k)
        assert set(routing) == set(firsts.values())
        for j, i in enumerate(q):
            up = cost._routed_up(program, i)
            if not up and i.op != Op.EXPERT_DOWN:
                assert j not in hints
                continue
            (by,) = hints[j]  # exactly once
            last_up = max(k for k in range(j + 1) if cost._routed_up(program, q[k]))
            assert q[by].layer == i.layer and cost._routed_up(program, q[by])
            assert by <= j and last_up - by <= cost.ROUTED_AHEAD
            checked += 1
    assert checked > 0


def test_the_expert_split_is_the_predicted_fastest_of_its_candidates():
    """Mixtral-8x7B at batch 4 expects 5.47 experts a layer: the integer
    bound gives 26 tiles a slot for 5 filled slots and 132 for the
    fraction. The prediction over the first layers picks 132, and the whole
    step is faster for it (16090 against 18699 us in the model)."""
    from vllm_ext.megakernel.build import spec_or_exit
    from vllm_ext.megakernel.cost import predict
    from vllm_ext.megakernel.planner import expert_split

    device = DEVICES["h200"]
    spec = spec_or_exit("test", "mixtral-8x7b", "bfloat16", 4)
    assert expert_split(spec, 4, device) == 132
    chosen = predict(plan(spec, 4, device, with_lm_head=True)).step_s
    rounded = predict(plan(spec, 4, device, with_lm_head=True, expert_tiles=26))
    assert chosen < 0.9 * rounded.step_s
