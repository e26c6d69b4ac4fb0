"""Online agents: a trained agent that keeps learning, week by week, from the realised past of the split it acts in.

``<algo>_online`` (:func:`evaluate_online`; ``dqn_online`` and ``ppo_online``): the agent starts from the checkpoint
of its train-split run and acts over a whole split one week at a time (the weeks of
:func:`pipeline.control.backtest.weeks`). At the start of each week from the second on it fine-tunes
(``algos/<algo>.py --init-from``, a subprocess as every training, :func:`pipeline.study.tasks.train_agent`) for
:data:`FINE_TUNE_STEPS` env steps on training windows of the acting split that end where the week begins
(``--train-split``, ``--train-window-end``), from the networks the last week ended with, then acts greedily for the
week with the policy it exported. Its start is the agent itself (the policy it never fine-tunes).

What it reads: at step ``t`` of week ``w`` its policy has seen the sessions and MOER of the acting split before week
``w`` (the windows) and, as every agent, the observation of step ``t``; nothing after ``t`` (tested by changing the
data after a step, ``tests/test_online.py``). A fine-tuning repeats the run's networks, sizes and update rule
(:data:`KEEP`); its own settings are :data:`FINE_TUNE_STEPS` and :data:`FINE_TUNE_ARGS`.

``mpc_rl_online`` (:class:`OnlinePlanner`) is the same for ``mpc_rl``'s day-level policy: from its train-split run
(``<experiment>/tuned/mpc_rl_seed<seed>/``, its start), at each week's start it keeps training (``algos/ppo.py
--init-from`` with :func:`pipeline.control.tuned.ppo_args`) for ``FINE_TUNE_STEPS["mpc_rl"]`` days on week-long
backtests (:class:`pipeline.control.rl_planner.PlannerEnv`) that start in the acting split's last
:data:`PLANNER_LOOKBACK_WEEKS` weeks and end before the week it acts in, then sets each day's planner parameters with
the result.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from envs.kpis import evaluate_policy, load_policy, read_policy_spec
from envs.site import load_site
from pipeline import depends
from pipeline.control import rl_planner
from pipeline.control.backtest import evaluation_site, week_steps
from pipeline.control.tuned import ppo_args, rl_policy_file, rl_run_dir
from pipeline.study import results, tasks
from pipeline.study.cluster import PRIORITY, get_client
from pipeline.study.config import SPLITS

FINE_TUNE_STEPS = {"dqn": 10_000, "ppo": 86_016, "mpc_rl": 28}
"""Env steps of each weekly fine-tuning, by online form (:data:`pipeline.study.results.ONLINE_FORMS`; PPO: four
rollouts of its cpu preset, 128 envs x 168 steps each; ``mpc_rl``: days, two rollouts of its two week-long episodes;
how each was chosen: docs/lab/online-learning.md)."""

PLANNER_LOOKBACK_WEEKS = 4
"""``mpc_rl_online``'s fine-tuning episodes start within the acting split's last this many weeks (and end before the
week it acts in): the recent past, as ``mpc_adaptive``'s weekly re-choice reads (docs/agents.md)."""

FINE_TUNE_ARGS = {"dqn": ("--learning-starts", "1024", "--start-e", "0.05", "--end-e", "0.05"), "ppo": ()}
"""Flags of each weekly fine-tuning besides the run's own (DQN: epsilon at its trained end value, a buffer of 1,024
transitions before the first gradient step)."""

KEEP = ("preset", "action_mode", "num_envs", "num_steps", "learning_rate", "gamma", "hidden_size", "max_grad_norm")
KEEP += ("gradient_steps", "batch_size", "buffer_size", "tau", "target_network_frequency", "double_q", "reward_scale")
KEEP += ("gae_lambda", "num_minibatches", "update_epochs", "norm_adv", "clip_coef", "clip_vloss", "ent_coef")
KEEP += ("vf_coef", "init_logstd", "norm_reward", "anneal_lr")
KEEP += ("socket_features", "weekday_features", "context_features", "norm_obs", "bootstrap_truncation", "bess_action")
KEEP += ("cuda",)
"""The run's arguments a fine-tuning repeats where its script has them (its networks, sizes and update rule); the
rest are the fine-tuning's own."""


def run_flags(run_dir: str | Path) -> tuple[str, ...]:
    """The command-line flags of the arguments in :data:`KEEP` that the run in ``run_dir`` was trained with (read
    from its ``checkpoint.pt``), so that a fine-tuning builds the same networks and update.

    Raises:
        FileNotFoundError: the run has no checkpoint.
    """
    path = Path(run_dir) / "checkpoint.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint to fine-tune from (did training finish?)")
    args = torch.load(path, map_location="cpu", weights_only=False)["args"]
    flags: list[str] = []
    for name in KEEP:
        if name not in args:
            continue
        flag, value = "--" + name.replace("_", "-"), args[name]
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return tuple(flags)


