"""Our PPO (``algos/ppo.py``) against Stable-Baselines3's PPO, configured alike, on ``Pendulum-v1`` and ``EVHub-v0``.

Both libraries train on the CPU with one torch thread, each run in its own subprocess, at the same env steps, for
seeds 1, 2 and 3 (:data:`SEEDS`). Measured per run:

- ``eval_return``: the mean undiscounted return of the deterministic policy over ``eval_episodes`` (default 10)
  episodes of a fresh single env, reset with the seeds ``EVAL_SEED + i`` (the same episodes for every run; EVHub-v0:
  windows of the test split). Ours acts through its exported ``policy.pt2`` (raw observations -> actions in the env's
  units), SB3 through ``model.predict(deterministic=True)`` with the ``VecNormalize`` statistics frozen;
- ``sps``: training env steps / training wall seconds, both from the same run (ours: its training clock, which leaves
  out set-up, export and evaluation; SB3: the wall time of ``model.learn``);
- EVHub-v0 only, ``test_co2_kg``: the site's CO2 over the whole test split under the deterministic policy
  (:func:`envs.kpis.evaluate_policy`, the project's KPI).

The table gives, per env and library, the medians over the seeds and each seed's value, and the ratio of the median
steps/s, ours / SB3; below it, ours / SB3 seed by seed (the two runs of a seed back to back, so less exposed to a
change of load on a shared machine) and their median. Our median return is judged against the range (min to max) of
SB3's seeds.

One configuration per env, held as our script's ``Args`` (:func:`ours_args`); SB3's arguments are derived from it
(:func:`sb3_kwargs`), so the two cannot drift apart. Alike in both: total env steps (whole rollouts), ``num_envs`` /
``n_envs``, ``num_steps`` / ``n_steps``, minibatch size, epochs, gamma and GAE lambda per env step, clip range 0.2
(no value clipping: SB3's ``clip_range_vf=None``, ours ``--no-clip-vloss``), constant learning rate (ours
``--no-anneal-lr``), no entropy bonus, value coefficient 0.5, gradient-norm clip 0.5, per-minibatch advantage
normalisation, Adam with eps 1e-5, separate actor and critic MLPs of two tanh layers of 64 with orthogonal
initialisation (SB3's default ``MlpPolicy``), a state-independent log std starting at 0 in the env's action units
(SB3's ``log_std_init``; ours ``--init-logstd -log(half range)``, as it acts in [-1, 1]), bootstrapping of time-limit
truncations, observation and reward normalisation both on or both off (SB3 by ``VecNormalize`` with the same gamma),
in-process vector envs stepped one after another (SB3 ``DummyVecEnv``, ours gymnasium's ``SyncVectorEnv`` on
Pendulum-v1). What stays different: ours samples actions in [-1, 1] and rescales them to the env's units, SB3 samples
in the env's units; SB3 clips normalised rewards to [-10, 10], ours does not; on EVHub-v0 ours steps its
torch-batched vector env, SB3 ``num_envs`` copies of the single-env ``EVHubEnv`` (float32 like ours; fed the same
observation features as our networks read, :func:`algos.harness.network_inputs`), and ours bootstraps a window's
truncation through the autoreset (``envs/vector.py``) and its reward normaliser's discounted return runs on through
it, where SB3 bootstraps from the window's last observation and restarts that return.

- ``Pendulum-v1``: RL Baselines3 Zoo's tuned PPO hyperparameters (``hyperparams/ppo.yml`` of
  https://github.com/DLR-RM/rl-baselines3-zoo: ``n_envs`` 4, ``n_timesteps`` 1e5, ``n_steps`` 1024, ``gae_lambda``
  0.95, ``gamma`` 0.9, ``n_epochs`` 10, ``ent_coef`` 0, ``learning_rate`` 1e-3, ``clip_range`` 0.2, SB3's default
  ``batch_size`` 64, no normalisation), at 25 rollouts (102,400 steps). The zoo's ``use_sde: True`` (generalised
  state-dependent exploration, ``sde_sample_freq`` 4) is SB3-only and is left off for both.
- ``EVHub-v0`` (caltech site, train split, hub actions, BESS action ``surplus``): our script's discount (0.98) and
  GAE lambda (0.95) per hour of site time, i.e. per 15-minute step ``0.98 ** 0.25`` and ``0.95 ** 0.25``, and its
  observation and reward normalisation; the sizes of the Stable-Baselines3 study this project replaces
  (:data:`benchmarks.training.STUDY_PPO`: 8 envs, ``n_steps`` 512, minibatch 256, 10 epochs) with SB3's default
  learning rate 3e-4, at 12 rollouts (49,152 steps) so that the whole benchmark stays near 15 minutes on 2 cores.
  (:mod:`benchmarks.training` compares speed and time to quality with each library's own settings instead.)

Run ``python -m benchmarks.ppo_vs_sb3 --help`` (``--quick`` for a smoke run); the runs go to
``outputs/bench/ppo_vs_sb3.parquet`` and the table is printed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import torch

from algos import harness, ppo
from benchmarks.common import BENCH_DIR, RESULT_PREFIX, fmt_num, machine_info, peak_rss_mb, run_worker, save_table
from envs.vector import BoxScaling, is_evhub

LIBRARIES = ("ours", "sb3")
SEEDS = (1, 2, 3)
EVAL_SEED = 10_000
"""The evaluation episodes reset with the seeds ``EVAL_SEED + i``, the same for every run."""
EVAL_SPLIT = "test"
"""EVHub-v0's evaluation split (its windows for the returns, the whole split for the CO2)."""


