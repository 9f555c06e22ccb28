"""Module-level helpers of the engine's hooks: optimizer-step watching, activation
checkpointing, and finding the tensors of a module's output."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.checkpoint import checkpoint


def watch_optimizer_steps(model) -> None:
    """After any optimizer's step over ``model``'s parameters, mark its weights changed.
    The hook holds the model weakly and goes away with it."""
    reference = weakref.ref(model)

    def after_step(optimizer, args, kwargs) -> None:
        target = reference()
        if target is not None and target.owns_parameters_of(optimizer):
            target._optimizer_stepped = True

    handle = register_optimizer_step_post_hook(after_step)
    weakref.finalize(model, handle.remove)


def checkpointed(forward, *args, **kwargs):
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def tensors_requiring_grad(output) -> list[torch.Tensor]:
    """Tensors in a (possibly nested) output structure that take part in backward."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors_requiring_grad(item)]
    if hasattr(output, "__dataclass_fields__"):
        return tensors_requiring_grad([getattr(output, name) for name in output.__dataclass_fields__])
    return []
