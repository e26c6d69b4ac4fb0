"""The out-of-memory back-off: a buffer halved at setup (:func:`allocate_halving`), and training that re-enters from
its live state at smaller sizes (:func:`train_with_oom_restarts`), each change warned and logged; the off-policy
scripts' sizes and rule (:class:`ReplaySizes`, :func:`halve_batch_or_envs`)."""

from __future__ import annotations

import dataclasses
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


OOM_MIN_BATCH_SIZE = 64
"""The smallest batch_size :func:`halve_batch_or_envs` halves to; below it, num_envs halves instead."""


@dataclasses.dataclass
class ReplaySizes:
    """The sizes of an off-policy run (SAC, DQN) that an out-of-memory back-off changes (``Args`` never does):
    :func:`halve_batch_or_envs` halves ``batch_size`` or ``num_envs``; ``buffer_size`` is set once at setup, to the
    replay buffer that fits (:func:`allocate_halving`)."""

    num_envs: int
    batch_size: int
    buffer_size: int


def halve_batch_or_envs(
    sizes: ReplaySizes, in_update: bool, gradient_steps: int | None = None
) -> tuple[ReplaySizes, str]:
    """The off-policy out-of-memory rule: in the gradient steps (``in_update``) halve ``batch_size`` while it stays at
    least :data:`OOM_MIN_BATCH_SIZE`; otherwise, and stepping the envs or at setup, halve ``num_envs`` (the envs are
    rebuilt, the replay buffer kept). Given ``gradient_steps`` per iteration of ``num_envs`` env steps, the change
    names the update-to-data ratio ``gradient_steps / num_envs``, which doubles. Returns ``(new sizes, "what
    changed")``, e.g. ``"batch_size 128 -> 64"``.

    Raises:
        ValueError: nothing left to halve (one env, and in the gradient steps a batch at its floor).
    """
    n, b = sizes.num_envs, sizes.batch_size
    if in_update and b // 2 >= OOM_MIN_BATCH_SIZE:
        return dataclasses.replace(sizes, batch_size=b // 2), f"batch_size {b} -> {b // 2}"
    if n < 2:
        floor = f" and batch_size {b} would drop below {OOM_MIN_BATCH_SIZE}" if in_update else ""
        raise ValueError(f"num_envs {n} cannot be halved{floor}")
    change = f"num_envs {n} -> {n // 2}"
    if gradient_steps is not None:
        g = gradient_steps
        change += f" (update-to-data ratio {g / n:.3g} -> {g / (n // 2):.3g})"
    return dataclasses.replace(sizes, num_envs=n // 2), change
