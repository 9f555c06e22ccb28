"""The command line: help, version, choices, DeepSpeed-file contradictions, output folders
and the demo's report. Nothing here trains a model; the runs are replaced by fakes."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from importlib.metadata import version

import pytest

from zeropp_tools.bench.cells import VARIANTS as BENCH_VARIANTS
from zeropp_tools.bench.cells import is_variant, variant_arguments
from zeropp_tools.cli import demo, training
from zeropp_tools.cli.logs import OUR_LOGGERS, configure_logging
from zeropp_tools.cli.main import main
from zeropp_tools.cli.parser import build_parser, explicitly_given
from zeropp_tools.cli.train_flags import scheme_flags
from zeropp_tools.schemes import named_schemes


@pytest.fixture(autouse=True)
def restore_logging():
    """main() configures logging for the whole process; put it back for other test files."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, {name: logging.getLogger(name).level for name in OUR_LOGGERS})
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def _walk(parser: argparse.ArgumentParser, path: str = "zeropp"):
    """(command path, action) for every action of the parser and all its subparsers."""
    for action in parser._actions:
        yield path, action
        if isinstance(action, argparse._SubParsersAction):
            for pseudo_action in action._choices_actions:
                yield f"{path} {pseudo_action.dest}", pseudo_action
            for name, subparser in action.choices.items():
                yield from _walk(subparser, f"{path} {name}")


def test_every_option_and_subcommand_has_help():
    missing = [
        f"{path}: {'/'.join(action.option_strings) or action.dest}"
        for path, action in _walk(build_parser())
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or not action.help.strip() or action.help == argparse.SUPPRESS)
    ]
    assert not missing, f"options without help: {missing}"


def test_every_subcommand_is_reachable():
    commands = {path for path, _ in _walk(build_parser())}
    for expected in ("zeropp demo", "zeropp train", "zeropp export", "zeropp cluster", "zeropp plan",
                     "zeropp study convergence", "zeropp bench comm", "zeropp bench grad-error",
                     "zeropp bench throughput", "zeropp bench accumulation", "zeropp bench replan", "zeropp bench sweep", "zeropp bench quant"):
        assert expected in commands


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "(default: 300)" in out  # --steps
    assert "ZeRO++ communication:" in out and "checkpoints:" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"zeropp {version('zeropp')}"


@pytest.mark.parametrize("arguments, flag", [
    (["train", "--precision", "fp64"], "--precision"),
    (["train", "--model", "huge"], "--model"),
    (["train", "--weight-bits", "6"], "--weight-bits"),
    (["train", "--gradient-grid", "cubic"], "--gradient-grid"),
    (["train", "--gradient-bits", "3,4"], "--gradient-bits"),
    (["train", "--steps", "0"], "--steps"),
    (["bench", "throughput", "--precision", "int8"], "--precision"),
    (["--log-level", "LOUD", "demo"], "--log-level"),
])
def test_bad_value_names_the_flag(capsys, arguments, flag):
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_missing_deepspeed_config_names_the_path(tmp_path, capsys):
    missing = tmp_path / "no_such_config.json"
    code = main(["train", "--deepspeed-config", str(missing), "--out", str(tmp_path / "run")])
    assert code == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_no_prefetch_without_paper_names_the_flag(capsys):
    assert main(["plan", "--no-prefetch"]) == 2
    assert "--no-prefetch applies to --paper only" in capsys.readouterr().err


def test_kept_weights_without_accumulation_names_the_flag(capsys):
    assert main(["plan", "--keep-weights-between-micro-steps"]) == 2
    assert "give --accumulation 2 or more" in capsys.readouterr().err
    assert main(["plan", "--paper", "--accumulation", "2", "--keep-weights-between-micro-steps"]) == 2
    assert "leave it out with --paper" in capsys.readouterr().err


