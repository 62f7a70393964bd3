"""Measure the machine a plan will run on: matmul throughput, memory bandwidth, per-op launch cost,
and collective latency/bandwidth per group size. The result is a profile (``passes/cost/profile_format.py``)
that ``plan(..., hardware="profile.json")`` prices plans with.

    measure_profile(ProfileConfig.make(quick=True))   # on every rank of an initialized world
    spawn_profile(4, ProfileConfig.make(quick=True))   # starts 4 local CPU processes over gloo itself

Every figure is measured with ALL ranks busy at once (a mesh axis's groups communicate
concurrently, and ranks sharing a CPU compete for its cores), timed as the median of ``repeats``
batches of calls, and taken as the slowest rank's median (a step waits for the slowest rank):
``timer.py``. The local work (matmuls, copies, elementwise ops, op launches) is in
``local_work.py``, the collectives over groups of ``n < world`` ranks, alternating between the
groups of both axes of an ``(n, world // n)`` mesh (on a CPU each call after a little local work,
as in a step: ``collectives.py``), in ``collectives.py``. Each series is measured
on ``fit`` sizes, used by the least-squares fits, and on ``held_out`` sizes, used only to report the
fits' prediction error. This module chooses what to measure (``ProfileConfig``), records the
machine, runs the series in order and fits them.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import queue as queue_mod
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autoshard.passes.cost.hardware import COLLECTIVE_KINDS
from autoshard.passes.cost.profile_format import PROFILE_FORMAT, derive_hardware, fit_affine, new_profile
from autoshard.passes.errors import AutoshardError
from autoshard.profiling.collectives import rank_groups, time_collective
from autoshard.profiling.kernel_tables import measure_kernel_tables
from autoshard.profiling.local_work import time_copies, time_elementwise, time_matmuls, time_op_chain
from autoshard.profiling.timer import Timer
from autoshard.runtime.groups import choose_device_backend

__all__ = ["ProfileConfig", "measure_profile", "spawn_profile", "machine_info", "cpu_model"]

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure. Sizes: matmul (m, k, n) shapes, copy bytes (read + written), collective
    full per-group bytes B (see passes/cost/collectives.py), op-chain lengths. ``group_sizes`` None: every
    power of two from 2 up to the world size that divides it."""
    matmul_fit: tuple = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 256, 1024),
                         (2048, 128, 512))
    matmul_held_out: tuple = ((96, 96, 96), (384, 384, 384), (1024, 512, 256))
    copy_fit: tuple = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
    copy_held_out: tuple = (8 * MiB, 32 * MiB)
    elementwise_fit: tuple = (16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB)
    elementwise_held_out: tuple = (128 * KiB, 512 * KiB)
    collective_fit: tuple = (4 * KiB, 32 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
    collective_held_out: tuple = (16 * KiB, 512 * KiB, 2 * MiB)
    op_chain: tuple = (1, 4, 8)
    #: on a CPU, each timed collective call follows a layer norm + GELU over this many bytes of
    #: float32 activations on every rank, whose own time is subtracted (``collectives.py``): the
    #: local work a step runs between two collectives. 0: back-to-back calls (as on a GPU)
    collective_work_bytes: int = 64 * KiB
    kinds: tuple = COLLECTIVE_KINDS
    group_sizes: Optional[tuple] = None
    repeats: int = 5
    bf16: bool = True
    #: on a GPU, also the kernel tables (``kernel_tables.py``): "full" (Llama-3 shapes, about a
    #: minute on an H100), "quick" (tiny shapes: checks the path) or "none"
    kernel_tables: str = "full"

    @classmethod
    def make(cls, quick: bool = False, **overrides) -> "ProfileConfig":
        """The default set, or a quick one (fewer sizes and repeats: seconds, not minutes)."""
        if quick:
            base = dict(matmul_fit=((64, 64, 64), (256, 256, 256), (1024, 256, 512), (2048, 128, 256)),
                        matmul_held_out=((128, 128, 128), (512, 256, 512)),
                        copy_fit=(1 * MiB, 8 * MiB, 32 * MiB), copy_held_out=(4 * MiB,),
                        elementwise_fit=(16 * KiB, 128 * KiB, 512 * KiB), elementwise_held_out=(64 * KiB,),
                        collective_fit=(4 * KiB, 64 * KiB, 512 * KiB, 2 * MiB),
                        collective_held_out=(16 * KiB, 1 * MiB), op_chain=(1, 4), repeats=3, bf16=False,
                        kernel_tables="quick")
            base.update(overrides)
            return cls(**base)
        return cls(**overrides)

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine_info(world: int, device: torch.device, backend: str) -> dict:
    """Host, CPU model, core count, torch version, device, memory per device, UTC date."""
    cpu = cpu_model()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mem, name = float(props.total_memory), props.name
    else:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(local, 1)
        name = "cpu process"
    return {"hostname": socket.gethostname(), "cpu": cpu, "nproc": os.cpu_count(), "torch": torch.__version__,
            "device": device.type, "device_name": name, "backend": backend, "world_size": world,
            "devices_per_node": local, "memory_bytes_per_device": mem, "threads_per_rank": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "inter_node_measured": False}


def _fitted(samples: list, x_of, held: list) -> dict:
    a, b = fit_affine([x_of(s) for s in samples], [s[-1] for s in samples])
    return {"samples": samples, "held_out": held, "fit": {"latency_s": a, "seconds_per_unit": b}}


def _local_work(nbytes: int) -> Optional[Callable[[], object]]:
    """A layer norm and a GELU over ``nbytes`` of float32 (rows of 256): what a step computes between
    two collectives; None for 0 bytes."""
    rows = int(nbytes) // 4 // 256
    if rows <= 0:
        return None
    x = torch.randn(rows, 256)
    return lambda: torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (256,)))


