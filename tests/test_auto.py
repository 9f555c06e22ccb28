"""Auto mode: the planning rule on given figures, and the tuner in a 2 x 2 training run
whose link is scripted to change (the emulated-cluster figures are ``zeropp bench auto``).
The tuner driven by hand on a scripted clock is in test_auto_tuner.py."""

import math
from dataclasses import replace

import pytest
import torch

from parity import train_step
from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.accounting import FlatSummary
from zeropp.auto import Accumulation, LinkSpeeds, candidates
from zeropp.auto.planning import Measurement, Workload, candidate_link_time, plan_next
from zeropp.auto.replay import predicted_step_s, replayed_step_s
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.simulate.schedule import Collective, Compute, Issue, Schedule, Wait
from zeropp.topology import Layout

CONFIG = ZeroConfig(auto=True, compute_dtype="bf16", reduce_dtype="bf16")
# A 2.6M-parameter model's flats on 2 x 2: root, then six blocks.
FLATS = [FlatSummary(True, True, 262_144), *[FlatSummary(False, True, 196_608)] * 6]
WORK = Workload(FLATS, Layout(4, 2), CONFIG)
CHOICES = candidates(2)


def _mbit(value: float) -> LinkSpeeds:
    return LinkSpeeds(value * 1e6 / 8, latency_s=1e-4)


def test_slow_link_first_tries_the_cheapest_link_not_zero3():
    plan = plan_next(CHOICES, {}, 0, WORK, _mbit(50))
    assert plan.trial == "zero++-two-hop"  # the fewest bytes across nodes
    assert all(how is None for _, how in plan.estimates.values())


def test_a_candidate_that_cannot_win_is_never_tried():
    # At 100 Mbit/s the two-hop gather measured 1 s; ZeRO-3's inter-node bytes alone take
    # 2.2 s there, hpZ's and qwZ's 1.6 s: never tried. qwz+qgz's take 0.76 s: it might win.
    measured = {"zero++-two-hop": Measurement(step_s=1.0, compute_s=0.6, epoch=0)}
    plan = plan_next(CHOICES, measured, 0, WORK, _mbit(100), running="zero++-two-hop")
    assert plan.trial == "zero++"  # the cheapest bound of those that might win
    measured["zero++"] = Measurement(step_s=1.2, compute_s=0.6, epoch=0)
    plan = plan_next(CHOICES, measured, 0, WORK, _mbit(100), running="zero++")
    assert plan.trial == "qwz+qgz" and plan.estimates["qwz+qgz"][0] < 0.97
    measured["qwz+qgz"] = Measurement(step_s=1.3, compute_s=0.6, epoch=0)
    plan = plan_next(CHOICES, measured, 0, WORK, _mbit(100), running="qwz+qgz")
    assert plan.trial == "zero++-two-hop"  # to confirm: nothing else can beat it
    for name in ("zero3", "hpz", "qwz", "qgz"):
        assert plan.estimates[name][1] is None and plan.estimates[name][0] > 1.3


def test_candidates_are_ranked_by_the_bytes_of_an_optimizer_step_of_k_micro_steps():
    def inter_node_bytes(name, accumulation):
        return candidate_link_time(replace(WORK, accumulation=accumulation), CHOICES[name], _mbit(50)).inter_node_bytes

    once, node_accumulation, every_micro_step = Accumulation(), Accumulation(8, True), Accumulation(8)
    for name in CHOICES:  # reducing in every micro-step: eight micro-steps' weights and gradients without hpZ
        expected = 8 * inter_node_bytes(name, once)
        assert (inter_node_bytes(name, every_micro_step) == expected) == (name in ("zero3", "qwz", "qgz", "qwz+qgz"))
    for name in ("zero++", "zero++-two-hop"):  # hpZ's copy and node sums: what one micro-step sends
        assert inter_node_bytes(name, node_accumulation) == inter_node_bytes(name, once)
    # Without hpZ the weights cross nodes in every micro-step: at k = 1 qwZ + qgZ sends
    # fewer bytes than hpZ, at k = 8 with node accumulation many more.
    assert inter_node_bytes("qwz+qgz", once) < inter_node_bytes("hpz", once)
    assert inter_node_bytes("qwz+qgz", node_accumulation) > 4 * inter_node_bytes("hpz", node_accumulation)


def test_zero3_compute_does_not_bound_the_quantized_candidates():
    # ZeRO-3 measured on a fast link, 2% of its step blocked. On shared cores a quantized
    # candidate can still be faster (fewer bytes cost less CPU outside the blocked time):
    # every candidate is tried before ZeRO-3 is chosen.
    measured = {"zero3": Measurement(step_s=1.0, compute_s=0.98, epoch=0, samples=3)}
    plan = plan_next(CHOICES, measured, 0, WORK, _mbit(100_000), running="zero3")
    assert plan.trial == "zero++-two-hop" and plan.estimates["zero++"][0] < 0.01


