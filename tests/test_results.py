"""``make results``: figures rendered from the stored JSON, held to one clean commit."""

import json
from pathlib import Path

import pytest

from zeropp_tools.bench.provenance import RESULTS_FOLDER
from zeropp_tools.results import runner
from zeropp_tools.results.render import BLOCK, RENDERED_FILES, StoredResults, render_files, render_text

REPOSITORY = Path(__file__).resolve().parents[1]

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MACHINE = {"cpu_model": "Test CPU", "cores": 2, "cpu_flags": ["avx2"]}


def _comm_report(commit: str, clean: bool, inter_node: int = 210) -> dict:
    def row(inter):
        bytes_ = {"intra_node": 100, "inter_node": inter}
        return {"measured": bytes_, "predicted": dict(bytes_), "inter_node_vs_zero3": inter / 1000}

    return {"layouts": {"2x2": {"zero3": row(1000), "zero++": row(inter_node)}},
            "provenance": {"git_commit": commit, "clean_tree": clean, "machine": MACHINE, "cpu_capability": "AVX2",
                           "torch": "2.13.0", "command": "zeropp bench comm --layouts 2x2"}}


def _results(folder: Path, report: dict) -> StoredResults:
    (folder / "quick").mkdir(parents=True)
    (folder / "quick" / "comm.json").write_text(json.dumps(report))
    return StoredResults(folder)


TEXT = "Before.\n<!-- results: bytes -->\nold text\n<!-- /results -->\nAfter.\n"


def test_a_block_is_written_from_the_json_and_a_figure_edited_by_hand_differs(tmp_path):
    rendered = render_text(TEXT, _results(tmp_path, _comm_report(COMMIT, True)))
    words = " ".join(rendered.split())  # the bullet is wrapped
    assert "0.210x of ZeRO-3's bytes per step on 2x2" in words and "equal to the analytic prediction" in words
    assert rendered.startswith("Before.\n") and rendered.endswith("<!-- /results -->\nAfter.\n")
    assert render_text(rendered, StoredResults(tmp_path)) == rendered  # rendering again changes nothing
    edited = rendered.replace("0.210x", "0.200x")
    assert render_text(edited, StoredResults(tmp_path)) != edited


@pytest.mark.parametrize("commit,clean", [(COMMIT + "-dirty", False), (COMMIT, False), (None, False)])
def test_a_result_from_a_dirty_tree_or_without_a_commit_is_not_cited(tmp_path, commit, clean):
    with pytest.raises(ValueError, match="not at a clean commit"):
        render_text(TEXT, _results(tmp_path, _comm_report(commit, clean)))


def test_one_block_cannot_cite_two_commits(tmp_path):
    results = _results(tmp_path, _comm_report(COMMIT, True))
    (tmp_path / "quick" / "other.json").write_text(json.dumps(_comm_report("f" * 40, True)))
    results.load("quick/comm.json")
    results.load("quick/other.json")
    with pytest.raises(ValueError, match="2 commits"):
        results.commit()


def test_an_unknown_block_name_is_an_error_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="names no section; known: .*'bytes'"):
        render_text("<!-- results: byts -->\n<!-- /results -->\n", StoredResults(tmp_path))


def test_a_tier_refuses_a_dirty_tree_and_a_resume_at_another_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "provenance", lambda: {"git_commit": COMMIT + "-dirty", "clean_tree": False})
    with pytest.raises(ValueError, match="uncommitted changes"):
        runner.run_tier("quick", tmp_path)
    with pytest.raises(ValueError, match="--tier 'fast' is not a tier; allowed values: \\['full', 'quick'\\]"):
        runner.run_tier("fast", tmp_path)
    folder = tmp_path / "benchmarks" / "results" / "quick"
    folder.mkdir(parents=True)
    (folder / runner.MANIFEST).write_text(json.dumps({"provenance": {"git_commit": "f" * 40}, "runs": {}}))
    with pytest.raises(ValueError, match="one tier holds one commit"):
        runner._start_manifest(folder, "quick", {"git_commit": COMMIT}, resume=True, restarting=set())


