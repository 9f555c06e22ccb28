"""The order in which units run, learned from the first pass, used to prefetch."""

from __future__ import annotations


class ExecutionOrder:
    """Records unit order during the first pass; afterwards answers "which unit is next"."""

    def __init__(self) -> None:
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self.frozen = False

    def observe(self, unit_index: int) -> None:
        if not self.frozen and unit_index not in self._position:
            self._position[unit_index] = len(self._order)
            self._order.append(unit_index)

    def freeze(self) -> None:
        if self._order:
            self.frozen = True

    def following(self, unit_index: int, count: int) -> list[int]:
        """Up to ``count`` units after ``unit_index``, in order."""
        if not self.frozen or unit_index not in self._position:
            return []
        position = self._position[unit_index] + 1
        return self._order[position : position + count]
