"""How a compiled region is compiled: ``CompileOptions`` (what the user asks for) and ``RegionCompiler``
(the ``torch.compile`` backend every region of one rank's program goes through, with its bookkeeping).

>>> CompileOptions()                       # what compile=True means
CompileOptions(backend='inductor', mode=None, cache_dir=None, one_compile_at_a_time=None)

``RegionCompiler.compile(body)`` is ``torch.compile(body, backend=<this compiler>, dynamic=False)``.
The backend runs inductor's ``compile_fx`` with ``fallback_random=True`` (random ops call ATen's
kernels on torch's generator, so dropout masks are the eager program's and a checkpoint's recompute
replays them) and the ``mode``'s settings, and records per compile:

- the seconds spent: dynamo's trace (from the call to the backend), AOTAutograd and inductor, and the
  backward compile AOTAutograd runs at the first backward; never the wait for the host lock below;
- dynamo's graph breaks with their reasons, the graphs made, and inductor's FX-graph-cache hits and
  misses (``torch._dynamo.utils.counters``), so a second process shows the cache reused.

Inductor's caches live under ``cache_dir`` (default: inductor's own, ``/tmp/torchinductor_<user>``;
set, it becomes ``TORCHINDUCTOR_CACHE_DIR`` for this process). ``one_compile_at_a_time`` (default: on
for inductor when the ranks run on CPU) makes the ranks of one host (every process using the same
cache directory) compile in turn, holding a file lock in the
cache directory while they compile (never while they run a collective): the ranks' graphs and kernels
are mostly the same, so the first compiles them and the others load them from the cache instead of
compiling the same C++ side by side on the same cores.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["CompileOptions", "RegionCompiler", "CompileStats", "BACKENDS"]

#: ``CompileOptions.backend`` values: inductor (fused kernels: C++ on CPU, Triton on GPU); aot_eager
#: (dynamo and AOTAutograd, no code generation: checks tracing quickly); eager (dynamo only)
BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class CompileOptions:
    """``autoshard.compile(..., compile=CompileOptions(...))``; ``compile=True`` is ``CompileOptions()``.
    ``backend``: one of ``BACKENDS``. ``mode``: ``torch.compile``'s mode for inductor (None, "default",
    "max-autotune-no-cudagraphs", ...). ``cache_dir``: inductor's cache directory (None: inductor's
    default). ``one_compile_at_a_time``: ranks of a host compile in turn (None: inductor on CPU)."""
    backend: str = "inductor"
    mode: Optional[str] = None
    cache_dir: Optional[str] = None
    one_compile_at_a_time: Optional[bool] = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise TypeError(f"CompileOptions(backend={self.backend!r}): choose one of {list(BACKENDS)}")
        if self.mode is not None:
            modes = sorted(torch._inductor.list_mode_options())
            if self.mode not in modes or self.backend != "inductor":
                raise TypeError(f"CompileOptions(mode={self.mode!r}): a mode is inductor's, one of {modes}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"CompileOptions(cache_dir={self.cache_dir!r}): pass a directory path")

    @classmethod
    def of(cls, value: Any) -> Optional["CompileOptions"]:
        """``compile=`` as given: False/None -> None, True -> the defaults, a ``CompileOptions`` as is;
        anything else is a TypeError naming what to pass."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"compile={value!r}: pass True (inductor), False, or autoshard.CompileOptions(backend=..., "
                        "mode=..., cache_dir=...)")

    def config_patches(self) -> dict:
        patches = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
        patches["fallback_random"] = True
        return patches


@dataclass
class CompileStats:
    """What compiling cost and found, summed over the compiles of one region (or a whole program)."""
    compiles: int = 0
    seconds: float = 0.0
    graphs: int = 0
    breaks: Counter = field(default_factory=Counter)  # reason -> count
    cache_hits: int = 0
    cache_misses: int = 0

    def add(self, other: "CompileStats") -> None:
        self.compiles += other.compiles
        self.seconds += other.seconds
        self.graphs += other.graphs
        self.breaks.update(other.breaks)
        self.cache_hits += other.cache_hits
        self.cache_misses += other.cache_misses

    @property
    def graph_breaks(self) -> int:
        return sum(self.breaks.values())