def test_malformed_deepspeed_config_names_the_path(tmp_path, capsys):
    config = tmp_path / "broken.json"
    config.write_text("{not json")
    assert main(["train", "--deepspeed-config", str(config), "--out", str(tmp_path / "run")]) == 2
    assert f"{config} is not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("flags, file_content, file_key", [
    (["--precision", "fp32"], {"bf16": {"enabled": True}}, "bf16.enabled"),  # typed, though the default
    (["--precision", "bf16"], {"fp16": {"enabled": True}}, "fp16.enabled"),
    (["--batch-per-rank", "4"], {"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu"),
    (["--accumulation", "2"], {"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
    (["--qwz"], {"zero_optimization": {"zero_quantized_weights": False}}, "zero_optimization.zero_quantized_weights"),
    (["--hpz", "1"], {"zero_optimization": {"zero_hpz_partition_size": 2}},
     "zero_optimization.zero_hpz_partition_size"),
    (["--qgz"], {"zero_optimization": {"zero_quantized_gradients": False}},
     "zero_optimization.zero_quantized_gradients"),
])
def test_flag_contradicting_deepspeed_file_is_an_error(tmp_path, capsys, flags, file_content, file_key):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(file_content))
    code = main(["train", "--deepspeed-config", str(config), *flags, "--out", str(tmp_path / "run")])
    assert code == 2
    error = capsys.readouterr().err
    assert flags[0] in error and file_key in error and str(config) in error
    assert not (tmp_path / "run").exists()


def _training_config(tmp_path, argv: list[str]):
    arguments = build_parser().parse_args(argv)
    return training.training_config(arguments, explicitly_given(argv), ranks_per_node=2)


def test_deepspeed_file_and_agreeing_or_unrelated_flags_merge(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
    }))
    merged = _training_config(tmp_path, [
        "train", "--deepspeed-config", str(config), "--precision", "bf16", "--qwz", "--weight-bits", "4",
        "--out", str(tmp_path / "run"),
    ])
    assert merged.zero.compute_dtype == "bf16" and merged.zero.hpz_size == 2  # from the file
    assert merged.zero.quantized_weights and merged.zero.weight_bits == 4  # flags the file does not set
    assert (merged.batch_per_rank, merged.clip, merged.accumulation) == (2, 0.5, 1)


def test_explicitly_given_sees_flags_typed_with_their_default_value():
    assert {"precision", "steps"} <= explicitly_given(["train", "--precision", "fp32", "--steps", "300"])
    assert "precision" not in explicitly_given(["train", "--steps", "3"])


