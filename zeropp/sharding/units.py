"""Which parameters belong to which unit.

A unit is the root module or a module whose class the policy names (for example a
transformer block). A parameter belongs to the innermost unit that contains every module
using it, so a weight tied between the embedding and the LM head lands in their common
ancestor (usually the root) and is flattened, communicated and stepped once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

ROOT_NAME = "<root>"


@dataclass(frozen=True)
class ParamUse:
    """One place where a parameter is read: ``getattr(module, attr)``."""

    module: nn.Module
    attr: str


@dataclass
class ParamInfo:
    param: nn.Parameter
    names: list[str]  # every fully qualified name the parameter has (several when tied)
    uses: list[ParamUse]


@dataclass
class UnitSpec:
    name: str
    module: nn.Module
    parent: "UnitSpec | None"
    params: list[ParamInfo] = field(default_factory=list)

    def ancestors(self) -> list["UnitSpec"]:
        """This unit and its enclosing units, innermost first."""
        chain, unit = [], self
        while unit is not None:
            chain.append(unit)
            unit = unit.parent
        return chain


def plan_units(model: nn.Module, unit_classes: tuple[type, ...]) -> list[UnitSpec]:
    """Units in module-tree order (root first) with their parameters assigned."""
    root = UnitSpec(ROOT_NAME, model, None)
    units = [root]
    unit_of_module: dict[int, UnitSpec] = {}
    _assign_modules(model, "", root, unit_classes, units, unit_of_module)

    infos: dict[int, ParamInfo] = {}
    owner_units: dict[int, list[UnitSpec]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            info = infos.setdefault(id(param), ParamInfo(param, [], []))
            if name not in info.names:
                info.names.append(name)
            use = ParamUse(module, attr)
            if all(u.module is not module or u.attr != attr for u in info.uses):
                info.uses.append(use)
            owner_units.setdefault(id(param), []).append(unit_of_module[id(module)])
    for key, info in infos.items():
        _common_unit(owner_units[key]).params.append(info)
    return units


def _assign_modules(module, name, current, unit_classes, units, unit_of_module) -> None:
    if module is not current.module and isinstance(module, unit_classes):
        current = UnitSpec(name, module, current)
        units.append(current)
    unit_of_module.setdefault(id(module), current)
    for child_name, child in module.named_children():
        full_name = f"{name}.{child_name}" if name else child_name
        _assign_modules(child, full_name, current, unit_classes, units, unit_of_module)


def _common_unit(owners: list[UnitSpec]) -> UnitSpec:
    """The innermost unit enclosing every owner."""
    common = owners[0].ancestors()
    for owner in owners[1:]:
        chain = {id(u) for u in owner.ancestors()}
        common = [u for u in common if id(u) in chain]
    return common[0]


def auto_unit_classes(model: nn.Module) -> tuple[type, ...]:
    """The block classes of ``model``: a Hugging Face model's ``_no_split_modules``, else the
    class of the modules repeated inside a ``ModuleList`` (two or more of one class)."""
    names = getattr(model, "_no_split_modules", None) or ()
    classes = {type(module) for module in model.modules() if type(module).__name__ in names}
    if classes:
        return tuple(sorted(classes, key=lambda c: c.__name__))
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1:
                classes |= kinds
    return tuple(sorted(classes, key=lambda c: c.__name__))


def modules_by_unit(units: list[UnitSpec]) -> list[list[nn.Module]]:
    """For each unit, the modules whose innermost enclosing unit it is, children before
    parents (the order of ``nn.Module.apply``)."""
    owner: dict[int, int] = {}
    for index, unit in enumerate(units):  # tree order: inner units overwrite their ancestors
        for module in unit.module.modules():
            owner[id(module)] = index
    result: list[list[nn.Module]] = [[] for _ in units]
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if id(module) not in seen:
            seen.add(id(module))
            result[owner[id(module)]].append(module)

    visit(units[0].module)
    return result