class _HostLock:
    """A re-entrant (within this process) exclusive lock on a file shared by the host's processes."""

    def __init__(self, path: Optional[str]):
        self.path, self._fd, self._depth = path, None, 0
        self.waited = 0.0  # seconds spent blocked acquiring it

    @contextlib.contextmanager
    def held(self):
        if self.path is None:
            yield
            return
        if self._depth == 0:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            started = time.perf_counter()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self.waited += time.perf_counter() - started
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None


def _counters() -> tuple:
    from torch._dynamo.utils import counters
    return (Counter(counters["graph_break"]), counters["stats"]["unique_graphs"],
            counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])


class RegionCompiler:
    """The backend of one rank's compiled regions. ``device``: where the program runs (the default of
    ``one_compile_at_a_time`` depends on it). ``totals``: every compile of this rank so far, backward
    graphs included (AOTAutograd compiles a region's backward at its first backward)."""

    def __init__(self, options: CompileOptions, device: Any = "cpu"):
        self.options = options
        if options.cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(os.fspath(options.cache_dir))
        serial = options.one_compile_at_a_time
        if serial is None:  # inductor on CPU: the ranks' C++ compiles would share the same cores
            serial = torch.device(device).type == "cpu" and options.backend == "inductor"
        self._lock = _HostLock(os.path.join(self.cache_dir(), "autoshard_compile.lock") if serial else None)
        self.totals = CompileStats()
        self._backend_started: Optional[float] = None
        self._in_call = False
        self._pending: Optional[CompileStats] = None

    @property
    def waited(self) -> float:
        """Seconds this rank spent waiting for the host's other ranks to finish compiling."""
        return self._lock.waited

    @staticmethod
    def cache_dir() -> str:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()

    def compile(self, body: torch.nn.Module) -> Callable:
        """``body`` compiled lazily (at its first call) by this backend, shapes static."""
        # a pipeline's split backward (ZB schedules: B, then W) runs a region's backward with
        # retain_graph=True, which AOTAutograd's donated buffers refuse; donating saves no step time here
        import torch._functorch.config as functorch_config
        functorch_config.donated_buffer = False
        return torch.compile(body, backend=self._backend, dynamic=False)

    def call(self, fn: Callable, args: tuple, stats: CompileStats):
        """``fn(*args)``; what a compile during the call costs and finds goes to ``stats`` (and ``totals``)."""
        before = _counters()
        started = time.perf_counter()
        self._backend_started, self._in_call = None, True
        pending = CompileStats()
        self._pending = pending
        try:
            return fn(*args)
        finally:
            self._in_call, self._pending = False, None
            if self._backend_started is not None:  # dynamo traced and compiled during this call
                pending.seconds += self._backend_started - started
                after = _counters()
                pending.compiles += 1
                pending.breaks.update(after[0] - before[0])
                pending.graphs += after[1] - before[1]
                pending.cache_hits += after[2] - before[2]
                pending.cache_misses += after[3] - before[3]
                stats.add(pending)
                self.totals.add(pending)

    # ---- the backend dynamo calls ----------------------------------------------------------------
    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        if self._backend_started is None:
            self._backend_started = time.perf_counter()
        with self._lock.held():
            started = time.perf_counter()
            try:
                if self.options.backend != "inductor":
                    from torch._dynamo import lookup_backend
                    return lookup_backend(self.options.backend)(gm, example_inputs)
                from torch._inductor.compile_fx import compile_fx, compile_fx_inner
                return compile_fx(gm, example_inputs, inner_compile=self._inner(compile_fx_inner),
                                  config_patches=self.options.config_patches())
            finally:
                if self._in_call:
                    self._pending.seconds += time.perf_counter() - started

    def _inner(self, compile_inner: Callable) -> Callable:
        """inductor's per-graph compile under the host lock; when it runs outside a region's call (the
        backward graph, at the first backward) its seconds and cache use go to ``totals``."""
        def inner(*args, **kwargs):
            if self._in_call:
                with self._lock.held():
                    return compile_inner(*args, **kwargs)
            before = _counters()
            with self._lock.held():
                started = time.perf_counter()
                try:
                    return compile_inner(*args, **kwargs)
                finally:
                    after = _counters()
                    self.totals.add(CompileStats(seconds=time.perf_counter() - started,
                                                 cache_hits=after[2] - before[2], cache_misses=after[3] - before[3]))
        return inner
