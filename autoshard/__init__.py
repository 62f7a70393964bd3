"""autoshard: an automatic-parallelization compiler for PyTorch.

``autoshard.plan(model, mesh, example_inputs=...)`` traces a model and solves an ILP for how to shard
it (data parallel, FSDP/ZeRO, tensor parallel); ``autoshard.compile(...)`` does the same under
torchrun and returns each rank's program; ``Plan.render`` draws the partition.
"""
from autoshard.passes.errors import (  # noqa: F401
    AutoshardError, BatchError, InfeasiblePlanError, MeshError, PlanFormatError, TraceError,
)
from autoshard.passes.mesh import Mesh  # noqa: F401
from autoshard.passes.spec import Partial, Replicate, Shard  # noqa: F401
from autoshard.plan import Plan, load_plan  # noqa: F401
from autoshard.api import compile, plan  # noqa: F401,A001
from autoshard import presets  # noqa: F401

__version__ = "0.1.0"
__all__ = ["plan", "compile", "load_plan", "Plan", "Mesh", "Shard", "Replicate", "Partial", "presets",
           "AutoshardError", "TraceError", "MeshError", "InfeasiblePlanError", "BatchError", "PlanFormatError"]
