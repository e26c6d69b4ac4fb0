"""``evhub-plan``: the command (:class:`Args`, :func:`run`, :func:`main`)."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from envs.errors import exit_code
from envs.files import write_text
from envs.site import load_site
from pipeline.live.profiles import LivePlan, make_plan
from pipeline.live.state import LiveError, read_state, state_at, write_state


# ------------------------------------------------------------------------------------------------ the command
@dataclass
class Args:
    """evhub-plan: plan the next hours of a site at its step with a controller of the study and write one OCPP 1.6J
    SetChargingProfile.req per connector with a car, a period per step (docs/live.md). Give the state with --state
    FILE, or rebuild it from the site's own data with --at TIME."""

    site: str = "caltech"
    """the site: a shipped name (caltech, iquitos) or the path of a site TOML"""
    controller: str | None = None
    """a causal planner of the registry (mpc, mpc_tuned_start, mpc_tuned, mpc_adaptive, mpc_rl_start, mpc_rl,
    mpc_scenario);
    default: the report's answer for the site, read from its results"""
    at: str | None = None
    """rebuild the state from the site's data at this time, on a step of the site (ISO 8601 with a UTC offset, e.g.
    2021-08-23T08:00:00-07:00): the cars plugged in then, each still needing its session's energy (capped at what its
    socket delivers before it leaves); the battery at its initial SOC (or --soc)"""
    state: Path | None = None
    """a state file (JSON, docs/live-state.schema.json): the time, SOC, plugged cars, MOER forecast and the history
    (its series at the site's step and its sessions)"""
    soc: float | None = None
    """with --at: the battery's SOC, [0, 1] (default: the site's initial SOC)"""
    seed: int | None = None
    """the study's seed of a tuned controller (default: the lowest one tuned)"""
    out: Path | None = None
    """write the plan (JSON) to this file, atomically (default: stdout)"""
    save_state: Path | None = None
    """with --at: also write the rebuilt state as a state file (and its history as Parquet beside it)"""
    output_dir: str = "outputs"
    """the study's output folder (its results and tuning), relative to the project root unless absolute"""
    experiment: str = ""
    """the study's experiment folder in it (default: the site's name)"""


@contextmanager
def quiet_stdout():
    """Send what native libraries print to stdout (the LP solver's banner) to stderr, so stdout carries the plan."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    saved = os.dup(fd)
    try:
        os.dup2(sys.stderr.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def run(args: Args) -> LivePlan:
    """Run the command of ``args``: read or rebuild the state, plan, write the plan (and the state with
    ``--save-state``); returns the plan.

    Raises:
        LiveError: a bad request or state (nothing is written).
    """
    if (args.at is None) == (args.state is None):
        raise LiveError("--at / --state: give exactly one (the time to rebuild the state at, or a state file)")
    if args.state is not None and (args.soc is not None or args.save_state is not None):
        raise LiveError("--soc / --save-state: only with --at (a state file carries its own SOC)")
    site = load_site(args.site)
    state = state_at(site, args.at, args.soc) if args.at is not None else read_state(args.state)
    with quiet_stdout():
        plan = make_plan(
            site, state, args.controller, seed=args.seed, output_dir=args.output_dir, experiment=args.experiment
        )
    text = json.dumps(plan.to_json(), indent=2) + "\n"
    if args.save_state is not None:
        write_state(state, args.save_state)
    if args.out is not None:
        write_text(args.out, text)
        print(
            f"wrote {args.out}: {plan.controller}, {len(plan.charging_profiles)} charging profile(s) over "
            f"{plan.horizon_h:g} h (OCPP 1.6J, validated), {plan.wall_s:.2f} s",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return plan


def main(argv: list[str] | None = None) -> int:
    """``evhub-plan`` (tyro): parse :class:`Args`, :func:`run`; an expected error prints one line and returns 1."""
    import tyro

    args = tyro.cli(Args, args=argv)
    return exit_code(lambda: run(args))
