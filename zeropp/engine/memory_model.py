"""The memory model: what one rank holds in each phase of a training step.

Every term is bytes on this rank, computed from the flat parameters' sizes, the config and
the strategies in force (docs/design.md section 2, "Bounded backward"). Phases:

- ``resting``: between steps, after ``zero_grad``: fp32 masters, compute-dtype shard copies,
  optimizer state, gradient shards (an optimizer over ``model.parameters()`` sets only the
  pieces' grads to None; the shard goes at the next forward), and what the weight gather
  keeps (hpZ parts, qwZ caches, the delta gather's copies).
- ``forward``: the gradient shards released; the root gathered, the computing unit and
  ``prefetch_units`` more gathered, with a quantized gather's receive buffers; activations.
- ``backward``: as forward, plus the gradient shards (all but the computing unit's own at
  the last unit, while the activations are freed), its full-size gradient twice (its pieces and
  their concatenation; its gathered values are freed before) and ``reductions_in_flight``
  reductions with their buffers.
- ``optimizer_step``: resting plus the optimizer's temporaries (torch's single-tensor
  AdamW, the CPU default, holds two the size of the largest parameter piece at a time).
- ``generation``: a no-grad forward in generation mode, every unit kept gathered.

Activations depend on the model and batch: the caller gives them (0 by default).
"""

from __future__ import annotations

from ..reduce import node_accumulation as node_reduction
from ..sharding import FlatParam

FP32 = 4
OPTIMIZER_TEMPORARIES = 2  # fp32 tensors the size of one parameter piece alive in a per-tensor step (measured)