def test_a_fresh_start_of_some_runs_keeps_the_other_runs_records_at_the_same_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "provenance", lambda: {"git_commit": COMMIT, "clean_tree": True})
    monkeypatch.setattr(runner, "_execute", lambda run, *rest, **options: {"command": [run.name], "exit_code": 0,
                                                                           "minutes": 1.0})
    runner.run_tier("full", tmp_path, only=["paper", "comm"])
    runner.run_tier("full", tmp_path, only=["comm"])
    manifest = json.loads((tmp_path / RESULTS_FOLDER / "full" / runner.MANIFEST).read_text())
    assert sorted(manifest["runs"]) == ["comm", "paper"]
    monkeypatch.setattr(runner, "provenance", lambda: {"git_commit": "f" * 40, "clean_tree": True})
    runner.run_tier("full", tmp_path, only=["comm"])
    manifest = json.loads((tmp_path / RESULTS_FOLDER / "full" / runner.MANIFEST).read_text())
    assert sorted(manifest["runs"]) == ["comm"]  # another commit's records do not stay


def test_a_tier_runs_only_the_named_runs_and_names_the_allowed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "provenance", lambda: {"git_commit": COMMIT, "clean_tree": True})
    executed = []
    monkeypatch.setattr(runner, "_execute", lambda run, *rest, **options: executed.append(run.name) or
                        {"command": [], "exit_code": 0, "minutes": 0.0})
    assert runner.run_tier("full", tmp_path, only=["paper", "comm"]) == 0
    assert executed == ["comm", "paper"]
    with pytest.raises(ValueError, match="--runs convergnce: not runs of the full tier; allowed values: .*'convergence'"):
        runner.run_tier("full", tmp_path, only=["convergnce"])


def test_the_readme_and_the_results_pages_state_what_the_stored_results_give():
    differences = render_files(REPOSITORY, REPOSITORY / RESULTS_FOLDER, write=False)
    assert not differences, "edit the JSON's source, not the figures: `zeropp results render`\n" + "\n".join(differences)
    readme_blocks = {match["name"] for match in BLOCK.finditer((REPOSITORY / "README.md").read_text())}
    assert {"bytes", "throughput", "accumulation", "memory", "convergence"} <= readme_blocks
    assert all(BLOCK.search((REPOSITORY / path).read_text()) for path in RENDERED_FILES)


def test_the_convergence_table_is_written_from_the_summary_read_back(tmp_path):
    from zeropp_tools.results.sections import convergence_table

    assert "Not yet run" in convergence_table(StoredResults(tmp_path))
    rows = {"zero3": ([1.40, 1.38], [0.0, 0.0], 0.0, None), "zero++": ([1.41, 1.39], [0.714, 0.725], 0.72, 0.005)}
    report = {"seeds": [0, 1], "noise_band_percent": 1.44, "versus_zero_pp": {},
              "runs": {name: {"final_validation_loss": {str(seed): loss for seed, loss in enumerate(losses)},
                              "gap_percent": {str(seed): gap for seed, gap in enumerate(gaps)},
                              "mean_gap_percent": mean, "gap_standard_error": error,
                              "node_link_bytes_per_step": 8e6, "resting_bytes_per_rank": None}
                       for name, (losses, gaps, mean, error) in rows.items()},
              "provenance": {**_comm_report(COMMIT, True)["provenance"], "command": "zeropp study convergence"}}
    (tmp_path / "full" / "convergence").mkdir(parents=True)
    (tmp_path / "full" / "convergence" / "summary.json").write_text(json.dumps(report))
    table = convergence_table(StoredResults(tmp_path))
    assert "| zero++ | 1.4100 | 1.3900 | +0.71%, +0.72% | +0.72% ± 0.01 | 8.000 | - |" in table
    assert "2 seeds per variant" in table and "(max - min over mean): 1.44%" in table


def _throughput_report(bandwidths: dict[str, dict[str, float]], commit: str = COMMIT) -> dict:
    """A stored throughput.json with ``bandwidths``: {bandwidth: {variant: tokens/s}}."""
    from zeropp_tools.bench.throughput import ratios

    results = {bandwidth: {variant: {"tokens_per_s": rate, "tokens_per_s_runs": [rate],
                                     **({"auto_decisions": [{"choice": "zero++"}]} if variant == "auto" else {})}
                           for variant, rate in row.items()} for bandwidth, row in bandwidths.items()}
    return {"results": results, "ratios": ratios(results), "repetitions": 3, "layout": "2x2",
            "train_arguments": ["--model", "medium"], "precision": {"compute_dtype": "bf16", "why": "native"},
            "provenance": {**_comm_report(commit, True)["provenance"], "torch": "2.13.0",
                           "command": "zeropp bench throughput"}}


