"""Collectives behind small interfaces, each recorded in the rank's :class:`CommLog`."""

from .primitives import Communicator, PendingReduceScatter

__all__ = ["Communicator", "PendingReduceScatter"]
