"""Measure the machine a plan will run on: matmul throughput, memory bandwidth, per-op launch cost,
and collective latency/bandwidth per group size. The result is a profile (``passes/cost/profile_format.py``)
that ``plan(..., hardware="profile.json")`` prices plans with.

    measure_profile(ProfileConfig.make(quick=True))   # on every rank of an initialized world
    spawn_profile(4, ProfileConfig.make(quick=True))   # starts 4 local CPU processes over gloo itself

Every figure is measured with ALL ranks busy at once (a mesh axis's groups communicate
concurrently, and ranks sharing a CPU compete for its cores), timed as the median of ``repeats``
batches of calls, and taken as the slowest rank's median (a step waits for the slowest rank).
Local work (matmuls in the three layouts of a training step, copies, an elementwise mix, and a
captured tiny network for the per-op launch cost) cycles through operand sets larger than the
caches, and its batches end at a barrier, so they run while every rank competes for the cores.
Collectives over groups of ``n < world`` ranks run on every group at once and alternate between
the groups of the two axes of an ``(n, world // n)`` mesh (``n`` consecutive ranks, then ``n``
ranks ``world // n`` apart), because a plan on a 2-D mesh interleaves collectives on both axes
(an FSDP weight is all-gathered on one axis, then on the other): each call then waits for the
slowest rank of the whole world, not just of its own group. (On 4 gloo ranks sharing 2 cores, a
size-2 all-gather or reduce-scatter timed on isolated pairs ran 1.3-2.2x faster than inside such a
chain, and (2, 2) FSDP steps priced with those fits were underestimated by 40-50%.) Each series is measured on ``fit`` sizes, used
by the least-squares fits, and on ``held_out`` sizes, used only to report the fits' prediction error.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from autoshard.passes.errors import AutoshardError
from autoshard.passes.cost.hardware import COLLECTIVE_KINDS
from autoshard.passes.cost.profile_format import PROFILE_FORMAT, derive_hardware, fit_affine, new_profile

from autoshard.runtime.groups import choose_device_backend

__all__ = ["ProfileConfig", "measure_profile", "spawn_profile", "machine_info"]

KiB, MiB = 1024, 1024 * 1024
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure. Sizes: matmul (m, k, n) shapes, copy bytes (read + written), collective
    full per-group bytes B (see passes/cost/model.py), op-chain lengths. ``group_sizes`` None: every
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
    kinds: tuple = COLLECTIVE_KINDS
    group_sizes: Optional[tuple] = None
    repeats: int = 5
    bf16: bool = True

    @classmethod
    def make(cls, quick: bool = False, **overrides) -> "ProfileConfig":
        """The default set, or a quick one (fewer sizes and repeats: seconds, not minutes)."""
        if quick:
            base = dict(matmul_fit=((64, 64, 64), (256, 256, 256), (1024, 256, 512), (2048, 128, 256)),
                        matmul_held_out=((128, 128, 128), (512, 256, 512)),
                        copy_fit=(1 * MiB, 8 * MiB, 32 * MiB), copy_held_out=(4 * MiB,),
                        elementwise_fit=(16 * KiB, 128 * KiB, 512 * KiB), elementwise_held_out=(64 * KiB,),
                        collective_fit=(4 * KiB, 64 * KiB, 512 * KiB, 2 * MiB),
                        collective_held_out=(16 * KiB, 1 * MiB), op_chain=(1, 4), repeats=3, bf16=False)
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


class _Timer:
    def __init__(self, device: torch.device, repeats: int, world: int):
        self.device, self.repeats, self.world = device, repeats, world

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], None], iters: int, fence: bool = False) -> float:
        """Slowest rank's median seconds per call of ``fn`` (every rank must call this together).

        ``fence``: the batch ends at a barrier, so its time runs until the LAST rank is done: local
        work timed while every rank competes for the cores, as in a step (without it a rank that
        finishes early sleeps in the next barrier and lends its core to the others)."""
        fn()
        self._sync()
        times = []
        for _ in range(self.repeats):
            if self.world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            self._sync()
            if fence and self.world > 1:
                dist.barrier()
            times.append((time.perf_counter() - t0) / iters)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64,
                           device=self.device if self.device.type == "cuda" else "cpu")
        if self.world > 1:
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return float(med.item())


def _iters(work: float, budget: float = 4e6, most: int = 50) -> int:
    """Calls per timed batch: more for small work (same on every rank: collectives need it)."""
    return int(max(2, min(most, budget / max(work, 1.0))))


def _rotation(bytes_per_set: float, budget: float = 32 * MiB) -> int:
    """How many operand sets to cycle through so the working set exceeds the caches, as in a
    training step where an op's operands were written long before it runs."""
    return int(max(1, min(16, budget // max(bytes_per_set, 1.0))))


def _matmul(timer: _Timer, shapes, dtype, device) -> list:
    """[m, k, n, seconds] per shape: the mean over the three layouts a training step multiplies in
    (forward ``A B``, input gradient ``G B^T``, weight gradient ``A^T G``), operands cycled cold."""
    rows = []
    for m, k, n in shapes:
        sets = [(torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype),
                 torch.randn(n, k, device=device).to(dtype).t(), torch.randn(k, m, device=device).to(dtype).t())
                for _ in range(_rotation(4.0 * (2 * m * k + 2 * k * n)))]
        state = {"i": 0}

        def run():
            a, b, bt, at = sets[state["i"] % len(sets)]
            state["i"] += 1
            torch.mm(a, b)
            torch.mm(a, bt)
            torch.mm(at, b)
        rows.append([m, k, n, timer(run, _iters(6.0 * m * k * n, 4e9, 200), fence=True) / 3])
    return rows


def _copy(timer: _Timer, sizes, device) -> list:
    rows = []
    for moved in sizes:
        src = torch.empty(int(moved) // 8, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        rows.append([2 * src.numel() * 4, timer(lambda: dst.copy_(src), _iters(moved, 2e9, 200), fence=True)])
    return rows


def _elementwise(timer: _Timer, sizes, device) -> list:
    """GELU, layer norm, softmax, mul, add over ``numel`` floats, forward, operands cycled cold:
    [bytes read + written as the cost model counts them (12 * 4 * numel), seconds]."""
    rows = []
    for numel in sizes:
        xs = [torch.randn(int(numel) // 256, 256, device=device) for _ in range(_rotation(16.0 * numel))]
        state = {"i": 0}

        def run():
            x = xs[state["i"] % len(xs)]
            state["i"] += 1
            y = torch.nn.functional.gelu(x)
            z = torch.nn.functional.layer_norm(y, (256,))
            w = torch.softmax(z, -1)
            return w * x + y
        rows.append([12 * 4 * xs[0].numel(), timer(run, _iters(xs[0].numel() * 20, 1e8, 200), fence=True)])
    return rows


class _Chain(torch.nn.Module):
    """A generic mix of small ops (layer norm, linear, GELU, view/transpose, softmax, residual add),
    ``layers`` times: what an eager step dispatches per op when the tensors are tiny."""

    def __init__(self, layers: int, d: int = 8):
        super().__init__()
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(layers)])
        self.fcs = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(layers)])

    def forward(self, x):
        b, t, d = x.shape
        for norm, fc in zip(self.norms, self.fcs):
            h = torch.nn.functional.gelu(fc(norm(x)))
            h = h.view(b, t, 2, d // 2).transpose(1, 2).softmax(-1).transpose(1, 2).reshape(b, t, d)
            x = x + h
        return x


def _op_chain(timer: _Timer, lengths, device) -> list:
    """Forward + backward of the captured ``_Chain`` program (as the runtime runs programs) for
    several depths; each sample is [op launches as the cost model counts them, seconds]."""
    from autoshard.passes.capture.export import capture
    from autoshard.passes.cost.model import GraphFacts
    from autoshard.passes.cost.hardware import PRESETS

    rows = []
    for layers in lengths:
        torch.manual_seed(0)
        model = _Chain(layers)
        x, y = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
        cg = capture(model, (x,), loss_fn=torch.nn.functional.mse_loss, target=y)
        facts = GraphFacts(cg, PRESETS["cpu"])
        launches = sum(facts.launches(n) for n in facts.kind)
        gm = cg.gm.to(device)
        params = [p.detach().to(device).requires_grad_(True) for p in model.parameters()]
        args = [*params, x.to(device), y.to(device)]

        def run(gm=gm, args=args):
            gm(*args).backward()
        rows.append([launches, timer(run, _iters(launches, 4000, 200), fence=True)])
    return rows


def _groups(world: int, n: int, rank: int) -> list:
    """This rank's groups of ``n``: [the WORLD] for ``n == world``; else [its group of ``n``
    consecutive ranks, its group of ``n`` ranks ``world // n`` apart] -- the groups of the last and
    of the first axis of a ``(n, world // n)`` mesh. Every rank creates every group, in one order."""
    if n == world:
        return [dist.group.WORLD]
    mine = [None, None]
    stride = world // n
    for start in range(0, world, n):
        g = dist.new_group(list(range(start, start + n)))
        if start <= rank < start + n:
            mine[0] = g
    for first in range(stride):
        g = dist.new_group(list(range(first, world, stride)))
        if rank % stride == first:
            mine[1] = g
    return mine


def _collective(timer: _Timer, kind: str, n: int, groups: list, rank: int, sizes, device, backend: str) -> list:
    """[B, seconds per call] for each size. With two groups (``n < world``) the calls alternate
    between them, as collectives on the axes of a 2-D mesh do in a step: every rank then waits for
    ranks outside its own group too, which groups timed alone in a loop never do."""
    rows = []
    for B in sizes:
        unit = n * n
        elems = max(unit, int(B) // 4 // unit * unit)
        full = torch.ones(elems, dtype=torch.float32, device=device)
        piece = torch.ones(elems // n, dtype=torch.float32, device=device)
        out = torch.empty_like(piece)
        recv = torch.empty_like(full)

        def call(group):
            if kind == "all_reduce":
                dist.all_reduce(full, group=group)
            elif kind == "all_gather":
                _all_gather_single(full, piece, group=group)
            elif kind == "reduce_scatter":
                _reduce_scatter_single(piece, full, group=group)
            elif kind == "all_to_all":
                dist.all_to_all_single(out, piece, group=group)
            else:  # send_recv: pairs (2i, 2i+1) exchange one message each way
                peer = rank ^ 1
                if backend == "gloo":
                    works = [dist.isend(full, peer), dist.irecv(recv, peer)]
                else:
                    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peer),
                                                    dist.P2POp(dist.irecv, recv, peer)])
                for w in works:
                    w.wait()
        if kind == "send_recv":
            groups = groups[:1]  # point-to-point: no group

        def fn():
            for g in groups:
                call(g)
        rows.append([elems * 4, timer(fn, _iters(elems * 4 * len(groups))) / len(groups)])
    return rows


def _fitted(samples: list, x_of, held: list) -> dict:
    a, b = fit_affine([x_of(s) for s in samples], [s[-1] for s in samples])
    return {"samples": samples, "held_out": held, "fit": {"latency_s": a, "seconds_per_unit": b}}


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
    timer = _Timer(device, config.repeats, world)
    prof = new_profile(machine_info(world, device, backend))
    prof["config"] = config.to_json()
    t0 = time.perf_counter()
    flops = lambda s: 2.0 * s[0] * s[1] * s[2]  # noqa: E731
    prof["matmul"] = {"dtype": "float32", **_fitted(_matmul(timer, config.matmul_fit, torch.float32, device), flops,
                                                    _matmul(timer, config.matmul_held_out, torch.float32, device))}
    if config.bf16:
        prof["matmul_bf16"] = {"dtype": "bfloat16", **_fitted(
            _matmul(timer, config.matmul_fit, torch.bfloat16, device), flops, [])}
    prof["memory"] = _fitted(_copy(timer, config.copy_fit, device), lambda s: s[0],
                             _copy(timer, config.copy_held_out, device))
    prof["elementwise"] = _fitted(_elementwise(timer, config.elementwise_fit, device), lambda s: s[0],
                                  _elementwise(timer, config.elementwise_held_out, device))
    prof["op_overhead"] = _fitted(_op_chain(timer, config.op_chain, device), lambda s: s[0], [])
    log(f"compute measured in {time.perf_counter() - t0:.1f} s")
    sizes = config.group_sizes or tuple(n for n in (2 ** i for i in range(1, 20)) if n <= world and world % n == 0)
    for n in sizes:
        if n < 2 or world % n:
            raise AutoshardError(f"group size {n} does not divide the world of {world} ranks")
        groups = _groups(world, n, rank)
        for kind in config.kinds:
            if kind == "send_recv" and n != 2:
                continue
            prof["collectives"].append({"kind": kind, "n": n, **_fitted(
                _collective(timer, kind, n, groups, rank, config.collective_fit, device, backend), lambda s: s[0],
                _collective(timer, kind, n, groups, rank, config.collective_held_out, device, backend))})
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
    import queue as queue_mod
    import torch.multiprocessing as mp

    if world < 1:
        raise AutoshardError(f"--nproc must be >= 1, got {world}")
    config = config or ProfileConfig()
    import tempfile

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
