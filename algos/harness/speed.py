"""The speed switches: ``--compile`` and ``--cudagraphs`` applied once to the plain hot functions (LeanRL's pattern,
:func:`bind`, :func:`capture`), :class:`CudaGraphed` replaying one from a CUDA graph, the persistent compile cache
(:func:`use_compile_cache`), the time spent compiling and capturing (:data:`COMPILE_CLOCK`), learning rates as device
tensors (:func:`device_lr`) and a clock that waits for the device (:func:`synced_clock`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch


def use_compile_cache(path: str | Path | None) -> Path | None:
    """Keep Inductor's compiled graphs in ``path``: its FX graph cache, the AOTAutograd cache and, under them, Triton's
    kernels (``TORCHINDUCTOR_CACHE_DIR``, which the compile workers inherit). Entries are keyed as torch keys them
    (graph, inputs' shapes and dtypes, config, torch version, device), so a graph one process compiled is a cache hit
    for the next, whichever script compiled it, and a second run compiles nothing it compiled before. Call it before
    the first compilation; None or ``""`` leaves torch's default (a folder under the system's temporary directory).
    Returns the folder, absolute, created where missing."""
    if not path:
        return None
    folder = Path(path).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return folder


class CompileClock:
    """Per hot function (by the name :func:`bind` gives it): the wall seconds of the calls that compiled a graph or
    captured a CUDA graph, the graphs compiled (Dynamo's ``unique_graphs``), and the graphs compiled after its first
    :attr:`SETTLE` calls (recompilations: each one costs the compile again, in the steady loop). Only the outermost
    timed call counts, so a rollout captured around a compiled step is charged once, under the rollout's name."""

    SETTLE = 2
    """calls of a function in which compiling is expected (the first call compiles; the second may once more, where
    Dynamo turns a changing Python number into a symbol)"""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every figure (a new run)."""
        self.seconds: dict[str, float] = {}
        self.graphs: dict[str, int] = {}
        self.late_graphs: dict[str, int] = {}
        self._depth = 0

    def timed(self, name: str, fn: Callable) -> Callable:
        """``fn`` with its compile and capture time charged to ``name``."""
        from torch._dynamo.utils import counters as dynamo_counters  # here: Dynamo's import costs seconds a process

        calls = 0

        def call(*args, **kwargs):
            nonlocal calls
            if self._depth:
                return fn(*args, **kwargs)
            calls += 1
            graphs0, captured0 = dynamo_counters["stats"]["unique_graphs"], getattr(fn, "graph", None)
            start = time.perf_counter()
            self._depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            new = dynamo_counters["stats"]["unique_graphs"] - graphs0
            if new or getattr(fn, "graph", None) is not captured0:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.graphs[name] = self.graphs.get(name, 0) + new
                if calls > self.SETTLE and new:
                    self.late_graphs[name] = self.late_graphs.get(name, 0) + new
            return out

        return call

    def total_s(self) -> float:
        """Compile and capture seconds over every function."""
        return sum(self.seconds.values())

    def summary(self) -> str:
        """One line: the total, then each function's seconds and graphs, and any recompilation."""
        parts = [f"{name} {s:.1f} s, {self.graphs.get(name, 0)} graphs" for name, s in self.seconds.items()]
        late = sum(self.late_graphs.values())
        tail = f"; RECOMPILED after the first calls: {self.late_graphs}" if late else ""
        return f"compile and capture: {self.total_s():.1f} s ({'; '.join(parts)}){tail}"


COMPILE_CLOCK = CompileClock()
"""The process's :class:`CompileClock`: :func:`bind` and :func:`capture` charge it, :class:`~algos.harness.Run` resets,
logs and returns it."""


class CudaGraphed:
    """Replays ``fn(*tensors)`` from a CUDA graph: ``warmup`` eager calls on a side stream, then capture.

    Inputs are copied into static buffers before each replay; the returned tensors are the graph's static outputs,
    overwritten by the next call. ``fn`` must not sync with the host, and every call must pass tensors of the shapes
    of the captured call.
    """

    def __init__(self, fn, warmup: int = 3):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: tuple[torch.Tensor, ...] = ()
        self.static_out = None

    def __call__(self, *args: torch.Tensor):
        if self.graph is not None:
            for dst, src in zip(self.static_in, args):
                dst.copy_(src)
            self.graph.replay()
            return self.static_out
        self.calls += 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if self.calls <= self.warmup:
            with torch.cuda.stream(stream):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            return out
        self.static_in = tuple(a.clone() for a in args)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self.fn(*self.static_in)
        self.graph.replay()  # capture records the work without running it
        return self.static_out


def bind(args, graphs: bool = True, compile: bool = True, **fns: Callable | None) -> tuple:
    """The hot functions (already bound to their networks with :func:`functools.partial`) as the speed switches
    say: ``torch.compile`` with ``--compile`` (eager's random kernels, so a seed gives the same run) unless
    ``compile`` is False (a long unrolled loop, e.g. GAE over a week of steps, whose graph costs far more to compile
    than it saves: its kernels still run in the CUDA graph), then, unless ``graphs`` is False (a function replayed
    inside a larger graph, see :func:`capture`), :class:`CudaGraphed` with ``--cudagraphs``; the compile and capture
    time of each is charged to :data:`COMPILE_CLOCK` under its keyword. None stays None. Returns them in the order
    given."""
    out = []
    if args.compile:
        torch._inductor.config.fallback_random = True
    for name, fn in fns.items():
        if fn is not None and args.compile and compile:
            fn = torch.compile(fn)
        if fn is not None and args.cudagraphs and graphs:
            fn = CudaGraphed(fn)
        if fn is not None and (args.compile or args.cudagraphs):
            fn = COMPILE_CLOCK.timed(name, fn)
        out.append(fn)
    return tuple(out)


def capture(args, fn: Callable, name: str = "graph") -> Callable:
    """``fn`` (tensors in, tensors out, no host sync, every state it touches updated in place) replayed from one CUDA
    graph with ``--cudagraphs``, e.g. a whole rollout of a torch-batched env: policy and env steps of ``num_steps``
    steps in one launch; its capture (and the compiling of what it calls) charged to ``name``. As it is otherwise."""
    return COMPILE_CLOCK.timed(name, CudaGraphed(fn)) if args.cudagraphs else fn


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad(set_to_none)`` in a form ``torch.compile`` traces: Dynamo does not trace
    ``Optimizer.zero_grad`` (torch 2.11-2.13), so calling it splits a compiled update into a graph before it and one
    after, with eager work between (more kernels in every replay, more to compile). The same gradients: None, or
    zero-filled in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if set_to_none:
                p.grad = None  # whatever it was: no branch on it, so no second graph once the gradients exist
            elif p.grad is not None:
                p.grad.zero_()


def device_lr(value: float, device: torch.device) -> torch.Tensor:
    """A learning rate as a device tensor, annealed in place: no recompilation, and CUDA graphs see the new value. On
    CUDA float32 (Adam takes a tensor LR only as capturable); on the CPU float64, which Adam reads back as a Python
    number, so the steps are those of a plain float LR."""
    return torch.tensor(value, device=device, dtype=torch.float32 if device.type == "cuda" else torch.float64)


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a host sync on CUDA), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
