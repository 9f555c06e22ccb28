"""The PyTorch contract of a wrapped model: plain torch optimizers over model.parameters(),
state_dict / load_state_dict (sharded and full), torch.distributed.checkpoint with
resharding to another world size."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.checkpoint import DistributedState, optimizer_state_dict
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig

STEPS = 5
BATCH = 4


def build():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


def batch(step):
    tokens = torch.randint(0, 256, (BATCH, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def schedule(step):
    return 1.0 / (1 + step)


def reference_run():
    model = build()
    optimizer = adamw(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*batch(step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, norms, {name: p.detach() for name, p in model.named_parameters()}


def wrap(world_size, options=None):
    return ShardedModel(build(), Topology.from_environment(ranks_per_node=min(2, world_size)),
                        ZeroConfig(**(options or {})), unit_classes=(Block,))


def local_rows(rank, world_size, inputs):
    per = BATCH // world_size
    return [t[rank * per : (rank + 1) * per] for t in inputs]


def mean_over_ranks(value):
    total = value.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()


def train_with_torch_optimizer(rank, world_size, options):
    model = wrap(world_size, options)
    names = [name for name, _ in model.named_parameters()]
    held = sum(p.numel() for p in model.parameters())
    optimizer = adamw(model.parameters())  # a plain torch optimizer over this rank's pieces
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*local_rows(rank, world_size, batch(step)))
        loss.backward()
        norms.append(model.clip_grad_norm_(0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(mean_over_ranks(loss))
    return names, held, losses, norms, model.full_state_dict(rank0_only=True)


@pytest.mark.parametrize("options", [{}, dict(quantized_weights=True, hpz_size=2)])
def test_torch_adamw_over_model_parameters_trains_like_the_unsharded_model(options):
    losses, norms, final = reference_run()
    results = spawn_ranks(train_with_torch_optimizer, 4, (options,))
    assert sum(held for _, held, _, _, _ in results) == sum(p.numel() for p in final.values())
    exact = not options
    for rank, (names, _, got_losses, got_norms, state) in enumerate(results):
        assert sorted(names) == sorted(final)  # original names, the tied weight once, on every rank
        for got, want in zip(got_losses, losses):
            assert abs(got - want) <= (1e-5 if exact else 2e-2) * want, (got_losses, losses)
        if exact:
            assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got_norms, norms)), (got_norms, norms)
        if rank == 0 and exact:  # Adam turns reduction-order noise in near-zero gradients into ~1e-6 moves
            for name, value in final.items():
                torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-4)
        elif rank == 0:  # INT8 weights: the whole model stays close (stale copies would not)
            moved = torch.cat([(state[name] - value).flatten() for name, value in final.items()])
            assert moved.norm() <= 2e-2 * torch.cat([value.flatten() for value in final.values()]).norm()
        else:
            assert state == {}  # rank0_only


def state_dict_round_trip(rank, world_size, full):
    model = wrap(world_size)
    sharded = model.state_dict()
    keys = sorted(sharded)
    assert all(hasattr(value, "local_shards") for name, value in sharded.items() if "weight" in name or "bias" in name)
    torch.manual_seed(5)
    other = GPT(GPTConfig.preset("tiny"))
    result = model.load_state_dict(other.state_dict())
    tokens = batch(0)
    with torch.no_grad():
        loss = model(*tokens).item()
    return keys, result, loss, model.full_state_dict()


def test_state_dict_keys_and_loading_a_full_state_dict():
    results = spawn_ranks(state_dict_round_trip, 2, (True,))
    torch.manual_seed(5)
    other = GPT(GPTConfig.preset("tiny"))
    with torch.no_grad():
        want = other(*batch(0)).item()
    for keys, result, loss, state in results:
        assert keys == sorted(other.state_dict())
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert abs(loss - want) <= 1e-6 * want
        assert all(torch.equal(state[name], value) for name, value in other.state_dict().items())


def inspect_state_dicts(rank, world_size):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = wrap(world_size)
    optimizer = adamw(model.parameters())
    model(*local_rows(rank, world_size, batch(0))).backward()
    optimizer.step()
    answers = {name: (value.numel(), tuple(value.shape), value.dtype, value.device)
               for name, value in model.state_dict().items()}
    moments = {name: state["exp_avg"].numel()
               for name, state in optimizer_state_dict(model, optimizer)["state"].items()}
    errors = []
    for call in (lambda: get_model_state_dict(model), lambda: get_optimizer_state_dict(model, optimizer)):
        with pytest.raises(AttributeError) as raised:
            call()
        errors.append(str(raised.value))
    return answers, moments, errors


def test_state_dict_values_answer_numel_shape_dtype_device_and_torch_state_dict_api_says_what_to_call():
    """Every value answers as the whole (flattened) parameter would; torch's
    get_model_state_dict / get_optimizer_state_dict stop with the calls to use instead."""
    whole = build().state_dict()
    for answers, moments, errors in spawn_ranks(inspect_state_dicts, 4):
        assert sorted(answers) == sorted(whole)
        for name, (numel, shape, dtype, device) in answers.items():
            assert (numel, shape, dtype, device) == (whole[name].numel(), (whole[name].numel(),),
                                                     torch.float32, torch.device("cpu")), name
        assert all(numel == whole[name].numel() for name, numel in moments.items())
        for error in errors:
            assert "model.module." in error and "zeropp.checkpoint.DistributedState(model, optimizer)" in error


def save_with_sharded_optimizer(rank, world_size, folder):
    model = wrap(world_size)
    optimizer = ShardedOptimizer(model, adamw)
    for step in range(3):
        model(*local_rows(rank, world_size, batch(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            dcp.save({"train": DistributedState(model, optimizer)}, checkpoint_id=folder)
    return model.full_state_dict()


def load_into_torch_optimizer(rank, world_size, folder):
    torch.manual_seed(99)
    model = wrap(world_size)  # other weights: the load must replace them
    optimizer = adamw(model.parameters())
    dcp.load({"train": DistributedState(model, optimizer)}, checkpoint_id=folder)
    model(*local_rows(rank, world_size, batch(2))).backward()
    optimizer.step()
    return model.full_state_dict()


def test_distributed_checkpoint_reshards_model_and_optimizer(tmp_path):
    """Saved by 4 ranks through ShardedOptimizer, loaded by 2 into torch.optim.AdamW over
    model.parameters(): the next step matches the run that went on at 4 ranks."""
    continued = spawn_ranks(save_with_sharded_optimizer, 4, (str(tmp_path),))[0]
    resumed = spawn_ranks(load_into_torch_optimizer, 2, (str(tmp_path),))
    for state in resumed:
        for name, value in continued.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-4)
