"""Imported once by ``run_ranks``'s forkserver (``ranks._PRELOAD``), so that every rank forked from it
starts warm instead of paying the same start-up in each of its 4 processes, in every test:

- the modules a rank worker imports (the front door, the compiled program, the testing harness);
- ``transformers`` and every model class ``autoshard.testing`` imports from it (about 3 CPU s per
  process cold: the lazy module's import structure, ``modeling_utils``, scipy);
- one capture of a tiny model: the first ``torch.export`` in a process builds its decomposition and
  fake-tensor tables (about 1.4 CPU s), later ones reuse them;
- then ``gc.freeze()``: the ~460,000 objects all this leaves (modules, op tables) move to the
  collector's permanent generation, which the ranks inherit, so a rank's full collection walks only what
  the rank made. Unfrozen, every ``gc.collect()`` walked them all: 0.36 CPU s each, and
  ``runtime.memory_probe`` collects once per measured forward (66 times per rank in
  ``test_memory_estimates``). Only never-freed start-up objects are frozen; whatever a rank creates is
  collected as before (CPython's documented use of ``gc.freeze`` before ``fork()``).

Nothing here is needed for correctness: a rank imports what it uses anyway. Every step is guarded,
since an exception escaping a forkserver preload would stop the forkserver; the warm-up runs with one
intra-op thread, as every rank does (``ranks._worker``), so no OpenMP pool exists when ranks fork.
"""
from __future__ import annotations

import ast
import gc
import importlib
import pathlib

__all__: list = []


def _transformers_imports() -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every ``from transformers... import names`` in ``autoshard/testing``."""
    found = []
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                found.append((node.module, [a.name for a in node.names]))
    return found


def _import_transformers() -> None:
    for module, names in _transformers_imports():
        try:
            mod = importlib.import_module(module)
            for name in names:
                getattr(mod, name, None)
        except Exception:  # noqa: BLE001 - a warm-up only; the rank that needs it raises its own error
            pass


def _first_capture() -> None:
    import torch

    from autoshard.passes.capture.export import capture

    state = torch.get_rng_state()  # ranks inherit the generator as if nothing had run
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        capture(model, (torch.ones(2, 4),), loss_fn=torch.nn.functional.mse_loss, target=torch.zeros(2, 2))
    finally:
        torch.set_rng_state(state)


def _warm() -> None:
    try:
        import torch
        torch.set_num_threads(1)
    except Exception:  # noqa: BLE001
        return
    for module in ("autoshard.api", "autoshard.compiled", "autoshard.plans", "autoshard.runtime.groups",
                   "autoshard.testing.equivalence", "autoshard.testing.models", "autoshard.testing.zoo_check"):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001
            pass
    _import_transformers()
    try:
        _first_capture()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()  # the warm-up's own garbage is freed, not frozen
    gc.freeze()


_warm()
