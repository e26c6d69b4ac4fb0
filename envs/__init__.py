"""Torch-batched environments for a solar + battery + EV-charging site, and the site model they run on.

Importing this package registers ``EVHub-v0``, ``Snake-v0`` (:mod:`envs.snake`) and ``IOBound-v0``
(:mod:`envs.io_bound`, a test env whose step waits on simulated I/O) with gymnasium::

    import gymnasium as gym
    import envs  # noqa: F401  (registers the ids)

    vec = gym.make_vec("EVHub-v0", num_envs=4096, vectorization_mode="vector_entry_point", device="cuda")
    single = gym.make("EVHub-v0")
"""

import importlib

import gymnasium as gym

from envs.config import ConfigError, SiteConfig, load_config

_LAZY = {
    "INFO_KEYS": "envs.evhub",
    "EVHubEnv": "envs.evhub",
    "EVHubVectorEnv": "envs.evhub",
    "Site": "envs.site",
    "SplitData": "envs.site",
    "load_site": "envs.site",
}
"""Names imported on first use (PEP 562), so that reading a site config (``envs.config``) does not import torch."""

__all__ = [
    "INFO_KEYS",
    "ConfigError",
    "EVHubEnv",
    "EVHubVectorEnv",
    "Site",
    "SiteConfig",
    "SplitData",
    "load_config",
    "load_site",
]

if "EVHub-v0" not in gym.registry:
    gym.register(
        id="EVHub-v0",
        entry_point="envs.evhub:EVHubEnv",
        vector_entry_point="envs.evhub:EVHubVectorEnv",
    )

if "Snake-v0" not in gym.registry:
    gym.register(
        id="Snake-v0",
        entry_point="envs.snake:SnakeEnv",
        vector_entry_point="envs.snake:SnakeVectorEnv",
    )

if "IOBound-v0" not in gym.registry:
    gym.register(id="IOBound-v0", entry_point="envs.io_bound:IOBoundEnv")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'envs' has no attribute {name!r}")
