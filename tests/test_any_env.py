"""The four scripts on envs that are not ours: gymnasium's Pendulum-v1 / CartPole-v1 and a Dict-observation env of
these tests, with ``--env-kwargs``; export and evaluation of any run; clear refusals of spaces the scripts cannot
drive; a run stopped early (SIGTERM, ``--max-wall-s``) saves and exports."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, load_algo

from algos import harness
from algos.harness import evaluate as evaluate_cli
from algos.harness import export as export_cli


class DictObsEnv(gym.Env):
    """A small task behind a Dict observation: ``"target"`` (Box ``(size,)``) and ``"phase"`` (Discrete 3); the reward
    is minus the distance of the action (Box ``(size,)``, or Discrete ``size``: a one-hot) from the target; episodes
    last ``horizon`` steps (truncated)."""

    def __init__(self, size: int = 2, horizon: int = 5, discrete: bool = False):
        self.size, self.horizon, self.discrete = size, horizon, discrete
        box = gym.spaces.Box(-1.0, 1.0, (size,), np.float32)
        self.observation_space = gym.spaces.Dict({"target": box, "phase": gym.spaces.Discrete(3)})
        self.action_space = gym.spaces.Discrete(size) if discrete else box

    def _obs(self):
        return {"target": self.target.astype(np.float32), "phase": self.t % 3}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.target = 0, self.np_random.uniform(-1.0, 1.0, self.size)
        return self._obs(), {}

    def step(self, action):
        a = np.eye(self.size)[int(action)] if self.discrete else np.asarray(action, np.float64)
        reward = -float(np.abs(a - self.target).sum())
        self.t += 1
        self.target = self.np_random.uniform(-1.0, 1.0, self.size)
        return self._obs(), reward, False, self.t >= self.horizon, {}


class TextObsEnv(DictObsEnv):
    """An observation space with no flat vector (Text)."""

    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Text(8)


if "DictObs-v0" not in gym.registry:
    gym.register(id="DictObs-v0", entry_point=DictObsEnv)
    gym.register(id="TextObs-v0", entry_point=TextObsEnv)

TINY = {
    "ppo": {"num_envs": 2, "num_steps": 16, "num_minibatches": 2, "update_epochs": 1, "total_timesteps": 64},
    "a2c": {"num_envs": 2, "num_steps": 8, "total_timesteps": 32},
    "sac": {"num_envs": 2, "total_timesteps": 48, "learning_starts": 16, "batch_size": 8, "buffer_size": 64},
    "dqn": {"num_envs": 2, "num_steps": 2, "total_timesteps": 48, "learning_starts": 16, "batch_size": 8,
            "buffer_size": 64},
}  # fmt: skip
"""A few iterations of each script."""


def tiny_args(algo: str, env_id: str, out, **fields):
    module = load_algo(algo)
    values = {**TINY[algo], "env_id": env_id, "output_dir": str(out), "cuda": False, **fields}
    return module, harness.preset_args(module.Args, module.PRESETS, module.ENV_DEFAULTS, **values)


def exported_acts_like_checkpoint(algo: str, run_dir) -> None:
    """The run's ``policy.pt2`` gives the actions of the policy rebuilt from its ``checkpoint.pt``."""
    module = load_algo(algo)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    fields = {f for f in module.Args.__dataclass_fields__}
    args = module.Args(**{k: v for k, v in state["args"].items() if k in fields})
    actor, env, _ = module.deterministic_policy(args, state)
    rebuilt = harness.EnvUnitsPolicy(actor, env.single_action_space).eval()
    exported = harness.load_policy(run_dir / "policy.pt2")
    obs = torch.randn(7, *env.obs_shape)
    with torch.no_grad():
        assert torch.equal(exported(obs), rebuilt(obs))
    env.close()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "a2c", "sac", "dqn"])
