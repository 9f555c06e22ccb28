"""Which units produced NaN or inf gradients, noted before the reduction spreads them."""

from __future__ import annotations

import torch


class NonfiniteTracker:
    """Keeps one sum per local unit gradient; :meth:`take` names the non-finite ones.

    A sum is non-finite exactly when some element is (fp32 accumulation of finite gradients
    does not overflow in practice), costs one pass instead of ``isfinite``'s several, and
    stays on the device: it is read once per step.
    """

    def __init__(self) -> None:
        self._sums: list[tuple[str, torch.Tensor]] = []  # (flat name, sum of its local gradient)

    def observe(self, name: str, gradient: torch.Tensor) -> None:
        self._sums.append((name, gradient.sum(dtype=torch.float32)))

    def take(self) -> list[str]:
        """Names whose local gradient had NaN or inf since the last call."""
        sums, self._sums = self._sums, []
        if not sums:
            return []
        finite = torch.isfinite(torch.stack([total for _, total in sums])).tolist()
        return [name for (name, _), ok in zip(sums, finite) if not ok]
