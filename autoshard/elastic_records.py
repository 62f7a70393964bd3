"""What an elastic run writes down about itself, so the next incarnation can say what changed.

Under ``<checkpoint_dir>``, rank 0 keeps:

- ``progress.json``: rewritten (atomically) after every step: the steps done, the world and plan
  running them, the plan's estimated step time, and the wall seconds since the last checkpoint. After
  a crash it says how far the dead run got: the work lost is the steps past the checkpoint the next
  run resumes from, and the seconds they took.
- ``elastic_log.jsonl``: one JSON line per start of the run (``StartRecord``): old world -> new world,
  old plan -> new plan, estimated step time before and after, re-plan and reshard seconds, lost
  work. ``StartRecord.line`` is the line printed at each start.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

__all__ = ["PROGRESS_FILE", "LOG_FILE", "StartRecord", "read_progress", "write_progress", "append_record"]

PROGRESS_FILE = "progress.json"
LOG_FILE = "elastic_log.jsonl"


@dataclass
class StartRecord:
    """One start of an elastic run (the first, or a restart after the world changed or a rank died)."""
    old_world: Optional[int]            #: None on the first start
    new_world: int
    old_plan: Optional[str]             #: ``plan_cache.plan_line`` of the plan that ran before
    new_plan: str
    old_step_time: Optional[float]      #: its estimated seconds per step
    new_step_time: float
    plan_cached: bool                   #: the plan came from the cache (else it was solved now)
    replan_seconds: float               #: fingerprint + cache lookup or solve, on rank 0
    reshard_seconds: float              #: loading the checkpoint into the new plan (0 without one)
    resumed_step: int                   #: the first step this start runs
    lost_steps: int                     #: steps the previous run did past the checkpoint resumed from
    lost_seconds: float                 #: the wall seconds those steps took

    @property
    def line(self) -> str:
        new_time = f"{self.new_step_time * 1e3:.3g} ms"
        solved = "from the plan cache" if self.plan_cached else "solved"
        if self.old_world is None:
            head = (f"elastic: world {self.new_world}, plan {self.new_plan} ({solved}, {self.replan_seconds:.2f} s), "
                    f"estimated step time {new_time}")
            if self.resumed_step == 0:
                return head + "; no checkpoint yet: starting at step 0"
            return head + f"; resumed at step {self.resumed_step} (reshard {self.reshard_seconds:.2f} s)"
        old_time = f"{self.old_step_time * 1e3:.3g} ms" if self.old_step_time is not None else "?"
        change = "world changed" if self.old_world != self.new_world else "restart on the same world"
        return (f"elastic: {change}: world {self.old_world} -> {self.new_world}; plan {self.old_plan} -> "
                f"{self.new_plan}; estimated step time {old_time} -> {new_time}; re-plan {self.replan_seconds:.2f} s "
                f"({solved}), reshard {self.reshard_seconds:.2f} s; resumed at step {self.resumed_step}, lost "
                f"{self.lost_steps} steps ({self.lost_seconds:.1f} s of work)")


def read_progress(root: str) -> Optional[dict]:
    """``progress.json`` under ``root`` as written by ``write_progress``; None when absent or unreadable
    (it only informs the start line, never the training)."""
    try:
        with open(os.path.join(root, PROGRESS_FILE), encoding="utf-8") as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def write_progress(root: str, doc: dict) -> None:
    """Replace ``progress.json`` atomically (a temporary file moved over it)."""
    tmp = os.path.join(root, PROGRESS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(root, PROGRESS_FILE))


def append_record(root: str, record: StartRecord) -> None:
    with open(os.path.join(root, LOG_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(record)) + "\n")
