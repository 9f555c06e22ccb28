"""Hugging Face ``Trainer`` on a zeropp-sharded model (``pip install 'zeropp[trainers]'``)::

    trainer = ZeroppTrainer(model=AutoModelForCausalLM.from_config(config), args=TrainingArguments(...),
                            zero_config=ZeroConfig(quantized_weights=True, hpz_size=2, quantized_gradients=True),
                            train_dataset=dataset)
    trainer.train()
    trainer = sharded_trainer(trl.SFTTrainer)(model=model, args=SFTConfig(...), zero_config=..., ...)

What differs from a plain ``Trainer``, and why:

- The model is wrapped in a :class:`~zeropp.ShardedModel` at construction, once the process
  group exists. ``trainer.model`` stays the Hugging Face module (its config, its forward's
  signature, ``save_pretrained``); ``trainer.model_wrapped`` is the sharded model, which
  trains and evaluates. accelerate never wraps it in DDP: zeropp reduces the gradients.
- The optimizer (``TrainingArguments.optim``, its weight-decay groups by the Trainer's own
  rule) steps this rank's fp32 master pieces.
- Clipping takes the global norm over every rank's shards; accelerate's would be per rank.
- Gradient accumulation: the Trainer's ``no_sync`` on all but the last micro-batch is
  zeropp's node accumulation (gradients cross nodes once per optimizer step).
- ``save_model`` gathers the whole weights (every rank joins) and rank 0 writes them with
  ``save_pretrained``. A checkpoint adds the sharded model and optimizer state through
  ``torch.distributed.checkpoint`` (folder ``zeropp``), which resumes at any world size.

``TrainingArguments(bf16=True)`` (TRL's default) computes in bf16 over fp32 masters
(``ZeroConfig(compute_dtype="bf16")``); ``fp16`` is refused. ``zero_config`` is a
:class:`~zeropp.ZeroConfig`, or a DeepSpeed JSON (path or dict) as
``TrainingArguments(deepspeed=...)`` would take it (see ``zeropp.deepspeed_config``); pass
it here, not as ``deepspeed=``, which would start DeepSpeed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from ..checkpoint import DistributedState
from ..config import ZeroConfig
from ..deepspeed_config import zero_config_from
from ..engine import ShardedModel
from ..hf import export_pretrained
from ..topology import Topology

logger = logging.getLogger(__name__)

CHECKPOINT_FOLDER = "zeropp"  # inside each Trainer checkpoint: the DCP files


def _with_trainer_precision(config: ZeroConfig, args) -> ZeroConfig:
    """``bf16=True`` in the training arguments is zeropp's bf16 compute (fp32 masters), as
    accelerate's autocast would have been for an unsharded model."""
    if args.fp16:
        raise ValueError("TrainingArguments.fp16: use bf16=True, or ZeroConfig(compute_dtype='fp16') with "
                         "ShardedOptimizer's loss scaling in your own loop")
    if args.bf16 and config.compute_dtype == "fp32":
        logger.info("TrainingArguments.bf16: gathering and computing in bf16 (masters stay fp32)")
        return replace(config, compute_dtype="bf16")
    return config


class ShardedTrainerMixin:
    """The overrides that put a ``transformers.Trainer`` (or a subclass: TRL's trainers) on
    zeropp; see :func:`sharded_trainer`."""

    def __init__(self, model: torch.nn.Module, args: transformers.TrainingArguments, *,
                 zero_config: ZeroConfig | dict | str | Path | None = None, ranks_per_node: int | None = None,
                 unit_classes="auto", **trainer_arguments) -> None:
        if args.deepspeed:
            raise ValueError("TrainingArguments.deepspeed starts DeepSpeed: pass the JSON as zero_config instead")
        if not isinstance(model, torch.nn.Module) or isinstance(model, ShardedModel):
            raise ValueError("model must be the Hugging Face module itself; ZeroppTrainer shards it")
        config = _with_trainer_precision(zero_config_from(zero_config), args)
        args.device  # accelerate starts the process group (gloo on CPU, NCCL on GPU)
        topology = Topology.from_environment(ranks_per_node=ranks_per_node)
        # Weight decay by the Trainer's rule, read off the layers before sharding empties them
        self.decay_parameter_names = set(self.get_decay_parameter_names(model))
        self.sharded = ShardedModel(model, topology, config, unit_classes=unit_classes)
        super().__init__(model=model, args=args, **trainer_arguments)

    # ------------------------------------------------------------ the model that trains
    def _move_model_to_device(self, model, device) -> None:
        """The shards already live on the topology's device."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.sharded  # not ``self.model``: accelerate then prepares the optimizer only

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            decay = self.decay_parameter_names
            pieces = [(name, piece) for name, piece in self.sharded.named_parameters() if piece.requires_grad]
            groups = [{"params": [piece for name, piece in pieces if name in decay],
                       "weight_decay": self.args.weight_decay},
                      {"params": [piece for name, piece in pieces if name not in decay], "weight_decay": 0.0}]
            optimizer_class, options = (self.optimizer_cls_and_kwargs if self.optimizer_cls_and_kwargs is not None
                                        else self.get_optimizer_cls_and_kwargs(self.args, self.model))
            self.optimizer = optimizer_class(groups, **options)
        return self.optimizer

    def _clip_grad_norm(self, model) -> torch.Tensor:
        return self.sharded.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.sharded.clip_grad_norm_(float("inf")) if grad_norm is None else grad_norm

    # ------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: rank 0 writes a folder ``from_pretrained`` loads (config, fp32
        safetensors gathered one unit at a time, the tokenizer, the training arguments), or
        for a PEFT model the adapter ``PeftModel.from_pretrained`` loads."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if hasattr(self.model, "peft_config"):  # a PEFT model: the adapter, as PeftModel.from_pretrained reads it
            whole = self.sharded.full_state_dict(rank0_only=True)
            if self.args.should_save:
                self.model.save_pretrained(output_dir, state_dict=whole)
        else:
            export_pretrained(self.sharded, output_dir, tokenizer=self.processing_class)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        dcp.save({"train": DistributedState(self.sharded, self.optimizer)},
                 checkpoint_id=os.path.join(output_dir, CHECKPOINT_FOLDER))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the optimizer's state, from the DCP folder."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_FOLDER)):
            raise ValueError(f"resume_from_checkpoint: {resume_from_checkpoint} has no {CHECKPOINT_FOLDER}/ "
                             "folder (not written by ZeroppTrainer)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        dcp.load({"train": DistributedState(self.sharded, self.optimizer)},
                 checkpoint_id=os.path.join(checkpoint, CHECKPOINT_FOLDER))
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        logger.info("resumed the sharded model and optimizer from %s", checkpoint)


class ZeroppTrainer(ShardedTrainerMixin, transformers.Trainer):
    """The Hugging Face ``Trainer`` on a zeropp-sharded model."""


def sharded_trainer(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) on
    a zeropp-sharded model: ``sharded_trainer(SFTTrainer)(model=..., args=..., zero_config=...)``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise ValueError(f"trainer_class must be transformers.Trainer or a subclass of it, got {trainer_class!r}")
    return type(f"Zeropp{trainer_class.__name__}", (ShardedTrainerMixin, trainer_class), {})