def predicted_memory(model, optimizer_state_bytes_per_value: int = 8, activation_bytes: int = 0,
                     node_accumulation: bool = False) -> dict[str, dict[str, int]]:
    """``{phase: {component: bytes}}`` for this rank; ``"total"`` in each phase sums it.
    ``optimizer_state_bytes_per_value``: 8 for Adam's two fp32 moments, 4 for SGD with
    momentum, 0 without state. ``node_accumulation``: micro-steps under ``no_sync`` keep
    the node's sums of this rank's slices, fp32 [N, S] per trainable flat, until the last,
    and reduce through the node's hop (``zeropp/reduce/node_accumulation.py``); with
    ``keep_weights_between_micro_steps`` they keep every unit gathered as well."""
    config = model.active_config
    layout = model.topology.layout
    flats = model.flat_params()
    trainable = [flat for flat in flats if flat.requires_grad]
    compute_itemsize = config.compute_torch_dtype.itemsize
    gather = model.weight_gather

    def kept(flat: FlatParam) -> int:
        return gather.for_flat(flat.requires_grad).kept_bytes(flat.shard_numel, layout)

    def full(unit) -> int:
        return sum(flat.padded_numel * compute_itemsize for flat in unit.flats)

    def receiving(unit) -> int:  # what a gather holds besides the full buffer (a quantized gather's codes)
        return sum(gather.for_flat(flat.requires_grad).receive_bytes(flat.shard_numel, layout) for flat in unit.flats)

    world = model.topology.group("world")
    backend = "nccl" if model.communicator.native_reduce_scatter(world, model.topology.device) else "gloo"

    def reducing(flat: FlatParam) -> int:
        reduction = model.gradient_reduction
        if node_accumulation:  # every micro-step's hop 1 goes in the reduce dtype, qgZ or not
            return node_reduction.held_bytes(flat.shard_numel, layout, config.reduce_torch_dtype)
        return reduction.held_bytes(flat.shard_numel, layout, backend)

    resting = {
        "masters": sum(flat.shard_numel for flat in flats) * FP32,
        "compute_shards": 0 if compute_itemsize == FP32 else sum(flat.shard_numel for flat in flats) * compute_itemsize,
        "optimizer_state": sum(flat.shard_numel for flat in trainable) * optimizer_state_bytes_per_value,
        "gradient_shards": sum(flat.shard_numel for flat in trainable) * FP32,
        "kept_copies": sum(kept(flat) for flat in flats),
    }
    root = next(unit for unit in model.units if unit.is_root)
    others = [unit for unit in model.units if not unit.is_root]
    # The computing unit and the prefetched ones hold their full buffers; one gather's
    # receive buffers are alive at a time at the peak (a finished gather has dropped its own).
    in_flight = sorted((full(unit) for unit in others), reverse=True)[: 1 + (config.prefetch_units if config.prefetch else 0)]
    receive = max((receiving(unit) for unit in model.units), default=0)
    root_in_forward = 0 if config.reshard_root_after_forward else full(root)
    forward = {**resting, "gradient_shards": 0, "root_gathered": root_in_forward,
               "units_gathered": sum(in_flight) + receive, "activations": activation_bytes}
    reductions = sorted((reducing(flat) for flat in trainable), reverse=True)
    largest_gradient = max((flat.padded_numel * compute_itemsize for flat in trainable), default=0)
    # The peak: while a unit's parameter gradients are concatenated (pieces and the whole,
    # its gathered values freed just before), the next units prefetched and the earlier
    # reductions in flight. Activations are freed as backward goes while gradient shards
    # arrive: the larger of the two counts. The computing unit (the largest, as in
    # gradient_being_built) has no shard yet: ``zero_grad`` cleared the last step's, as a
    # step that reduces once does (accumulating with sync in every micro-step, or
    # ``zero_grad(set_to_none=False)``, keeps it: one shard more). A qgZ reduction released
    # from the queue holds only its inter-node codes, not counted (the measured peak fell
    # when release came).
    own_shard = max((flat.shard_numel * FP32 for flat in trainable), default=0)
    backward = {**resting, "gradient_shards": resting["gradient_shards"] - own_shard,
                "root_gathered": full(root), "units_gathered": sum(in_flight[1:]) + receive,
                "gradient_being_built": 2 * largest_gradient,
                "reductions_in_flight": sum(reductions[: config.reductions_in_flight]),
                "activations": max(0, activation_bytes - resting["gradient_shards"] + own_shard)}
    generation = {**resting, "gradient_shards": 0, "units_gathered": sum(full(unit) for unit in model.units)
                  + max(receiving(unit) for unit in model.units), "activations": activation_bytes}
    largest_piece = max((piece.parameter.numel() for flat in trainable for piece in flat.local_pieces), default=0)
    step = {**resting, "optimizer_temporaries": OPTIMIZER_TEMPORARIES * largest_piece * FP32}
    if node_accumulation:
        # A released reduction (hop 2 in flight, design 5.3) holds its node sums, counted
        # here, and its rows, which were not at the measured peak.
        node_sums = layout.num_nodes * sum(flat.shard_numel for flat in trainable) * FP32
        forward["node_sums"] = backward["node_sums"] = node_sums
        if config.keep_weights_between_micro_steps:
            # Every unit stays gathered, the computing one's values too. The peak is a
            # backward without sync: it gathers nothing (no receive buffers) and makes no
            # gradient shards; the one with sync frees each unit before its shard arrives.
            forward["units_gathered"] = sum(full(unit) for unit in others) + receive
            backward["units_gathered"], backward["gradient_shards"] = sum(full(unit) for unit in others), 0
            backward["activations"] = activation_bytes
    phases = {"resting": resting, "forward": forward, "backward": backward, "optimizer_step": step,
              "generation": generation}
    for components in phases.values():
        components["total"] = sum(components.values())
    return phases


def format_memory(phases: dict[str, dict[str, int]]) -> str:
    """A table: one row per component, one column per phase, MB."""
    names = list(dict.fromkeys(name for components in phases.values() for name in components if name != "total"))
    header = f"{'MB per rank':<22}" + "".join(f"{phase:>16}" for phase in phases)
    rows = [header]
    for name in [*names, "total"]:
        rows.append(f"{name:<22}" + "".join(f"{components.get(name, 0) / 1e6:>16.1f}" for components in phases.values()))
    return "\n".join(rows)
