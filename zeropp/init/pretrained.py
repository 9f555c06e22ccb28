"""Pretrained weights straight into shards: each rank reads, from safetensors files, only
the bytes of the parameter ranges its shards hold."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..sharding import ParamInfo
from ..sharding.flat_param import Slot, slot_pieces
from .base import ModuleInit, WeightSource, check_written, default_module_init, materialize_buffers
from .safetensors_files import SafetensorsFiles


class LoadSafetensors(WeightSource):
    """Weights from ``path``: a ``.safetensors`` file, a folder, or a Hugging Face
    ``model.safetensors.index.json``. Names are the wrapped module's parameter names; a
    checkpoint saved without (or with) the model's ``base_model_prefix`` also matches. Meta
    buffers come from the file when it has them, else from the module's initialisation
    (``init_fn``, default as in :class:`RunInitializers`), as for rotary-embedding tables."""

    def __init__(self, path: str | Path, init_fn: ModuleInit | None = None) -> None:
        self.files = SafetensorsFiles(path)
        self.init_fn = init_fn

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    def prepare_unit(self, index: int, modules: list[nn.Module], params: list[ParamInfo]) -> None:
        for module in modules:
            attrs = materialize_buffers(module, self.device)
            missing = []
            for attr in attrs:
                key = self._key(self.buffer_name(module, attr))
                if key is None:
                    missing.append(attr)
                else:
                    entry = self.files.entries[key]
                    module._buffers[attr].copy_(self.files.read(key, 0, entry.numel).view(entry.shape))
            if missing:
                self._initialize_buffers(module, missing)

    def _initialize_buffers(self, module: nn.Module, attrs: list[str]) -> None:
        names = [self.buffer_name(module, attr) for attr in attrs]
        if any(param is not None for param in module._parameters.values()):
            raise ValueError(f"buffers {names} are not in {self.files.path} and their module also holds "
                             "parameters; build the module with real buffers, or save them in the checkpoint")
        with torch.no_grad():
            (self.init_fn or default_module_init(self.root))(module)
        for name, attr in zip(names, attrs):
            check_written(f"buffer {name}", module._buffers[attr], "its initialisation")

    def shard(self, params: list[ParamInfo], slots: list[Slot], start: int, shard_numel: int) -> torch.Tensor:
        shard = torch.zeros(shard_numel, dtype=torch.float32, device=self.device)
        pieces = slot_pieces(slots, start, start + shard_numel)
        keys = {id(slot): self._key_of_slot(slot) for slot, _, _ in pieces}
        missing = [slot.names[0] for slot, _, _ in pieces if keys[id(slot)] is None]
        if missing:
            sample = sorted(self.files.entries)[:5]
            raise ValueError(f"{len(missing)} parameters are not in {self.files.path}: {missing[:5]}; "
                             f"it holds names like {sample}")
        for slot, first, last in pieces:
            key = keys[id(slot)]
            stored = tuple(self.files.entries[key].shape)
            if stored != tuple(slot.shape):
                raise ValueError(f"{key} has shape {stored} in {self.files.path}, the model's "
                                 f"{slot.names[0]} has {tuple(slot.shape)}")
            position = slot.offset + first - start
            shard[position : position + last - first].copy_(self.files.read(key, first, last))
        return shard

    def _key_of_slot(self, slot: Slot) -> str | None:
        """The checkpoint's name for a parameter (tied weights: whichever name it saved)."""
        for name in slot.names:
            key = self._key(name)
            if key is not None:
                return key
        return None

    def _key(self, name: str) -> str | None:
        prefix = getattr(self.root, "base_model_prefix", "")
        candidates = [name]
        if prefix:
            candidates += [name.removeprefix(f"{prefix}."), f"{prefix}.{name}"]
        return next((key for key in candidates if key in self.files.entries), None)
