"""What one pipeline search was asked for, as two small frozen records handed down the search in place
of loose keywords (the settings every planner reads travel as ``passes.solve.context.PlanContext``).

``PipelinePins``: what the caller of ``plan_pipeline`` fixes (None: searched). ``PipelineSearch``: what
``plan_pipeline`` hands the candidate search (``search.plan_candidates``/``profile_candidates``) and the
stage search (``search.search_stages``) once it has resolved the pins: the layer units, the schedules
and the pinned microbatch count, stage cut and recompute, and the two-pass budget split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from autoshard.passes.levers import MixedPrecision
from autoshard.passes.sharding.pins import HintsFor, PinsFor
from autoshard.passes.pipeline.schedule.registry import searched_schedules

#: schedules searched unless pinned: the registry's ``searched`` ones (``schedule/registry.py``)
DEFAULT_SCHEDULES = searched_schedules()

__all__ = ["DEFAULT_SCHEDULES", "PipelinePins", "PipelineSearch"]


@dataclass(frozen=True)
class PipelinePins:
    """What a pipeline plan is pinned to; None leaves it to the search.

    ``pp``, ``schedule`` (a name or several), ``microbatches``, ``stages`` (the first unit of every stage
    after the first, as unit indices or node names). ``shapes``: only these (dp, tp) submeshes per rank
    group. ``recompute``: every stage recomputes (True) or none does (False). ``pins_for(program,
    submesh)``: decisions fixed on every intra-op solve (a layout's placements). ``overlap_grad_sync``:
    the runtime starts gradient all-reduces under the backward still running (False: after it).
    ``scatter_gather``: a value crossing a stage cut whole on tp is sent as 1/tp pieces and gathered.
    ``blocking_sends``: a stage's sends block its stream as its receives do (``scoring.send_seconds``).
    ``deepspeed_gathers``: the pieces are gathered as DeepSpeed's ``PartitionedTensor`` does
    (``partitioned_tensors``; ``scoring.regather_seconds``, ``scoring.piece_copy_seconds``).
    ``mixed_precision``: how the candidates' gradients are reduced and held (``passes.levers.MixedPrecision``
    without ``param_dtype``: the program is traced in the model's dtype; a layout's
    ``accumulate_allreduce_grads_in_fp32``), priced on every pp > 1 candidate and recorded in its stages'
    levers (``candidate_plan.CandidateSpec``)."""
    pp: Optional[int] = None
    schedule: Optional[Union[str, Sequence[str]]] = None
    microbatches: Optional[int] = None
    stages: Optional[Sequence[Union[int, str]]] = None
    shapes: Optional[Sequence[tuple[int, int]]] = None
    recompute: Optional[bool] = None
    pins_for: Optional[PinsFor] = None
    overlap_grad_sync: bool = True
    scatter_gather: bool = False
    blocking_sends: bool = False
    deepspeed_gathers: bool = False
    mixed_precision: Optional[MixedPrecision] = None


@dataclass(frozen=True)
class PipelineSearch:
    """One search's resolved settings.

    Candidates (``search.profile_candidates``): ``units`` (None: ``layer_units`` of the program),
    ``blocks`` (the real block count when the program was traced with fewer), ``single`` (also profile
    pp = 1), ``deep_chain``, ``shapes``, ``pins_for``, ``hints_for``; the two passes of
    ``plan_candidates``: ``quick_s``, ``thorough_s``, ``finalists``, ``total_s``.
    Both searches: ``schedules``, ``microbatches`` (pinned count, None: searched). Stage search
    (``search.search_stages``): ``starts`` (a pinned cut), ``recompute`` (pinned, None: per stage).
    ``mixed_precision``: ``PipelinePins.mixed_precision``."""
    units: Optional[list] = None
    blocks: Optional[int] = None
    single: bool = False
    deep_chain: bool = False
    shapes: Optional[Sequence[tuple[int, int]]] = None
    pins_for: Optional[PinsFor] = None
    hints_for: Optional[HintsFor] = None
    quick_s: float = 2.0
    thorough_s: float = 10.0
    finalists: int = 3
    total_s: Optional[float] = None
    schedules: Sequence[str] = DEFAULT_SCHEDULES
    microbatches: Optional[int] = None
    starts: Optional[list[int]] = None
    recompute: Optional[bool] = None
    mixed_precision: Optional[MixedPrecision] = None