def measure_profile(config: Optional[ProfileConfig] = None, *, name: Optional[str] = None,
                    log: Optional[Callable[[str], None]] = None) -> Optional[dict]:
    """Measure on every rank of the current world (or alone, without torch.distributed); returns
    the profile dict on rank 0 and None on the others. Call it on every rank together."""
    config = config or ProfileConfig()
    log = log or (lambda msg: None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    backend = str(dist.get_backend()) if dist.is_initialized() else "none"
    device = choose_device_backend()[0] if "nccl" in backend else torch.device("cpu")
    timer = Timer(device, config.repeats, world)
    prof = new_profile(machine_info(world, device, backend))
    prof["config"] = config.to_json()
    t0 = time.perf_counter()
    flops = lambda s: 2.0 * s[0] * s[1] * s[2]  # noqa: E731
    prof["matmul"] = {"dtype": "float32", **_fitted(time_matmuls(timer, config.matmul_fit, torch.float32, device), flops,
                                                    time_matmuls(timer, config.matmul_held_out, torch.float32, device))}
    if config.bf16:
        prof["matmul_bf16"] = {"dtype": "bfloat16", **_fitted(
            time_matmuls(timer, config.matmul_fit, torch.bfloat16, device), flops, [])}
    prof["memory"] = _fitted(time_copies(timer, config.copy_fit, device), lambda s: s[0],
                             time_copies(timer, config.copy_held_out, device))
    prof["elementwise"] = _fitted(time_elementwise(timer, config.elementwise_fit, device), lambda s: s[0],
                                  time_elementwise(timer, config.elementwise_held_out, device))
    prof["op_overhead"] = _fitted(time_op_chain(timer, config.op_chain, device), lambda s: s[0], [])
    if device.type == "cuda" and config.kernel_tables != "none":
        prof.update(measure_kernel_tables(device, quick=config.kernel_tables == "quick", log=log))
    log(f"compute measured in {time.perf_counter() - t0:.1f} s")
    local_work = _local_work(config.collective_work_bytes) if device.type == "cpu" else None
    sizes = config.group_sizes or tuple(n for n in (2 ** i for i in range(1, 20)) if n <= world and world % n == 0)
    for n in sizes:
        if n < 2 or world % n:
            raise AutoshardError(f"group size {n} does not divide the world of {world} ranks")
        groups = rank_groups(world, n, rank)
        for kind in config.kinds:
            if kind == "send_recv" and n != 2:
                continue
            prof["collectives"].append({"kind": kind, "n": n, **_fitted(
                time_collective(timer, kind, n, groups, rank, config.collective_fit, device, backend, local_work), lambda s: s[0],
                time_collective(timer, kind, n, groups, rank, config.collective_held_out, device, backend, local_work))})
        log(f"collectives over groups of {n} measured ({time.perf_counter() - t0:.1f} s so far)")
    prof["seconds"] = time.perf_counter() - t0
    if rank != 0:
        return None
    prof["name"] = name or f"profile-{prof['machine']['hostname']}-{device.type}x{world}"
    prof["hardware"] = derive_hardware(prof, prof["name"]).to_json()
    assert prof["format"] == PROFILE_FORMAT
    return prof


def _spawned_rank(rank: int, world: int, store_path: str, config_json: str, name: Optional[str], queue) -> None:
    os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)  # as torchrun does for several processes per machine
    try:
        # a FileStore, not a TCP port: a free port picked by the parent can be taken before rank 0 binds it
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        cfg = json.loads(config_json)
        config = ProfileConfig(**{k: (tuple(tuple(x) if isinstance(x, list) else x for x in v)
                                      if isinstance(v, list) else v) for k, v in cfg.items()})
        prof = measure_profile(config, name=name)
        if rank == 0:
            queue.put(("ok", json.dumps(prof)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the parent must hear of every failure
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def spawn_profile(world: int, config: Optional[ProfileConfig] = None, *, name: Optional[str] = None,
                  timeout: float = 600.0) -> dict:
    """Start ``world`` local CPU processes joined by gloo, measure, and return rank 0's profile."""
    if world < 1:
        raise AutoshardError(f"--nproc must be >= 1, got {world}")
    config = config or ProfileConfig()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_path = os.path.join(tempfile.mkdtemp(prefix="autoshard_profile_"), "store")
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, store_path, json.dumps(config.to_json()), name, queue),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get(timeout=timeout)
    except queue_mod.Empty:
        raise AutoshardError(f"profiling {world} processes did not finish within {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise AutoshardError(f"profiling failed on {payload}")
    return json.loads(payload)
