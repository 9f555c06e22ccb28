"""The ZeRO-3 engine: hooks that gather units just in time and reduce their gradients."""

from .sharded_model import ShardedModel

__all__ = ["ShardedModel"]
