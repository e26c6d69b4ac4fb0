"""What every agent (``algos/ppo.py``, ``a2c.py``, ``sac.py``, ``dqn.py``) promises, checked once per agent: a tiny CPU
run on a synthetic site writes its curves, checkpoint, policy and evaluation; the exported policy reproduces that
evaluation; ``--resume`` continues from the checkpoint; a non-finite loss stops the run and keeps the last good
checkpoint; ``--help`` documents every field; ``--cudagraphs`` without CUDA stops with a clear error; ``--compile`` on
the CPU reproduces the eager run; the GPU statistics are NaN on the CPU. What is one agent's own stays in its file
(``tests/test_<algo>.py``).

The tiny runs (``tiny_runs`` in ``conftest.py``) are trained once per session and shared with the agents' own files;
PPO's is marked slow, as its checks were before."""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ALGO_TINY, TINY_RUN_STEPS, assert_compile_reproduces_eager, load_algo, run_algo

import envs
import envs.evhub
from algos import harness
from envs.evhub import EVHubVectorEnv, discrete_action_table
from envs.kpis import evaluate_policy, load_policy, read_policy_spec
from envs.vector import RecordEpisodeStatistics

GPU_COLUMNS = ["gpu_mem_allocated_gb", "gpu_mem_reserved_gb", "gpu_mem_peak_gb", "gpu_util_pct"]
"""metrics.parquet columns of :func:`harness.gpu_stats` (NaN on the CPU)."""

COLUMNS = (
    "global_step",
    "wall_s",
    "sps",
    "episodic_return",
    "episodic_length",
    "episodic_co2_kg",
    "episodic_unserved_kwh",
)
"""metrics.parquet columns of every agent."""

TAGS = ("charts/SPS", "charts/episodic_return", "charts/episodic_co2_kg", "charts/episodic_unserved_kwh")
"""TensorBoard scalars of every agent on EVHub-v0."""


@dataclass(frozen=True)
class Algo:
    """What one agent's tiny run (``conftest.ALGO_TINY``, ``conftest.TINY_RUN_STEPS``) and its contracts look like."""

    name: str
    steps: list[int]
    """``metrics.parquet``'s ``global_step`` after the tiny run."""
    resumed_to: int
    """``--total-timesteps`` of the resumed run (one more log row)."""
    resumed_iteration: int
    """The checkpoint's ``iteration`` after the resumed run."""
    printed: tuple[str, ...]
    """Resolved values the run prints at start."""
    columns: tuple[str, ...]
    """The agent's own ``metrics.parquet`` columns."""
    tags: tuple[str, ...] = ()
    """The agent's own TensorBoard scalars."""
    episodes_end: tuple[int, ...] | None = None
    """The log rows (global steps) in which the envs' 48-step episodes end (None: every row): their episode statistics
    are finite, with CO2 above zero."""
    finite: tuple[str, ...] = ()
    """Columns finite in every row (beside those of ``episodes_end``)."""
    non_increasing: tuple[str, ...] = ()
    """Columns that never grow from row to row."""
    discrete_hub: bool = False
    """The policy acts through EVHub-v0's discrete action table: each action is one of its rows."""
    non_finite: tuple[str, ...] | None = None
    """Flags that make a loss non-finite after the first optimizer step (None: the agent's own test checks it)."""
    non_finite_steps: int = 0
    """Steps asked for beyond the checkpoint in the non-finite run."""
    non_finite_at: int | None = None
    """Steps after the checkpoint at which the non-finite update is reported (None: not checked)."""
    non_finite_losses: tuple[str, ...] = ()
    """At least one of these is named in the error (none: not checked)."""
    help_phrases: tuple[str, ...] = ()
    """Docstrings of the agent's own fields (first words) and choices that ``--help`` shows."""
    compile_steps: int = 0
    """Env steps of the eager vs ``--compile`` comparison."""


