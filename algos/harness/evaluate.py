"""``python -m algos.harness.evaluate RUN_DIR [--episodes N]``: a finished run's policy over N episodes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from envs.errors import is_expected, one_message
from envs.files import atomic_write

from .cli import env_kwargs_of
from .episodes import evaluate_episodes
from .policy import load_policy


def main(argv: list[str] | None = None) -> int:
    """``python -m algos.harness.evaluate RUN_DIR [--episodes N]``: evaluate a finished run's exported policy on its env
    (the env id, ``--env-kwargs`` and seed of its ``config.json``); prints the return's mean and std, writes
    ``eval_episodes.parquet`` in the run folder. Exit status 0, or 2 with a one-line error."""
    parser = argparse.ArgumentParser(
        prog="python -m algos.harness.evaluate",
        description="Run a finished run's exported policy (deterministic) for N episodes of its env; print the "
        "return's mean and std, write eval_episodes.parquet in the run folder.",
    )
    parser.add_argument("run_dir", type=Path, help="the run folder (holding config.json and policy.pt2)")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to run (default 10)")
    ns = parser.parse_args(argv)
    try:
        config_path = ns.run_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {ns.run_dir}: not a run folder of algos/*.py")
        config = json.loads(config_path.read_text())
        policy_path = ns.run_dir / "policy.pt2"
        if not policy_path.is_file() and (ns.run_dir / "policy.pt").is_file():
            policy_path = ns.run_dir / "policy.pt"
        rows = evaluate_episodes(
            load_policy(policy_path),
            config["env_id"],
            env_kwargs_of(config.get("env_kwargs", "")),
            ns.episodes,
            int(config["seed"]),
        )
    except Exception as exc:  # noqa: BLE001 - only the expected kinds are caught, the others re-raised
        if not is_expected(exc):
            raise
        print(f"error: {one_message(exc)}", file=sys.stderr)
        return 2
    out = ns.run_dir / "eval_episodes.parquet"
    atomic_write(out, lambda tmp: rows.to_parquet(tmp, index=False))
    print(
        f"{config['env_id']}: return {rows['return'].mean():.2f} +- {rows['return'].std(ddof=0):.2f} over "
        f"{len(rows)} episodes (length {rows['length'].mean():.1f}); {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
