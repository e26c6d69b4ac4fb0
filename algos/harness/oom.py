"""What a CUDA out-of-memory error is to the scripts: the errors of the back-off (:mod:`.backoff`), the error's message
found behind a compile or capture error, the memory handed back, and the live state copied to the CPU."""

from __future__ import annotations

import gc

import torch


class OutOfMemoryBackoffError(RuntimeError):
    """CUDA ran out of memory and the sizes cannot shrink further (``max_oom_retries`` reached, or nothing left to
    shrink); training stops, the last checkpoint is kept."""


class OutOfMemoryRestart(Exception):
    """Raised by :meth:`Run.out_of_memory`: CUDA ran out of memory ``where``; ``state`` is the live training state
    (on the CPU) to re-enter from, ``in_update`` whether it struck in the gradient steps."""

    def __init__(self, where: str, error: str, state: dict | None, in_update: bool):
        super().__init__(error)
        self.where, self.error, self.state, self.in_update = where, error, state, in_update


def out_of_memory_message(exc: BaseException) -> str | None:
    """The first line of the CUDA out-of-memory error behind ``exc`` (itself, or what it was raised from or while
    handling: a failed compile or graph capture raises its own error on top), or None if there is none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return (str(exc).strip().splitlines() or ["CUDA out of memory"])[0]
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return None


def free_device_memory(device: torch.device) -> None:
    """Hand the memory of dropped tensors and CUDA graphs back: a garbage collection (tracebacks keep frames alive in
    cycles), then, on CUDA, the caching allocator's unused blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def to_cpu(tree):
    """A copy of a nested dict / list / tuple of tensors with every tensor on the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree
