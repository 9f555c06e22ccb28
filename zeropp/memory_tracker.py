"""Live tensor bytes per device, counted at the dispatcher (not the allocator, not RSS).

:class:`LiveTensorTracker` is a ``TorchDispatchMode``: every storage an operator creates is
counted until it dies (a weak reference's callback), and ``UntypedStorage.resize_``, which
the engine uses to free and refill gathered buffers and which does not pass through the
dispatcher, is followed too. Storages that existed before the tracker started are counted
once ``track`` is given them. Because it counts bytes of live storages, it answers the
question the memory model asks (what must be resident) on any device, independent of
allocator caching and fragmentation; it also runs under ``FakeTensorMode`` (the dry run),
where no byte is allocated at all.

Usage::

    tracker = LiveTensorTracker()
    tracker.track(model.state_tensors())
    with tracker:
        ... forward, backward, step ...
    tracker.peak_bytes  # {device: bytes}
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    """Current and peak live bytes per device, and the peak of each phase marked."""

    def __init__(self, dry_run: bool = False) -> None:
        """``dry_run``: meta tensors count as the bytes they stand for (a run on the meta
        device stands in for an accelerator), and a host synchronisation on them (``.item()``)
        is recorded in :attr:`host_syncs` and answered with 1 instead of raising."""
        super().__init__()
        self.dry_run = dry_run
        self.host_syncs: Counter[str] = Counter()  # "phase: op at file:line" -> calls
        self._sizes: dict[int, tuple[torch.device, int]] = {}  # storage key -> (device, bytes)
        self._references: dict[int, weakref.ref] = {}
        self.current: dict[torch.device, int] = defaultdict(int)
        self.peak_bytes: dict[torch.device, int] = defaultdict(int)
        self.phase = "untracked"
        self.phase_peaks: dict[str, dict[torch.device, int]] = {}
        self._original_resize = None

    # ------------------------------------------------------------------ public
    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count storages that existed before the tracker started (each storage once)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor.untyped_storage(), tensor.device)

    def mark_phase(self, name: str) -> None:
        """From now on, peaks are also recorded under ``name`` (e.g. "forward")."""
        self.phase = name
        self.phase_peaks.setdefault(name, defaultdict(int))
        self._update_peaks()

    def reset_peaks(self) -> None:
        self.peak_bytes = defaultdict(int, self.current)
        self.phase_peaks = {}

    def training_step(self, forward, optimizer) -> torch.Tensor:
        """One training step with its phases marked: ``forward()`` gives the loss, then
        backward, ``optimizer.step()`` and ``zero_grad()``; the phase is "resting" after."""
        self.mark_phase("forward")
        loss = forward()
        self.mark_phase("backward")
        loss.backward()
        self.mark_phase("optimizer_step")
        optimizer.step()
        optimizer.zero_grad()
        self.mark_phase("resting")
        return loss

    def current_total(self) -> int:
        return sum(self.current.values())

    def peak_total(self) -> int:
        return sum(self.peak_bytes.values())

    def phase_peak_total(self, name: str) -> int:
        return sum(self.phase_peaks.get(name, {}).values())

    # ------------------------------------------------------------------ mode
    def __enter__(self):
        self._original_resize = torch.UntypedStorage.resize_
        original, tracker = self._original_resize, self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        synchronising = _host_sync(func, args, kwargs or {})
        if synchronising:
            self.host_syncs[f"{self.phase}: {synchronising} at {_caller()}"] += 1
            if self.dry_run and func is torch.ops.aten._local_scalar_dense.default:
                return 1
            if self.dry_run and synchronising == "copy to cpu":  # values the dry run does not have
                source = args[0]
                return torch.zeros(source.shape, dtype=(kwargs or {}).get("dtype") or source.dtype, device="cpu")
        output = func(*args, **(kwargs or {}))
        # Most operators return one tensor: no need to flatten it (a tenth of a tracked step).
        for tensor in (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor.untyped_storage(), tensor.device)
        # In-place resizes and set_ change a storage's size under the same key.
        if func._overloadpacket in (torch.ops.aten.resize_, torch.ops.aten.set_):
            for tensor in tree_flatten(args)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._resized(tensor.untyped_storage())
        return output

    # ------------------------------------------------------------------ bookkeeping
    @staticmethod
    def _key(storage: torch.UntypedStorage) -> int:
        return storage._cdata

    def _add(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        if device.type == "meta" and not self.dry_run:  # shapes only, no bytes
            return
        key = self._key(storage)
        if key in self._sizes:
            self._resized(storage)
            return
        nbytes = storage.nbytes()
        self._sizes[key] = (device, nbytes)
        self._references[key] = weakref.ref(storage, lambda _, key=key: self._died(key))
        self.current[device] += nbytes
        self._update_peaks()

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = self._key(storage)
        if key not in self._sizes:
            return
        device, before = self._sizes[key]
        after = storage.nbytes()
        self._sizes[key] = (device, after)
        self.current[device] += after - before
        self._update_peaks()

    def _died(self, key: int) -> None:
        device, nbytes = self._sizes.pop(key, (None, 0))
        self._references.pop(key, None)
        if device is not None:
            self.current[device] -= nbytes

    def _update_peaks(self) -> None:
        phase_peak = self.phase_peaks.get(self.phase)
        for device, nbytes in self.current.items():
            if nbytes > self.peak_bytes[device]:
                self.peak_bytes[device] = nbytes
            if phase_peak is not None and nbytes > phase_peak[device]:
                phase_peak[device] = nbytes


def _host_sync(func, args, kwargs) -> str | None:
    """The name of a host synchronisation: a device tensor read on the host (``.item()``,
    ``.tolist()``) or copied to the CPU; None for anything else."""
    # The operator first: flattening every operator's arguments was a third of a tracked step.
    if func is torch.ops.aten._local_scalar_dense.default:
        name = "item"
    elif func is torch.ops.aten._to_copy.default and str(kwargs.get("device", "")) == "cpu":
        name = "copy to cpu"
    else:
        return None
    tensors = [tensor for tensor in tree_flatten((args, kwargs))[0] if isinstance(tensor, torch.Tensor)]
    on_device = any(tensor.device.type not in ("cpu",) for tensor in tensors)
    return name if on_device else None


def _caller() -> str:
    """The innermost frame of zeropp's own code (else the innermost outside torch)."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        if "/zeropp/" in frame.filename and "memory_tracker" not in frame.filename:
            return f"{frame.filename.split('/zeropp/', 1)[1]}:{frame.lineno}"
    for frame in reversed(frames):
        if "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "torch"
