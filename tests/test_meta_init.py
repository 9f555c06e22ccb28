"""Construction at scale: a module built on the meta device, materialized shard by shard,
by its own initialisation or from safetensors files, never whole on any rank."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.init import LoadSafetensors, RunInitializers
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig


def meta_gpt():
    with torch.device("meta"):
        return GPT(GPTConfig.preset("tiny"))


def init_and_report(rank, world_size, seed, options):
    topology = Topology.from_environment(ranks_per_node=min(2, world_size))
    model = ShardedModel(meta_gpt(), topology, ZeroConfig(**options), unit_classes=(Block,),
                         init=RunInitializers(seed=seed))
    state = model.full_state_dict()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return state, loss.item()


def test_initialisation_does_not_depend_on_world_size():
    results = {world: spawn_ranks(init_and_report, world, (7, {})) for world in (1, 2, 4)}
    reference, _ = results[1][0]
    for world, ranks in results.items():
        for state, loss in ranks:
            assert state.keys() == reference.keys()
            assert all(torch.equal(state[name], reference[name]) for name in reference), world
            assert math.isfinite(loss)
    other = spawn_ranks(init_and_report, 1, (8, {}))[0][0]
    assert not torch.equal(other["blocks.0.mlp.up.weight"], reference["blocks.0.mlp.up.weight"])


def test_initialisation_follows_the_modules_own_scheme():
    """Same distributions as the eager model: std 0.02, residual projections scaled, zero
    biases, LayerNorm ones; the tied weight once."""
    state, _ = spawn_ranks(init_and_report, 2, (0, {}))[0]
    eager = dict(GPT(GPTConfig.preset("tiny")).named_parameters(remove_duplicate=False))
    assert set(state) == set(eager)
    layers = GPTConfig.preset("tiny").num_layers
    for name, value in state.items():
        if name.endswith("bias") or name.startswith("ln") or ".ln" in name:
            assert torch.equal(value, eager[name].detach()), name
        else:
            expected = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            assert abs(value.std().item() - expected) < 0.15 * expected, name
    assert torch.equal(state["lm_head.weight"], state["token_embedding.weight"])


def load_and_report(rank, world_size, path):
    topology = Topology.from_environment(ranks_per_node=min(2, world_size))
    source = LoadSafetensors(path)
    model = ShardedModel(meta_gpt(), topology, ZeroConfig(), unit_classes=(Block,), init=source)
    shard_bytes = sum(flat.master.numel() * 4 for flat in model.flat_params())
    return model.full_state_dict(), source.bytes_read, shard_bytes


@pytest.mark.parametrize("sharded_index", [False, True])
def test_pretrained_weights_load_into_shards(tmp_path, sharded_index):
    torch.manual_seed(3)
    eager = GPT(GPTConfig.preset("tiny"))
    weights = {name: p.detach().to(torch.bfloat16 if "mlp" in name else torch.float32).contiguous()
               for name, p in eager.named_parameters()}  # the tied weight saved once, mixed dtypes
    if sharded_index:
        names = sorted(weights)
        halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
        for file, members in halves.items():
            save_file({name: weights[name] for name in members}, tmp_path / file)
        weight_map = {name: file for file, members in halves.items() for name in members}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        path = tmp_path
    else:
        path = tmp_path / "model.safetensors"
        save_file(weights, path)
    results = spawn_ranks(load_and_report, 4, (str(path),))
    for state, bytes_read, shard_bytes in results:
        for name, value in eager.named_parameters(remove_duplicate=False):
            assert torch.equal(state[name], weights.get(name, weights["token_embedding.weight"]).float()), name
        assert bytes_read <= shard_bytes  # only this rank's ranges (bf16 ones at half the bytes)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    assert sum(bytes_read for _, bytes_read, _ in results) == total  # every byte read once, by one rank


def bad_load(rank, world_size, path):
    topology = Topology.from_environment(ranks_per_node=1)
    ShardedModel(meta_gpt(), topology, ZeroConfig(), unit_classes=(Block,), init=LoadSafetensors(path))


def test_missing_weights_and_uninitialised_parameters_are_named(tmp_path):
    eager = GPT(GPTConfig.preset("tiny"))
    weights = {name: p.detach().clone() for name, p in eager.named_parameters() if "blocks.1." not in name}
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(Exception, match=r"not in .*blocks\.1\."):
        spawn_ranks(bad_load, 1, (str(tmp_path / "model.safetensors"),))
    with pytest.raises(Exception, match="meta device"):
        spawn_ranks(init_and_report_without_source, 1)
    with pytest.raises(Exception, match="did not set it"):
        spawn_ranks(init_and_report_with_init_fn, 1)


def init_and_report_without_source(rank, world_size):
    ShardedModel(meta_gpt(), Topology.from_environment(ranks_per_node=1), ZeroConfig(), unit_classes=(Block,))


def init_and_report_with_init_fn(rank, world_size):
    def only_linear(module):  # leaves embeddings and LayerNorms uninitialised
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()

    ShardedModel(meta_gpt(), Topology.from_environment(ranks_per_node=1), ZeroConfig(), unit_classes=(Block,),
                 init=RunInitializers(init_fn=only_linear))


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def construction_peak(rank, world_size, on_meta):
    """Peak resident memory added while building and wrapping (bytes), and the model's fp32 size."""
    topology = Topology.from_environment(ranks_per_node=2)
    ShardedModel(meta_gpt(), topology, ZeroConfig(), unit_classes=(Block,), init=RunInitializers())  # one-time imports
    config = GPTConfig(num_layers=8, num_heads=6, embed_dim=384, block_size=64)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident size
    before = _status_kib("VmRSS")
    with torch.device("meta" if on_meta else "cpu"):
        module = GPT(config)
    model_bytes = 4 * sum(p.numel() for p in module.parameters())
    init = RunInitializers() if on_meta else None
    model = ShardedModel(module, topology, ZeroConfig(), unit_classes=(Block,), init=init)
    peak = (_status_kib("VmHWM") - before) * 1024
    del model
    return peak, model_bytes


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak memory is read from Linux /proc")
def test_no_rank_holds_the_whole_model_while_wrapping_a_meta_model(monkeypatch):
    # Large blocks straight from mmap: freed tensors leave the resident set at once, so the
    # peak measures the tensors alive, not how glibc's heap happened to fragment.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    # Fresh interpreters: glibc reads the threshold at start, which a forked rank skips.
    meta = spawn_ranks(construction_peak, 4, (True,), start_method="spawn")
    eager = spawn_ranks(construction_peak, 4, (False,), start_method="spawn")
    model_bytes = meta[0][1]
    for peak, _ in meta:  # a quarter of the model, plus one unit (an eighth) being initialised
        assert peak < 0.5 * model_bytes, (peak, model_bytes)
    for peak, _ in eager:  # the whole model, then its flat copy
        assert peak > model_bytes, (peak, model_bytes)