def _ppo(
    iterations: int,
    num_envs: int,
    num_steps: int,
    minibatch_size: int,
    gamma: float,
    learning_rate: float,
    normalise: bool,
    **env: str,
) -> dict:
    """One env's PPO settings: ``iterations`` rollouts of ``num_envs x num_steps`` env steps, each learned from for 10
    epochs in minibatches of ``minibatch_size`` steps, GAE's lambda 0.95, observations and rewards normalised or not;
    ``env``: the env's own options."""
    return {
        "total_timesteps": iterations * num_envs * num_steps,
        "num_envs": num_envs,
        "num_steps": num_steps,
        "num_minibatches": num_envs * num_steps // minibatch_size,
        "update_epochs": 10,
        "gamma": gamma,
        "gae_lambda": 0.95,
        "learning_rate": learning_rate,
        "norm_obs": normalise,
        "norm_reward": normalise,
        **env,
    }


SETTINGS: dict[str, dict] = {
    "Pendulum-v1": _ppo(25, 4, 1024, 64, gamma=0.9, learning_rate=1e-3, normalise=False),
    "EVHub-v0": _ppo(
        12,
        8,
        512,
        256,
        gamma=0.98,  # per hour of site time
        learning_rate=3e-4,
        normalise=True,
        site="caltech",
        action_mode="hub",
        bess_action="surplus",
    ),
}
"""Each env's configuration, as overrides of our script's ``Args`` (gamma and lambda per hour on EVHub-v0)."""

COMMON = {
    "hidden_size": 64,
    "clip_coef": 0.2,
    "clip_vloss": False,
    "anneal_lr": False,
    "ent_coef": 0.0,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "norm_adv": True,
    "target_kl": None,
    "bootstrap_truncation": True,
    "num_threads": 1,
    "cuda": False,
    "preset": "cpu",
    "checkpoint_every": 0,
    "eval_split": "none",
}
"""Overrides of our ``Args`` shared by every env (see the module docstring)."""


# ------------------------------------------------------------------------------------------- configuration
def make_single_env(args, split: str | None = None, inputs: list[int] | None = None):
    """One gymnasium env of ``args.env_id`` as SB3 trains on it and both libraries are evaluated on: EVHub-v0's
    :class:`envs.evhub.EVHubEnv` on ``split`` (default ``args.train_split``) in float32, any other id by
    ``gym.make``. ``inputs``: keep only these observation features (SB3's training envs)."""
    import gymnasium as gym

    if is_evhub(args.env_id):
        from envs.evhub import EVHubEnv

        env = EVHubEnv(
            site=args.site,
            split=split or args.train_split,
            action_mode=args.action_mode,
            bess_action=args.bess_action,
            dtype=torch.float32,
        )
    else:
        env = gym.make(args.env_id)
    if inputs is None:
        return env
    box = env.observation_space
    space = gym.spaces.Box(box.low[inputs], box.high[inputs], dtype=box.dtype)
    return gym.wrappers.TransformObservation(env, lambda obs: obs[inputs], space)


def network_inputs(args) -> list[int] | None:
    """The observation features our networks read (:func:`algos.harness.network_inputs`; None: all)."""
    if not is_evhub(args.env_id):
        return None
    env = make_single_env(args)
    return harness.network_inputs(env.vec, args)