def test_replan_tries_the_fastest_prediction_and_bounds_a_candidate_it_cannot_replay():
    # Every candidate measured on a fast link (epoch 0), predicted at 50 Mbit/s (epoch 1)
    # but zero3, which has no recorded step to replay.
    compute = {"zero3": 0.20, "hpz": 0.21, "qwz": 0.24, "qgz": 0.26, "qwz+qgz": 0.30, "zero++": 0.30,
               "zero++-two-hop": 0.32}
    measured = {name: Measurement(seconds + 0.01, seconds, 0) for name, seconds in compute.items()}
    predicted = {"hpz": 2.0, "qwz": 1.6, "qgz": 1.5, "qwz+qgz": 0.9, "zero++": 0.7, "zero++-two-hop": 0.8}
    slow = plan_next(CHOICES, measured, 1, WORK, _mbit(50), predicted=predicted)
    assert (slow.trial, slow.choice) == ("zero++", None)  # tried until measured at the new bandwidth
    assert all(slow.estimates[name] == (seconds, False) for name, seconds in predicted.items())
    bound = candidate_link_time(WORK, CHOICES["zero3"], _mbit(50)).inter_node_bytes / _mbit(50).inter_node_bytes_per_s
    assert slow.estimates["zero3"] == (bound, None)
    assert "zero++ predicted 700 ms" in slow.reason


def _step(compute_first: bool) -> Schedule:
    """One unit's compute and a world all-gather of 1 MB per rank (3 MB into node 0 on 2 x 2),
    the gather after the compute or hidden behind it."""
    gather = [Collective("all_gather", "ring", (0, 1, 2, 3), 10**6, "forward_gather", "bfloat16")]
    events = [Compute(0, "forward", 1000), Issue(0), Wait(0)] if compute_first else [
        Issue(0), Compute(0, "forward", 1000), Wait(0)]
    return Schedule(4, 2, 0, 0, 0, gather, events)


def test_a_measured_step_is_replayed_on_new_links_and_keeps_what_the_replay_left_out():
    fast, slow = LinkSpeeds(30e6, latency_s=0.0), LinkSpeeds(7.5e6, latency_s=0.0)  # 3 MB: 0.1 s, 0.4 s
    exposed, hidden = _step(compute_first=True), _step(compute_first=False)
    assert replayed_step_s(exposed, 0.1, fast) == pytest.approx(0.2)  # compute, then the gather
    assert replayed_step_s(hidden, 0.1, fast) == pytest.approx(0.1)  # the gather behind the compute
    # Measured 0.25 s and 0.12 s: the replay's change is added to what was measured.
    assert predicted_step_s(0.25, 0.1, exposed, fast, slow) == pytest.approx(0.55)
    assert predicted_step_s(0.12, 0.1, hidden, fast, slow) == pytest.approx(0.42)
    # Faster links cannot make a step shorter than its compute.
    assert predicted_step_s(0.105, 0.1, hidden, slow, LinkSpeeds(1e12, latency_s=0.0)) == pytest.approx(0.1)


def test_one_rank_per_node_drops_the_hpz_candidates():
    assert sorted(candidates(1)) == ["qgz", "qwz", "qwz+qgz", "zero3"]


def test_auto_refuses_the_fields_it_chooses():
    with pytest.raises(ValueError, match="quantized_weights"):
        ZeroConfig(auto=True, quantized_weights=True)
    with pytest.raises(ValueError, match="auto_probe_every"):
        ZeroConfig(auto=True, auto_probe_every=0)
    laid_out = ZeroConfig(auto=True, quantization_block_size=64, gradient_chunks=2)
    assert (laid_out.parameter_alignment, laid_out.effective_shard_alignment) == (64, 128)


class ScriptedProbe:
    """Stands in for the link probe: the inter-node bandwidth a script says, per probe."""

    def __init__(self, mbit_per_probe: list[float]) -> None:
        self.script = list(mbit_per_probe)
        self.latency_s = 1e-4
        self.crosses_nodes = True

    def measure_all(self) -> LinkSpeeds:
        return self.measure_inter_node(math.inf)

    def measure_inter_node(self, expected_bytes_per_s: float) -> LinkSpeeds:
        mbit = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return _mbit(mbit)


STEPS = 24


class _ProbeAfterDecision(ScriptedProbe):
    """Finds ``mbit[0]`` until the tuner's first decision, then ``mbit[1]``."""

    def __init__(self, mbit: list[float], tuner) -> None:
        super().__init__(mbit)
        self.tuner = tuner

    def measure_inter_node(self, expected_bytes_per_s: float) -> LinkSpeeds:
        return _mbit(self.script[1] if self.tuner.decisions else self.script[0])


