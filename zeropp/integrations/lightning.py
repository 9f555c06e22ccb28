"""PyTorch Lightning's ``Trainer`` and Lightning Fabric on a zeropp-sharded model
(``pip install 'zeropp[lightning]'``)::

    strategy = ZeroppStrategy(ZeroConfig(quantized_weights=True, hpz_size=8, quantized_gradients=True))
    trainer = lightning.Trainer(strategy=strategy, accelerator="gpu", devices=8, num_nodes=2,
                                gradient_clip_val=1.0, accumulate_grad_batches=4)
    trainer.fit(module)

    fabric = lightning.Fabric(strategy=ZeroppFabricStrategy(config), devices=8, num_nodes=2)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))

The strategy keeps Lightning's DDP strategy's processes, launchers and collectives (the
process group, ``reduce`` for ``self.log(..., sync_dist=True)``, ``barrier``,
``broadcast``) and replaces what DDP does to the model:

- ``setup`` wraps the ``LightningModule`` in a :class:`~zeropp.ShardedModel` (``unit_classes
  ="auto"``: the block class repeated in a ``ModuleList``, e.g. a Hugging Face model's
  decoder layers). A module built under ``trainer.init_module(empty_init=True)`` is on the
  meta device and is initialised one unit at a time (``RunInitializers(seed)``).
- ``configure_optimizers`` runs with ``self.parameters()`` / ``self.named_parameters()``
  answering this rank's fp32 master pieces, so the usual ``AdamW(self.parameters())``
  steps the shards.
- ``gradient_clip_val`` with the norm algorithm clips by the global norm over every rank's
  shards (``ShardedModel.clip_grad_norm_``); Lightning's default would take a per-rank norm.
- ``accumulate_grad_batches``: the micro-batches before the last run under
  ``model.no_sync()``, zeropp's node accumulation (gradients cross nodes once per step).
- Checkpoints are folders: the model and optimizers through ``torch.distributed.checkpoint``
  (resumable at another world size) and ``meta.pt`` with the rest of Lightning's
  checkpoint (loops, schedulers, callbacks). ``Trainer.fit(ckpt_path=folder)`` resumes.
- Precision is the ``ZeroConfig``'s: fp32 masters, ``compute_dtype="bf16"`` for bf16
  compute. ``Trainer(precision=...)`` other than ``"32-true"`` is refused.

:class:`ZeroppFabricStrategy` does the same for Fabric: ``fabric.setup(model, optimizer)``
shards the model and points the optimizer's groups at this rank's pieces of the
parameters they held; ``fabric.init_module(empty_init=True)`` builds
on the meta device; ``fabric.clip_gradients(..., max_norm=)`` takes the global norm;
``fabric.no_backward_sync(model)`` is node accumulation; ``fabric.save`` / ``fabric.load``
write and read the same checkpoint folders.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import lightning.fabric.strategies as fabric_strategies
import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ..checkpoint import load_optimizer_state_dict, optimizer_state_dict
from ..config import ZeroConfig
from ..deepspeed_config import zero_config_from
from ..engine import ShardedModel
from ..init import RunInitializers
from ..topology import Topology

logger = logging.getLogger(__name__)

METADATA_FILE = "meta.pt"  # inside each checkpoint folder: Lightning's state beside the DCP files


class ShardedPrecision(Precision):
    """fp32 as Lightning sees it (zeropp casts itself); clipping by norm over every rank's shards."""

    def __init__(self, strategy: "ZeroppStrategy") -> None:
        super().__init__()
        self._strategy = strategy

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        self._strategy.sharded_model.clip_grad_norm_(float(clip_val))


