"""Starting weights for a module built on the meta device: run its initialisation unit by
unit, or read pretrained safetensors weights straight into the shards."""

from .base import WeightSource
from .initializers import RunInitializers
from .pretrained import LoadSafetensors

__all__ = ["LoadSafetensors", "RunInitializers", "WeightSource"]
