"""Configuration of the sharded engine: one frozen object, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import math

import torch

from .quantization import BlockFormat
from .quantization.blocks import GRIDS

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def parse_dtype(field_name: str, value: str | torch.dtype) -> torch.dtype:
    """Turn ``"bf16"`` or ``torch.bfloat16`` into a dtype, naming the field on error."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"{field_name}={value!r} is not supported; allowed values: {sorted(DTYPES)}")


GRADIENT_SCALE_DTYPES = ("fp32", "bf16")
QUANTIZATION_BITS = (4, 8, 12)  # qwZ and qgZ; the 2- and 3-bit formats are for weight changes
DELTA_BITS = (2, 3, 4, 8)
AUTO_CHOSEN_FIELDS = ("quantized_weights", "two_hop_weight_gather", "hpz_size", "quantized_gradients", "weight_deltas")

FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    "precision": ("compute_dtype", "reduce_dtype"),
    "gather": ("quantized_weights", "weight_bits", "two_hop_weight_gather", "hpz_size", "quantization_block_size",
               "quantized_nontrainable_weights", "weight_deltas", "weight_delta_bits"),
    "reduce": ("quantized_gradients", "gradient_bits_intra_node", "gradient_bits_inter_node", "gradient_grid_inter_node",
               "gradient_chunks", "gradient_hadamard", "gradient_error_feedback", "gradient_stochastic_rounding",
               "gradient_scale_dtype"),
    "schedule": ("late_bits_from_step", "late_weight_bits", "late_gradient_bits_inter_node"),
    "auto": ("auto", "auto_probe_every"),
    "engine": ("prefetch", "prefetch_units", "reductions_in_flight", "keep_weights_between_micro_steps",
               "reshard_root_after_forward", "sync_module_states", "activation_checkpointing",
               "shard_alignment", "compile_quantization", "debug_collective_order"),
}
"""The config's fields by what they configure (the README's options table follows it)."""