class _WeeklyFineTuning:
    """What both online forms share: the run they fine-tune next from, the wall time of each fine-tuning."""

    seed: int
    site_toml: str
    steps: int
    week: int
    work_dir: Path
    last_run: Path
    update_s: list[float]

    def _train_week(self, algo: str, t: int, extra: tuple[str, ...], **train_kw):
        """Run ``algos/<algo>.py`` for :attr:`steps` from :attr:`last_run`'s networks into ``week<w>/`` (``w`` the
        week step ``t`` starts; seed ``1000 * seed + w``); returns the policy it exported."""
        w = t // self.week
        out = self.work_dir / f"week{w:03d}"
        extra = (*extra, "--init-from", str(self.last_run / "checkpoint.pt"), "--checkpoint-every", "0")
        t0 = time.perf_counter()
        tasks.train_agent(algo, 1000 * self.seed + w, self.site_toml, str(out), self.steps, extra, echo=False,
                          **train_kw)  # fmt: skip
        self.update_s.append(time.perf_counter() - t0)
        self.last_run = out
        return load_policy(tasks.find_policy(out))


class OnlineAgent(_WeeklyFineTuning):
    """A :data:`envs.kpis.Policy` that fine-tunes itself at each week's start (module docstring).

    Args:
        algo: the agent's script (``algos/<algo>.py``); a key of :data:`FINE_TUNE_STEPS`.
        seed: the run's seed; week ``w``'s fine-tuning has seed ``1000 * seed + w``.
        run_dir: the agent's train-split run (``checkpoint.pt``, ``policy.pt2``).
        site_toml: the site. split: the split it acts in. work_dir: where the weekly runs go (one folder each).
        steps: env steps of each fine-tuning (default :data:`FINE_TUNE_STEPS`); 0 never fine-tunes (the start).
    """

    def __init__(
        self, algo: str, seed: int, run_dir: str | Path, site_toml: str, split: str, work_dir: str | Path, steps=None
    ):
        self.algo, self.seed, self.site_toml, self.split = algo, seed, str(site_toml), split
        self.steps = FINE_TUNE_STEPS[algo] if steps is None else int(steps)
        self.work_dir = Path(work_dir)
        self.flags = run_flags(run_dir)
        self.last_run = Path(run_dir)
        self.policy = load_policy(tasks.find_policy(run_dir))
        config = load_site(site_toml).config
        self.week = week_steps(config.dt_h)
        self.first = max(self.week, config.episode_steps)  # the first step a training window fits before
        self.update_s: list[float] = []  # wall seconds of each weekly fine-tuning

    def __call__(self, obs: torch.Tensor, env) -> torch.Tensor:
        """Actions of the current policy; at a week's start with a training window's worth of the split before it,
        fine-tune first."""
        t = int(env.t[0])
        if self.steps and t >= self.first and t % self.week == 0:
            self._fine_tune(t)
        return self.policy(obs, env)

    def _fine_tune(self, t: int) -> None:
        """Fine-tune on the windows before step ``t`` from the last week's networks; act with the result."""
        window = ("--train-split", self.split, "--train-window-end", str(t))
        self.policy = self._train_week(self.algo, t, (*self.flags, *FINE_TUNE_ARGS[self.algo], *window))


class OnlinePlanner(_WeeklyFineTuning, rl_planner.DailyPolicyPlanner):
    """``mpc_rl_online`` (module docstring): :class:`~pipeline.control.rl_planner.DailyPolicyPlanner` whose day-level
    policy keeps training at each week's start on the acting split's past weeks.

    Args:
        seed: the run's seed; week ``w``'s fine-tuning has seed ``1000 * seed + w``.
        run_dir: ``mpc_rl``'s train-split run (``checkpoint.pt``, ``policy.pt2``).
        site_toml: the site. split: the split it acts in. work_dir: where the weekly runs go (one folder each).
        days: days (env steps) of each fine-tuning (default ``FINE_TUNE_STEPS["mpc_rl"]``); 0 never fine-tunes
            (``mpc_rl`` itself).

    Raises:
        FileNotFoundError: the run has no checkpoint or policy.
    """

    def __init__(self, seed: int, run_dir: str | Path, site_toml: str, split: str, work_dir: str | Path, days=None):
        if not (Path(run_dir) / "checkpoint.pt").is_file():
            raise FileNotFoundError(f"{Path(run_dir) / 'checkpoint.pt'}: no mpc_rl run to fine-tune from")
        site = evaluation_site(load_site(site_toml))
        policy = load_policy(rl_policy_file(run_dir))
        rl_planner.DailyPolicyPlanner.__init__(self, site, split, policy, rl_planner.base_params(site))
        self.seed, self.site_toml, self.work_dir, self.last_run = seed, str(site_toml), Path(work_dir), Path(run_dir)
        self.steps = FINE_TUNE_STEPS["mpc_rl"] if days is None else int(days)
        self.week = week_steps(site.config.dt_h)
        self.update_s = []

    def __call__(self, obs: torch.Tensor, env) -> torch.Tensor:
        """The planner's action; at a week's start with a whole episode of the split's recent past before it, the
        day-level policy is fine-tuned first."""
        t = int(env.t[0])
        if self.steps and t > 0 and t % self.week == 0:
            window = (max(0, t - PLANNER_LOOKBACK_WEEKS * self.week), t)
            if len(rl_planner.episode_starts(self.site, self.split, *window)):
                environ = rl_planner.training_environ(self.site_toml, self.split, window)
                self.policy = self._train_week("ppo", t, ppo_args(self.steps), env_vars=environ,
                                               code=depends.CONTROL)  # fmt: skip
        return rl_planner.DailyPolicyPlanner.__call__(self, obs, env)


