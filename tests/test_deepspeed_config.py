import json

import pytest

from zeropp.deepspeed_config import load_deepspeed_config

ZERO_PP = {
    "zero_optimization": {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
    },
    "bf16": {"enabled": True},
    "train_micro_batch_size_per_gpu": 4,
}


def test_zeropp_keys_map_onto_our_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO_PP))
    config, training = load_deepspeed_config(path)
    assert config.quantized_weights and config.quantized_gradients and config.hpz_size == 2
    assert config.compute_dtype == "bf16"
    assert training == {"train_micro_batch_size_per_gpu": 4}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"optimizer": {}}, r"unsupported DeepSpeed config keys: \['optimizer'\]"),
        ({"zero_optimization": {"stage": 2}}, "stage 3 only"),
        ({"zero_optimization": {"stage": 3, "offload_param": {}}}, r"\['offload_param'\]"),
        ({"fp16": {"enabled": True}}, "both true"),
        ({"zero_optimization": {"zero_hpz_partition_size": 0}}, "zero_hpz_partition_size"),
        ({"zero_optimization": {"zero_quantized_weights": "yes"}}, "quantized_weights"),
    ],
)
def test_unknown_or_contradictory_keys_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        load_deepspeed_config({**ZERO_PP, **change})