def test_failed_validation_leaves_no_output_folder(tmp_path, capsys):
    out = tmp_path / "runs" / "tiny"
    assert main(["train", "--model", "tiny", "--seq-len", "128", "--out", str(out)]) == 2
    assert "seq_len=128" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_hpz_not_dividing_the_node_fails_before_the_folder(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--hpz", "3", "--world-size", "4", "--ranks-per-node", "2", "--out", str(out)]) == 2
    assert not out.exists()


def test_crash_before_any_step_removes_the_folders_it_created(tmp_path, monkeypatch):
    def crash(arguments, config):
        open(config.metrics_path, "w").close()  # what a rank does before its first step
        raise RuntimeError("rank 1 died")

    monkeypatch.setattr(training, "_train_spawned", crash)
    out = tmp_path / "runs" / "crash"
    with pytest.raises(RuntimeError, match="rank 1 died"):
        main(["train", "--model", "tiny", "--seq-len", "64", "--out", str(out)])
    assert not (tmp_path / "runs").exists()


def test_value_error_in_a_rank_exits_2_and_removes_the_folder(tmp_path, monkeypatch):
    def invalid(arguments, config):
        raise ValueError("bad setting found on rank 0")

    monkeypatch.setattr(training, "_train_spawned", invalid)
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--seq-len", "64", "--out", str(out)]) == 2
    assert not out.exists()


def test_crash_after_some_steps_keeps_the_metrics(tmp_path, monkeypatch, capsys):
    def crash_at_step_two(arguments, config):
        with open(config.metrics_path, "w") as metrics:
            metrics.write('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.9}\n')
        raise RuntimeError("rank 3 died")

    monkeypatch.setattr(training, "_train_spawned", crash_at_step_two)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        main(["train", "--model", "tiny", "--seq-len", "64", "--out", str(out)])
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    error = capsys.readouterr().err
    assert "2 step(s)" in error and str(out / "metrics.jsonl") in error


def test_failure_in_an_existing_folder_removes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def crash(arguments, config):
        raise RuntimeError("boom")

    monkeypatch.setattr(training, "_train_spawned", crash)
    with pytest.raises(RuntimeError):
        main(["train", "--model", "tiny", "--seq-len", "64", "--out", str(out)])
    assert (out / "notes.txt").read_text() == "mine"


def test_cluster_without_a_command_is_a_user_error(capsys):
    assert main(["cluster"]) == 2
    assert "after --" in capsys.readouterr().err


def test_logging_sends_reports_to_stdout_and_errors_to_stderr(capsys):
    configure_logging("INFO")
    logger = logging.getLogger("zeropp_tools.cli.test")
    logger.info("a report line")
    logger.debug("hidden at INFO")
    logger.error("a problem")
    captured = capsys.readouterr()
    assert captured.out == "a report line\n"
    assert captured.err == "zeropp: error: a problem\n"
    configure_logging("ERROR")
    logger.info("hidden at ERROR")
    assert capsys.readouterr().out == ""


def _fake_summary(inter_node_megabytes: list[float], validation_loss: float, tokens_per_s: float) -> dict:
    return {
        "config": {"model_size": "small", "num_parameters": 842_496, "world_size": 4, "num_nodes": 2,
                   "ranks_per_node": 2, "seed": 0},
        "final_train_loss": validation_loss - 0.05,
        "validation_loss": validation_loss,
        "tokens_per_s": tokens_per_s,
        "losses": [5.0 - 0.02 * step for step in range(120)],
        "comm_per_step": {
            f"phase{index}": {"count": 1, "received": int(mb * 1e6), "received_inter_node": int(mb * 1e6)}
            for index, mb in enumerate(inter_node_megabytes)
        },
    }


def test_demo_report_and_plot_from_fake_summaries(tmp_path):
    summaries = {
        "ZeRO-3": _fake_summary([2.0, 2.0, 4.0], validation_loss=2.0, tokens_per_s=20_000),
        "ZeRO++": _fake_summary([0.5, 0.25, 0.25], validation_loss=2.02, tokens_per_s=12_000),
    }
    assert demo.cross_node_bytes(summaries["ZeRO-3"]) == 8_000_000
    report = demo.demo_report(summaries, tmp_path)
    assert "ZeRO-3 / ZeRO++: 8.0x" in report
    assert "+1.00%" in report
    assert "20,000" in report and "8.000" in report and "1.000" in report
    plot = tmp_path / "plots" / "demo.png"
    demo.plot_demo(summaries, plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("variant", sorted(BENCH_VARIANTS))
def test_every_benchmark_variant_trains_the_named_scheme(variant):
    # The flags the bench passes set exactly the scheme's fields on top of the defaults.
    defaults, _ = training.zero_config(build_parser().parse_args(["train"]), explicit=set())
    zero, _ = training.zero_config(build_parser().parse_args(["train", *variant_arguments(variant, 2)]), explicit=set())
    assert zero == replace(defaults, **named_schemes(2)[variant])


def test_scheme_flags_name_a_field_without_a_flag():
    with pytest.raises(ValueError, match="gradient_error_feedback"):
        scheme_flags({"gradient_error_feedback": True})


def test_a_compiled_benchmark_variant_adds_only_the_compile_flag():
    plain, compiled = variant_arguments("deltas", 2), variant_arguments("deltas+compiled", 2)
    assert compiled == [*plain, "--compile-quantization"]
    zero, _ = training.zero_config(build_parser().parse_args(["train", *compiled]), explicit=set())
    assert zero.compile_quantization and zero.weight_deltas
    assert is_variant("zero+++compiled") and not is_variant("zero++-fast")