class ZeroppStrategy(DDPStrategy):
    """``Trainer(strategy=ZeroppStrategy(config))``: ZeRO-3 / ZeRO++ in place of DDP.

    ``config`` is a :class:`~zeropp.ZeroConfig` or a DeepSpeed JSON (path or dict);
    ``ranks_per_node`` defaults to the launcher's ``LOCAL_WORLD_SIZE`` (give it to emulate
    nodes on one machine); ``seed`` seeds the unit-by-unit initialisation of a meta-device
    module.
    """

    strategy_name = "zeropp"

    def __init__(self, config: ZeroConfig | dict | str | Path | None = None, *, ranks_per_node: int | None = None,
                 unit_classes="auto", seed: int = 0, **ddp_arguments) -> None:
        super().__init__(precision_plugin=None, **ddp_arguments)
        self.sharding = Sharding(zero_config_from(config), ranks_per_node, unit_classes, seed)
        self._sharded: ShardedModel | None = None
        self.precision_plugin = ShardedPrecision(self)

    @property
    def sharded_model(self) -> ShardedModel:
        if self._sharded is None:
            raise ValueError("ZeroppStrategy: the model is sharded in Trainer.fit/validate/test/predict's setup; "
                             "there is none yet")
        return self._sharded

    # ------------------------------------------------------------ the model
    def setup(self, trainer: pl.Trainer) -> None:
        requested = trainer._accelerator_connector._precision_flag
        if str(requested) not in ("32-true", "32"):
            raise ValueError(f"Trainer(precision={requested!r}): ZeroppStrategy computes in the ZeroConfig's "
                             "compute_dtype; leave precision at '32-true' and set ZeroConfig(compute_dtype='bf16')")
        self.accelerator.setup(trainer)
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: torch.nn.Module) -> ShardedModel:
        if self._sharded is not None and model in (self._sharded, self._sharded.module):
            return self._sharded  # fit, then validate: the module is sharded already
        self._sharded = self.sharding.shard(model, self.root_device)
        return self._sharded

    def model_to_device(self) -> None:
        """The shards are made on the device; the whole model never moves there."""

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        with torch.device("meta") if empty_init else contextlib.nullcontext():
            yield

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # The LightningModule's own parameters are gone into the flat shards: configure_optimizers
        # sees this rank's pieces under the original names instead, for as long as it runs.
        module = self.lightning_module
        module.named_parameters = self.sharded_model.named_parameters
        try:
            super().setup_optimizers(trainer)
        finally:
            del module.named_parameters

    @contextlib.contextmanager
    def block_backward_sync(self):
        with self.sharded_model.no_sync():
            yield

    # ------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict:
        return self.sharded_model.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer_state_dict(self.sharded_model, _unwrap(optimizer))

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise ValueError("ZeroppStrategy.save_checkpoint: storage_options is not supported (DCP writes the folder)")
        path = Path(self.broadcast(str(filepath)))
        state = {"model": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{index}": optimizer
                      for index, optimizer in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(state, checkpoint_id=path)
        if self.is_global_zero:
            torch.save(checkpoint, path / METADATA_FILE)
        self.barrier("ZeroppStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Collective: the model (and, when fitting, the optimizers) from the DCP files,
        at any world size; returns the rest of Lightning's checkpoint."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / METADATA_FILE).is_file():
            raise ValueError(f"ckpt_path={str(path)!r} is not a checkpoint folder written by ZeroppStrategy "
                             f"(no {METADATA_FILE})")
        optimizers = [_unwrap(optimizer) for optimizer in self.optimizers]
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            optimizers = []
        state = {"model": self.sharded_model.state_dict()}
        state.update({f"optimizer_{index}": optimizer_state_dict(self.sharded_model, optimizer)
                      for index, optimizer in enumerate(optimizers)})
        dcp.load(state, checkpoint_id=path)
        self.sharded_model.load_state_dict(state["model"])
        for index, optimizer in enumerate(optimizers):
            load_optimizer_state_dict(self.sharded_model, optimizer, state[f"optimizer_{index}"])
        return torch.load(path / METADATA_FILE, weights_only=False)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Loaded by :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Loaded by :meth:`load_checkpoint`."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizers must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False


@dataclass(frozen=True)
class Sharding:
    """How both strategies shard a module: the config, the node size, the unit classes and
    the seed of a meta-device module's unit-by-unit initialisation."""

    config: ZeroConfig
    ranks_per_node: int | None
    unit_classes: object
    seed: int

    def shard(self, module: torch.nn.Module, device: torch.device) -> ShardedModel:
        on_meta = any(param.is_meta for param in module.parameters())
        topology = Topology.from_environment(ranks_per_node=self.ranks_per_node, device=device)
        return ShardedModel(module, topology, self.config, unit_classes=self.unit_classes,
                            init=RunInitializers(self.seed) if on_meta else None)


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _NodeAccumulation(_BackwardSyncControl):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        return module.no_sync() if enabled else contextlib.nullcontext()


class ZeroppFabricStrategy(fabric_strategies.DDPStrategy):
    """``Fabric(strategy=ZeroppFabricStrategy(config))``; arguments as :class:`ZeroppStrategy`'s."""

    def __init__(self, config: ZeroConfig | dict | str | Path | None = None, *, ranks_per_node: int | None = None,
                 unit_classes="auto", seed: int = 0, **ddp_arguments) -> None:
        super().__init__(**ddp_arguments)
        self.sharding = Sharding(zero_config_from(config), ranks_per_node, unit_classes, seed)
        self._sharded: ShardedModel | None = None
        self._backward_sync_control = _NodeAccumulation()

    @property
    def sharded_model(self) -> ShardedModel:
        if self._sharded is None:
            raise ValueError("ZeroppFabricStrategy: call fabric.setup(model, optimizer) first")
        return self._sharded

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if scheduler is not None:
            raise ValueError("fabric.setup(..., scheduler=): ZeroppFabricStrategy points the optimizer at the "
                             "shards; create the scheduler afterwards")
        names = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        sharded = self.setup_module(module)
        return sharded, [_over_pieces(optimizer, names, sharded) for optimizer in optimizers], None

    def setup_module(self, module: torch.nn.Module) -> ShardedModel:
        if self.precision.precision not in ("32-true", "32"):
            raise ValueError(f"Fabric(precision={self.precision.precision!r}): ZeroppFabricStrategy computes in "
                             "the ZeroConfig's compute_dtype; leave precision at '32-true' and set "
                             "ZeroConfig(compute_dtype='bf16')")
        self._sharded = self.sharding.shard(module, self.root_device)
        return self._sharded

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.sharded_model.owns_parameters_of(optimizer):
            raise ValueError("fabric.setup_optimizers: the optimizer steps no piece of the sharded model; build it "
                             "over model.parameters() and pass both to fabric.setup(model, optimizer)")
        return optimizer

    def module_to_device(self, module: torch.nn.Module) -> None:
        """The shards are made on the device; the whole model never moves there."""

    def module_init_context(self, empty_init: bool | None = None):
        return torch.device("meta") if empty_init else super().module_init_context(empty_init)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_gradients(norm_type={norm_type}): ZeroppFabricStrategy clips by the L2 norm only")
        return self.sharded_model.clip_grad_norm_(float(max_norm))

    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        """Collective: modules and optimizers through DCP, everything else (stateful objects
        as their state dicts) in ``meta.pt``."""
        if storage_options is not None or filter is not None:
            raise ValueError("ZeroppFabricStrategy.save_checkpoint: storage_options and filter are not supported")
        path = Path(self.broadcast(str(path)))
        tensors, rest = self._split(state)
        dcp.save(tensors, checkpoint_id=path)
        if self.is_global_zero:
            torch.save(rest, path / METADATA_FILE)
        self.barrier()

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None) -> dict:
        """Collective: restores ``state``'s modules and optimizers in place and its other
        entries from ``meta.pt``; returns what the checkpoint holds beyond ``state``."""
        path = Path(self.broadcast(str(path)))
        if not isinstance(state, dict) or not state:
            raise ValueError("fabric.load(path, state): give the dict of objects to restore (the model, the "
                             "optimizer, ...); a sharded checkpoint has no whole copy to hand back")
        if not (path / METADATA_FILE).is_file():
            raise ValueError(f"{str(path)!r} is not a checkpoint folder written by ZeroppFabricStrategy "
                             f"(no {METADATA_FILE})")
        tensors, _ = self._split(state)
        dcp.load(tensors, checkpoint_id=path)
        for key, loaded in tensors.items():
            if isinstance(state[key], ShardedModel):
                state[key].load_state_dict(loaded, strict=strict)
            else:
                load_optimizer_state_dict(self.sharded_model, state[key], loaded)
        rest = torch.load(path / METADATA_FILE, weights_only=False)
        for key in [key for key in state if key not in tensors]:
            if key in rest and _stateful(state[key]):
                state[key].load_state_dict(rest.pop(key))
            elif key in rest:
                state[key] = rest.pop(key)
            elif strict:
                raise ValueError(f"fabric.load: {key!r} is not in the checkpoint (it has {sorted(rest)})")
        return rest

    def _split(self, state: dict) -> tuple[dict, dict]:
        """(DCP's part: module and optimizer state dicts, the rest)."""
        tensors, rest = {}, {}
        for key, value in state.items():
            if isinstance(value, ShardedModel):
                tensors[key] = value.state_dict()
            elif isinstance(value, torch.optim.Optimizer):
                tensors[key] = optimizer_state_dict(self.sharded_model, value)
            elif isinstance(value, torch.nn.Module):
                raise ValueError(f"state[{key!r}] is a module ZeroppFabricStrategy did not shard; "
                                 "pass the one fabric.setup returned")
            else:
                rest[key] = value.state_dict() if _stateful(value) else value
        return tensors, rest


def _stateful(value) -> bool:
    """An object saved as its state dict and restored in place (a scheduler, a sampler)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _over_pieces(optimizer: torch.optim.Optimizer, names: dict[int, list[str]], sharded: ShardedModel):
    """``optimizer``, its groups now holding this rank's pieces of the parameters they held
    (which sharding took out of the module); hyperparameters untouched."""
    if optimizer.state:
        raise ValueError("fabric.setup: the optimizer has stepped already; set it up before its first step")
    pieces = dict(sharded.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        params, seen = [], set()
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError("fabric.setup: the optimizer steps a tensor that is not a parameter of the model")
            for piece in (pieces[name] for name in names[id(param)]):
                if id(piece) not in seen:
                    seen.add(id(piece))
                    params.append(piece)
        group["params"] = params
    return optimizer