ALGOS = {
    "ppo": Algo(
        "ppo",
        steps=[192, 384],
        resumed_to=576,
        resumed_iteration=3,
        printed=("num_envs=4",),
        columns=("value_loss", "policy_loss", "entropy", "learning_rate"),
        non_finite=("--learning-rate", "inf"),
        non_finite_steps=384,
        non_finite_at=192,
        non_finite_losses=("value_loss", "policy_loss"),
        help_phrases=("the surrogate clipping coefficient",),
        compile_steps=576,
    ),
    "a2c": Algo(
        "a2c",
        steps=[192, 384],
        resumed_to=576,
        resumed_iteration=18,
        printed=("num_envs=4",),
        columns=("value_loss", "policy_loss", "entropy", "explained_variance", "learning_rate"),
        tags=(
            "losses/value_loss",
            "losses/policy_loss",
            "losses/entropy",
            "losses/explained_variance",
            "charts/learning_rate",
        ),
        non_finite=("--learning-rate", "inf", "--no-anneal-lr"),
        non_finite_steps=384,
        non_finite_at=64,
        help_phrases=(
            "the lambda of the generalised advantage estimation",
            "the smoothing constant alpha of RMSprop",
            "rmsprop",
            "adam",
        ),
        compile_steps=384,
    ),
    "sac": Algo(
        "sac",
        steps=[192, 384],
        resumed_to=576,
        resumed_iteration=144,
        printed=("batch_size=32",),
        columns=(
            "qf1_values",
            "qf2_values",
            "qf1_loss",
            "qf2_loss",
            "qf_loss",
            "actor_loss",
            "alpha",
            "alpha_loss",
            "learning_rate",
        ),
        tags=("losses/qf1_values", "losses/qf_loss", "losses/actor_loss", "losses/alpha", "losses/alpha_loss"),
        non_finite=("--q-lr", "inf"),
        non_finite_steps=192,
        non_finite_losses=("qf_loss",),
        help_phrases=("target smoothing coefficient",),
        compile_steps=384,
    ),
    "dqn": Algo(
        # 32 iterations of 8 steps, a row every 8; the 48-step episodes of the 4 envs end at step 192
        "dqn",
        steps=[64, 128, 192, 256],
        resumed_to=320,
        resumed_iteration=40,
        printed=("num_envs=4",),
        columns=("td_loss", "q_values", "epsilon", "learning_rate"),
        episodes_end=(192,),
        finite=("td_loss", "q_values", "epsilon", "sps"),
        non_increasing=("epsilon",),
        discrete_hub=True,
        help_phrases=("the target network update rate", "use the double-DQN target"),
        compile_steps=256,
    ),
}

SLOW_RUN = {"ppo"}
"""The agents whose tiny run is slow: every check of that run is marked slow."""


