"""Bad input through the public API: each row of the README's table, one test each. Both
ranks make the same mistake, so both raise (a mistake on one rank alone leaves the others
in a collective until the timeout, which tests/test_failures.py covers)."""

import json
import logging

import pytest
import torch
from torch import nn

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.deepspeed_config import load_deepspeed_config
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig


def _wrapped(topology, module=None, unit_classes=(Block,), **config):
    torch.manual_seed(0)
    model = ShardedModel(module or GPT(GPTConfig.preset("tiny")), topology, ZeroConfig(**config), unit_classes)
    return model, ShardedOptimizer(model, lambda params: torch.optim.SGD(params, lr=0.1))


def _tokens(rows=2):
    tokens = torch.randint(0, 256, (rows, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, optimizer, inputs, targets) -> float:
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def wrong_device_then_a_good_step(rank, world_size):
    model, optimizer = _wrapped(Topology.from_environment(ranks_per_node=1))
    inputs, targets = _tokens()
    try:
        model(inputs.to("meta"), targets)
    except ValueError as error:
        message = str(error)
    return message, _step(model, optimizer, inputs, targets)


def test_input_on_another_device_is_named_and_nothing_breaks():
    for message, loss in spawn_ranks(wrong_device_then_a_good_step, 2):
        assert "argument 0 is on meta" in message and ".to('cpu')" in message, message
        assert loss == loss  # finite: the engine is intact after the error


def wrong_dtype_then_a_good_step(rank, world_size):
    model, optimizer = _wrapped(Topology.from_environment(ranks_per_node=1))
    inputs, targets = _tokens()
    try:
        model(inputs.float(), targets)
    except RuntimeError as error:
        message = str(error)
    return message, _step(model, optimizer, inputs, targets)


def test_input_of_the_wrong_dtype_fails_in_the_module_and_nothing_breaks():
    for message, loss in spawn_ranks(wrong_dtype_then_a_good_step, 2):
        assert "Long" in message or "Int" in message, message  # the embedding names the dtype it needs
        assert loss == loss


def empty_batch(rank, world_size):
    model, _ = _wrapped(Topology.from_environment(ranks_per_node=1))
    inputs, targets = _tokens(rows=0)
    model(inputs, targets)


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match=r"empty batch \(shape \(0, 16\)\)"):
        spawn_ranks(empty_batch, 2)


def nan_inputs(rank, world_size, policy):
    topology = Topology.from_environment(ranks_per_node=1)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = ShardedModel(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), topology, ZeroConfig(),
                         (nn.TransformerEncoderLayer,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.SGD(params, lr=0.1), on_nonfinite=policy)
    before = [p.detach().clone() for p in model.master_parameters()]
    inputs = torch.randn(2, 4, 16)
    inputs[0, 0, 0] = float("nan")
    model(inputs).square().mean().backward()
    stepped = optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.master_parameters()))
    return stepped, optimizer.skipped_steps, unchanged


def test_nan_inputs_skip_the_step_or_raise_naming_the_unit():
    for stepped, skipped, unchanged in spawn_ranks(nan_inputs, 2, ("skip",)):
        assert not stepped and skipped == 1 and unchanged
    with pytest.raises(FloatingPointError, match="non-finite gradients, by rank and unit"):
        spawn_ranks(nan_inputs, 2, ("raise",))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.empty(0))  # a zero-size parameter
        self.second = nn.Linear(4, 1)

    def forward(self, x):
        return self.second(self.first(x)) + self.empty.sum()


def unit_classes_matching_nothing(rank, world_size):
    _wrapped(Topology.from_environment(ranks_per_node=1), Tiny(), unit_classes=(Block,))


def test_unit_classes_matching_nothing_name_the_classes_found():
    with pytest.raises(ValueError, match=r"unit_classes=\['Block'\] match no submodule of Tiny; .*'Linear'"):
        spawn_ranks(unit_classes_matching_nothing, 2)


def zero_size_parameter(rank, world_size):
    model, optimizer = _wrapped(Topology.from_environment(ranks_per_node=1), Tiny(), unit_classes=(nn.Linear,))
    losses = []
    for _ in range(3):
        loss = model(torch.ones(2, 4)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict()["empty"].shape


def test_zero_size_parameter_trains():
    for losses, shape in spawn_ranks(zero_size_parameter, 2):
        assert losses[2] < losses[0] and shape == (0,)


def test_without_unit_classes_the_single_unit_is_announced(caplog):
    from zeropp.engine.checks import check_unit_classes

    with caplog.at_level(logging.WARNING, logger="zeropp"):
        check_unit_classes(Tiny(), (), num_units=1)
    assert "single unit" in caplog.text


# A checkpoint of another world size with a different model: tests/test_checkpoint.py,
# test_checkpoint_from_another_model_is_rejected (saved on 4 ranks, loaded on 1).


def test_deepspeed_auto_values_resolve_and_tuning_hints_warn(caplog):
    source = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "overlap_comm": "auto",
                                    "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 5e7},
              "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 10}
    with caplog.at_level(logging.INFO, logger="zeropp"):
        config, training = load_deepspeed_config(source)
    assert config.quantized_weights and config.prefetch and config.compute_dtype == "fp32" and training == {}
    assert "zero_optimization.stage3_prefetch_bucket_size" in caplog.text and "steps_per_print" in caplog.text


def test_deepspeed_keys_that_change_training_are_errors():
    with pytest.raises(ValueError, match=r"\['offload_optimizer'\]"):
        load_deepspeed_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=r"\['scheduler'\]"):
        load_deepspeed_config({"scheduler": {"type": "WarmupLR"}})


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'ds.json'} does not exist"):
        load_deepspeed_config(tmp_path / "ds.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_deepspeed_config(tmp_path / "bad.json")


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_auto_unit_classes_find_the_repeated_blocks():
    from zeropp.sharding import auto_unit_classes

    assert auto_unit_classes(GPT(GPTConfig.preset("tiny"))) == (Block,)
    assert auto_unit_classes(Stack()) == (nn.Sequential,)
    hugging_face_like = Stack()
    hugging_face_like._no_split_modules = ["Linear"]
    assert auto_unit_classes(hugging_face_like) == (nn.Linear,)
    assert auto_unit_classes(Tiny()) == ()
