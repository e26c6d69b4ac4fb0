"""Network blocks the scripts share: CleanRL's orthogonal :func:`layer_init`, the running observation normaliser, the
feature selection of :func:`~algos.harness.cli.network_inputs`, the CNN torso of image observations and the explained
variance."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from envs.vector import fold_moments


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights of gain ``std`` and constant biases (CleanRL's ``layer_init``), in place, for a ``Linear``
    or a ``Conv2d``; returns the layer."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class RunningObsNorm(nn.Module):
    """Running mean/variance of the observations (CleanRL's ``NormalizeObservation``, as buffers on the device).

    ``forward`` standardises and clips to ``[-clip, clip]``; :meth:`update` folds a batch into the statistics in
    place (no host sync). Part of the networks, it travels with the checkpoint and the
    exported policy. ``dim``: the size of flat observations, or the shape of one (``(C, H, W)``: per pixel).
    """

    def __init__(self, dim: int | tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.full((), 1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``x`` float32 ``(B, *dim)`` into the running mean/variance
        (:func:`envs.vector.fold_moments`)."""
        fold_moments(self.mean, self.var, self.count, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standardised and clipped ``x``: float32 ``(B, *dim)`` -> ``(B, *dim)``."""
        return ((x - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)


class Select(nn.Module):
    """Keeps the observation features listed in ``keep`` (the networks' inputs): ``(B, obs_dim)`` ->
    ``(B, len(keep))``."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.keep)


def select(inputs: list[int] | None, obs_dim: int) -> nn.Module:
    """:class:`Select` of ``inputs`` (:func:`~algos.harness.cli.network_inputs`), or the identity where they are every
    feature."""
    return nn.Identity() if inputs is None or len(inputs) == obs_dim else Select(list(inputs))


def cnn_torso(obs_shape: tuple[int, ...], channels: tuple[int, int], hidden: int, init=layer_init) -> nn.Sequential:
    """The CNN torso of image observations: float32 ``(B, C, H, W)`` -> features ``(B, hidden)``, ``Conv2d(C, c1, 3,
    padding=1)-ReLU-Conv2d(c1, c2, 3, padding=1)-ReLU-Flatten-Linear(c2 * H * W, hidden)-ReLU`` with ``(c1, c2) =
    channels``; the padding keeps the board size, so every cell stays in place up to the linear layer. ``init``
    initialises each layer (CleanRL's :func:`layer_init` by default; ``lambda m: m`` keeps torch's own).

    Raises:
        ValueError: ``channels`` is not two positive ints, or ``obs_shape`` is not ``(C, H, W)``.
    """
    if len(obs_shape) != 3:
        raise ValueError(f"a CNN torso takes image observations (C, H, W), got shape {tuple(obs_shape)}")
    channels = tuple(int(x) for x in channels)
    if len(channels) != 2 or min(channels) < 1:
        raise ValueError(f"--cnn-channels takes two positive channel counts (C1 C2), got {channels}")
    (c, h, w), (c1, c2) = (int(x) for x in obs_shape), channels
    return nn.Sequential(
        init(nn.Conv2d(c, c1, 3, padding=1)),
        nn.ReLU(),
        init(nn.Conv2d(c1, c2, 3, padding=1)),
        nn.ReLU(),
        nn.Flatten(),
        init(nn.Linear(c2 * h * w, hidden)),
        nn.ReLU(),
    )


def explained_variance(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 - Var[y - y_pred] / Var[y]`` of float ``(B,)`` tensors as a device scalar (NaN where ``Var[y] == 0``)."""
    var_y = y.var()
    ev = 1.0 - (y - y_pred).var() / var_y
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), ev)
