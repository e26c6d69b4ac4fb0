"""Checkpoints: their format, the random-number states they carry, the file read back and checked (with the error
of one that cannot be resumed from), and an optimizer state loaded without the settings of the run that saved it.
:class:`~algos.harness.run.Run` writes and restores them."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from envs.vector import env_name

CHECKPOINT_FORMAT = 3
"""Version of the checkpoint layout written by :meth:`Run.save`; a checkpoint of another version is refused (3: the
replay buffer as ``{"rows"}`` or ``{"log"}``, :func:`algos.harness.replay.checkpoint_buffer`, and ``resumes``)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: unreadable, of another format, algorithm or env."""


def rng_states() -> dict:
    """The random-number states of Python, NumPy, torch and (where CUDA is available) every CUDA device:
    ``{"python", "numpy", "torch"[, "cuda"]}``, as a checkpoint stores them."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def set_rng_states(rng: dict) -> None:
    """Restore the random-number states of :func:`rng_states` (the CUDA ones where both the checkpoint has them and
    CUDA is available)."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def cannot_resume(path: Path, what: str) -> str:
    """The message of a checkpoint at ``path`` that cannot be resumed from because of ``what``, with the ways out."""
    return (
        f"cannot resume from {path}: {what}. Delete it (rm {path}) to start afresh in "
        f"this folder, run without --resume, or give another --output-dir"
    )


def read_checkpoint(path: Path, device: torch.device, algo: str, env_id: str) -> dict:
    """The checkpoint file at ``path`` loaded onto ``device``, checked for its format, algorithm ``algo`` and env
    ``env_id`` (compared by :func:`envs.vector.env_name`).

    Raises:
        CheckpointError: the file cannot be read (cut short, not a torch file), is of another
            :data:`CHECKPOINT_FORMAT`, or was written by another algorithm or for another env.
    """
    try:
        state = torch.load(path, map_location=device, weights_only=False)  # our own file
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, Exception) as exc:  # noqa: BLE001
        first_line = str(exc).strip().splitlines()[0] if str(exc) else "empty"
        raise CheckpointError(
            cannot_resume(
                path,
                f"it cannot be read ({type(exc).__name__}: {first_line}; a file cut short by a crash or a full disk, "
                f"or not a torch checkpoint)",
            )
        ) from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format", "none") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            cannot_resume(
                path,
                f"it was written by another version of this project (checkpoint format {found}, this one reads "
                f"{CHECKPOINT_FORMAT})",
            )
        )
    if state.get("algo") != algo or env_name(state.get("env_id", "")) != env_name(env_id):
        raise CheckpointError(
            cannot_resume(path, f"it is a {state.get('algo')} run on {state.get('env_id')}, not {algo} on {env_id}")
        )
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, lr=None) -> None:
    """Load a saved optimizer ``state`` but keep this run's ``capturable`` flag and learning rate ``lr`` (a float or
    the device tensor annealed in place; None keeps the current one): a checkpoint from another device, or from a
    run with another LR, would bring settings this run cannot use."""
    groups = [
        {**saved, "capturable": group.get("capturable", False)}
        for saved, group in zip(state["param_groups"], optimizer.param_groups)
    ]
    current = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict({**state, "param_groups": groups})
    for group, old in zip(optimizer.param_groups, current):
        group["lr"] = old if lr is None else lr
