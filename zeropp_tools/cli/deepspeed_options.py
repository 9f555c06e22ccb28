"""``zeropp train --deepspeed-config FILE``: the file's settings merged with the flags.

The file sets what it names; flags set the rest. A flag typed on the command line that
sets one of the file's settings to another value is an error naming both, because
silently preferring either one trains a model the user did not ask for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from zeropp.config import ZeroConfig
from zeropp.deepspeed_config import PRECISION_KEYS, ZERO_KEYS, load_deepspeed_config

logger = logging.getLogger(__name__)

# zero_optimization key -> the train flag's argparse destination (keys without a flag, like
# overlap_comm, can only come from the file, so they never contradict anything).
ZERO_KEY_FLAGS = {
    "zero_quantized_weights": "qwz",
    "zero_hpz_partition_size": "hpz",
    "zero_quantized_gradients": "qgz",
}
TRAINING_KEY_FLAGS = {
    "train_micro_batch_size_per_gpu": "batch_per_rank",
    "gradient_accumulation_steps": "accumulation",
}


@dataclass(frozen=True)
class FileSetting:
    """One setting the file makes, in the file's words and in the flag's terms."""

    destination: str  # argparse destination of the flag for the same setting
    file_key: str  # e.g. "zero_optimization.zero_hpz_partition_size"
    file_value: object  # as written in the file
    flag_value: object  # the flag value that means the same


def read_deepspeed_file(path: str) -> dict:
    """The file's JSON object; a missing, unreadable or malformed file is a ValueError
    naming the path, not a traceback."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"--deepspeed-config: {path} does not exist")
    try:
        text = file.read_text()
    except OSError as error:
        raise ValueError(f"--deepspeed-config: cannot read {path}: {error.strerror or error}") from None
    try:
        source = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--deepspeed-config: {path} is not valid JSON ({error})") from None
    if not isinstance(source, dict):
        raise ValueError(f"--deepspeed-config: {path} must hold a JSON object, got {type(source).__name__}")
    return source


def file_settings(source: dict) -> list[FileSetting]:
    """The settings of ``source`` that a train flag can also set."""
    settings = []
    zero = source.get("zero_optimization", {})
    if isinstance(zero, dict):  # load_deepspeed_config reports a malformed section
        for key, destination in ZERO_KEY_FLAGS.items():
            if key in zero:
                settings.append(FileSetting(destination, f"zero_optimization.{key}", zero[key], zero[key]))
    for key, destination in TRAINING_KEY_FLAGS.items():
        if key in source:
            settings.append(FileSetting(destination, key, source[key], source[key]))
    precision = _precision_setting(source)
    if precision:
        settings.append(precision)
    return settings


def _precision_setting(source: dict) -> FileSetting | None:
    """A bf16 or fp16 block sets the precision: the enabled one's dtype, or fp32 when every
    block present is disabled. No block at all leaves the precision to --precision."""
    present = [key for key in PRECISION_KEYS if isinstance(source.get(key), dict)]
    if not present:
        return None
    enabled = [key for key in present if source[key].get("enabled", False)]
    if enabled:
        return FileSetting("precision", f"{enabled[0]}.enabled", True, enabled[0])
    return FileSetting("precision", f"{present[0]}.enabled", False, "fp32")


def check_contradictions(arguments, explicit: set[str], settings: list[FileSetting], path: str) -> None:
    for setting in settings:
        if setting.destination not in explicit:
            continue
        given = getattr(arguments, setting.destination)
        if given != setting.flag_value:
            raise ValueError(
                f"{_flag_text(setting.destination, given)} contradicts "
                f"{setting.file_key}={_show(setting.file_value)} in {path}; drop the flag or change the file"
            )


def _flag_text(destination: str, value: object) -> str:
    flag = "--" + destination.replace("_", "-")
    return flag if value is True else f"{flag} {value}"  # on/off flags are typed bare


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def merge_with_file(arguments, explicit: set[str], flags_zero: ZeroConfig) -> tuple[ZeroConfig, dict]:
    """The ZeroConfig of the flags with every field the file sets taken from the file, and
    the file's training settings (batch, accumulation, clipping)."""
    path = arguments.deepspeed_config
    source = read_deepspeed_file(path)
    file_zero, training = load_deepspeed_config(source)  # validates every key and value
    check_contradictions(arguments, explicit, file_settings(source), path)
    fields_from_file = _zero_fields_named(source)
    logger.debug("from %s: %s; training settings %s", path, sorted(fields_from_file), training)
    merged = replace(flags_zero, **{name: getattr(file_zero, name) for name in fields_from_file})
    return merged, training


def _zero_fields_named(source: dict) -> set[str]:
    """ZeroConfig fields the file sets explicitly (the rest keep the flags' values)."""
    named = {ZERO_KEYS[key] for key in source.get("zero_optimization", {}) if ZERO_KEYS.get(key)}
    if _precision_setting(source):
        named.add("compute_dtype")
    return named
