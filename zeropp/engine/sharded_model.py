"""ShardedModel: ZeRO-3 over any ``nn.Module``.

Lifecycle of a unit in one training step (docs/design.md section 2)::

    forward pre-hook   gather (or wait for the prefetch), install views, prefetch the next
    forward post-hook  free, and hook the outputs so backward can gather again
    output grad hook   gather before the unit's backward, prefetch the next in backward order
    grad-ready hook    the gathered buffer's gradient is complete: start the reduce-scatter
                       (after waiting for the oldest while ``reductions_in_flight`` are in
                       flight, adding each finished one into its master shard's grad)
    end of backward    finish the reductions still in flight
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..accounting import CommLog
from ..auto import AutoTuner
from ..collectives import Communicator
from ..config import ZeroConfig
from ..sharding import FlatParam, ShardState
from ..init import WeightSource
from ..reduce import QgzReduction
from ..reduce.node_accumulation import NodeAccumulation
from ..simulate.schedule import ScheduleRecorder
from ..topology import Topology
from . import memory_model, metrics
from .checks import check_inputs, check_weight_source, resolve_unit_classes
from .construction import UnitBuilder
from .contract import TorchContract
from .full_parameters import full_parameters
from .gathering import UnitGathering
from .generation import PinnedUnits, generation_mode
from .hook_helpers import checkpointed, tensors_requiring_grad, watch_optimizer_steps
from .nonfinite import NonfiniteTracker
from .frozen_release import FrozenRelease
from .reductions import ReductionQueue
from .schedule import ExecutionOrder
from .strategies import Strategies
from .unit import Unit


class ShardedModel(TorchContract, nn.Module):
    """Wraps ``module`` so that each rank holds 1/W of its parameters at rest.

    ``unit_classes`` names the module classes that become units of their own (for example
    the transformer block class), or is ``"auto"``: a Hugging Face model's
    ``_no_split_modules``, else the class repeated in a ``ModuleList``. Everything else
    belongs to the root unit.
    """

    def __init__(
        self,
        module: nn.Module,
        topology: Topology,
        config: ZeroConfig | None = None,
        unit_classes: tuple[type, ...] | str = (),
        init: WeightSource | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.topology = topology
        self.config = config or ZeroConfig()
        self.config.check_layout(topology.ranks_per_node)
        self.comm_log = CommLog(topology.layout, topology.rank)
        self._comm = Communicator(self.comm_log, check_order=self.config.debug_collective_order, device=topology.device)
        self._world = topology.group("world")
        self._strategies = Strategies(self.config, topology, self._comm)
        builder = UnitBuilder(topology, self.config, self._comm, check_weight_source(module, init, topology.device))
        self.units = builder.build(module, resolve_unit_classes(module, unit_classes))
        self._forward_order = ExecutionOrder()
        self._backward_order = ExecutionOrder()
        self._in_backward = False
        self._reductions = ReductionQueue(self.config.reductions_in_flight)
        self._gradient_sync = True
        self._accumulation: NodeAccumulation | None = None  # made at the first micro-step without sync
        self._gathering = UnitGathering(self.units, self._strategies, self.config)
        self._frozen_release = FrozenRelease(self.units, self._gathering.free_gathered)
        self._nonfinite = NonfiniteTracker()
        self._pinned: PinnedUnits | None = None  # generation mode: units kept gathered
        self._optimizer_stepped = False  # set by any optimizer stepping these parameters
        self._parameter_ids = {id(param) for param in [*self.master_parameters(), *self.parameters()]}
        watch_optimizer_steps(self)
        if self.config.sync_module_states:
            self._broadcast_buffers()
        self._register_hooks()

    # ----------------------------------------------------------------- construction
    def _broadcast_buffers(self) -> None:
        for buffer in self.module.buffers():
            self._comm.broadcast(buffer.data, self._world, source_rank=0, phase="init")

    def _register_hooks(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            if self.config.activation_checkpointing and not unit.is_root:
                unit.module.forward = functools.partial(checkpointed, unit.module.forward)
            for flat in unit.flats:
                if flat.requires_grad:
                    flat.full.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad_ready, flat)
                    )

    # ----------------------------------------------------------------- public
    def forward(self, *args, **kwargs):
        check_inputs(self.topology.device, args, kwargs)
        return self.module(*args, **kwargs)

    def generation_mode(self, max_pinned_units: int | None = None):
        """Context manager: no-grad forwards keep each unit gathered after its first use
        (the root, and at most ``max_pinned_units`` others, least recently used released
        first) until the block ends (see :mod:`zeropp.engine.generation`)."""
        return generation_mode(self, max_pinned_units)

    def generate(self, *args, max_pinned_units: int | None = None, **kwargs):
        """The wrapped module's ``generate`` (built-in GPT, Hugging Face) in generation mode."""
        with self.generation_mode(max_pinned_units):
            return self.module.generate(*args, **kwargs)

    def _refresh_changed_weights(self) -> None:
        """Master shards change under an optimizer step (noticed by a step hook: fused
        kernels leave no other trace) or an in-place edit (noticed by the version counter,
        which the pieces from ``named_parameters`` share): refresh what derives from them."""
        edited = [flat for flat in self.flat_params() if flat.master._version != flat.seen_version]
        if self._optimizer_stepped or edited:
            self.on_weights_changed(include_frozen=any(not flat.requires_grad for flat in edited))

    def owns_parameters_of(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps this model's master shards or their pieces."""
        return any(id(param) in self._parameter_ids for group in optimizer.param_groups for param in group["params"])

    @property
    def communicator(self) -> Communicator:
        """The accounted communicator of this model (for collectives outside the engine)."""
        return self._comm

    def master_parameters(self) -> list[nn.Parameter]:
        """The fp32 shards the optimizer steps on (trainable parameters only)."""
        return [flat.master for unit in self.units for flat in unit.flats if flat.requires_grad]

    def flat_params(self) -> list[FlatParam]:
        return [flat for unit in self.units for flat in unit.flats]

    def full_parameters(self, writeback: bool = True, rank0_only: bool = False):
        """Context manager: the whole fp32 parameters under their names, edits written back
        (see :func:`zeropp.engine.full_parameters.full_parameters`)."""
        return full_parameters(self, writeback, rank0_only)

    def predicted_step_bytes(self, accumulation: int = 1, node_accumulation: bool = False) -> dict[str, dict[str, int]]:
        """The analytic bytes this rank receives per optimizer step of ``accumulation``
        micro-steps (the first ``accumulation - 1`` under :meth:`no_sync` with
        ``node_accumulation``), per phase, intra and inter node."""
        return metrics.predicted_bytes(self, accumulation, node_accumulation)

    def predicted_memory(self, optimizer_state_bytes_per_value: int = 8, activation_bytes: int = 0,
                         node_accumulation: bool = False) -> dict:
        """This rank's bytes per phase and component (resting, forward, backward, optimizer
        step, generation; see :mod:`zeropp.engine.memory_model`). Adam keeps 8 bytes of
        state per value; give the activations when they matter."""
        return memory_model.predicted_memory(self, optimizer_state_bytes_per_value, activation_bytes, node_accumulation)

    def weight_quantization_error(self) -> float | None:
        """Relative L2 error of the gathered weights against the fp32 masters (collective);
        None when nothing is quantized."""
        return metrics.weight_quantization_error(self)

    def set_training_step(self, step: int) -> None:
        """Apply the settings in force at training step ``step`` (``late_bits_from_step``);
        call it before the step's forward."""
        self._strategies.training_step = step
        if self._strategies.update():
            self._drop_copies()

    @property
    def auto_tuner(self) -> AutoTuner | None:
        """Auto mode's tuner (its ``choice`` and ``decisions``), None without auto mode."""
        return self._strategies.auto

    @property
    def active_config(self) -> ZeroConfig:
        """The settings in force now (the schedule's and auto mode's choice applied)."""
        return self._strategies.active_config

    @property
    def weight_gather(self):
        return self._strategies.weight_gather

    @property
    def gradient_reduction(self):
        return self._strategies.gradient_reduction

    def _drop_copies(self) -> None:
        """After a switch of strategies, which start with no copies."""
        self._gathering.free_all()
        for flat in self.flat_params():
            flat.state = ShardState.SHARDED

    def _tune(self) -> None:
        """Auto mode's turn, before the first forward of each training step."""
        if not torch.is_grad_enabled() or self._pinned is not None:
            return
        if self._strategies.tune(metrics.flat_summaries(self), self._optimizer_stepped, self._accumulation is not None):
            self._drop_copies()

    def on_weights_changed(self, include_frozen: bool = False) -> None:
        """Call after the master shards changed: drop stale gathered copies, refresh the
        compute-dtype shards. Frozen parameters keep theirs unless ``include_frozen``
        (they changed too: loaded or edited)."""
        self._gathering.free_all()
        for flat in self.flat_params():
            if flat.requires_grad or include_frozen:
                flat.refresh_compute_shard()
                # Loaded or edited masters may be far from any copy: start copies afresh.
                (self.weight_gather.forget if include_frozen else self.weight_gather.invalidate)(flat)
                flat.state = self._gathering.resting_state(flat)
            flat.seen_version = flat.master._version
        self._optimizer_stepped = False

    # ----------------------------------------------------------------- accumulation
    def zero_grad(self, set_to_none: bool = True) -> None:
        for flat in self.flat_params():
            flat.clear_grad()
        if self._accumulation is not None:
            self._accumulation.clear()
        if self.config.keep_weights_between_micro_steps:  # an accumulation thrown away may leave units gathered
            self._gathering.free_all()

    @contextlib.contextmanager
    def record_schedule(self):
        """Record what this rank issues inside the block, in order: collectives started and
        waited on, and each unit's compute between them. Yields the recorder; its
        ``schedule`` (``reset()`` starts a new one, at a step's start) is what
        ``zeropp.simulate`` replays on other hardware."""
        recorder = ScheduleRecorder(self.topology.world_size, self.topology.ranks_per_node, self.topology.rank)
        previous, self._comm.schedule = self._comm.schedule, recorder  # auto mode's, while it tries candidates
        try:
            yield recorder
        finally:
            self._comm.schedule = previous

    def _record_compute(self, unit: Unit, kind: str) -> None:
        """Report a unit's compute to the recorder the communicator carries, if any."""
        if self._comm.schedule is not None:
            self._comm.schedule.compute(unit.index, kind, sum(flat.numel for flat in unit.flats))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """As FSDP2's: False for the micro-steps before the last of an accumulation.
        Collective (every rank the same). Without sync a unit's gradient is reduced inside
        the node only, each rank keeping the node's sum of its slice [N, S] fp32 (1/D of
        the model); the next backward with sync sends those sums across nodes once
        (docs/design.md section 5.3)."""
        if not requires_gradient_sync and self._accumulation is None:
            self._accumulation = NodeAccumulation(self.topology, self._comm, self.active_config.reduce_torch_dtype)
        self._gradient_sync = bool(requires_gradient_sync)

    def _keeps_weights(self) -> bool:
        """Whether gathered units stay gathered now (``keep_weights_between_micro_steps``):
        through each micro-step without sync, and the forward of the one with sync after them;
        its backward frees each unit as usual."""
        if not self.config.keep_weights_between_micro_steps:
            return False
        if not self._gradient_sync:
            return True
        return not self._in_backward and self._accumulation is not None and self._accumulation.has_sums()

    @contextlib.contextmanager
    def no_sync(self):
        """``with model.no_sync():`` the backward passes inside accumulate inside the node;
        the first backward after the block crosses nodes (see :meth:`set_requires_gradient_sync`)."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    # ----------------------------------------------------------------- hooks
    def _gather_phase(self) -> str:
        return "backward_gather" if self._in_backward else "forward_gather"

    def _pre_forward(self, unit: Unit, module, args):
        if unit.is_root and not self._in_backward:  # also when called as self.module(...), as generate() does
            self._tune()
            self._refresh_changed_weights()
            for flat in self.flat_params():
                flat.drop_cleared_grad()
        if not self._in_backward:
            self._forward_order.observe(unit.index)
        self._gathering.ensure(unit, self._gather_phase())
        if not self._in_backward:
            self._gathering.prefetch(self._forward_order, unit, "forward_gather")
            self._record_compute(unit, "forward")
        if self._pinned is not None:
            self._pinned.install_views(unit)
        else:
            # A recomputation in backward (activation checkpointing) feeds the forward's
            # graph, whose views are already counted.
            unit.install_views(None if self._in_backward else self._on_last_use)
        if torch.is_grad_enabled() and not self._in_backward:
            return self._frozen_release.wrap_inputs(unit, args)
        return None

    def _post_forward(self, unit: Unit, module, args, output):
        if torch.is_grad_enabled():
            for tensor in tensors_requiring_grad(output):
                tensor.register_hook(functools.partial(self._pre_backward, unit))
        if unit.is_root and not self._in_backward:
            self._forward_order.freeze()
        if self._in_backward:
            return None
        if self._pinned is not None and not torch.is_grad_enabled():
            self._pinned.keep(unit)
            return None
        keep_root = unit.is_root and torch.is_grad_enabled() and not self.config.reshard_root_after_forward
        if not keep_root and not self._keeps_weights():
            self._gathering.free(unit)
        return None

    def _pre_backward(self, unit: Unit, grad: torch.Tensor):
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._backward_order.observe(unit.index)
        self._gathering.ensure(unit, "backward_gather")
        self._gathering.prefetch(self._backward_order, unit, "backward_gather")
        if self.config.activation_checkpointing and not unit.is_root:
            self._record_compute(unit, "recompute")
        self._record_compute(unit, "backward")
        return None

    def take_nonfinite_units(self) -> list[str]:
        """Units whose local gradient had NaN or inf since the last call."""
        return self._nonfinite.take()

    def _on_last_use(self, flat: FlatParam) -> None:
        """Backward is about to concatenate ``flat``'s parameter gradients: free the gathered
        values first, so they and the full-size gradient are never alive together."""
        if not self._keeps_weights():
            self._gathering.free_gathered(flat)
        self._frozen_release.trainable_done(flat)

    def _on_grad_ready(self, flat: FlatParam, full: torch.Tensor) -> None:
        grad = full.grad  # [padded_numel], compute dtype
        full.grad = None
        self._nonfinite.observe(flat.name, grad)
        if not self._keeps_weights():
            flat.free_full(self._gathering.resting_state(flat))
        self._reductions.make_room()
        self._reductions.add(flat, self._start_reduction(flat, grad))

    def _start_reduction(self, flat: FlatParam, grad: torch.Tensor):
        reduction = self.gradient_reduction  # the one in force now (auto mode may switch it)
        if not self._gradient_sync or (self._accumulation is not None and self._accumulation.holds(flat)):
            quantized_hop = reduction if isinstance(reduction, QgzReduction) else None
            return self._accumulation.start(flat, grad, final=self._gradient_sync, quantized_hop=quantized_hop)
        return reduction.start(grad, flat.name)

    def _finish_backward(self) -> None:
        self._reductions.finish_all()
        for flat in self.flat_params():
            flat.forget_uses()
        self._frozen_release.reset()
        if not self._keeps_weights():
            self._gathering.free_all()
        self._backward_order.freeze()
        self._in_backward = False