def ours_args(
    env_id: str, seed: int, scale: float = 1.0, output_dir: str | None = None, overrides: dict | None = None
) -> ppo.Args:
    """Our script's ``Args`` for ``env_id``: :data:`SETTINGS` (with ``overrides`` on top) and :data:`COMMON` on the
    CPU preset, the initial log std of SB3's (0 in the env's action units), ``scale`` times the env steps rounded to
    whole rollouts (at least one).

    Raises:
        KeyError: an env without :data:`SETTINGS`.
    """
    own = SETTINGS[env_id] | (overrides or {})
    batch = own["num_envs"] * own["num_steps"]
    own["total_timesteps"] = max(1, round(own["total_timesteps"] * scale / batch)) * batch
    args = harness.preset_args(
        ppo.Args, ppo.PRESETS, ppo.ENV_DEFAULTS, env_id=env_id, seed=seed, output_dir=output_dir, **COMMON, **own
    )
    space = make_single_env(args).action_space
    half = np.unique(BoxScaling(space).half)
    if len(half) != 1:
        raise ValueError(f"{env_id}: unequal action ranges {half}; one initial log std cannot match SB3's")
    return dataclasses.replace(args, init_logstd=-math.log(float(half[0])))


def sb3_kwargs(args: ppo.Args) -> dict:
    """Stable-Baselines3's ``PPO`` arguments alike ``args`` (discounts per env step), with ``"normalize"``: the
    ``VecNormalize`` arguments (None: no normalisation)."""
    gamma = harness.per_step(args, args.gamma)
    h = args.hidden_size
    normalize = None
    if args.norm_obs or args.norm_reward:
        normalize = {"norm_obs": args.norm_obs, "norm_reward": args.norm_reward, "gamma": gamma}
    return {
        "n_steps": args.num_steps,
        "batch_size": args.num_envs * args.num_steps // args.num_minibatches,
        "n_epochs": args.update_epochs,
        "gamma": gamma,
        "gae_lambda": harness.per_step(args, args.gae_lambda),
        "learning_rate": args.learning_rate,
        "clip_range": args.clip_coef,
        "clip_range_vf": args.clip_coef if args.clip_vloss else None,
        "normalize_advantage": args.norm_adv,
        "ent_coef": args.ent_coef,
        "vf_coef": args.vf_coef,
        "max_grad_norm": args.max_grad_norm,
        "target_kl": args.target_kl,
        "policy_kwargs": {
            "net_arch": {"pi": [h, h], "vf": [h, h]},
            "activation_fn": torch.nn.Tanh,
            "ortho_init": True,
            "log_std_init": 0.0,
        },
        "normalize": normalize,
    }


def settings_json(args: ppo.Args) -> str:
    """The configuration both libraries train with, as JSON (SB3's names)."""
    kw = sb3_kwargs(args)
    kw["policy_kwargs"] = {**kw["policy_kwargs"], "activation_fn": "Tanh"}
    return json.dumps({"n_envs": args.num_envs, "total_timesteps": args.total_timesteps, **kw})


# ------------------------------------------------------------------------------------------- one run
Act = Callable[[np.ndarray], np.ndarray]
"""A deterministic policy: raw observations float32 ``(B, obs_dim)`` -> actions ``(B, act_dim)`` in the env's units."""


def _train_ours(args: ppo.Args) -> tuple[int, float, Act]:
    """Train our PPO in this process; ``(env steps, training wall s, policy)``, the policy its ``policy.pt2``."""
    result = ppo.main(args)
    path = Path(result["policy"])
    module = torch.export.load(path).module() if path.suffix == ".pt2" else torch.jit.load(str(path))

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.as_tensor(obs, dtype=torch.float32)).numpy()

    return int(result["global_step"]), float(result["train_wall_s"]), act


