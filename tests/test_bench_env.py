"""benchmarks/env_throughput.py at tiny sizes: table shape, statuses, speed-up column, Parquet output.

No timing assertions: rates on a shared CI machine say nothing; only that they are positive and finite.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from benchmarks import env_throughput as bench


@pytest.mark.slow  # starts worker subprocesses (gym_async, sb3_subproc): a few seconds
def test_all_impls_side_by_side(tmp_path):
    df = bench.run(
        num_envs=[1, 2], impls=bench.ALL_IMPLS, repeats=1, min_seconds=0.01, max_subprocess_envs=2, out_dir=tmp_path
    )
    assert list(df.columns) == [*bench.COLUMNS, "machine"]
    assert sorted(zip(df.impl, df.num_envs)) == sorted((i, n) for i in bench.ALL_IMPLS for n in (1, 2))
    sb3 = bench._sb3_available()
    for r in df.itertuples(index=False):
        if r.impl in bench.SB3_IMPLS and not sb3:
            assert r.status == "skipped: stable-baselines3 not installed"
            continue
        if r.impl == "ours_cudagraph":  # no CUDA here
            assert r.status == "skipped: a CUDA graph needs a CUDA device" and math.isnan(r.steps_per_s)
            continue
        assert r.status == "ok", r
        assert math.isfinite(r.steps_per_s) and r.steps_per_s > 0
        assert r.steps_per_s_min <= r.steps_per_s <= r.steps_per_s_max
        assert r.repeats == 1
        assert math.isfinite(r.speedup_vs) and r.speedup_vs > 0
        assert r.peak_rss_mb > 0
        assert math.isnan(r.cuda_peak_mb)  # everything ran on the CPU
        assert r.device == "cpu"
    ours = df[df.impl == "ours"]
    assert (ours.speedup_vs == 1.0).all()
    # speed-up = our rate at the same N over this row's rate
    for n in (1, 2):
        at_n = df[df.num_envs == n]
        ours_rate = at_n[at_n.impl == "ours"].steps_per_s.item()
        np.testing.assert_allclose(at_n.speedup_vs, ours_rate / at_n.steps_per_s)

    path = tmp_path / "env_throughput.parquet"
    assert path.is_file()
    back = pd.read_parquet(path)
    pd.testing.assert_frame_equal(back, df)
    assert back.attrs.get("unit") == "env steps per second"

    md = bench.markdown(df)
    assert md.splitlines()[0].startswith("| impl | N | steps/s median | min..max | ours ÷ this |")
    assert len(md.splitlines()) == 2 + len(df)


def test_sizes_above_the_limits_are_skipped_rows(tmp_path):
    impls = ("ours", "gym_sync", "sb3_dummy", "gym_async", "sb3_subproc")
    df = bench.run(
        num_envs=[1, 2],
        impls=impls,
        repeats=1,
        min_seconds=0.01,
        max_inprocess_envs=1,
        max_subprocess_envs=0,  # no worker processes in this test
        out_dir=tmp_path,
    )
    assert len(df) == 2 * len(impls)
    rows = df.set_index(["impl", "num_envs"])
    for impl in ("gym_sync", "sb3_dummy"):
        if impl == "sb3_dummy" and not bench._sb3_available():
            continue
        assert rows.loc[(impl, 1), "status"] == "ok"
        skipped = rows.loc[(impl, 2)]
        assert skipped.status.startswith("skipped: N > max_inprocess_envs=1")
        assert skipped.repeats == 0
        for col in ("steps_per_s", "steps_per_s_min", "steps_per_s_max", "speedup_vs", "peak_rss_mb"):
            assert math.isnan(skipped[col]), col
    for impl in ("gym_async", "sb3_subproc"):
        for n in (1, 2):
            assert rows.loc[(impl, n), "status"].startswith("skipped: ")
            assert math.isnan(rows.loc[(impl, n), "steps_per_s"])
    assert (rows.loc["ours", "status"] == "ok").all()
    assert (tmp_path / "env_throughput.parquet").is_file()
    md = bench.markdown(df)
    assert "skipped: N > max_inprocess_envs=1" in md


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown impl"):
        bench.run(num_envs=[1], impls=["ours", "gym_turbo"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="num_envs"):
        bench.run(num_envs=[0], impls=["ours"], out_dir=tmp_path)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            bench.run(num_envs=[1], device="cuda", impls=["ours"], out_dir=tmp_path)
    assert not (tmp_path / "env_throughput.parquet").exists()


def test_cli_help():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.env_throughput", "--help"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--num-envs",
        "--device",
        "--impls",
        "--repeats",
        "--min-seconds",
        "--max-subprocess-envs",
        "--out-dir",
    ):
        assert flag in proc.stdout


def test_snake_runs_side_by_side_with_its_single_env(tmp_path):
    df = bench.run(
        num_envs=[2], impls=("ours", "gym_sync"), repeats=1, min_seconds=0.01, out_dir=tmp_path, env_id="Snake-v0"
    )
    assert (df.status == "ok").all(), df.status.tolist()
    assert (df.steps_per_s > 0).all() and df.attrs["env_id"] == "Snake-v0"
    assert (tmp_path / "env_throughput_snake.parquet").is_file()
    with pytest.raises(ValueError, match="unknown env id"):
        bench.run(num_envs=[1], impls=("ours",), env_id="Pong-v0", out_dir=tmp_path)


def test_compiled_step_is_an_opt_in_row_of_its_own(tmp_path):
    """``ours_compile`` runs Snake's step under torch.compile (one graph) beside the eager ``ours``."""
    assert "ours_compile" in bench.ALL_IMPLS and "ours_compile" not in bench.DEFAULT_IMPLS
    df = bench.run(
        num_envs=[2], impls=("ours", "ours_compile"), repeats=1, min_seconds=0.01, out_dir=tmp_path, env_id="Snake-v0"
    )
    assert (df.status == "ok").all(), df.status.tolist()
    assert df.impl.tolist() == ["ours", "ours_compile"] and (df.device == "cpu").all()
    assert (df.steps_per_s > 0).all() and df.speedup_vs.notna().all()