def test_script_on_gymnasium_and_dict_env_with_env_kwargs(algo, tmp_path, capsys):
    """Each script trains on a gymnasium env and on a Dict-observation env with --env-kwargs, records them, exports
    from the checkpoint the policy it ends with, and evaluates by episodes, at its end and as a command."""
    gym_id, gym_kwargs = ("CartPole-v1", "{}") if algo == "dqn" else ("Pendulum-v1", '{"g": 9.5}')
    module, args = tiny_args(algo, gym_id, tmp_path / "gym", env_kwargs=gym_kwargs, eval_episodes=2)
    out = module.main(args)
    assert out["global_step"] > 0 and out["stopped"] is None
    rows = pd.read_parquet(tmp_path / "gym" / "eval_episodes.parquet")
    assert len(rows) == 2 and (rows["length"] > 0).all()
    assert np.allclose(out["eval_episodes"]["return"], rows["return"])

    kwargs = {"size": 3, "horizon": 4, "discrete": algo == "dqn"}
    run_dir = tmp_path / "dict"
    module, args = tiny_args(algo, "DictObs-v0", run_dir, env_kwargs=json.dumps(kwargs), eval_episodes=3)
    out = module.main(args)
    printed = capsys.readouterr().out
    assert "flattened from Dict" in printed and "to 6 floats" in printed  # 3 target values + one-hot of 3 phases
    assert json.loads(json.loads((run_dir / "config.json").read_text())["env_kwargs"]) == kwargs
    rows = pd.read_parquet(run_dir / "eval_episodes.parquet")
    assert rows["length"].tolist() == [4, 4, 4]  # the horizon given by --env-kwargs reached the env
    assert (rows["return"] <= 0).all()
    exported_acts_like_checkpoint(algo, run_dir)

    (run_dir / "policy.pt2").unlink()
    assert export_cli.main([str(run_dir)]) == 0
    exported_acts_like_checkpoint(algo, run_dir)
    (run_dir / "eval_episodes.parquet").unlink()
    assert evaluate_cli.main([str(run_dir), "--episodes", "3"]) == 0
    again = pd.read_parquet(run_dir / "eval_episodes.parquet")
    pd.testing.assert_frame_equal(again, rows)  # the same episodes (seeds) and policy: the same returns


def test_env_kwargs_parsed_and_refused_clearly():
    assert harness.env_kwargs_of("") == {}
    assert harness.env_kwargs_of('{"g": 9.5, "name": "x"}') == {"g": 9.5, "name": "x"}
    assert harness.env_kwargs_of("g=9.5,render_mode=rgb_array,flag=true") == {
        "g": 9.5,
        "render_mode": "rgb_array",
        "flag": True,
    }
    with pytest.raises(ValueError, match="not a JSON object"):
        harness.env_kwargs_of("[1, 2]")
    with pytest.raises(ValueError, match="is not key=value"):
        harness.env_kwargs_of("g")


@pytest.mark.parametrize(
    ("algo", "env_id", "env_kwargs", "message"),
    [
        ("ppo", "TextObs-v0", "", "TextObs-v0's observation space Text(1, 8"),
        ("sac", "TextObs-v0", "", "cannot be flattened to a fixed-size vector"),
        ("dqn", "Pendulum-v1", "", "Pendulum-v1"),  # a Box action space: DQN takes Discrete
        ("a2c", "Pendulum-v1", "bad=1", "pass its constructor's arguments with --env-kwargs"),
        ("ppo", "NoSuchEnv-v0", "", "NoSuchEnv"),  # gymnasium's own error for an unknown id
    ],
)
def test_unsupported_space_or_kwargs_is_one_clear_line(
    algo, env_id, env_kwargs, message, tmp_path, capsys, monkeypatch
):
    """The script's command line ends with ``error: ...`` naming the env and the space (or the refused arguments),
    exit status 2, no traceback."""
    module = load_algo(algo)
    argv = ["--env-id", env_id, "--no-cuda", "--output-dir", str(tmp_path / "run")]
    argv += ["--env-kwargs", env_kwargs] if env_kwargs else []
    monkeypatch.setattr(sys, "argv", [f"{algo}.py", *argv])
    with pytest.raises(SystemExit) as stop:
        harness.script(module.main, module.Args, module.PRESETS, module.ENV_DEFAULTS)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_sigterm_mid_run_saves_and_exports(tmp_path):
    """SIGTERM while training: the run stops after its iteration, writes its checkpoint and a policy that acts as
    the checkpoint's, and exits with 128 + 15."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "algos" / "ppo.py"), "--env-id", "Pendulum-v1", "--no-cuda", "--num-envs", "2"]
    cmd += ["--num-steps", "32", "--total-timesteps", "10000000", "--output-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (run_dir / "metrics.parquet").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-2000:]
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, log[-2000:]
    assert "SIGTERM: stopped at global_step" in log
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert 0 < state["global_step"] < 10_000_000
    exported_acts_like_checkpoint("ppo", run_dir)


def test_max_wall_s_stops_saves_and_exports(tmp_path):
    module, args = tiny_args("ppo", "Pendulum-v1", tmp_path / "run", total_timesteps=10_000_000, max_wall_s=1e-9)
    out = module.main(args)
    assert out["stopped"] == "--max-wall-s 1e-09" and out["stopped_by_signal"] is None
    assert out["global_step"] == TINY["ppo"]["num_envs"] * TINY["ppo"]["num_steps"]  # one iteration, then the stop
    exported_acts_like_checkpoint("ppo", tmp_path / "run")
    metrics = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert metrics["global_step"].tolist() == [out["global_step"]]  # the stopped iteration is logged as the last


def test_logged_steps_are_trained_steps(tmp_path, capsys):
    module, args = tiny_args("ppo", "Pendulum-v1", tmp_path / "run", total_timesteps=100)
    out = module.main(args)
    assert out["global_step"] == 96  # three iterations of 2 x 16
    assert "96 steps (--total-timesteps 100 in whole iterations of 32 steps)" in capsys.readouterr().out