def _train_sb3(args: ppo.Args) -> tuple[int, float, Act]:
    """Train Stable-Baselines3's PPO in this process (:func:`sb3_kwargs`); ``(env steps, training wall s, policy)``,
    the policy ``predict(deterministic=True)`` on the frozen ``VecNormalize`` statistics."""
    import functools

    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    torch.set_num_threads(args.num_threads)
    kw = sb3_kwargs(args)
    normalize = kw.pop("normalize")
    inputs = network_inputs(args)
    venv = DummyVecEnv([functools.partial(make_single_env, args, None, inputs)] * args.num_envs)
    norm = VecNormalize(venv, **normalize) if normalize else None
    model = PPO("MlpPolicy", norm or venv, seed=args.seed, device="cpu", verbose=0, **kw)
    t0 = time.perf_counter()
    model.learn(total_timesteps=args.total_timesteps)
    wall = time.perf_counter() - t0
    venv.close()
    if norm is not None:
        norm.training = False

    def act(obs: np.ndarray) -> np.ndarray:
        x = obs if inputs is None else obs[:, inputs]
        if norm is not None:
            x = norm.normalize_obs(x)
        return model.predict(x, deterministic=True)[0]

    return int(model.num_timesteps), wall, act


def episode_returns(act: Act, args, episodes: int) -> list[float]:
    """Undiscounted returns of ``act`` over ``episodes`` episodes of a fresh single env (EVHub-v0: windows of
    :data:`EVAL_SPLIT`), reset with the seeds ``EVAL_SEED + i``."""
    env = make_single_env(args, EVAL_SPLIT)
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=EVAL_SEED + i)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs[None])[0])
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


def split_co2_kg(act: Act, args) -> float:
    """EVHub-v0: the site's CO2 (kg) over the whole :data:`EVAL_SPLIT` under ``act``
    (:func:`envs.kpis.evaluate_policy`)."""
    from envs import load_site
    from envs.kpis import evaluate_policy

    def policy(obs: torch.Tensor, env_) -> torch.Tensor:
        return torch.as_tensor(act(obs.cpu().numpy().astype(np.float32)), dtype=obs.dtype)

    row, _ = evaluate_policy(
        policy, load_site(args.site), EVAL_SPLIT, "ppo", args.action_mode, bess_action=args.bess_action
    )
    return float(row.co2_kg.iloc[0])


def run_one(
    library: Literal["ours", "sb3"],
    env_id: str,
    seed: int,
    scale: float = 1.0,
    eval_episodes: int = 10,
    out_dir: str | Path | None = None,
    overrides: dict | None = None,
) -> dict:
    """Train ``library``'s PPO on ``env_id`` in this process, evaluate it, and return the run's row (JSON-able):
    ``library, env_id, seed, num_envs, env_steps, train_wall_s, sps, eval_return, eval_return_std, eval_episodes,
    test_co2_kg`` (NaN but for EVHub-v0), ``peak_rss_mb, settings`` (:func:`settings_json`). ``overrides``: changes
    to the env's :data:`SETTINGS` (tests shrink the rollout with them).

    Raises:
        ValueError: an unknown library. KeyError: an env without :data:`SETTINGS`.
    """
    if library not in LIBRARIES:
        raise ValueError(f"unknown library {library!r}: expected one of {LIBRARIES}")
    run_dir = Path(out_dir or BENCH_DIR) / "runs" / f"ppo_vs_sb3_{env_id}_{library}_seed{seed}"
    args = ours_args(env_id, seed, scale, str(run_dir), overrides)
    steps, wall, act = (_train_ours if library == "ours" else _train_sb3)(args)
    returns = episode_returns(act, args, eval_episodes)
    return {
        "library": library,
        "env_id": env_id,
        "seed": seed,
        "num_envs": args.num_envs,
        "env_steps": steps,
        "train_wall_s": wall,
        "sps": steps / max(wall, 1e-9),
        "eval_return": float(np.mean(returns)),
        "eval_return_std": float(np.std(returns)),
        "eval_episodes": eval_episodes,
        "test_co2_kg": split_co2_kg(act, args) if is_evhub(env_id) else math.nan,
        "peak_rss_mb": peak_rss_mb(),
        "settings": settings_json(args),
    }


# ------------------------------------------------------------------------------------------- all runs
COLUMNS = (
    "library",
    "env_id",
    "seed",
    "num_envs",
    "env_steps",
    "train_wall_s",
    "sps",
    "eval_return",
    "eval_return_std",
    "eval_episodes",
    "test_co2_kg",
    "peak_rss_mb",
    "settings",
    "status",
    "machine",
)
"""Columns of the runs table, one row per (env, seed, library); ``status`` is ``ok`` or ``failed: ...``."""


