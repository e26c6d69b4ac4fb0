"""Faults caused for real: a training run killed with SIGKILL resumes from its last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from conftest import ROOT, run_algo


@pytest.mark.slow
def test_sigkilled_ppo_run_resumes_to_the_full_step_count(site_toml, tmp_path):
    out = tmp_path / "ppo"
    args = ["--site", str(site_toml), "--output-dir", str(out), "--num-envs", "4", "--num-steps", "48",
            "--num-minibatches", "2", "--update-epochs", "2", "--hidden-size", "16", "--checkpoint-every", "2",
            "--no-cuda", "--eval-split", "none"]
    total = 4 * 48 * 400  # 400 iterations: long enough to be killed in the middle
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "algos" / "ppo.py"), *args, "--total-timesteps", str(total)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = out / "checkpoint.pt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.is_file() and torch.load(ckpt, weights_only=False)["iteration"] >= 6:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed_at = torch.load(ckpt, weights_only=False)["global_step"]  # the checkpoint file is whole (atomic write)
    assert 0 < killed_at < total
    assert not (out / "policy.pt2").exists()

    resumed = run_algo("ppo", *args, "--total-timesteps", str(total), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpt} at global_step {killed_at}" in resumed.stdout
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics.global_step.iloc[-1] == total
    assert metrics.global_step.is_monotonic_increasing and metrics.global_step.is_unique
    assert torch.load(ckpt, weights_only=False)["global_step"] == total
    assert (out / "policy.pt2").is_file()
