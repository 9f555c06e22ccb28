"""An emulated multi-node cluster on one machine: one network namespace per node."""

from .emulated import TCP_PAYLOAD_SHARE, ClusterSpec, EmulatedCluster, payload_bytes_per_s, shaped_mbit

__all__ = ["TCP_PAYLOAD_SHARE", "ClusterSpec", "EmulatedCluster", "payload_bytes_per_s", "shaped_mbit"]
