"""The files of the learned planners' tuning in an experiment's ``tuned/`` folder, named here only.

Under ``<output_dir>/<experiment>/tuned/``::

    mpc_tuned_seed<seed>.json              the CMA-ES tuning's summary: parameters, budget, fingerprint
    mpc_tuned_seed<seed>_history.parquet   its generations
    mpc_rl_seed<seed>/                     mpc_rl's day-level PPO run (metrics, checkpoint, policy.pt2)

Names and ``mpc_rl``'s training command only (no planner, no torch), so that doit can name its targets and check
that a run is up to date without importing the planners.
"""

from __future__ import annotations

from pathlib import Path

ENV_ID = "EVHubPlanner-v0"
"""The gymnasium id of ``mpc_rl``'s day-level env (registered by :mod:`pipeline.control.rl_planner`)."""
EPISODE_DAYS = 7
"""Days of an ``mpc_rl`` training episode (one week)."""


def tuning_files(folder: str | Path, seed: int) -> tuple[Path, Path]:
    """``(summary_json, history_parquet)`` of the tuning with ``seed`` in ``folder``."""
    return Path(folder) / f"mpc_tuned_seed{seed}.json", Path(folder) / f"mpc_tuned_seed{seed}_history.parquet"


def rl_run_dir(folder: str | Path, seed: int) -> Path:
    """The training run of ``mpc_rl``'s policy of ``seed``, beside the tuning: ``<folder>/mpc_rl_seed<seed>/``."""
    return Path(folder) / f"mpc_rl_seed{seed}"


def rl_policy_file(run_dir: str | Path) -> Path:
    """The exported day-level policy of an ``mpc_rl`` training run."""
    return Path(run_dir) / "policy.pt2"


def ppo_args(days: int) -> tuple[str, ...]:
    """``algos/ppo.py``'s flags for ``mpc_rl`` (besides seed, output folder and ``--total-timesteps days``): two async
    workers (each day is 24 LP solves), rollouts of one week per worker, a small net, gamma 0.9 (a day's parameters
    matter mostly that day and the next); the ``cpu`` preset on the CPU on every machine (the LPs bound it, and the
    policy is then the same with or without a GPU)."""
    steps = EPISODE_DAYS
    return (
        "--preset",
        "cpu",
        "--no-cuda",
        "--env-id",
        f"pipeline.control.rl_planner:{ENV_ID}",
        "--vector-mode",
        "async",
        "--num-envs",
        "2",
        "--num-steps",
        str(steps),
        "--num-minibatches",
        "1",
        "--update-epochs",
        "8",
        "--hidden-size",
        "32",
        "--gamma",
        "0.9",
        "--learning-rate",
        "0.0003",
        "--num-threads",
        "1",
        "--checkpoint-every",
        "5",
        "--eval-split",
        "none",
    )
