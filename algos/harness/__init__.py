"""What every training script shares and is not its algorithm (the role of CleanRL's ``cleanrl_utils``).

An algorithm file (``algos/ppo.py`` ...) holds its ``Args``, networks, hot functions and a CleanRL-shaped loop; it
imports this package (``from algos import harness``) and takes every name below from it, whichever module holds it:

* :mod:`~algos.harness.cli`: :class:`RunArgs`, the fields every script has, and :func:`cli` / :func:`preset_args`:
  the CPU and GPU presets and an env's own defaults (``Snake-v0``'s) are ``Args`` instances chosen *before* parsing,
  so ``--help`` prints the real default of each field and ``Args`` is never mutated afterwards; :func:`script`, the
  run folder (:func:`output_dir`), the seeds and switches (:func:`setup`); :func:`make_env`: the script's vector env
  (:func:`envs.vector.make_vec`, the site for ``EVHub-v0``) with device-side episode statistics, and
  :func:`network_inputs`, the features the networks read (from the env's published observation layout);
* :mod:`~algos.harness.run`: :class:`Run`, the run folder, TensorBoard writer and ``metrics.parquet`` (one host read
  per log interval), the progress bar and SPS clocks, the finite-loss guard, checkpoint save / load through
  :func:`envs.files.atomic_write` and resume, the deterministic evaluation on the site's split, and policy export;
* :mod:`~algos.harness.checkpoint`: the checkpoint format, its RNG states, the checked read
  (:class:`CheckpointError`) and :func:`load_optimizer_state`;
* :mod:`~algos.harness.replay`: the off-policy scripts' :class:`ReplayBuffer`, :func:`store` (one env step's
  transitions into it) and :class:`ReplayLog`: what a checkpoint keeps so that ``--resume`` rebuilds the same buffer
  by replaying the env (:func:`checkpoint_buffer`, :func:`restore_buffer`);
* :mod:`~algos.harness.policy`: policy export with one contract (:class:`EnvUnitsPolicy`, :func:`export_policy`,
  :func:`export_run_policy`) and :func:`load_policy`; ``python -m algos.harness.export RUN_DIR`` exports a run's
  latest checkpoint (each script's ``deterministic_policy``);
* :mod:`~algos.harness.episodes`: :func:`evaluate_episodes`, the deterministic policy's episodic return on any
  gymnasium env (``--eval-episodes``; ``python -m algos.harness.evaluate RUN_DIR`` for a finished run);
* :mod:`~algos.harness.speed`: :func:`bind`, the ``--compile`` / ``--cudagraphs`` switches, applied once to the plain
  hot functions (LeanRL's pattern); :class:`CudaGraphed` replays one from a CUDA graph; :func:`capture`,
  :func:`device_lr`, :func:`synced_clock`;
* :mod:`~algos.harness.nets`: network blocks (:func:`layer_init`, :class:`RunningObsNorm`, :func:`select`,
  :func:`cnn_torso`, :func:`explained_variance`);
* :mod:`~algos.harness.gpu`: :func:`gpu_stats`, logged beside the curves;
* :mod:`~algos.harness.oom` and :mod:`~algos.harness.backoff`: :func:`train_with_oom_restarts`: on a CUDA
  out-of-memory error the loop hands over its live state, the algorithm's own shrink rule makes the sizes smaller,
  and training re-enters from that state; :func:`allocate_halving` for a buffer at setup; the off-policy scripts'
  sizes and shrink rule (:class:`ReplaySizes`, :func:`halve_batch_or_envs`).

The modules import one another in one direction only: ``gpu``, ``speed``, ``nets``, ``policy``, ``episodes``,
``oom`` and ``checkpoint`` stand alone, ``cli`` reads ``checkpoint`` and ``speed``, ``replay`` reads ``checkpoint``,
``run`` reads those, ``backoff`` reads ``run``; the commands ``export`` and ``evaluate`` read what they need and are
not imported by the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import envs  # noqa: F401
except ModuleNotFoundError:  # run as `python algos/<algo>.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from .backoff import (
    OOM_MIN_BATCH_SIZE,
    ReplaySizes,
    allocate_halving,
    halve_batch_or_envs,
    train_with_oom_restarts,
)
from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    cannot_resume,
    load_optimizer_state,
    read_checkpoint,
    rng_states,
    set_rng_states,
)
from .cli import (
    EVHUB_ONLY_ARGS,
    RunArgs,
    cli,
    env_kwargs_of,
    env_own_defaults,
    make_env,
    network_inputs,
    output_dir,
    per_step,
    preset_args,
    preset_name,
    presets_table,
    script,
    setup,
)
from .episodes import evaluate_episodes
from .gpu import GPU_STAT_KEYS, gpu_stats
from .nets import RunningObsNorm, Select, cnn_torso, explained_variance, layer_init, select
from .oom import OutOfMemoryBackoffError, OutOfMemoryRestart, free_device_memory, out_of_memory_message, to_cpu
from .policy import EnvUnitsPolicy, export_policy, export_run_policy, load_policy
from .replay import ReplayBuffer, ReplayLog, checkpoint_buffer, restore_buffer, store
from .run import NonFiniteLossError, Run
from .speed import COMPILE_CLOCK, CudaGraphed, bind, capture, device_lr, synced_clock, use_compile_cache, zero_grad

__all__ = [
    # cli
    "EVHUB_ONLY_ARGS",
    "RunArgs",
    "cli",
    "env_kwargs_of",
    "env_own_defaults",
    "make_env",
    "network_inputs",
    "output_dir",
    "per_step",
    "preset_args",
    "preset_name",
    "presets_table",
    "script",
    "setup",
    # run
    "NonFiniteLossError",
    "Run",
    # checkpoint
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "cannot_resume",
    "load_optimizer_state",
    "read_checkpoint",
    "rng_states",
    "set_rng_states",
    # replay
    "ReplayBuffer",
    "ReplayLog",
    "checkpoint_buffer",
    "restore_buffer",
    "store",
    # policy export and evaluation
    "EnvUnitsPolicy",
    "evaluate_episodes",
    "export_policy",
    "export_run_policy",
    "load_policy",
    # speed
    "COMPILE_CLOCK",
    "CudaGraphed",
    "bind",
    "capture",
    "device_lr",
    "synced_clock",
    "use_compile_cache",
    "zero_grad",
    # nets
    "RunningObsNorm",
    "Select",
    "cnn_torso",
    "explained_variance",
    "layer_init",
    "select",
    # gpu
    "GPU_STAT_KEYS",
    "gpu_stats",
    # out of memory
    "OOM_MIN_BATCH_SIZE",
    "OutOfMemoryBackoffError",
    "OutOfMemoryRestart",
    "ReplaySizes",
    "allocate_halving",
    "free_device_memory",
    "halve_batch_or_envs",
    "out_of_memory_message",
    "to_cpu",
    "train_with_oom_restarts",
]
