"""Optimizers that step on each rank's fp32 master shards."""

from .sharded import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
