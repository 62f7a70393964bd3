"""autoshard: an automatic-parallelization compiler for PyTorch.

``autoshard.plan(model, mesh, example_inputs=...)`` traces a model and solves an ILP for how to shard
it (data parallel, FSDP/ZeRO, tensor parallel); ``autoshard.compile(...)`` does the same under
torchrun and returns each rank's program; ``Plan.render`` draws the partition. With ``pp="auto"``
both plan pipeline stages too (3D plans: a ``Plan`` is a list of stages, one without a pipeline).

The front door: ``api`` (plan, compile), ``compiled`` (what compile returns), ``plans`` (``Plan``),
``sharding_rules`` (``register_sharding``: a rule for your own op), ``presets``, ``summary``, ``cli``, and the subpackages ``drawing/`` and ``profiling/``. Below it sit
the analysis (``autoshard.passes``, installed from ``passes/``) and the runtime (``autoshard.runtime``,
from ``runtime/``). ``autoshard.testing`` is the tests' and benchmarks' support, not the front door's.

Names that need torch load on first use, so torch-free commands (``autoshard solve``) start fast.

May import: torch, graphviz, ``autoshard.passes`` and ``autoshard.runtime``. Never ``autoshard.testing``.
"""
import importlib

from autoshard.passes.errors import (  # noqa: F401  (torch-free)
    AutoshardError, BatchCouplingWarning, BatchError, CheckpointError, InfeasiblePlanError, MeshError,
    PeakPricedWarning, PlanFormatError, StageCutError, TraceError,
)
from autoshard.passes.mesh import Mesh  # noqa: F401  (torch-free)

__version__ = "0.1.0"

_LAZY = {
    "plan": "autoshard.api", "compile": "autoshard.api",
    "Plan": "autoshard.plans", "load_plan": "autoshard.plans",
    "MixedPrecision": "autoshard.passes.levers", "CompileOptions": "autoshard.runtime.compile_backend", "register_sharding": "autoshard.sharding_rules",
    "Shard": "autoshard.passes.spec", "Replicate": "autoshard.passes.spec", "Partial": "autoshard.passes.spec",
    "set_moe_capacity_factor": "autoshard.passes.capture.moe_experts",
    "measure_expert_load": "autoshard.expert_load",
}
_SUBMODULES = ("presets", "checkpoint", "elastic", "layouts")

__all__ = ["plan", "compile", "load_plan", "register_sharding", "Plan", "Mesh", "Shard", "Replicate",
           "Partial", "MixedPrecision", "CompileOptions", "presets", "checkpoint", "elastic", "layouts", "AutoshardError", "TraceError", "MeshError",
           "InfeasiblePlanError", "StageCutError", "BatchError", "PlanFormatError", "CheckpointError",
           "BatchCouplingWarning", "PeakPricedWarning", "set_moe_capacity_factor", "measure_expert_load"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"autoshard.{name}")
    else:
        raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