def run(
    env_ids: Sequence[str] = tuple(SETTINGS),
    seeds: Sequence[int] = SEEDS,
    scale: float = 1.0,
    eval_episodes: int = 10,
    out_dir: str | Path | None = None,
    name: str = "ppo_vs_sb3",
    timeout_s: float = 900.0,
) -> pd.DataFrame:
    """Train and evaluate both libraries on every env and seed, one subprocess per run (ours and SB3 alternate, so a
    change of load on the machine falls on both), and write ``<out_dir>/<name>.parquet`` after every run.

    Returns:
        the runs table (:data:`COLUMNS`).

    Raises:
        ValueError: an env without :data:`SETTINGS`, no seeds, or ``eval_episodes < 1``.
    """
    unknown = [e for e in env_ids if e not in SETTINGS]
    if unknown or not seeds or eval_episodes < 1:
        raise ValueError(
            f"need envs among {list(SETTINGS)} (got {list(env_ids)}), at least one seed and eval_episodes >= 1"
        )
    out = Path(out_dir or BENCH_DIR)
    machine = json.dumps(machine_info("cpu"))
    rows: list[dict] = []
    for env_id in env_ids:
        for seed in seeds:
            for library in LIBRARIES:
                cmd = ["--one", library, "--env-id", env_id, "--seed", str(seed), "--scale", str(scale)]
                cmd += ["--eval-episodes", str(eval_episodes), "--out-dir", str(out)]
                t0 = time.perf_counter()
                base = {"library": library, "env_id": env_id, "seed": seed, "machine": machine}
                try:
                    res = run_worker("benchmarks.ppo_vs_sb3", cmd, timeout_s)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"[{env_id} {library} seed {seed}] failed: {exc}", flush=True)
                    rows.append(base | {"status": f"failed: {str(exc).splitlines()[0][:200]}"})
                else:
                    rows.append(base | res | {"status": "ok"})
                    print(
                        f"[{env_id} {library} seed {seed}] {res['env_steps']:,} steps in {res['train_wall_s']:.1f} s "
                        f"({res['sps']:,.0f} steps/s), eval return {res['eval_return']:.1f} "
                        f"({time.perf_counter() - t0:.0f} s in all)",
                        flush=True,
                    )
                save_table(runs_table(rows), name, out)
    return runs_table(rows)


def runs_table(rows: list[dict]) -> pd.DataFrame:
    """The runs table (:data:`COLUMNS`) of run rows (:func:`run_one`'s with ``status`` and ``machine``)."""
    df = pd.DataFrame(rows)
    for col in COLUMNS:
        if col not in df:
            df[col] = math.nan if col not in ("settings", "status", "machine") else ""
    return df[list(COLUMNS)]


def summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per env and library over the seeds that ran: ``env_id, library, seeds, env_steps, return_median, return_min,
    return_max, returns, sps_median, sps_list, sps_vs_sb3`` (ours' median steps/s over SB3's), ``sps_ratios`` (ours'
    steps/s over SB3's at each seed both ran: the two runs back to back, so a change of load on the machine falls less
    on one library) and ``sps_ratio_paired`` (their median), ``co2_median`` and ``verdict`` (ours' median return
    against SB3's range: ``within``, ``above`` or ``below``); the env's comparisons are on both of its rows."""
    rows = []
    ok = runs[runs.status == "ok"]
    for env_id in dict.fromkeys(runs.env_id):
        med_sps, ranges, by_seed = {}, {}, {}
        for library in LIBRARIES:
            r = ok[(ok.env_id == env_id) & (ok.library == library)].sort_values("seed")
            if r.empty:
                continue
            ret, sps = r.eval_return.tolist(), r.sps.tolist()
            med_sps[library] = statistics.median(sps)
            by_seed[library] = dict(zip(r.seed, sps))
            ranges[library] = (statistics.median(ret), min(ret), max(ret))
            rows.append(
                {
                    "env_id": env_id,
                    "library": library,
                    "seeds": ",".join(str(s) for s in r.seed),
                    "env_steps": float(r.env_steps.median()),
                    "return_median": ranges[library][0],
                    "return_min": ranges[library][1],
                    "return_max": ranges[library][2],
                    "returns": ret,
                    "sps_median": med_sps[library],
                    "sps_list": sps,
                    "co2_median": float(r.test_co2_kg.median()),
                }
            )
        ratio = med_sps["ours"] / med_sps["sb3"] if len(med_sps) == 2 else math.nan
        paired = [v / by_seed["sb3"][k] for k, v in by_seed.get("ours", {}).items() if k in by_seed.get("sb3", {})]
        verdict = ""
        if len(ranges) == 2:
            ours, (_, lo, hi) = ranges["ours"][0], ranges["sb3"]
            verdict = "within" if lo <= ours <= hi else ("above" if ours > hi else "below")
        for row in rows:
            if row["env_id"] == env_id:
                row.update(
                    sps_vs_sb3=ratio,
                    sps_ratios=paired,
                    sps_ratio_paired=statistics.median(paired) if paired else math.nan,
                    verdict=verdict,
                )
    return pd.DataFrame(rows)


def markdown(runs: pd.DataFrame) -> str:
    """Markdown table of :func:`summary` of a :func:`run` table (returns undiscounted, steps/s in env steps per
    second of training, CO2 in kg), one line per env with the verdict, and the runs that failed."""
    s = summary(runs)
    if s.empty:
        return "\n".join(f"- {r.env_id} {r.library} seed {r.seed}: {r.status}" for r in runs.itertuples())
    lines = [
        "| env | library | seeds | env steps | return, median | return, min to max | return per seed | steps/s, median "
        "| steps/s per seed | steps/s ours ÷ SB3 | test CO2 kg, median |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s.itertuples():
        lines.append(
            f"| {r.env_id} | {r.library} | {r.seeds} | {fmt_num(r.env_steps, ',.0f')} | "
            f"{fmt_num(r.return_median, '.1f')} | {r.return_min:.1f} to {r.return_max:.1f} | "
            f"{', '.join(f'{v:.1f}' for v in r.returns)} | {fmt_num(r.sps_median, ',.0f')} | "
            f"{', '.join(f'{v:,.0f}' for v in r.sps_list)} | {fmt_num(r.sps_vs_sb3, '.2f')} | "
            f"{fmt_num(r.co2_median, '.1f')} |"
        )
    lines.append("")
    for env_id, r in s.groupby("env_id", sort=False):
        if len(r) == 2:
            ours, sb3 = r[r.library == "ours"].iloc[0], r[r.library == "sb3"].iloc[0]
            lines.append(
                f"- {env_id}: our median return {ours.return_median:.1f} is {ours.verdict} SB3's range "
                f"({sb3.return_min:.1f} to {sb3.return_max:.1f}); our median steps/s {ours.sps_vs_sb3:.2f}x SB3's; "
                f"ours ÷ SB3 seed by seed {', '.join(f'{v:.2f}' for v in ours.sps_ratios)} (median "
                f"{ours.sps_ratio_paired:.2f})"
            )
    for r in runs[runs.status != "ok"].itertuples():
        lines.append(f"- {r.env_id} {r.library} seed {r.seed}: {r.status}")
    return "\n".join(lines)


@dataclass
class Args:
    """Our PPO against Stable-Baselines3's PPO, configured alike, on Pendulum-v1 and EVHub-v0: the final
    deterministic return and the training steps/s side by side (medians over the seeds)."""

    env_ids: tuple[str, ...] = tuple(SETTINGS)
    """envs to compare on: Pendulum-v1, EVHub-v0"""
    seeds: tuple[int, ...] = SEEDS
    """training seeds; each runs both libraries"""
    scale: float = 1.0
    """multiplies every env's training steps (rounded to whole rollouts, at least one)"""
    eval_episodes: int = 10
    """deterministic evaluation episodes per run"""
    quick: bool = False
    """a smoke run: seed 1, one rollout per run, 2 evaluation episodes, written to ppo_vs_sb3_quick.parquet"""
    out_dir: str | None = None
    """folder of the Parquet table and our runs' folders (None: outputs/bench)"""
    timeout_s: float = 900.0
    """wall limit of one run, seconds"""
    one: Literal["ours", "sb3"] | None = None
    """(internal) run only this library on --env-id and --seed in this process and print its row as JSON"""
    env_id: str = "Pendulum-v1"
    """(internal, with --one) the env"""
    seed: int = 1
    """(internal, with --one) the seed"""


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    if args.one:
        res = run_one(args.one, args.env_id, args.seed, args.scale, args.eval_episodes, args.out_dir)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return
    if args.quick:
        args = dataclasses.replace(args, seeds=(1,), scale=1e-6, eval_episodes=2)
    name = "ppo_vs_sb3_quick" if args.quick else "ppo_vs_sb3"
    runs = run(args.env_ids, args.seeds, args.scale, args.eval_episodes, args.out_dir, name, args.timeout_s)
    print(markdown(runs))


if __name__ == "__main__":
    main()