def on_the_run(names=ALGOS) -> list:
    """``names`` as parameters, marked slow where their tiny run is."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUN else n for n in names]


# ---------------------------------------------------------------------------------------------- the tiny run
@pytest.mark.parametrize("name", on_the_run())
def test_tiny_run_writes_curves_checkpoint_policy_and_eval(name, tiny_runs, tiny_site_toml):
    algo, total = ALGOS[name], TINY_RUN_STEPS[name]
    out, proc = tiny_runs(name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "preset=cpu" in proc.stdout  # the resolved values are printed at start
    for value in algo.printed:
        assert value in proc.stdout, value
    assert list(out.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (out / "checkpoint.pt").is_file()

    # the curves
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert len(metrics) == len(algo.steps) and list(metrics.global_step) == algo.steps
    for col in COLUMNS + algo.columns:
        assert col in metrics, col
    assert GPU_COLUMNS == [k.removeprefix("perf/") for k in harness.GPU_STAT_KEYS]
    assert [c for c in metrics if c.startswith("gpu_")] == GPU_COLUMNS
    assert metrics[GPU_COLUMNS].isna().all().all()  # GPU monitoring: NaN on the CPU
    ended = metrics if algo.episodes_end is None else metrics[metrics.global_step.isin(algo.episodes_end)]
    assert len(ended) == len(algo.episodes_end or metrics)
    assert np.isfinite(ended.drop(columns=GPU_COLUMNS).to_numpy(dtype=float)).all(), metrics.T
    assert (ended.episodic_co2_kg > 0).all() and (ended.episodic_length == 48).all()
    if algo.finite:
        assert np.isfinite(metrics[list(algo.finite)].to_numpy()).all(), metrics.T
    for col in algo.non_increasing:
        assert (metrics[col].diff().dropna() <= 0).all(), col

    # TensorBoard scalars under the CleanRL / SB3 names
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in TAGS + algo.tags:
        assert tag in tags, tag

    # the exported policy: actions in [-1, 1], a dynamic batch dimension, loadable without algos
    obs_dim = envs.evhub.obs_dim(6)
    module = torch.export.load(out / "policy.pt2").module()
    policy = load_policy(out / "policy.pt2")
    for batch in (1, 5):
        obs = torch.randn(batch, obs_dim)
        action = module(obs)
        assert action.shape == (batch, 2) and action.dtype == torch.float32
        assert (action.abs() <= 1.0).all()
        action = policy(obs, None)
        assert action.shape == (batch, 2) and (action.abs() <= 1.0).all()
    assert policy(torch.zeros(1, obs_dim, dtype=torch.float64), None).shape == (1, 2)
    if algo.discrete_hub:
        env = EVHubVectorEnv(5, site=str(tiny_site_toml), action_mode="hub")
        obs, _ = env.reset(seed=0)
        action = policy(obs, env)
        assert action.shape == (5, 2)
        table = discrete_action_table().float()
        assert all(any(torch.equal(a, row) for row in table) for a in action)  # every action is a table row

    # the final deterministic evaluation on the test split
    kpi = pd.read_parquet(out / "eval_test.parquet")
    assert kpi.controller.tolist() == [name] and kpi.split.tolist() == ["test"]
    assert math.isfinite(kpi.co2_kg.iloc[0]) and kpi.co2_kg.iloc[0] > 0
    assert kpi.env_steps.iloc[0] == total
    assert kpi.train_wall_s.iloc[0] > 0 and kpi.steps_per_s.iloc[0] > 0
    traces = pd.read_parquet(out / "eval_test_traces.parquet")
    assert len(traces) == 7 * 24 and "co2_kg" in traces
    assert traces.co2_kg.sum() == pytest.approx(kpi.co2_kg.iloc[0])
    assert "co2_kg" in proc.stdout  # the KPIs are printed


@pytest.mark.parametrize("name", on_the_run())
def test_exported_policy_reproduces_the_eval(name, tiny_runs, tiny_site_toml):
    out, proc = tiny_runs(name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = read_policy_spec(out)  # what the pipeline's evaluation reads
    assert spec == {"action_mode": "hub", "bess_action": "surplus"}
    policy = load_policy(out / "policy.pt2")
    row, _ = evaluate_policy(
        policy, envs.load_site(tiny_site_toml), "test", name, spec["action_mode"], bess_action=spec["bess_action"]
    )
    kpi = pd.read_parquet(out / "eval_test.parquet")
    assert row.co2_kg.iloc[0] == pytest.approx(kpi.co2_kg.iloc[0], rel=1e-4)


@pytest.mark.parametrize("name", on_the_run())
def test_resume_continues_from_the_checkpoint(name, tiny_runs, tiny_site_toml, tmp_path):
    algo = ALGOS[name]
    trained, first = tiny_runs(name)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "run"
    shutil.copytree(trained, out)  # the shared run stays as it is
    proc = run_algo(
        name,
        "--site",
        str(tiny_site_toml),
        "--output-dir",
        str(out),
        "--total-timesteps",
        str(algo.resumed_to),
        "--resume",
        "--eval-split",
        "none",
        *ALGO_TINY[name],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed" in proc.stdout and f"global_step {TINY_RUN_STEPS[name]}" in proc.stdout
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == algo.steps + [algo.resumed_to]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == algo.resumed_to and ckpt["iteration"] == algo.resumed_iteration


@pytest.mark.parametrize("name", on_the_run(n for n, a in ALGOS.items() if a.non_finite is not None))
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(name, tiny_runs, tiny_site_toml, tmp_path):
    algo = ALGOS[name]
    out, first = tiny_runs(name)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "nan"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes())
    before = (run / "checkpoint.pt").read_bytes()
    step = torch.load(run / "checkpoint.pt", weights_only=False)["global_step"]
    # an infinite learning rate turns the weights into inf/NaN after the first optimizer step
    proc = run_algo(
        name,
        "--site",
        str(tiny_site_toml),
        "--output-dir",
        str(run),
        "--total-timesteps",
        str(step + algo.non_finite_steps),
        "--resume",
        *algo.non_finite,
        *ALGO_TINY[name],
    )
    assert proc.returncode != 0
    assert "NonFiniteLossError" in proc.stderr, proc.stderr[-2000:]
    if algo.non_finite_at is not None:
        assert f"global_step {step + algo.non_finite_at}" in proc.stderr, proc.stderr[-2000:]
    if algo.non_finite_losses:
        assert any(loss in proc.stderr for loss in algo.non_finite_losses), proc.stderr[-2000:]
    assert (run / "checkpoint.pt").read_bytes() == before
    assert not (run / "policy.pt2").exists()


# ---------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("name", list(ALGOS))
def test_help_documents_every_field(name):
    module = load_algo(name)
    proc = run_algo(name, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("│", " ").split())  # help text wrapped inside tyro's boxes, joined
    for f in dataclasses.fields(module.Args):
        assert f"--{f.name.replace('_', '-')}" in text, f.name
    # every field has its docstring in the help (first few words, as tyro may wrap lines): the agent's own ...
    for phrase in ALGOS[name].help_phrases:
        assert phrase in text, phrase
    # ... and those of RunArgs, also where the script only gives the field its own default
    for phrase in (
        "continue from output_dir/checkpoint.pt",
        "bf16 autocast of the network forward passes",
        "needs CUDA",
        "the name of this experiment",
        "iterations between host reads of the statistics",
        "iterations between checkpoints (0: only at the end)",
    ):
        assert phrase in text, phrase
    for choice in ("auto", "cpu", "gpu"):
        assert choice in text


@pytest.mark.parametrize("name", list(ALGOS))
def test_cudagraphs_on_cpu_stops_with_a_clear_error(name, site_toml, tmp_path):
    proc = run_algo(
        name, "--site", str(site_toml), "--output-dir", str(tmp_path), "--cudagraphs", *ALGO_TINY[name], timeout=60
    )
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- speed switches
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "dqn" else n for n in ALGOS])
def test_compile_on_cpu_reproduces_the_eager_run(name, site_toml, tmp_path):
    assert_compile_reproduces_eager(name, site_toml, tmp_path, ALGOS[name].compile_steps, ALGO_TINY[name])


# ---------------------------------------------------------------------------------------------- GPU statistics
@pytest.mark.parametrize("name", list(ALGOS))
def test_gpu_stats_on_cpu_are_nan(name, tmp_path):
    stats = harness.gpu_stats(torch.device("cpu"))
    assert (
        set(stats)
        == set(harness.GPU_STAT_KEYS)
        == {"perf/gpu_mem_allocated_gb", "perf/gpu_mem_reserved_gb", "perf/gpu_mem_peak_gb", "perf/gpu_util_pct"}
    )
    assert all(isinstance(v, float) and math.isnan(v) for v in stats.values())

    class OneStep:  # every episode ends after one step of reward 0
        num_envs, device = 1, torch.device("cpu")

        def step(self, action):
            ended, cut = torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)
            return torch.zeros(1, 3), torch.zeros(1), ended, cut, {}

    # one metrics row, as the agent's training loop logs it on the CPU
    module = load_algo(name)
    args = harness.preset_args(
        module.Args,
        module.PRESETS,
        module.ENV_DEFAULTS,
        env_id="Pendulum-v1",
        num_envs=1,
        cuda=False,
        output_dir=str(tmp_path),
        eval_split="none",
    )
    run = harness.Run(name, args, module.LOSS_NAMES, module.PRESETS, module.ENV_DEFAULTS)
    try:
        env = RecordEpisodeStatistics(OneStep())
        losses = dict.fromkeys(module.LOSS_NAMES, torch.zeros(()))
        for _ in run.iterations(1):
            env.step(torch.zeros(1, 1))
            run.global_step += 1
            row = run.log(env, run.new_guard(), {f"losses/{k}": v for k, v in losses.items()}, num_envs=1)
    finally:
        run.close()
    assert math.isnan(row["gpu_mem_peak_gb"]) and math.isnan(row["gpu_util_pct"]) and row["episodic_length"] == 1.0
    assert math.isnan(pd.read_parquet(tmp_path / "metrics.parquet").gpu_util_pct.iloc[0])
