"""The runtime: a planned graph becomes each rank's own program, and trains.

- ``groups``: ``setup_distributed(mesh) -> MeshEnv`` (one process group per mesh axis, device and
  backend from the environment), ``broadcast_json``.
- ``collectives``: autograd-aware collectives (all_gather, reduce_scatter, all_reduce, all_to_all,
  chunk, to_partial), each backward the adjoint of its forward.
- ``redistribute``: placements -> placements as a list of those collectives (the steps are
  ``passes.layout.redistribution``'s, which the cost model prices).
- ``localize`` / ``lowerings``: local sizes and devices; the emitters of the special lowerings, one per
  ``Lowering`` descriptor of ``passes.cost.lowerings``.
- ``lower``: the per-rank fx program. ``materialize``: this rank's shards only.
- ``param_gather``: parameter copies gathered (and cast) per block in flat collectives, prefetched,
  optionally freed after forward and gathered again for backward (reshard after forward).
- ``recompute`` / ``regions``: activation checkpointing (full, selective) of block regions.
- ``stage``: one stage of a plan lowered for this rank, with every memory lever, and F / B / W per
  microbatch. ``executor``: ``RankProgram``, the one program type: this rank's stages under the plan's
  schedule (``pipeline/``: the interpreter and point-to-point transfers; without a pipeline, a schedule
  of one stage), the step with accumulation. ``step_inputs``: a step's batch cut into microbatches;
  ``step_results``: the loss reduced over the ranks, a forward's outputs assembled.
- ``gradsync``: bucketed, overlapped gradient all-reduce, one per stage. ``memory_probe``: measured
  saved and gathered bytes.

May import: torch and ``autoshard.passes``. Never the front door (``autoshard``'s own modules) or
``autoshard.testing``.
"""
import importlib

__all__ = ["RankProgram", "MeshEnv", "setup_distributed", "broadcast_json"]

# loaded on first use: planning imports one runtime module (``compile_backend``, for ``compile=``'s
# options) and must not pay for the whole runtime with it
_LAZY = {"RankProgram": ".executor", "MeshEnv": ".groups", "setup_distributed": ".groups", "broadcast_json": ".groups"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
