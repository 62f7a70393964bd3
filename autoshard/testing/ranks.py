"""Run a function on N local CPU processes joined by gloo, and collect what each returns.

    results = run_ranks(fn, 4, arg1, arg2)      # fn(rank, world_size, arg1, arg2) on 4 ranks
    results[0]                                   # what rank 0 returned

``fn`` must be a module-level function: it is pickled by its module and name, and ranks fork from a
forkserver that has imported torch once. A function of a test module works: each rank starts with
the parent's ``sys.path``, which under pytest holds the test file's folder. Tensors in the returned
value come back as CPU tensors. If a rank raises, ``run_ranks`` raises the same
exception (its traceback text attached as a note); if the ranks run past ``timeout`` seconds, it
kills them and raises ``TimeoutError`` naming the ranks that had not finished.

``init="store"`` (default) joins the ranks with a FileStore before ``fn`` runs; ``init="env"``
only sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK (as torchrun does), so ``fn`` starts
with torch.distributed uninitialized.

Work every rank would do alike (capturing the same models) can be done once:

    results = run_ranks(fn, 4, arg1, prepare=functools.partial(capture_all, names))

runs ``prepare()`` in one process (forked from the forkserver, one intra-op thread), which then forks
the ranks; each rank gets its own copy-on-write copy of the result, nothing pickled:
``fn(rank, world_size, prepared, arg1)``. Four ranks capturing the same model on a 2-core machine cost
four captures' CPU; prepared, one. ``prepare`` must be picklable (a module-level function or a
``functools.partial`` of one) and should leave no threads running (the ranks are forked).
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _T:
    """A tensor in transit, as a numpy array (no shared-memory handles outlive the child)."""
    def __init__(self, t: torch.Tensor):
        self.dtype = str(t.dtype).replace("torch.", "")
        t = t.detach().cpu()
        self.array = (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()

    def restore(self) -> torch.Tensor:
        return torch.from_numpy(self.array).to(getattr(torch, self.dtype))


def _pack(obj):
    if isinstance(obj, torch.Tensor):
        return _T(obj)
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v) for v in obj)
    return obj


def _unpack(obj):
    if isinstance(obj, _T):
        return obj.restore()
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v) for v in obj)
    return obj


def _report(out, rank: int, e: BaseException) -> None:
    """Send ``e`` (picklable, or its text in a RuntimeError) with its traceback to the parent."""
    tb = traceback.format_exc()
    try:
        pickle.dumps(e)
        exc = e
    except Exception:  # noqa: BLE001
        exc = RuntimeError(f"{type(e).__name__}: {e}")
    out.put((rank, False, exc, tb))


def _worker(fn, rank, world, init, rendezvous, out, args, kwargs):
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    import torch.distributed as dist
    try:
        if init == "store":
            store = dist.FileStore(rendezvous, world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        elif init == "env":
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous)})
        result = fn(rank, world, *args, **kwargs)
        if dist.is_initialized():
            dist.barrier()  # nobody leaves (closing its gloo pairs) while another is still connecting
        packed = _pack(result)
        pickle.dumps(packed)  # fail here, with a traceback, rather than silently in the queue's thread
        out.put((rank, True, packed, None))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        _report(out, rank, e)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        # Skip the interpreter's slow teardown of torch; flush the result first.
        out.close()
        out.join_thread()
        os._exit(0)


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.device_mesh", "torch.fx", "numpy", "torch.export",
            "torch._dynamo", "autoshard.passes.capture.export", "autoshard.passes.solve.planner",
            "autoshard.runtime.executor", "autoshard.testing.rank_warmup"]


def _context():
    """A forkserver context: the server imports torch once, and every rank forks from it (spawning
    four fresh interpreters that each import torch costs seconds per test). Falls back to spawn."""
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    except ValueError:
        return mp.get_context("spawn")


def _die_with_parent() -> None:
    """Linux: this process is killed when its parent dies (a prepared rank's parent is the process that
    prepared, which ``run_ranks`` kills on a failure or a timeout)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _prepared_ranks(prepare, fn, world, init, rendezvous, out, args, kwargs):
    """The process that runs ``prepare()`` once, forks the ranks from its state and waits for them; a
    failure of ``prepare`` or a rank that dies without reporting reaches the parent through ``out``."""
    torch.set_num_threads(1)  # before any op: no OpenMP pool exists when the ranks fork
    try:
        prepared = prepare()
    except BaseException as e:  # noqa: BLE001 - the parent must hear of it
        _report(out, _PREPARE, e)
        out.close()
        out.join_thread()
        os._exit(0)
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            _worker(fn, rank, world, init, rendezvous, out, (prepared,) + tuple(args), kwargs)  # never returns
        pids.append(pid)
    for rank, pid in enumerate(pids):
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:  # ``_worker`` always leaves through os._exit(0): this rank was killed
            out.put((rank, False, RuntimeError(f"rank {rank} died with exit code {code}"), None))
    out.close()
    out.join_thread()
    os._exit(0)


#: the "rank" of a failure in ``prepare``
_PREPARE = -1


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 180.0, init: str = "store",
              prepare: Optional[Callable[[], Any]] = None, **kwargs) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes; with
    ``prepare``, ``fn(rank, world_size, prepare(), *args, **kwargs)``, ``prepare`` run once (module
    docstring)."""
    if init not in ("store", "env", None):
        raise ValueError(f"init must be 'store', 'env' or None, got {init!r}")
    ctx = _context()
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="autoshard_ranks_")
    rendezvous = free_port() if init == "env" else os.path.join(tmp, "store")
    if prepare is None:
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, init, rendezvous, out, args, kwargs),
                             daemon=True) for r in range(world_size)]
    else:  # not a daemon: a daemonic process may not have children
        procs = [ctx.Process(target=_prepared_ranks, args=(prepare, fn, world_size, init, rendezvous, out, args,
                                                           kwargs))]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                                   f"(a collective waiting on a rank that never joined?)")
            try:
                rank, ok, value, tb = out.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and (prepare or r not in results)
                        and p.exitcode not in (0, None)]
                if dead and failure is None:
                    time.sleep(0.5)  # its message may still be in flight
                    if out.empty():
                        who = "the process preparing the ranks" if prepare else f"rank {dead[0]}"
                        raise RuntimeError(f"{who} died with exit code {procs[dead[0]].exitcode}")
                continue
            if ok:
                results[rank] = _unpack(value)
            else:
                failure = (rank, value, tb)
                break
    finally:
        if failure is not None or len(results) < world_size:
            for p in procs:
                if p.is_alive():
                    p.kill()  # a prepared world's ranks die with it (``_die_with_parent``)
        for p in procs:
            p.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is not None:
        rank, exc, tb = failure
        where = "in prepare" if rank == _PREPARE else f"on rank {rank}"
        if hasattr(exc, "add_note"):
            if tb:
                exc.add_note(f"--- raised {where} ---\n{tb}")
            raise exc
        raise RuntimeError(f"failed {where}:\n{tb}")
    return [results[r] for r in range(world_size)]
