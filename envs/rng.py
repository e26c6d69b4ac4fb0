"""Counter-based random streams for the torch-batched envs: one 32-bit stream per env, pure integer tensor code.

Each env's stream is a Weyl sequence (``state += WEYL`` mod 2**32) passed through an integer hash
(:func:`mix32`, the two-multiply finaliser of Wellons' ``lowbias32``). Draws are int64 values in ``[0, 2**32)``;
everything is integer arithmetic in int64 without overflow, so a stream gives the same numbers on every device,
env ``i`` of a batch draws exactly what a single env with the same seed draws, and ``torch.compile`` traces the
draws into the step's graph (a ``torch.Generator`` cannot be traced, and CUDA graphs cannot replay its state).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
WEYL = 0x61C88647  # odd: the Weyl sequence visits all 2**32 values
SEED_SALT = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of 32-bit values held in an int64 tensor (any shape), result in [0, 2**32). Both multipliers are
    below 2**31, so no product leaves the int64 range: results are identical on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def stream_keys(seeds: torch.Tensor) -> torch.Tensor:
    """Start values of the per-env streams, int64 in [0, 2**32), from int64 seeds >= 0."""
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    return mix32(lo ^ mix32((hi + SEED_SALT) & MASK32))


def seeds_tensor(seed: int | Sequence[int], num_envs: int, device: torch.device) -> torch.Tensor:
    """int64 ``(num_envs,)`` seeds: an int ``s`` gives env ``i`` the seed ``s + i`` (gymnasium's convention for vector
    envs), a sequence gives one per env.

    Raises:
        ValueError: a negative seed, one of 2**63 or more, or a sequence of another length than ``num_envs``.
    """
    if isinstance(seed, (int, np.integer)):
        seed = int(seed)
        if seed < 0 or seed + num_envs - 1 >= 2**63:
            raise ValueError(f"seed must lie in [0, 2**63 - num_envs], got {seed}")
        return torch.arange(num_envs, dtype=torch.int64, device=device) + seed
    values = [int(s) for s in seed]
    if len(values) != num_envs:
        raise ValueError(f"got {len(values)} seeds for {num_envs} envs")
    if any(s < 0 or s >= 2**63 for s in values):
        raise ValueError("seeds must lie in [0, 2**63)")
    return torch.tensor(values, dtype=torch.int64, device=device)


def draw(state: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` numbers from each stream, int64 ``(num_envs, k)`` in ``[0, 2**32)``; advances ``state`` int64
    ``(num_envs,)`` in place by ``k`` (every env draws the same count, whatever its state)."""
    steps = torch.arange(1, k + 1, dtype=torch.int64, device=state.device) * WEYL
    out = mix32((state[:, None] + steps) & MASK32)
    state.add_(k * WEYL).bitwise_and_(MASK32)
    return out


def below(x: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """Draws ``x`` in ``[0, 2**32)`` mapped to integers uniform in ``[0, n)`` (``n`` < 2**31): ``(x * n) >> 32``."""
    return (x * n) >> 32


def unit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Draws ``x`` in ``[0, 2**32)`` as floats in ``[0, 1)`` of ``dtype``."""
    return x.to(dtype) * (1.0 / 2**32)


def state_tensors(env, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Copies of ``env``'s dynamic state tensors named in ``keys`` (its random streams among them): what a
    checkpoint needs to resume mid-episode."""
    return {k: getattr(env, k).clone() for k in keys}


def load_state_tensors(env, state: dict[str, torch.Tensor], keys: Sequence[str]) -> None:
    """Copy the tensors of :func:`state_tensors` back into ``env``'s own (in place, so compiled steps and CUDA
    graphs that hold them stay valid), moved to its device and dtype.

    Raises:
        ValueError: a missing key, or a tensor shaped for another ``num_envs`` (or board / socket count).
    """
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"env state misses {missing}")
    for k in keys:
        value, own = state[k], getattr(env, k)
        if tuple(value.shape) != tuple(own.shape):
            raise ValueError(f"env state '{k}' has shape {tuple(value.shape)}, expected {tuple(own.shape)}")
    for k in keys:
        own = getattr(env, k)
        own.copy_(state[k].to(device=own.device, dtype=own.dtype))
