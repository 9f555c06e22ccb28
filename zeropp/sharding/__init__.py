"""Grouping parameters into units and the flat, padded, sharded buffer of each unit."""

from .flat_param import FlatParam, ShardState
from .units import ParamInfo, ParamUse, UnitSpec, auto_unit_classes, plan_units

__all__ = ["FlatParam", "ShardState", "ParamInfo", "ParamUse", "UnitSpec", "auto_unit_classes", "plan_units"]
