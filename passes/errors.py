"""Errors autoshard raises for bad input. Each message names the cause and what to do."""


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class TraceError(AutoshardError):
    """The model could not be captured (names the construct and where it is)."""


class MeshError(AutoshardError):
    """The mesh does not match the world (shows the arithmetic)."""


class InfeasiblePlanError(AutoshardError):
    """No plan fits the memory limit (shows the smallest memory any plan needs and what dominates)."""


class StageCutError(AutoshardError):
    """The program cannot be cut into as many pipeline stages as asked (names the stage count, the cut
    candidates tried and why the others were refused); not a memory problem."""


class BatchError(AutoshardError):
    """A batch does not divide over the mesh, or differs from the batch the program was built for."""


class PlanFormatError(AutoshardError):
    """A saved plan is malformed or belongs to a different model/mesh."""


class CheckpointError(AutoshardError):
    """A state dict or checkpoint does not match the compiled model (names the keys), or holds a value
    a checkpoint cannot store without pickle."""


class TraceMismatchError(TraceError):
    """Two ranks traced the model into different programs (names the first op without a counterpart):
    the model's forward depends on the process (its rank, or values drawn when it is traced)."""


class CollectiveError(AutoshardError, RuntimeError):
    """A collective or point-to-point transfer failed or ran past its process group's timeout (names the
    op, its group, the rank and, in a pipeline, the stage and action): ranks waiting in different
    collectives, or a peer that died."""


class OptionError(AutoshardError, TypeError):
    """A keyword of ``plan``/``compile`` (or a value of the plan's data) has a value of the wrong kind;
    the message names the keyword and what it takes. Also a ``TypeError``, as Python's own keyword
    errors are."""


class BatchCouplingWarning(UserWarning):
    """A plan runs batch-coupled ops (BatchNorm in training, reductions over the batch) on parts of the
    batch (gradient accumulation, pipeline microbatches): the step computes something else than one
    full batch would. Names the ops (node and module)."""


class PeakPricedWarning(UserWarning):
    """A hardware description gives datasheet peaks and nothing about the rates kernels and
    collectives achieve, so a plan is priced as if every GEMM, copy and collective ran at peak."""


class LayoutError(AutoshardError, ValueError):
    """A layout cannot be applied to this model or mesh (names the cause and what to choose instead)."""