def _train(rank, world_size, config: ZeroConfig, script: list[float] | None, ranks_per_node: int, steps: int = STEPS):
    torch.manual_seed(0)
    topology = Topology.from_environment(ranks_per_node=ranks_per_node)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), topology, config, unit_classes=(Block,))
    if script is not None:
        model.auto_tuner.probe = _ProbeAfterDecision(script, model.auto_tuner)
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=3e-3))
    losses, choices = [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (2 * world_size, 33), generator=generator)[2 * rank: 2 * rank + 2]
        losses.append(train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:]))
        choices.append(model.auto_tuner.choice if model.auto_tuner else None)
    decisions = model.auto_tuner.decisions if model.auto_tuner else []
    return {"losses": losses, "choices": choices, "decisions": decisions}


def test_tuner_follows_a_link_that_changes_and_every_rank_agrees():
    # 50 Mbit/s until the first decision, then 100 Gbit/s. The steps do not change with it,
    # so the steady state finds it at its 6th look, 12 steps on.
    config = ZeroConfig(auto=True, auto_probe_every=2)
    # Room for the worst case: every candidate tried, with close calls, before and after.
    results = spawn_ranks(_train, 4, (config, [50, 100_000], 2, 60))
    assert all(result["choices"] == results[0]["choices"] for result in results)
    assert all(result["decisions"] == results[0]["decisions"] for result in results)
    first, *later = results[0]["decisions"]
    assert first.choice != "zero3" and first.inter_node_mbit == 50
    # Steady-state medians may move the choice on the slow link; the fast one re-plans.
    replanned = [decision for decision in later if decision.inter_node_mbit == 100_000]
    assert replanned, results[0]["decisions"]
    # On the fast link ZeRO-3 is tried (it could win once its link time vanished).
    assert "zero3" in results[0]["choices"][first.step:]
    assert all(math.isfinite(loss) for loss in results[0]["losses"])


def test_auto_on_one_node_is_exact_zero3():
    auto = spawn_ranks(_train, 4, (ZeroConfig(auto=True), None, 4))[0]
    plain = spawn_ranks(_train, 4, (ZeroConfig(), None, 4))[0]
    assert set(auto["choices"]) == {"zero3"} and auto["decisions"][0].reason.startswith("one node")
    for got, expected in zip(auto["losses"], plain["losses"]):
        assert abs(got - expected) <= 1e-6 * abs(expected)


def _probe(rank, world_size):
    from zeropp.accounting import CommLog
    from zeropp.auto import LinkProbe
    from zeropp.collectives import Communicator

    topology = Topology.from_environment(ranks_per_node=2)
    log = CommLog(topology.layout, rank)
    links = LinkProbe(topology, Communicator(log, device=topology.device)).measure_all()
    return links, log.totals_by_phase()


def test_probe_measures_every_link_and_is_accounted():
    results = spawn_ranks(_probe, 4)
    links, totals = results[0]
    assert all(result[0] == links for result in results)  # the slowest rank's figures, everywhere
    assert 0 < links.inter_node_bytes_per_s < math.inf and 0 < links.intra_node_bytes_per_s < math.inf
    assert links.latency_s > 0
    # Three one-byte gathers and four sized ones across nodes, one inside: all accounted as "auto".
    assert set(totals) == {"auto"} and totals["auto"]["received_inter_node"] > 256 * 1024 // 2


def test_close_calls_are_settled_while_trying_not_in_the_steady_state():
    # Every candidate measured on 3 steps but qwz+qgz, on one, 1% behind zero++.
    seconds = {"zero3": 0.70, "hpz": 0.68, "qwz": 0.66, "qgz": 0.65, "qwz+qgz": 0.606, "zero++": 0.60,
               "zero++-two-hop": 0.64}
    measured = {name: Measurement(step, step - 0.1, 0, samples=1 if name == "qwz+qgz" else 3)
                for name, step in seconds.items()}
    trying = plan_next(CHOICES, measured, 0, WORK, _mbit(100_000), running="zero++")
    assert trying.trial == "qwz+qgz"
    steady = plan_next(CHOICES, measured, 0, WORK, _mbit(100_000), running="zero++", close_calls=False)
    assert (steady.trial, steady.choice) == (None, "zero++")


def test_a_close_call_waits_until_every_candidate_worth_trying_was_tried():
    # zero++ (running) and qwz+qgz within 1% on one step each; the two-hop gather untried.
    measured = {"zero3": Measurement(0.70, 0.40, 0, samples=3), "zero++": Measurement(0.60, 0.50, 0),
                "qwz+qgz": Measurement(0.606, 0.50, 0)}
    choices = {name: CHOICES[name] for name in ("zero3", "qwz+qgz", "zero++", "zero++-two-hop")}
    first = plan_next(choices, measured, 0, WORK, _mbit(100_000), running="zero++")
    assert first.trial == "zero++-two-hop"
    measured["zero++-two-hop"] = Measurement(0.80, 0.55, 0)  # too slow for a second look
    then = plan_next(choices, measured, 0, WORK, _mbit(100_000), running="zero++-two-hop")
    assert then.trial == "zero++"  # the close call, fewer steps first, then the faster
