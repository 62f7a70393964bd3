"""Sharding rules, one module per op family. Importing ``ALL_RULE_MODULES`` registers them all."""
from autoshard.passes.sharding.rules.registry import OpCall, RULES, register_rule, rule_strategies  # noqa: F401


def _load_all():
    import importlib
    import pkgutil
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("registry",):
            mods.append(importlib.import_module(f"{__name__}.{info.name}"))
    return mods


ALL_RULE_MODULES = _load_all()
