"""zeropp: ZeRO-3 sharded data parallelism with the ZeRO++ communication optimizations."""

from .config import ZeroConfig
from .engine import ShardedModel
from .optim import ShardedOptimizer
from .topology import Layout, Topology

__all__ = ["Layout", "ShardedModel", "ShardedOptimizer", "Topology", "ZeroConfig"]
