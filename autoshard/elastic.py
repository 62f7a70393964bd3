"""Elastic training: survive losing nodes (and getting them back) under torchrun, and train on exactly as before.

    torchrun --nnodes=1:4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
             --max-restarts=10 train.py          # the same command on every node

    result = autoshard.elastic.run(build_model, make_batches, steps=1000, checkpoint_dir="ckpt", every=50,
                                   loss_fn=lm_loss, devices_per_node=8)

When an agent dies, torchrun ends the survivors' workers and starts them again on a smaller world
(and on a larger one when a node joins). Each start of ``run``, on every rank:

1. reads the world size (``WORLD_SIZE``) and builds ``Mesh.for_world(world, devices_per_node)``;
2. on rank 0: fingerprints the model's global-batch program, checks it against the checkpoint's
   (``CheckpointError`` on a mismatch: the checkpoint belongs to another model), and loads the plan
   cached for this world and fingerprint or solves one and caches it (``autoshard.plan_cache``); every
   rank gets that plan (``run_and_broadcast``), so all run the same. A world too small to hold the model
   raises ``InfeasiblePlanError`` (naming the memory it needs) on every rank;
3. compiles the plan and loads the checkpoint ``LATEST`` names, resharded onto the new plan (none yet:
   starts at step 0 and says so);
4. prints one line (``elastic_records.StartRecord.line``): old world -> new world, old plan -> new
   plan, estimated step time before and after, re-plan and reshard seconds, work lost;
5. trains steps ``[resumed, steps)``: the batch of step s is ``make_batches(s)``, the whole global batch
   on every rank, so the batch and the data order do not depend on the world size and a run that lost
   a node equals an unbroken run step for step (within float tolerance: the sums of a data-parallel
   gradient are added in another order on another world). The planner may choose gradient accumulation
   to fit a smaller world; ``run`` never forces it (it is exact only for models without batch-coupled
   ops such as BatchNorm);
6. checkpoints every ``every`` steps and at the end (``runtime.checkpoint_pointer``: a new directory,
   then ``LATEST`` switched atomically, so a rank dying mid-save or mid-reshard leaves the previous
   checkpoint loadable). Saves are synchronous: DCP's ``async_save`` runs its collectives from a
   background thread, which on one gloo process group would interleave with the training step's.

Scale-up with torch 2.13's c10d rendezvous needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in every
agent's environment: with the store shared across rounds, an agent that stays rank 0 into the next
round does not publish that round's ``MASTER_ADDR``, and the agent joining waits for it until it fails.

RNG state is not carried across starts (a restart on another world has other ranks); models whose
step draws random numbers (dropout) are therefore not step-equal across a restart.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from autoshard.api import compile as compile_model
from autoshard.api import plan as plan_model
from autoshard.elastic_records import StartRecord, append_record, read_progress, write_progress
from autoshard.passes.errors import CheckpointError
from autoshard.passes.mesh import Mesh
from autoshard.plan_cache import cached_or_planned, model_fingerprint, plan_line
from autoshard.plans import Plan
from autoshard.runtime.checkpoint_files import load
from autoshard.runtime.checkpoint_pointer import checkpoint_info, save_checkpoint
from autoshard.runtime.groups import choose_device_backend, run_and_broadcast

__all__ = ["run", "ElasticResult"]


@dataclass
class ElasticResult:
    """What one start of ``run`` did (on this rank)."""
    start: StartRecord
    world: int
    plan: Plan
    first_step: int
    next_step: int                       #: the step a later start would resume at
    losses: dict = field(default_factory=dict)   #: step -> loss, for the steps this start ran


def run(build_model: Callable[[], torch.nn.Module], make_batches: Callable[[int], tuple], steps: int,
        checkpoint_dir: str, *, every: int = 50, loss_fn: Callable, devices_per_node: Optional[int] = None,
        make_optimizer: Optional[Callable] = None, make_scheduler: Optional[Callable] = None,
        stop_after: Optional[int] = None, on_step: Optional[Callable[[int, float], None]] = None,
        log: Callable[[str], None] = print, collective_timeout_s: float = 300.0, **plan_kwargs: Any) -> ElasticResult:
    """Train ``build_model()`` for ``steps`` steps, surviving world changes (see the module docstring);
    call on every rank under torchrun (or alone: a world of 1).

    ``build_model()``: the model, the same weights on every call (seed inside). ``make_batches(step)``:
    ``(inputs, target)`` of global step ``step``, ``inputs`` a tuple of tensors, the global batch.
    ``make_optimizer(params)`` (default AdamW, lr 1e-3) and ``make_scheduler(optimizer)`` (optional; its
    ``state_dict`` must be JSON-able, as ``LambdaLR``'s is). ``devices_per_node``: default torchrun's
    ``LOCAL_WORLD_SIZE`` (a world that is not a whole number of such nodes gets a 1-D mesh).
    ``checkpoint_dir`` must be one directory every node sees (a shared filesystem, as DCP needs).
    ``stop_after``: end (with a checkpoint) once this many steps are done, short of ``steps`` (the LR
    schedule still spans ``steps``). ``on_step(step, loss)`` runs on every rank after each step.
    ``collective_timeout_s``: how long a collective waits for a peer before this rank fails (and torchrun
    restarts it); it must exceed rank 0's re-plan, which the other ranks wait for in a broadcast.
    ``plan_kwargs`` go to ``autoshard.plan`` (``hardware``, ``memory_limit``, ...). Raises
    ``CheckpointError`` for a checkpoint of another model, ``InfeasiblePlanError`` when the world
    cannot hold the model."""
    if every < 1 or steps < 1:
        raise ValueError(f"every={every}, steps={steps}: both must be at least 1")
    world, rank = _join_world(collective_timeout_s)
    per_node = devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = Mesh.for_world(world, per_node if world % per_node == 0 else world)
    model = build_model()
    example_inputs, example_target = make_batches(0)
    os.makedirs(checkpoint_dir, exist_ok=True)

    def plan_on_rank0() -> dict:
        t0 = time.perf_counter()
        fingerprint = model_fingerprint(model, example_inputs, loss_fn, example_target)
        saved = checkpoint_info(checkpoint_dir)
        if saved is not None and saved.get("fingerprint") != fingerprint:
            raise CheckpointError(
                f"the checkpoint in {checkpoint_dir} (step {saved['step']}) was saved by a different model or batch "
                f"shape (fingerprint {saved.get('fingerprint')} != this model's {fingerprint}): use another "
                "checkpoint directory, or build the model and batches it was saved with")
        chosen, cached, _ = cached_or_planned(lambda: plan_model(
            model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, example_target=example_target,
            **plan_kwargs), checkpoint_dir, mesh, fingerprint)
        return {"plan": chosen.to_json(), "cached": cached, "seconds": time.perf_counter() - t0,
                "fingerprint": fingerprint, "checkpoint": saved, "progress": read_progress(checkpoint_dir)}

    decided = run_and_broadcast(plan_on_rank0)
    chosen = Plan.from_json(decided["plan"])
    cm = compile_model(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, example_target=example_target,
                       plan=chosen)
    opt = make_optimizer(cm.parameters()) if make_optimizer else torch.optim.AdamW(cm.parameters(), lr=1e-3)
    sched = make_scheduler(opt) if make_scheduler else None

    def training_state(next_step: int) -> dict:
        state = {"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt), "progress": {"next_step": next_step}}
        if sched is not None:
            state["scheduler"] = sched.state_dict()
        return state

    first, reshard_s, saved = 0, 0.0, decided["checkpoint"]
    if saved is not None:
        t0 = time.perf_counter()
        state = training_state(0)
        load(state, saved["path"])
        cm.load_state_dict(state["model"])
        cm.load_optimizer_state_dict(opt, state["optim"])
        if sched is not None:
            sched.load_state_dict(state["scheduler"])
        first, reshard_s = int(state["progress"]["next_step"]), time.perf_counter() - t0
    record = _start_record(world, chosen, decided, first, reshard_s)
    if rank == 0:
        log(record.line)
        append_record(checkpoint_dir, record)

    last = min(steps, stop_after) if stop_after is not None else steps
    info = {"fingerprint": decided["fingerprint"], "world": world, "mesh": list(mesh.shape), "plan": record.new_plan}
    losses: dict = {}
    since_checkpoint, checkpoint_step, step_seconds = time.perf_counter(), first, []
    for step in range(first, last):
        t0 = time.perf_counter()
        inputs, target = make_batches(step)
        loss = cm.step(*inputs, target=target)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss
        if on_step is not None:
            on_step(step, loss)
        if (step + 1) % every == 0 or step + 1 == last:
            save_checkpoint(training_state(step + 1), checkpoint_dir, step + 1, info=info)
            since_checkpoint, checkpoint_step = time.perf_counter(), step + 1
        step_seconds.append(time.perf_counter() - t0)
        if rank == 0:
            write_progress(checkpoint_dir, {
                "steps_done": step + 1, "world": world, "plan": record.new_plan,
                "estimated_step_time": record.new_step_time, "checkpoint_step": checkpoint_step,
                "seconds_since_checkpoint": time.perf_counter() - since_checkpoint,
                "mean_step_seconds": sum(step_seconds) / len(step_seconds)})
    return ElasticResult(record, world, chosen, first, last, losses)


def _join_world(timeout_s: float) -> tuple[int, int]:
    """(world, rank): torchrun's, joining its process group with a bounded collective timeout (a rank
    whose peer died then fails instead of waiting for gloo's default half hour); (1, 0) alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(choose_device_backend()[1], timeout=datetime.timedelta(seconds=timeout_s))
    return world, (dist.get_rank() if dist.is_initialized() else 0)


def _start_record(world: int, chosen: Plan, decided: dict, first: int, reshard_s: float) -> StartRecord:
    before = decided["progress"] or {}
    lost = max(0, int(before.get("steps_done", first)) - first) if before else 0
    if lost and before.get("checkpoint_step") == first:
        lost_s = float(before.get("seconds_since_checkpoint", 0.0))
    else:
        lost_s = lost * float(before.get("mean_step_seconds", 0.0))
    return StartRecord(
        old_world=before.get("world"), new_world=world, old_plan=before.get("plan"), new_plan=plan_line(chosen),
        old_step_time=before.get("estimated_step_time"), new_step_time=chosen.estimated_step_time,
        plan_cached=bool(decided["cached"]), replan_seconds=float(decided["seconds"]), reshard_seconds=reshard_s,
        resumed_step=first, lost_steps=lost, lost_seconds=lost_s)
