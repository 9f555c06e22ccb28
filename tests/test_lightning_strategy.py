"""ZeroppStrategy and ZeroppFabricStrategy refuse what they cannot do, by name, before any
process starts (the training runs are in tests/test_trainers.py)."""

import pytest
import torch

lightning = pytest.importorskip("lightning", reason="PyTorch Lightning: pip install 'zeropp[lightning]'")
from zeropp.integrations.lightning import ZeroppFabricStrategy, ZeroppStrategy  # noqa: E402


def test_a_precision_other_than_fp32_is_refused_with_the_config_field_to_use():
    fabric = lightning.fabric.Fabric(accelerator="cpu", devices=1, strategy=ZeroppFabricStrategy(),
                                     precision="bf16-mixed")
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*compute_dtype='bf16'"):
        fabric.strategy.setup_module(torch.nn.Linear(2, 2))


def test_deepspeed_json_keys_zeropp_does_not_know_are_refused_by_name():
    with pytest.raises(ValueError, match="bogus"):
        ZeroppStrategy({"zero_optimization": {"stage": 3, "bogus": 1}})


def test_checkpoint_options_fabric_cannot_honour_are_refused():
    strategy = ZeroppFabricStrategy()
    with pytest.raises(ValueError, match="filter"):
        strategy.save_checkpoint("unused", {}, filter={"model": lambda key, value: True})
    with pytest.raises(ValueError, match="scheduler"):
        strategy.setup_module_and_optimizers(torch.nn.Linear(2, 2), [], scheduler=object())
