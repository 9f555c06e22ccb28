"""An emulated multi-node cluster on one machine: one network namespace per node."""

from .emulated import ClusterSpec, EmulatedCluster, shaped_mbit

__all__ = ["ClusterSpec", "EmulatedCluster", "shaped_mbit"]
