"""``python -m algos.harness.export RUN_DIR``: export the policy of a run's latest checkpoint (:func:`main`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

import torch

from envs.errors import is_expected, one_message

from .checkpoint import CheckpointError, read_checkpoint
from .policy import export_run_policy


def main(argv: list[str] | None = None) -> int:
    """``python -m algos.harness.export RUN_DIR``: export the policy of a run's latest ``checkpoint.pt`` (a run killed
    before its end, say) as :meth:`algos.harness.Run.finish` does, with the run's ``config.json`` (or the checkpoint's
    arguments) and the algorithm's own ``deterministic_policy``. Exit status 0, or 2 with a one-line error."""

    parser = argparse.ArgumentParser(
        prog="python -m algos.harness.export",
        description="Export the policy of a run's latest checkpoint.pt to policy.pt2 in the run folder, as a run's "
        "end does.",
    )
    parser.add_argument("run_dir", type=Path, help="the run folder (holding checkpoint.pt)")
    ns = parser.parse_args(argv)
    try:
        path = ns.run_dir / "checkpoint.pt"
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {path}: nothing to export")
        raw = torch.load(path, map_location="cpu", weights_only=False)
        module = importlib.import_module(f"algos.{raw['algo']}")
        fields = {f.name for f in dataclasses.fields(module.Args)}
        args = module.Args(**{k: v for k, v in raw["args"].items() if k in fields})
        state = read_checkpoint(path, torch.device("cpu"), raw["algo"], args.env_id)
        actor, env, action_mode = module.deterministic_policy(args, state)
        try:
            out = export_run_policy(args, env, actor, ns.run_dir, action_mode)
        finally:
            env.close()
    except Exception as exc:  # noqa: BLE001 - only the expected kinds are caught, the others re-raised
        if not (isinstance(exc, CheckpointError) or is_expected(exc)):
            raise
        print(f"error: {one_message(exc)}", file=sys.stderr)
        return 2
    print(f"exported the policy of {path} (global_step {state['global_step']:,}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