def _write(folder: Path, relative: str, report: dict) -> None:
    (folder / relative).parent.mkdir(parents=True, exist_ok=True)
    (folder / relative).write_text(json.dumps(report))


def test_the_readme_throughput_line_comes_from_the_full_matrix_and_states_auto_mode_once_they_exist(tmp_path):
    from zeropp_tools.results.sections import throughput_auto, throughput_bullet

    peers = {"fsdp2-hsdp": 500.0, "deepspeed-zero++": 400.0}
    _write(tmp_path, "quick/throughput/throughput.json",
           _throughput_report({"none": {"zero3": 2000.0, "zero++": 1800.0, **peers},
                               "200": {"zero3": 400.0, "zero++": 1200.0, **peers}}, "f" * 40))
    assert "at 200 Mbit/s ZeRO++ trains at 3.00x" in " ".join(throughput_bullet(StoredResults(tmp_path)).split())
    assert "Not yet run" in throughput_auto(StoredResults(tmp_path))
    _write(tmp_path, "full/throughput/throughput.json",
           _throughput_report({"none": {"zero3": 2000.0, "zero++": 1800.0, "hpz": 1900.0, **peers},
                               "50": {"zero3": 100.0, "zero++": 500.0, "hpz": 300.0, **peers}}))
    _write(tmp_path, "full/auto/throughput.json",
           _throughput_report({"none": {"zero3": 2000.0, "zero++": 1800.0, "auto": 1900.0}}))
    auto_50 = _throughput_report({"50": {"zero3": 100.0, "zero++": 500.0, "auto": 450.0}})
    _write(tmp_path, "full/auto_50/throughput.json", auto_50)
    words = " ".join(throughput_bullet(StoredResults(tmp_path)).split())
    assert "at 50 Mbit/s ZeRO++ trains at 5.00x" in words
    assert "auto mode unshaped 0.95x, 50 Mbit/s 0.90x of the best scheme it can choose" in words
    auto_50["provenance"]["machine"] = {**MACHINE, "cpu_model": "Other CPU"}  # a later sitting's machine
    _write(tmp_path, "full/auto_50/throughput.json", auto_50)
    words = " ".join(throughput_bullet(StoredResults(tmp_path)).split())
    assert "auto mode unshaped 0.95x, 50 Mbit/s 0.90x (on Other CPU) of the best scheme" in words
    table = throughput_auto(StoredResults(tmp_path))
    assert "| unshaped | 1,900 | zero++ | zero3 | 2,000 | 0.95x |" in table
    assert "| 50 Mbit/s | 450 | zero++ | zero++ | 500 | 0.90x |" in table


def test_a_run_killed_midway_is_resumed_with_what_its_benchmark_had_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "provenance", lambda: {"git_commit": COMMIT, "clean_tree": True})
    monkeypatch.setattr(runner.os, "geteuid", lambda: 0)  # the throughput run shapes links: root only

    def killed(run, *rest, **options):
        raise KeyboardInterrupt  # the sitting ends while the benchmark runs

    monkeypatch.setattr(runner, "_execute", killed)
    with pytest.raises(KeyboardInterrupt):
        runner.run_tier("full", tmp_path, only=["throughput"])
    resumed = []
    monkeypatch.setattr(runner, "_execute", lambda run, *rest, resume: resumed.append(resume) or
                        {"command": [], "exit_code": 0, "minutes": 1.0})
    assert runner.run_tier("full", tmp_path, resume=True, only=["throughput"]) == 0
    assert resumed == [True]  # the benchmark is told to keep its runs, not to start over
    manifest = json.loads((tmp_path / RESULTS_FOLDER / "full" / runner.MANIFEST).read_text())
    assert manifest["runs"]["throughput"]["exit_code"] == 0
