"""Policy export with one contract for every script: the deterministic actor, its actions put into the env's own units,
saved as a ``torch.export`` program (``policy.pt2``) that code without ``algos`` can load; and its reading back
(:func:`load_policy`). ``python -m algos.harness.export RUN_DIR`` exports a run's latest checkpoint
(:mod:`algos.harness.export`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

from envs.evhub import action_dim
from envs.files import atomic_write
from envs.kpis import write_policy_spec
from envs.vector import EVHUB_ID, BoxScaling, is_evhub


class EnvUnitsPolicy(nn.Module):
    """A deterministic actor with its output put into the env's own units (the one export contract).

    ``actor`` maps raw observations float32 ``(B, *obs_shape)`` to, for a Box action space, actions float32
    ``(B, act_dim)`` meant in [-1, 1]: they are clipped there and rescaled affinely to the Box's finite
    ``[low, high]``; for a ``Discrete(n, start)``, indices int64 ``(B,)`` in ``0..n-1``: ``start`` is added.
    """

    def __init__(self, actor: nn.Module, space: gym.Space):
        super().__init__()
        self.actor = actor
        self.discrete = isinstance(space, gym.spaces.Discrete)
        if self.discrete:
            self.register_buffer("start", torch.tensor(int(space.start), dtype=torch.int64))
        else:
            scaling = BoxScaling(space)
            self.register_buffer("center", torch.as_tensor(scaling.mid, dtype=torch.float32))
            self.register_buffer("scale", torch.as_tensor(scaling.half, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Raw observations -> actions in the env's units (class docstring)."""
        if self.discrete:
            return self.actor(obs) + self.start
        return self.center + self.scale * self.actor(obs).clamp(-1.0, 1.0)


def export_policy(
    actor: nn.Module, obs_shape: tuple[int, ...], space: gym.Space, out_dir: Path, spec: dict | None
) -> Path:
    """Save the deterministic policy for code that does not import ``algos``: ``policy.pt2``, a ``torch.export``
    program of :class:`EnvUnitsPolicy` with a dynamic batch dimension (load with ``torch.export.load(path).module()``;
    raw observations float32 ``(B, *obs_shape)`` -> actions in the env's own units). ``spec`` (EVHub-v0's env
    settings: ``env_id``, ``action_mode``, ``bess_action``) goes into ``policy.json`` beside it and into the program
    itself (extra file ``policy.json``), so a policy moved without its JSON still acts under its own rule. If export
    fails, a TorchScript trace to ``policy.pt``. Written atomically. Returns the written path."""
    import copy

    module = EnvUnitsPolicy(copy.deepcopy(actor), space).cpu().float().eval()
    example = torch.zeros(2, *obs_shape)
    extra = {"policy.json": json.dumps(spec or {})}
    try:
        program = torch.export.export(module, (example,), dynamic_shapes={"obs": {0: torch.export.Dim("batch", min=1)}})
        path = out_dir / "policy.pt2"
        atomic_write(path, lambda tmp: torch.export.save(program, tmp, extra_files=extra), suffix=".tmp.pt2")
    except Exception as exc:  # noqa: BLE001 - any export failure falls back to TorchScript
        print(f"torch.export failed ({type(exc).__name__}: {exc}); saving a TorchScript trace instead", file=sys.stderr)
        path = out_dir / "policy.pt"
        traced = torch.jit.trace(module, example)
        atomic_write(path, lambda tmp: torch.jit.save(traced, str(tmp), _extra_files=extra))
    if spec:
        write_policy_spec(out_dir, spec["env_id"], spec["action_mode"], spec["bess_action"])
    return path


def export_run_policy(args, env, actor: nn.Module, out_dir: Path, action_mode: str | None = None) -> Path:
    """:func:`export_policy` of a run's ``actor`` for its ``env`` (a :func:`envs.vector.make_vec` env): for EVHub-v0
    the actions of ``action_mode`` (default ``args.action_mode``) and its settings in ``policy.json``, else the env's
    own action space. Returns the written path."""
    space, spec = env.single_action_space, None
    if is_evhub(args.env_id):
        mode = action_mode or args.action_mode
        space = gym.spaces.Box(-1.0, 1.0, (action_dim(mode, env.n_sockets),), np.float32)
        spec = {"env_id": EVHUB_ID, "action_mode": mode, "bess_action": args.bess_action}
    return export_policy(actor, tuple(env.obs_shape), space, out_dir, spec)


def load_policy(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """An exported policy (:func:`algos.harness.export_policy`: ``policy.pt2``, or the TorchScript ``policy.pt``): raw
    observations float32 ``(B, *obs_shape)`` -> actions in the env's own units.

    Raises:
        FileNotFoundError: no such file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported policy at {path}")
    if path.suffix == ".pt2":
        return torch.export.load(str(path)).module()
    return torch.jit.load(str(path))
