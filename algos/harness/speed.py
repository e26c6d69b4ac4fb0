"""The speed switches: ``--compile`` and ``--cudagraphs`` applied once to the plain hot functions (LeanRL's pattern,
:func:`bind`, :func:`capture`), :class:`CudaGraphed` replaying one from a CUDA graph, learning rates as device tensors
(:func:`device_lr`) and a clock that waits for the device (:func:`synced_clock`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


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


def bind(args, graphs: bool = True, **fns: Callable | None) -> tuple:
    """The hot functions (already bound to their networks with :func:`functools.partial`) as the speed switches
    say: ``torch.compile`` with ``--compile`` (eager's random kernels, so a seed gives the same run), then, unless
    ``graphs`` is False (a function replayed inside a larger graph, see :func:`capture`), :class:`CudaGraphed` with
    ``--cudagraphs``. None stays None. Returns them in the order given."""
    out = []
    if args.compile:
        torch._inductor.config.fallback_random = True
    for fn in fns.values():
        if fn is not None and args.compile:
            fn = torch.compile(fn)
        if fn is not None and args.cudagraphs and graphs:
            fn = CudaGraphed(fn)
        out.append(fn)
    return tuple(out)


def capture(args, fn: Callable) -> Callable:
    """``fn`` (tensors in, tensors out, no host sync, every state it touches updated in place) replayed from one CUDA
    graph with ``--cudagraphs``, e.g. a whole rollout of a torch-batched env: policy and env steps of ``num_steps``
    steps in one launch. As it is otherwise."""
    return CudaGraphed(fn) if args.cudagraphs else fn


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