def evaluate_online(
    algo: str, seed: int, run_dir: str, site_toml: str, split: str, out_dir: str, work_dir: str, steps=None
) -> list[str]:
    """Run ``<algo>_online`` (:class:`OnlineAgent`; ``mpc_rl``: :class:`OnlinePlanner`) over ``split`` and write its
    KPI row and traces like :func:`pipeline.study.tasks.evaluate_agent`; the row's ``update_s`` is the mean wall time
    of a weekly fine-tuning. Returns ``[kpi_path, traces_path]``.

    Raises:
        FileNotFoundError: the run has no checkpoint or policy. RuntimeError: a fine-tuning failed.
    """
    work = Path(work_dir) / f"{algo}_{split}_seed{seed}"
    if algo == "mpc_rl":
        agent = OnlinePlanner(seed, run_dir, site_toml, split, work, steps)
        site, spec = agent.site, {"action_mode": "socket", "bess_action": "setpoint"}
    else:
        agent = OnlineAgent(algo, seed, run_dir, site_toml, split, work, steps)
        site, spec = load_site(site_toml), read_policy_spec(run_dir)
    kpis, traces = evaluate_policy(
        agent, site, split, f"{algo}_online", spec["action_mode"], bess_action=spec["bess_action"]
    )
    kpis["seed"] = float(seed)
    kpis["update_s"] = sum(agent.update_s) / max(len(agent.update_s), 1)
    return tasks.write_run(kpis, traces, out_dir, f"{algo}_online", split, seed)


def start_run(cfg, name: str, seed: int) -> Path:
    """The train-split run the online form of ``name`` starts from: the agent's ``<root>/runs/`` run, or ``mpc_rl``'s
    beside the tuning."""
    root = Path(cfg.root)
    if name == "mpc_rl":
        return rl_run_dir(root / "tuned", seed)
    return root / "runs" / results.run_name(name, seed)


def run(cfg, client=None, log=print) -> list[Path]:
    """``doit run online``: :func:`evaluate_online` for each of :func:`~pipeline.study.results.online_forms`, seed and
    split, one Dask task each (the study's trained runs are their starts, :func:`start_run`), into ``<root>/online/``
    (the report shows the rows once they are there; their weekly runs go to ``<root>/online/runs/``). Prints each row's
    CO2 and the mean wall time of a weekly fine-tuning.

    Raises:
        FileNotFoundError: a run has no checkpoint or policy (run the pipeline's training first).
        RuntimeError: a fine-tuning failed.
    """
    from distributed import as_completed

    out = Path(cfg.root) / "online"
    jobs = []
    for algo in results.online_forms(cfg):
        for seed in cfg.seeds:
            run_dir = start_run(cfg, algo, seed)
            if not (run_dir / "checkpoint.pt").is_file():
                task = "tune:mpc_rl" if algo == "mpc_rl" else f"train:{algo}"
                raise FileNotFoundError(f"{run_dir}: no checkpoint.pt; train {algo} first (doit run {task})")
            jobs += [(algo, seed, str(run_dir), split) for split in SPLITS]
    client = client or get_client(cfg.scheduler_address, cfg.workers)
    futures = {
        client.submit(evaluate_online, a, s, r, str(cfg.site_toml), split, str(out), str(out / "runs"),
                      priority=PRIORITY["simulate"], pure=False): (a, s, split)
        for a, s, r, split in jobs
    }  # fmt: skip
    files: list[Path] = []
    for fut in as_completed(futures):
        a, s, split = futures[fut]
        kpi, traces = fut.result()
        row = pd.read_parquet(kpi).iloc[0]
        log(f"{a}_online seed {s} {split}: CO2 {row.co2_kg:,.1f} kg, served {row.ev_energy_served_pct:.1f}%, "
            f"{row.update_s:.1f} s a weekly fine-tuning")  # fmt: skip
        files += [Path(kpi), Path(traces)]
    return files
