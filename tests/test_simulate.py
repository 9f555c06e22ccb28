"""The step simulator: the schedule it replays is the engine's (its bytes are the
accounting's), and its timing rules hold on hand-built schedules whose answer is known."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from zeropp.simulate.hardware import Hardware, available
from zeropp.simulate.schedule import Collective, Compute, Issue, Schedule, Wait
from zeropp.simulate.simulator import _received, collective_time, simulate
from zeropp.topology import Layout
from zeropp_tools.dryrun import DryRun, config_for, dry_model, dry_run_schedule, join_fake_world

# A made-up machine with round numbers: 1 TFLOP/s, 1 GB/s adapters at full efficiency,
# no latency, no wave quantization, compute at half speed while a collective runs.
ROUND = Hardware(name="round", sustained_flops=1e12, slowdown_during_communication=0.5, processors=0, tile_m=1,
                 tile_n=1, intra_node_bytes_per_s=10e9, network_adapters_per_node=1, adapter_bytes_per_s=1e9,
                 link_efficiency=1.0, parallel_flows_adapter_bytes_per_s=0.0, base_latency_s=0.0,
                 intra_node_step_latency_s=0.0,
                 inter_node_step_latency_s=0.0, arrival_skew_s=0.0, host_receive_intra_node_bytes_per_s=0.0,
                 host_receive_inter_node_bytes_per_s=0.0, kernel_bytes_per_s=1e12, optimizer_bytes_per_parameter=0,
                 sources={})
WORLD = (0, 1, 2, 3)


def _schedule(events, collectives=(), tokens=1000) -> Schedule:
    return Schedule(4, 2, 0, tokens, 0, list(collectives), list(events))


def _gather(chunk_bytes: int, group=WORLD) -> Collective:
    return Collective("all_gather", "ring", group, chunk_bytes, "forward_gather", "float16")


def test_compute_alone_is_flops_over_the_rate():
    # 2 x 1e6 parameters x 1000 tokens = 2 GFLOP forward, 4 GFLOP backward: 6 ms at 1 TFLOP/s.
    step = simulate(_schedule([Compute(0, "forward", 10**6), Compute(0, "backward", 10**6)]), ROUND)
    assert step.step_s == pytest.approx(6e-3)
    assert step.bottleneck == "compute"


def test_a_hidden_gather_slows_compute_by_the_overlap():
    # A world ring on 2 x 2 brings node 0 three chunks over its adapter: 3 MB, 3 ms. Compute
    # of 10 ms runs at half speed for those 3 ms: 10 + 0.5 x 3 = 11.5 ms.
    events = [Issue(0), Compute(0, "forward", 5 * 10**6), Wait(0)]
    step = simulate(_schedule(events, [_gather(10**6)]), ROUND)
    assert step.inter_node_s == pytest.approx(3e-3)
    assert step.step_s == pytest.approx(11.5e-3)
    assert step.stalled_s == 0


def test_an_exposed_gather_is_waited_for():
    events = [Issue(0), Compute(0, "forward", 5 * 10**5), Wait(0)]  # 1 ms of compute, 30 ms link
    step = simulate(_schedule(events, [_gather(10**7)]), ROUND)
    assert step.step_s == pytest.approx(30e-3)
    assert step.bottleneck == "inter-node link"


def test_collectives_share_their_group_stream_and_the_node_adapters():
    both_on_world = [Issue(0), Issue(1), Wait(0), Wait(1)]
    assert simulate(_schedule(both_on_world, [_gather(10**6), _gather(10**6)]), ROUND).step_s == pytest.approx(6e-3)
    # Inside the node only: no adapter, and other groups run beside.
    inside = _gather(10**7, group=(0, 1))
    events = [Issue(0), Issue(1), Wait(0), Wait(1)]
    step = simulate(_schedule(events, [_gather(10**6), inside]), ROUND)
    assert step.step_s == pytest.approx(max(3e-3, 10**7 / 10e9))


def test_an_inter_node_group_counts_every_rank_of_the_node():
    # Group (0, 2): rank 0 receives one chunk from node 1; rank 1 runs its own copy with
    # rank 3 at the same time, so node 0's adapter carries two chunks.
    time = collective_time(_gather(10**6, group=(0, 2)), Layout(4, 2), 0, ROUND)
    assert time.inter_node_s == pytest.approx(2e-3)
    # Those two copies are two flows across the link: at the rate probed for that pattern.
    shared = replace(ROUND, parallel_flows_adapter_bytes_per_s=0.5e9)
    assert collective_time(_gather(10**6, group=(0, 2)), Layout(4, 2), 0, shared).inter_node_s == pytest.approx(4e-3)
    assert collective_time(_gather(10**6), Layout(4, 2), 0, shared).inter_node_s == pytest.approx(3e-3)  # one ring



def test_the_arrival_skew_delays_a_collective_after_compute_until_a_stall_lines_the_ranks_up():
    skewed = replace(ROUND, arrival_skew_s=2e-3)
    gathers = [_gather(10**6), _gather(10**6)]  # 3 ms each on node 0's adapter
    # 1 ms of compute; the first gather starts 2 ms after it and stalls the ranks until
    # 6 ms, so the second starts at once: 9 ms, not 11.
    step = simulate(_schedule([Compute(0, "forward", 5 * 10**5), Issue(0), Wait(0), Issue(1), Wait(1)], gathers), skewed)
    assert step.step_s == pytest.approx(9e-3)
    # Issued before any compute, the first starts on time and hides under 10 ms of compute
    # (at half speed for its 3 ms: 11.5 ms); its wait does not stall, so the ranks are still
    # apart and the second starts 2 ms after the compute: 11.5 + 2 + 3 ms.
    events = [Issue(0), Compute(0, "forward", 5 * 10**6), Wait(0), Issue(1), Wait(1)]
    assert simulate(_schedule(events, gathers), skewed).step_s == pytest.approx(16.5e-3)


def test_received_bytes_cost_host_time_where_the_host_copies_them():
    # Rank 0 receives the world ring's 3 chunks from rank 3, on node 1: 3 MB over the
    # adapter (3 ms), then 3 MB copied at 1 GB/s on the compute stream (3 ms more).
    gather = _gather(10**6)
    assert _received(gather, Layout(4, 2), 0).inter_node == 3 * 10**6
    copying = replace(ROUND, host_receive_inter_node_bytes_per_s=1e9, host_receive_intra_node_bytes_per_s=1e9)
    step = simulate(_schedule([Issue(0), Wait(0)], [gather]), copying)
    assert step.host_copy_s == pytest.approx(3e-3) and step.step_s == pytest.approx(6e-3)
    assert simulate(_schedule([Issue(0), Wait(0)], [gather]), ROUND).step_s == pytest.approx(3e-3)  # 0: no host copy


@pytest.fixture
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["zero3", "zero++"])
def test_recorded_schedule_moves_the_bytes_the_accounting_counts(fake_world, variant):
    run = DryRun(layers=2, hidden=256, vocabulary=1000, nodes=2, ranks_per_node=4, tokens_per_rank=64, variant=variant)
    join_fake_world(run)
    model, tokens = dry_model(run)
    with model.record_schedule() as recorder:
        for _ in range(2):
            recorder.reset()
            model.comm_log.reset()
            model(tokens[:, :-1], tokens[:, 1:]).backward()
    schedule = recorder.schedule
    layout = Layout(run.world_size, run.ranks_per_node)
    received = [_received(schedule.collectives[event.collective_id], layout, 0)
                for event in schedule.events if isinstance(event, Issue)]
    totals = model.comm_log.totals()
    assert sum(row.inter_node for row in received) == totals["received_inter_node"]
    assert sum(row.intra_node for row in received) == totals["received_intra_node"]
    issued = {event.collective_id for event in schedule.events if isinstance(event, Issue)}
    waited = [event.collective_id for event in schedule.events if isinstance(event, Wait)]
    assert sorted(waited) == sorted(issued)  # every collective issued is waited on, once
    computed = {(event.unit, event.kind) for event in schedule.events if isinstance(event, Compute)}
    assert computed == {(unit, kind) for unit in range(3) for kind in ("forward", "backward")} | {
        (unit, "recompute") for unit in (1, 2)}


def test_slow_adapters_favour_zeropp_in_the_simulated_schedules(fake_world):
    hardware = Hardware.load("v100-dgx2")
    steps = {}
    for variant in ("zero3", "zero++"):
        run = DryRun(layers=2, hidden=1024, vocabulary=4000, nodes=4, ranks_per_node=4, tokens_per_rank=256,
                     variant=variant)
        join_fake_world(run)
        schedule = dry_run_schedule(run)
        steps[variant] = {adapters: simulate(schedule, hardware.with_adapters(adapters, 1e8)) for adapters in (1, 64)}
        dist.destroy_process_group()
    assert steps["zero3"][1].bottleneck == "inter-node link"
    assert steps["zero++"][1].step_s < 0.5 * steps["zero3"][1].step_s
    assert steps["zero++"][1].inter_node_s < 0.3 * steps["zero3"][1].inter_node_s
    assert steps["zero3"][64].step_s < steps["zero3"][1].step_s


def test_without_prefetch_no_gather_overlaps_compute_and_the_step_slows(fake_world):
    # plan --paper --no-prefetch: each gather is waited for before any compute is issued.
    hardware = Hardware.load("v100-dgx2").with_adapters(1)
    run = DryRun(layers=2, hidden=1024, vocabulary=4000, nodes=4, ranks_per_node=4, tokens_per_rank=256)
    steps = {}
    for prefetch in (True, False):
        join_fake_world(run)
        schedule = dry_run_schedule(run, replace(config_for(run), prefetch=prefetch))
        dist.destroy_process_group()
        gathers = {index for index, collective in enumerate(schedule.collectives) if "gather" in collective.phase}
        pending, overlapped = set(), False
        for event in schedule.events:
            if isinstance(event, Issue) and event.collective_id in gathers:
                pending.add(event.collective_id)
            elif isinstance(event, Wait):
                pending.discard(event.collective_id)
            elif isinstance(event, Compute) and pending:
                overlapped = True
        assert overlapped == prefetch
        steps[prefetch] = simulate(schedule, hardware)
    assert steps[False].stalled_s > steps[True].stalled_s
    assert steps[False].step_s > steps[True].step_s


def test_a_recorded_step_keeps_the_host_time_of_each_event_and_the_replay_its_own_clock():
    from zeropp.simulate.schedule import ScheduleRecorder

    recorder = ScheduleRecorder(4, 2, 0)
    recorder.compute(0, "forward", 5 * 10**5)
    recorder.waited(recorder.issued(_gather(10**6)))
    times = [event.at_s for event in recorder.schedule.events]
    assert all(at is not None for at in times) and times == sorted(times)
    # The replay's clock at the same events: compute from 0, the gather issued after its
    # 1 ms, the stream resuming when the 3 ms gather is done.
    replay = simulate(replace(recorder.schedule, tokens_per_rank=1000), ROUND)
    assert replay.event_clock_s == pytest.approx([0.0, 1e-3, 4e-3])
    recorder.reset()
    assert recorder.schedule.events == []
    from zeropp_tools.simulation.compare import timeline_drift

    recorded = _schedule([Compute(0, "forward", 5 * 10**5, 0.0), Issue(0, 0.002), Wait(0, 0.010)], [_gather(10**6)])
    drift = timeline_drift(recorded, ROUND)
    assert [(row["type"], row["recorded_s"]) for row in drift] == [("compute", 0.0), ("issue", 0.002), ("wait", 0.010)]
    assert [row["simulated_s"] for row in drift] == pytest.approx([0.0, 1e-3, 4e-3])


def test_schedules_survive_a_json_round_trip(tmp_path):
    schedule = _schedule([Issue(0, 0.5), Compute(3, "recompute", 7), Wait(0, 1.25)], [_gather(5)])
    schedule.save(tmp_path / "schedule.json")
    assert Schedule.load(tmp_path / "schedule.json") == schedule


def test_every_hardware_description_loads_and_names_its_sources():
    assert {"v100-dgx2", "a100-8gpu", "h100-8gpu"} <= set(available())
    for name in available():
        hardware = Hardware.load(name)
        assert set(hardware.sources) >= {"sustained_flops", "adapter_bytes_per_s", "base_latency_s", "arrival_skew_s"}
    with pytest.raises(ValueError, match="allowed values"):
        Hardware.load("tpu")


def test_wave_quantization_penalises_small_batches_on_a_gpu():
    v100 = Hardware.load("v100-dgx2")
    block = 12 * 6144 * 6144
    assert v100.wave_efficiency(1024, block) < v100.wave_efficiency(2048, block) <= 1.0
    assert replace(v100, processors=0).wave_efficiency(1, block) == 1.0


def test_plan_simulates_every_variant_and_slow_links_favour_zeropp(fake_world):
    from argparse import Namespace

    from zeropp_tools.simulation.planner import plan_hardware, simulate_all, variant_schedules

    args = Namespace(model="tiny", layers=None, hidden=None, vocabulary=None, nodes=2, ranks_per_node=2,
                     tokens_per_rank=256, accumulation=2, activation_checkpointing=False, hardware=None,
                     inter_node_mbit=20.0, rank_gflops=5.0, keep_weights_between_micro_steps=False)
    schedules = variant_schedules(args)
    assert set(schedules) == {"zero3", "qwz", "hpz", "qgz", "zero++"}
    computed = [event for event in schedules["zero3"].events if isinstance(event, Compute)]
    assert sum(event.kind == "forward" for event in computed) == 2 * len({event.unit for event in computed})
    steps = simulate_all(schedules, plan_hardware(args))
    assert min(steps, key=lambda name: steps[name].step_s) == "zero++"
    assert steps["zero3"].bottleneck == "inter-node link"
    # Weights kept between the two micro-steps: ZeRO-3 gathers once instead of twice per
    # micro-step, and the slow link makes that the step's difference.
    kept = variant_schedules(Namespace(**{**vars(args), "keep_weights_between_micro_steps": True}))
    gathers = {name: sum(collective.phase.endswith("gather") for collective in schedule.collectives)
               for name, schedule in (("default", schedules["zero3"]), ("kept", kept["zero3"]))}
    units = len({event.unit for event in computed})
    assert gathers["kept"] == units  # each unit once, in the first forward
    assert gathers["default"] == 2 * (2 * units - 1)  # per micro-step twice, the root (kept through it) once
    assert simulate_all(kept, plan_hardware(args))["zero3"].step_s < 0.7 * steps["zero3"].step_s


def test_a_hugging_face_config_gives_the_plan_its_shape(tmp_path):
    from argparse import Namespace

    from zeropp_tools.simulation.planner import plan_gpt

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 32000}')
    args = Namespace(model="tiny", layers=None, hidden=None, vocabulary=None, tokens_per_rank=2048, hf_config=str(tmp_path))
    gpt = plan_gpt(args)
    assert (gpt.num_layers, gpt.embed_dim, gpt.vocab_size, gpt.num_heads) == (32, 4096, 32000, 32)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 32, "vocab_size": 32000}')
    with pytest.raises(ValueError, match="hidden_size"):
        plan_gpt(args)


def test_the_adapter_probe_counts_the_rings_bytes_into_a_node():
    from zeropp_tools.simulation.calibrate import ring_bytes_into_node

    # 2 x 2: ring 0 -> 1 -> 2 -> 3 -> 0 enters node 0 only over 3 -> 0, three chunks in all.
    assert ring_bytes_into_node(Layout(4, 2), 100) == 300
    assert ring_bytes_into_node(Layout(8, 4), 100) == 700
    assert ring_bytes_into_node(Layout(4, 4), 100) == 0
    # Each rank among its peers on the other nodes: on 2 x 2 a chunk into each of node 0's
    # two ranks; on 4 x 2 three into each.
    peers = lambda layout: (lambda rank: layout.inter_node_ranks(layout.local_index_of(rank)))
    assert ring_bytes_into_node(Layout(4, 2), 100, peers(Layout(4, 2))) == 200
    assert ring_bytes_into_node(Layout(8, 2), 100, peers(Layout(8, 2))) == 600


def test_a_probed_link_replaces_the_shapers_rate_and_an_unprobed_one_loses_tcps_headers():
    from zeropp_tools.cluster import TCP_PAYLOAD_SHARE
    from zeropp_tools.simulation.compare import link_hardware

    probes = {"50": {"adapter_bytes_per_s": 5e6, "parallel_flows_adapter_bytes_per_s": 4e6, "source": "test"}}
    assert link_hardware(ROUND, "none", probes) is ROUND
    assert link_hardware(ROUND, "50", probes).inter_node_bytes_per_s == pytest.approx(5e6)
    assert link_hardware(ROUND, "50", probes).inter_node_rate(2) == pytest.approx(4e6)
    assert link_hardware(ROUND, "200", probes).inter_node_rate(2) == link_hardware(ROUND, "200").inter_node_bytes_per_s
    assert link_hardware(ROUND, "200", probes).inter_node_bytes_per_s == pytest.approx(25e6 * TCP_PAYLOAD_SHARE)
    older = replace(ROUND, link_efficiency=TCP_PAYLOAD_SHARE)  # descriptions that apply TCP's share themselves
    assert link_hardware(older, "200").inter_node_bytes_per_s == pytest.approx(25e6 * TCP_PAYLOAD_SHARE)
    with pytest.raises(ValueError, match="--bandwidths: '1g' is not a link; allowed values: a positive Mbit/s"):
        link_hardware(ROUND, "1g")


def _loaded_probe(rank, world_size):
    import time

    from zeropp import Topology
    from zeropp_tools.simulation import calibrate

    calibrate.LOADED_ROUNDS, calibrate.LOADED_PROBES, calibrate.LINK_CHUNK = 3, 1, 64 << 10  # this rank's module only
    topology = Topology.from_environment(ranks_per_node=2)
    return calibrate._loaded_link(lambda: time.sleep(0.05 if rank == 0 else 0.0), topology)


def test_a_shaped_links_probe_lasts_long_enough_to_dwarf_the_arrival_skew(monkeypatch, tmp_path):
    from zeropp_tools.cluster import payload_bytes_per_s
    from zeropp_tools.simulation import compare
    from zeropp_tools.simulation.calibrate import LINK_CHUNK, PROBE_TRANSFER_S, probe_chunk_bytes

    assert probe_chunk_bytes(3) == LINK_CHUNK  # unshaped: a unit's share, as a step gathers it
    assert probe_chunk_bytes(0) == probe_chunk_bytes(0, 1e8) == LINK_CHUNK  # one node: nothing crosses
    assert probe_chunk_bytes(3, payload_bytes_per_s(50)) == LINK_CHUNK  # 3 MB take half a second at 50 Mbit/s
    fast = payload_bytes_per_s(1000)
    for chunks in (2, 3):  # a flow per rank, the world ring (on 2 x 2)
        assert chunks * probe_chunk_bytes(chunks, fast) == pytest.approx(fast * PROBE_TRANSFER_S, abs=chunks)
        assert probe_chunk_bytes(chunks, fast) > 3 * LINK_CHUNK
    # The benchmark tells each shaped link's probe the shaper's rate.
    calls = []

    def calibration(spec, arguments, out, extra):
        calls.append((spec.bandwidth_mbit, extra))
        out.write_text('{"adapter_bytes_per_s": 1.0}')

    monkeypatch.setattr(compare, "_run_calibration", calibration)
    compare.probe_shaped_links(2, 2, [], ["none", "1000"], tmp_path / "probes.json")
    assert calls == [(1000.0, ["--link-only", "--shaped-mbit", "1000.0"])]


def test_the_loaded_probe_waits_for_the_slowest_ranks_compute():
    from zeropp.launch import spawn_ranks

    for empty, adapter, parallel in spawn_ranks(_loaded_probe, 4):
        # Ranks 1-3 wait out rank 0's 50 ms of compute before each gather: 3/4 of it on average.
        assert 0.03 <= empty < 0.5
        assert 0 < adapter < float("inf") and 0 < parallel < float("inf")


def _calibrate_tiny(rank, world_size):
    from zeropp import Topology
    from zeropp_tools.simulation import calibrate

    # Fewer and smaller probes than a calibration takes: this rank's copy of the module only.
    calibrate.PROBES, calibrate.SLOWDOWN_PAIRS, calibrate.REPEATS, calibrate.LOADED_ROUNDS = 1, 1, 2, 2
    calibrate.LOADED_PROBES = 1
    calibrate.LINK_CHUNK = 64 << 10
    return calibrate.measure("tiny", (2, 16), "fp32", Topology.from_environment(ranks_per_node=2))


def test_the_calibration_measures_every_number_a_description_needs(tmp_path):
    import argparse
    import json

    from zeropp.launch import spawn_ranks
    from zeropp_tools.simulation.calibrate import describe

    measured = spawn_ranks(_calibrate_tiny, 4)[0]
    assert all(value >= 0 for value in measured.values())
    assert measured["sustained_flops"] > 0 and measured["adapter_bytes_per_s"] > 0
    source = {"git_commit": "0" * 40, "machine": {"cpu_model": "test"}}
    arguments = argparse.Namespace(model="tiny", batch_per_rank=2, seq_len=16, precision="fp32")
    path = tmp_path / "cluster.json"
    layout = argparse.Namespace(num_nodes=2, ranks_per_node=2)  # what describe reads of the topology
    path.write_text(json.dumps(describe(measured, arguments, layout, source)))
    hardware = Hardware.load(str(path))
    assert hardware.arrival_skew_s == measured["arrival_skew_s"] and set(hardware.sources) >= set(measured)
    assert hardware.host_receive_inter_node_bytes_per_s == hardware.adapter_bytes_per_s  # unshaped: the cores' copy rate
