"""The out-of-memory back-off: a buffer halved at setup (:func:`allocate_halving`), and training that re-enters from
its live state at smaller sizes (:func:`train_with_oom_restarts`), each change warned and logged."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .oom import OutOfMemoryBackoffError, OutOfMemoryRestart, free_device_memory, out_of_memory_message
from .run import Run


def allocate_halving(run: Run, make: Callable[[int], Any], size: int, floor: int, name: str) -> tuple[Any, int]:
    """``(make(size), size)``, halving ``size`` after each CUDA out-of-memory error while it stays ``>= floor`` (a
    replay buffer at setup: ``name`` is its field, ``"buffer_size"``). Each halving is warned on stderr and logged as
    TensorBoard text ``oom``; none counts against ``max_oom_retries``.

    Raises:
        OutOfMemoryBackoffError: halving once more would go below ``floor``.
    """
    while True:
        try:
            return make(size), size
        except RuntimeError as exc:
            error = out_of_memory_message(exc)
            if error is None:
                raise
        flag = "--" + name.replace("_", "-")
        if size // 2 < floor:
            raise OutOfMemoryBackoffError(
                f"CUDA out of memory at setup for {name} {size:,}, and halving it would go below {floor:,}; the run "
                f"stopped before training. Ask for less memory: a smaller {flag}, --num-envs or --batch-size.\n"
                f"The error: {error}"
            )
        free_device_memory(run.device)
        message = f"CUDA out of memory at setup: {name} {size:,} -> {size // 2:,}; continuing"
        print(f"warning: {message}", file=sys.stderr, flush=True)
        run.writer.add_text("oom", message, run.global_step)
        size //= 2


def train_with_oom_restarts(train: Callable, run: Run, sizes, shrink: Callable) -> dict:
    """Call ``train(run, sizes, state)`` until it returns; on a CUDA out-of-memory error, shrink and re-enter.

    ``train`` raises :class:`OutOfMemoryRestart` from its loop (through :meth:`Run.out_of_memory`) with the live
    state; an out-of-memory error anywhere else (setting up) re-enters from the state it was given. ``shrink(sizes,
    in_update)`` is the algorithm's rule: it returns ``(smaller sizes, "what changed")`` or raises ValueError with the
    reason it cannot. Each shrink is warned on stderr and logged as TensorBoard text ``oom``.

    Raises:
        OutOfMemoryBackoffError: ``max_oom_retries`` shrinks were made already, or ``shrink`` cannot.
    """
    state = None
    while True:
        try:
            return train(run, sizes, state)
        except OutOfMemoryRestart as restart:
            where, error, in_update = restart.where, restart.error, restart.in_update
            state = restart.state if restart.state is not None else state
        except RuntimeError as exc:
            error = out_of_memory_message(exc)
            if error is None:
                raise
            where, in_update = "at setup", False
        run.close_env()
        free_device_memory(run.device)
        reason = None
        if len(run.oom_history) >= run.args.max_oom_retries:
            reason = f"max_oom_retries={run.args.max_oom_retries} halvings were made already"
        else:
            try:
                sizes, change = shrink(sizes, in_update)
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            run.close()
            kept = (
                f"the last good checkpoint {run.ckpt_path} is left untouched"
                if run.ckpt_path.exists()
                else ("no checkpoint was written")
            )
            tried = "".join(f"\n  {h}" for h in run.oom_history) or " none"
            raise OutOfMemoryBackoffError(
                f"CUDA out of memory {where} with {sizes}, and no further back-off: {reason}. Training stopped; "
                f"{kept}.\nHalvings made:{tried}\nAsk for less memory: fewer --num-envs, a smaller --batch-size or "
                "--hidden-size, no --cudagraphs or --compile; or allow more with --max-oom-retries.\nThe error: "
                f"{error}"
            )
        message = f"CUDA out of memory {where}: {change}; continuing"
        print(f"warning: {message}", file=sys.stderr, flush=True)
        run.oom_history.append(message)
        run.writer.add_text("oom", message, run.global_step)
