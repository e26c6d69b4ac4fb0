"""The files of the learned planners' tuning in an experiment's ``tuned/`` folder, named here only.

Under ``<output_dir>/<experiment>/tuned/``::

    mpc_tuned_seed<seed>.json              the CMA-ES tuning's summary: parameters, budget, fingerprint
    mpc_tuned_seed<seed>_history.parquet   its generations
    mpc_rl_seed<seed>/                     mpc_rl's day-level PPO run (metrics, checkpoint, policy.pt2)

Names only (no planner, no torch), so that doit can name its targets without importing the planners.
"""

from __future__ import annotations

from pathlib import Path


def tuning_files(folder: str | Path, seed: int) -> tuple[Path, Path]:
    """``(summary_json, history_parquet)`` of the tuning with ``seed`` in ``folder``."""
    return Path(folder) / f"mpc_tuned_seed{seed}.json", Path(folder) / f"mpc_tuned_seed{seed}_history.parquet"


def rl_run_dir(folder: str | Path, seed: int) -> Path:
    """The training run of ``mpc_rl``'s policy of ``seed``, beside the tuning: ``<folder>/mpc_rl_seed<seed>/``."""
    return Path(folder) / f"mpc_rl_seed{seed}"


def rl_policy_file(run_dir: str | Path) -> Path:
    """The exported day-level policy of an ``mpc_rl`` training run."""
    return Path(run_dir) / "policy.pt2"
