"""``algos/ppo.py``: a tiny CPU training run on a synthetic site, resume, the non-finite stop, GAE and ``--help``."""

from __future__ import annotations

import dataclasses
from functools import partial
import math
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, load_algo, run_algo, tiny_run

SCRIPT = ROOT / "algos" / "ppo.py"

TINY = [
    "--num-envs", "4",
    "--num-steps", "48",
    "--num-minibatches", "2",
    "--update-epochs", "2",
    "--hidden-size", "16",
    "--checkpoint-every", "1",
    "--no-cuda",
]  # fmt: skip
"""Tiny budget: 4 envs x 48 steps (one synthetic episode) per iteration."""


load_ppo = partial(load_algo, "ppo")
run_ppo = partial(run_algo, "ppo")


@pytest.fixture(scope="module")
def trained(site_toml, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    return tiny_run("ppo", site_toml, tmp_path_factory, "--total-timesteps", "384", *TINY)


@pytest.mark.slow
def test_tiny_run_writes_curves_checkpoint_policy_and_eval(trained):
    out, proc = trained
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(out.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (out / "checkpoint.pt").is_file()

    metrics = pd.read_parquet(out / "metrics.parquet")
    assert len(metrics) == 2  # 384 steps / (4 envs x 48 steps) iterations, one row each
    assert list(metrics.global_step) == [192, 384]
    assert np.isfinite(metrics.to_numpy(dtype=float)).all(), metrics.T
    assert (metrics.episodic_co2_kg > 0).all()

    policy = torch.export.load(out / "policy.pt2").module()
    obs_dim = 17 + 3 * 6
    for batch in (1, 5):  # dynamic batch dimension
        action = policy(torch.randn(batch, obs_dim))
        assert action.shape == (batch, 2) and action.dtype == torch.float32
        assert (action.abs() <= 1.0).all()

    kpi = pd.read_parquet(out / "eval_test.parquet")
    assert kpi.controller.tolist() == ["ppo"] and kpi.split.tolist() == ["test"]
    assert math.isfinite(kpi.co2_kg.iloc[0]) and kpi.co2_kg.iloc[0] > 0
    assert kpi.env_steps.iloc[0] == 384
    assert kpi.train_wall_s.iloc[0] > 0 and kpi.steps_per_s.iloc[0] > 0
    traces = pd.read_parquet(out / "eval_test_traces.parquet")
    assert len(traces) == 7 * 24 and "co2_kg" in traces
    assert traces.co2_kg.sum() == pytest.approx(kpi.co2_kg.iloc[0])
    assert "co2_kg" in proc.stdout  # the KPIs are printed


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(trained, site_toml):
    out, first = trained
    assert first.returncode == 0, first.stderr[-3000:]
    proc = run_ppo(
        "--site", str(site_toml), "--output-dir", str(out), "--total-timesteps", "576", "--resume",
        "--eval-split", "none", *TINY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed" in proc.stdout and "global_step 384" in proc.stdout
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [192, 384, 576]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 576 and ckpt["iteration"] == 3


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(trained, site_toml, tmp_path):
    out, first = trained
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "nan"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes())
    before = (run / "checkpoint.pt").read_bytes()
    step = torch.load(run / "checkpoint.pt", weights_only=False)["global_step"]
    # an infinite learning rate turns the weights into inf/NaN after the first optimizer step
    proc = run_ppo(
        "--site", str(site_toml), "--output-dir", str(run), "--total-timesteps", str(step + 384), "--resume",
        "--learning-rate", "inf", *TINY,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "NonFiniteLossError" in proc.stderr and f"global_step {step + 192}" in proc.stderr, proc.stderr[-2000:]
    assert "value_loss" in proc.stderr or "policy_loss" in proc.stderr
    assert (run / "checkpoint.pt").read_bytes() == before
    assert not (run / "policy.pt2").exists()


def test_help_documents_every_field():
    ppo = load_ppo()
    proc = run_ppo("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for f in dataclasses.fields(ppo.Args):
        assert f"--{f.name.replace('_', '-')}" in text, f.name
    # every field has its docstring in the help (first few words, as tyro may wrap lines)
    assert "the surrogate clipping coefficient" in text
    assert "continue from output_dir/checkpoint.pt" in text


def test_gae_matches_a_hand_computed_example():
    ppo = load_ppo()
    gamma, lam = 0.9, 0.8
    # env 0: a terminal step at t=1 (dones[2] = 1), bootstraps from next_value after t=2
    # env 1: no episode end inside, the observation after the rollout is terminal (next_done = 1)
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0]])
    values = torch.tensor([[0.5, 0.0], [1.0, 0.0], [1.5, 0.0]])
    dones = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    next_value = torch.tensor([2.0, 1.0])
    next_done = torch.tensor([0.0, 1.0])
    adv, ret = ppo.compute_gae(rewards, values, dones, next_value, next_done, gamma, lam)
    # env 0: d2 = 3 + 0.9*2 - 1.5 = 3.3; d1 = 2 - 1 = 1 (no bootstrap); d0 = 1 + 0.9*1 - 0.5 = 1.4
    #        A2 = 3.3, A1 = 1.0, A0 = 1.4 + 0.72 * 1.0 = 2.12
    # env 1: d2 = 1 (next obs terminal), d1 = d0 = 0: A2 = 1, A1 = 0.72, A0 = 0.72^2
    expected = torch.tensor([[2.12, 0.5184], [1.0, 0.72], [3.3, 1.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_running_normalisers_match_batch_statistics():
    ppo = load_ppo()
    torch.manual_seed(0)
    data = torch.randn(5, 64, 3) * torch.tensor([1.0, 5.0, 0.1]) + torch.tensor([0.0, 2.0, -1.0])
    norm = ppo.RunningObsNorm(3)
    for batch in data:
        norm.update(batch)
    flat = data.reshape(-1, 3)
    torch.testing.assert_close(norm.mean, flat.mean(0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(norm.var, flat.var(0, unbiased=False), rtol=1e-3, atol=1e-4)
    assert norm(flat).abs().max() <= norm.clip

    rn = ppo.make_reward_norm(2, torch.device("cpu"))
    rewards = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    returns = []
    ret = torch.zeros(2, dtype=torch.float64)
    for r in rewards:
        scaled = ppo.normalize_reward(rn, r, torch.zeros(2), gamma=0.5)
        ret = ret * 0.5 + r.double()
        returns.append(ret.clone())
        assert scaled.dtype == r.dtype
    torch.testing.assert_close(rn["ret"], ret)
    var = torch.stack(returns).reshape(-1).var(unbiased=False)
    torch.testing.assert_close(rn["var"], var, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(scaled, rewards[-1] / torch.sqrt(var + 1e-8).float(), rtol=1e-3, atol=1e-6)