@dataclass(frozen=True)
class ZeroConfig:
    """How a model is sharded and communicated. Every field has a safe default."""

    # --- Precision: what computes and what travels.
    compute_dtype: str = "fp32"
    """Dtype of gathered weights and of forward/backward compute ("fp32", "bf16", "fp16")."""
    reduce_dtype: str | None = None
    """Dtype gradients are communicated in; None means the compute dtype."""

    # --- Weight gather (docs/design.md section 4): plain, qwZ, two-hop, with or without hpZ.
    quantized_weights: bool = False
    """qwZ: the weight all-gather carries block-quantized codes plus fp32 scales."""
    weight_bits: int = 8
    """Bits per weight value in the qwZ gather (8 as in ZeRO++, 4, or 12)."""
    two_hop_weight_gather: bool = False
    """Gather weights in two hops: this node's shards exact inside the node, only the other
    nodes' shards across nodes (quantized with qwZ). Each node link carries W - D shards
    instead of the ring's W - 1; the backward hpZ copy is then kept in the compute dtype."""
    hpz_size: int = 1
    """hpZ: ranks per secondary partition group (1 disables; must divide the ranks per node)."""
    quantization_block_size: int = 256
    """Values per quantization block (one fp32 scale each), for weights and gradients."""
    quantized_nontrainable_weights: bool = False
    """MixZ++: frozen parameters are gathered block-quantized (``weight_bits``) whatever
    ``quantized_weights`` says, and with hpZ their packed copy stays inside the node for
    good: after their first gather they never cross the node link again."""
    weight_deltas: bool = False
    """Delta gather: weights travel in the two-hop shape, and across nodes only the change of
    each shard since the copy the other nodes hold, block-quantized to ``weight_delta_bits``.
    Sender and receivers add the same dequantized change to their copies, which stay
    bit-identical, and what rounding left out is part of the next change, so the error stays
    within one step's quantization. The copy is also the backward gather's, inside the node
    (it replaces hpZ and qwZ: leave ``hpz_size``, ``quantized_weights`` and
    ``two_hop_weight_gather`` at their defaults). Costs an fp32 copy of 1/(ranks per node)
    of the model per rank."""
    weight_delta_bits: int = 3
    """Bits per value of the weight changes the delta gather sends across nodes (2, 3, 4, 8);
    3 keeps a node link under half of ZeRO++'s bytes with 4-bit gradients (docs/results/convergence.md)."""

    # --- Gradient reduction (docs/design.md section 5): plain or qgZ and its options.
    quantized_gradients: bool = False
    """qgZ: reduce-scatter gradients by a two-hop quantized all-to-all."""
    gradient_bits_intra_node: int = 4
    """Bits per gradient value on the intra-node hop of qgZ."""
    gradient_bits_inter_node: int = 4
    """Bits per gradient value on the inter-node hop of qgZ."""
    gradient_grid_inter_node: str = "uniform"
    """Levels of the inter-node hop of qgZ: ``"uniform"`` (INT codes) or ``"log"`` (4 bits:
    absmax times 0 and +-2^-6 ... 2^0, the same bytes as INT4; each value keeps its size to
    within a third, which is what Adam, dividing by each value's own scale, needs)."""
    gradient_chunks: int = 2
    """qgZ pipelines each bucket in this many chunks so the two hops overlap."""
    gradient_hadamard: int = 0
    """qgZ: rotate groups of this many values (a power of two, e.g. 32) by a Hadamard
    transform before quantizing; 0 disables. Sums stay in the rotated domain."""
    gradient_error_feedback: bool = False
    """qgZ: carry each rank's inter-node quantization error into its next step (LoCo-style)."""
    gradient_stochastic_rounding: bool = False
    """qgZ: round gradient codes stochastically (unbiased) instead of to nearest."""
    gradient_scale_dtype: str = "fp32"
    """qgZ: dtype of each block's scale on the wire, ``"fp32"`` or ``"bf16"`` (2 bytes, so
    128-value blocks cost what 256-value blocks cost with fp32 scales)."""

    # --- Schedule: settings that change at a training step.
    late_bits_from_step: int = 0
    """From this training step on use ``late_weight_bits`` and ``late_gradient_bits_inter_node``
    (0: never). INT4 gradients slow the early, fast-falling phase of training and INT8
    weights the late one (AdamW's steps shrink below an INT8 quantum as the learning rate
    decays), so a run can spend the same bytes on the gradients first and the weights
    later. Applied by ``ShardedModel.set_training_step``, which ``zeropp train`` calls."""
    late_weight_bits: int = 12
    """qwZ bits per weight from ``late_bits_from_step`` on."""
    late_gradient_bits_inter_node: int = 4
    """qgZ inter-node bits from ``late_bits_from_step`` on."""

    # --- Auto mode (docs/design.md section 11).
    auto: bool = False
    """Choose qwZ / hpZ / qgZ / the two-hop gather for the network found: probe the links at
    the first step, try the candidates that could win, run the fastest, and re-plan when the
    inter-node bandwidth moves by more than 2x. Overrides those four fields; bits, grids and
    block size stay as set here. Flat buffers are laid out for every candidate."""
    auto_probe_every: int = 5
    """Auto mode: training steps between two probes of the inter-node bandwidth."""

    # --- Engine: overlap, memory, start-up and debugging.
    prefetch: bool = True
    """Gather the next unit asynchronously while the current one computes."""
    prefetch_units: int = 1
    """With ``prefetch``: how many units ahead have their gathers in flight. 2 keeps the
    inter-node link busy while the next unit's within-node hop and dequantization run (the
    two-hop gather), at the memory of one more gathered unit."""
    reductions_in_flight: int = 1
    """Gradient reductions in flight at once during backward; a new one first waits for the
    oldest (1, as in FSDP2: one reduction overlaps the next unit's backward). Each holds its
    unit's full-size gradient until its collective completes, so memory grows with it."""
    keep_weights_between_micro_steps: bool = False
    """Gradient accumulation under ``no_sync``: a unit gathered in a micro-step without
    gradient sync stays gathered until the backward with sync frees it, so later
    micro-steps gather nothing (FSDP2's ``set_reshard_after_backward(False)`` and
    ``reshard_after_forward=False`` for those micro-steps). Costs every unit's full weights
    in the compute dtype for the accumulation (M values per rank, as DDP)."""
    reshard_root_after_forward: bool = False
    """Free the root unit after forward; False keeps it for backward, which needs it first."""
    sync_module_states: bool = True
    """Broadcast rank 0's initial weights so every rank starts from the same model."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in backward instead of storing them."""
    shard_alignment: int = 1
    """Each rank's shard length is a multiple of this many elements."""
    compile_quantization: bool = False
    """Run the torch quantization kernel through torch.compile (compiles once per shape)
    where the native CPU kernels do not apply: CUDA tensors, INT2/3 codes, CPUs without a
    C compiler. The same codes either way."""
    debug_collective_order: bool = False
    """Before every collective, check that all ranks issue the same one (slow; for hangs)."""

    def __post_init__(self) -> None:
        parse_dtype("compute_dtype", self.compute_dtype)
        if self.reduce_dtype is not None:
            parse_dtype("reduce_dtype", self.reduce_dtype)
        for item in fields(self):
            value = getattr(self, item.name)
            if item.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{item.name} must be true or false, got {value!r}")
        if not isinstance(self.late_bits_from_step, int) or self.late_bits_from_step < 0:
            raise ValueError(f"late_bits_from_step must be an integer >= 0, got {self.late_bits_from_step!r}")
        for name in ("shard_alignment", "hpz_size", "gradient_chunks", "auto_probe_every", "prefetch_units",
                     "reductions_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._check_hadamard()
        if self.gradient_grid_inter_node not in GRIDS:
            raise ValueError(f"gradient_grid_inter_node={self.gradient_grid_inter_node!r} is not supported; "
                             f"allowed values: {list(GRIDS)}")
        self._check_weight_deltas()
        for name in ("weight_bits", "weight_delta_bits", "gradient_bits_intra_node", "gradient_bits_inter_node", "late_weight_bits",
                     "late_gradient_bits_inter_node"):
            if name != "weight_delta_bits" and getattr(self, name) not in QUANTIZATION_BITS:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; allowed values: "
                                 f"{list(QUANTIZATION_BITS)}")
            grid = self.gradient_grid_inter_node if "gradient_bits_inter_node" in name else "uniform"
            try:
                BlockFormat(getattr(self, name), self.quantization_block_size, grid)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        if self.gradient_scale_dtype not in GRADIENT_SCALE_DTYPES:
            raise ValueError(f"gradient_scale_dtype={self.gradient_scale_dtype!r} is not supported; "
                             f"allowed values: {list(GRADIENT_SCALE_DTYPES)}")
        if self.auto:
            chosen = [name for name in AUTO_CHOSEN_FIELDS if getattr(self, name) != getattr(ZeroConfig, name)]
            if chosen:
                raise ValueError(f"auto=True chooses {list(AUTO_CHOSEN_FIELDS)} itself; leave {chosen} at their "
                                 f"defaults or turn auto off")
        if self.gradient_grid_inter_node == "log" and self.gradient_stochastic_rounding:
            raise ValueError("gradient_stochastic_rounding works on the uniform grid only; "
                             "turn it off or set gradient_grid_inter_node='uniform'")

    def group(self, name: str) -> dict[str, object]:
        """The fields of one group of :data:`FIELD_GROUPS` and their values."""
        if name not in FIELD_GROUPS:
            raise ValueError(f"unknown config group {name!r}; allowed values: {list(FIELD_GROUPS)}")
        return {field_name: getattr(self, field_name) for field_name in FIELD_GROUPS[name]}

    def at_step(self, step: int) -> "ZeroConfig":
        """The settings in force at training step ``step``: the late bits once it reaches
        ``late_bits_from_step``."""
        if not self.late_bits_from_step or step < self.late_bits_from_step:
            return self
        return replace(
            self, weight_bits=self.late_weight_bits, gradient_bits_inter_node=self.late_gradient_bits_inter_node,
            late_bits_from_step=0,
        )

    @property
    def compute_torch_dtype(self) -> torch.dtype:
        return parse_dtype("compute_dtype", self.compute_dtype)

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        if self.reduce_dtype is None:
            return self.compute_torch_dtype
        return parse_dtype("reduce_dtype", self.reduce_dtype)

    def _check_weight_deltas(self) -> None:
        if self.weight_delta_bits not in DELTA_BITS:
            raise ValueError(f"weight_delta_bits={self.weight_delta_bits!r} is not supported; allowed values: "
                             f"{list(DELTA_BITS)}")
        if not self.weight_deltas:
            return
        replaced = {"quantized_weights": False, "two_hop_weight_gather": False, "hpz_size": 1}
        clashing = [name for name, default in replaced.items() if getattr(self, name) != default]
        if clashing:
            raise ValueError(f"weight_deltas=True is its own weight gather (two-hop shape, quantized changes, "
                             f"a copy inside the node for backward); leave {clashing} at their defaults")

    def _check_hadamard(self) -> None:
        size = self.gradient_hadamard
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"gradient_hadamard must be 0 or a power of two, got {size!r}")
        if size and (size & (size - 1) or self.quantization_block_size % size):
            raise ValueError(
                f"gradient_hadamard={size} must be 0 or a power of two dividing quantization_block_size="
                f"{self.quantization_block_size}"
            )

    def check_layout(self, ranks_per_node: int) -> None:
        """Errors that need the layout: hpz_size must divide the ranks per node."""
        if ranks_per_node % self.hpz_size != 0:
            allowed = [h for h in range(1, ranks_per_node + 1) if ranks_per_node % h == 0]
            raise ValueError(
                f"hpz_size={self.hpz_size} must divide the ranks per node ({ranks_per_node}); allowed values: {allowed}"
            )

    @property
    def weight_format(self) -> BlockFormat:
        return BlockFormat(self.weight_bits, self.quantization_block_size)

    @property
    def weight_delta_format(self) -> BlockFormat:
        return BlockFormat(self.weight_delta_bits, self.quantization_block_size)

    @property
    def gradient_formats(self) -> tuple[BlockFormat, BlockFormat]:
        """(intra-node hop, inter-node hop) formats of qgZ."""
        block = self.quantization_block_size
        return (BlockFormat(self.gradient_bits_intra_node, block),
                BlockFormat(self.gradient_bits_inter_node, block, self.gradient_grid_inter_node))

    @property
    def parameter_alignment(self) -> int:
        """Each parameter starts on a block boundary when anything is quantized."""
        if (self.auto or self.quantized_weights or self.quantized_gradients or self.quantized_nontrainable_weights
                or self.weight_deltas):
            return self.quantization_block_size
        return 1

    @property
    def effective_shard_alignment(self) -> int:
        """Shards are whole quantization blocks (qwZ), and whole blocks per qgZ chunk."""
        alignment = self.shard_alignment
        if self.auto or self.quantized_weights or self.quantized_nontrainable_weights or self.weight_deltas:
            alignment = math.lcm(alignment, self.quantization_block_size)
        if self.auto or self.quantized_gradients:
            alignment = math.lcm(alignment, self.quantization_block_size * self.gradient_chunks)
        return alignment



def standard_variants(ranks_per_node: int) -> dict[str, ZeroConfig]:
    """ZeRO-3, each ZeRO++ optimization alone and all three (hpZ over the whole node), in
    bf16: the set every report compares."""
    base = ZeroConfig(compute_dtype="bf16", reduce_dtype="bf16")
    return {
        "zero3": base,
        "qwz": replace(base, quantized_weights=True),
        "hpz": replace(base, hpz_size=ranks_per_node),
        "qgz": replace(base, quantized_gradients=True),
        "zero++": replace(base, quantized_weights=True, hpz_size=ranks_per_node, quantized_gradients=True),
    }
