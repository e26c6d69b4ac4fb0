"""Determinism on the CPU: the same inputs and seed give byte-identical baseline KPI files (the oracle's
included) and, for every agent, the same training curve and the same trained policy, in separate processes.

On a GPU, ``--deterministic-algorithms`` is the switch for bitwise-repeatable runs (see the README)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, run_algo
from test_a2c import TINY as A2C_TINY
from test_dqn import TINY as DQN_TINY
from test_ppo import TINY as PPO_TINY
from test_sac import TINY as SAC_TINY

from pipeline.control.baselines import POLICIES
from pipeline.study import tasks

TIMING = ["wall_s", "sps"]
"""Metrics columns that measure the machine, not the run."""


def _baselines_in_a_subprocess(site_toml, out) -> None:
    code = (
        "import sys; from pipeline.study import tasks; from pipeline.control.baselines import POLICIES\n"
        "for c in (*POLICIES, 'oracle'): tasks.run_controller(sys.argv[1], c, 'test', sys.argv[2])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(site_toml), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_baseline_kpi_files_are_byte_identical_across_processes(site_toml, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for c in (*POLICIES, "oracle"):
        tasks.run_controller(str(site_toml), c, "test", str(first))
    _baselines_in_a_subprocess(site_toml, second)
    names = sorted(p.name for p in first.glob("*.parquet"))
    assert len(names) == 2 * (len(POLICIES) + 1)  # KPI row + traces per controller, oracle included
    assert names == sorted(p.name for p in second.glob("*.parquet"))
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, budget, tiny",
    [("ppo", 576, PPO_TINY), ("sac", 384, SAC_TINY), ("a2c", 384, A2C_TINY), ("dqn", 256, DQN_TINY)],
    ids=["ppo", "sac", "a2c", "dqn"],
)
def test_same_seed_gives_the_same_training_curve_and_policy(algo, budget, tiny, site_toml, tmp_path):
    curves, policies = [], []
    # the second run also switches PyTorch to its deterministic algorithms: on the CPU that changes nothing
    for attempt, flags in (("first", []), ("second", ["--deterministic-algorithms"])):
        out = tmp_path / attempt
        proc = run_algo(
            algo,
            "--site",
            str(site_toml),
            "--output-dir",
            str(out),
            "--seed",
            "7",
            "--total-timesteps",
            str(budget),
            "--eval-split",
            "none",
            *tiny,
            *flags,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        curves.append(pd.read_parquet(out / "metrics.parquet").drop(columns=TIMING))
        policies.append(torch.export.load(str(out / "policy.pt2")).state_dict)
    assert len(curves[0]) >= 2 and np.isfinite(curves[0].to_numpy(dtype=float)).sum() > 3
    pd.testing.assert_frame_equal(curves[0], curves[1], check_exact=True)
    assert policies[0].keys() == policies[1].keys() and len(policies[0]) > 0
    for name, weights in policies[0].items():
        assert torch.equal(weights, policies[1][name]), name
