"""Training throughput and time to quality: our PPO and SAC against Stable-Baselines3's, on EVHub-v0.

Every configuration trains in its own subprocess (so peak memory is its own) on a site's train split (``--site``,
default caltech), with the BESS action ``surplus`` for both libraries, and evaluates its deterministic policy on the
test split at regular env-step intervals. The training clock leaves those evaluations out. Measured per
configuration:

- ``sps``: env steps per second of training (steps / training wall time, evaluations left out), and
  ``sps_steady``: the same over the second half of the iterations (past compilation; SB3: equal to ``sps``);
- ``time_to_target_s``: training wall time (s) until the test-split CO2 first reaches
  ``target_share`` (default 50%) of the oracle's CO2 saving over the uncontrolled site, that is
  ``co2 <= uncontrolled - share * (uncontrolled - oracle)``; NaN if never reached within the budget;
- ``peak_rss_mb`` (MiB, the training process; SB3's SubprocVecEnv workers not included) and
  ``cuda_peak_mb`` (MiB allocated by torch, CUDA only).

Configurations (:data:`CONFIGS`): ``study`` uses the settings of the Stable-Baselines3 study this project replaces (PPO:
8 envs in subprocesses, n_steps 512, batch 256, 10 epochs, [256, 256] networks; SAC: batch 256, 1 env, [256, 256]);
``preset`` is our script's own device preset; ``gpu_max`` is our PPO or SAC sized for throughput on a GPU (tens of
thousands of envs, CUDA graphs). Hyperparameters not named here are each library's defaults.

Run: ``python -m benchmarks.training --help``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import torch

from algos import harness
from benchmarks.common import (
    BENCH_DIR,
    RESULT_PREFIX,
    cuda_peak_mb,
    fmt_num,
    machine_info,
    peak_rss_mb,
    resolve_device,
    run_worker,
    save_table,
)


@dataclass(frozen=True)
class Config:
    """One training benchmark run.

    Attributes:
        name: unique name, ``<library>_<algo>_<settings>``.
        library: ``"ours"`` (``algos/<algo>.py``) or ``"sb3"`` (Stable-Baselines3).
        algo: ``"ppo"`` or ``"sac"``.
        settings: ``"study"``, ``"preset"`` or ``"gpu_max"`` (see the module docstring).
        devices: devices the configuration runs on (``"cpu"``, ``"cuda"``).
        args: command-line overrides of our script (ours only).
    """

    name: str
    library: Literal["ours", "sb3"]
    algo: Literal["ppo", "sac"]
    settings: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    args: tuple[str, ...] = ()


STUDY_PPO = (
    "--num-envs",
    "8",
    "--num-steps",
    "512",
    "--num-minibatches",
    "16",
    "--update-epochs",
    "10",
    "--hidden-size",
    "256",
)
STUDY_SAC = (
    "--num-envs",
    "1",
    "--batch-size",
    "256",
    "--hidden-size",
    "256",
    "--gradient-steps",
    "1",
    "--learning-starts",
    "5000",
)

CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("sb3_ppo_study", "sb3", "ppo", "study", ("cpu",)),
        Config("ours_ppo_study", "ours", "ppo", "study", ("cpu",), STUDY_PPO),
        Config("ours_ppo_preset", "ours", "ppo", "preset"),
        Config(
            "ours_ppo_gpu_max",
            "ours",
            "ppo",
            "gpu_max",
            ("cuda",),
            (
                "--num-envs",
                "32768",
                "--num-steps",
                "32",
                "--num-minibatches",
                "4",
                "--update-epochs",
                "2",
                "--compile",
                "--cudagraphs",
            ),
        ),
        Config("sb3_sac_study", "sb3", "sac", "study", ("cpu", "cuda")),
        Config("ours_sac_study", "ours", "sac", "study", ("cpu",), STUDY_SAC),
        Config("ours_sac_preset", "ours", "sac", "preset"),
        Config(
            "ours_sac_gpu_max",
            "ours",
            "sac",
            "gpu_max",
            ("cuda",),
            (
                "--num-envs",
                "8192",
                "--batch-size",
                "4096",
                "--gradient-steps",
                "1",
                "--buffer-size",
                "4000000",
                "--learning-starts",
                "81920",
                "--compile",
                "--cudagraphs",
            ),
        ),
    )
}
"""The benchmark's configurations by name."""


def reference_co2(site: str = "caltech", split: str = "test") -> dict[str, float]:
    """Uncontrolled and oracle CO2 (kg) of ``split``: ``{"uncontrolled_kg", "oracle_kg"}``.

    Simulates the uncontrolled site and solves the perfect-foresight LP (HiGHS), as the pipeline does.
    """
    from envs import load_site
    from envs.kpis import evaluate_policy
    from pipeline.control.baselines import uncontrolled
    from pipeline.control.oracle import solve_oracle

    s = load_site(site)
    unc, _ = evaluate_policy(uncontrolled, s, split, "uncontrolled")
    oracle, _ = solve_oracle(s, split)
    return {"uncontrolled_kg": float(unc.co2_kg.iloc[0]), "oracle_kg": float(oracle.co2_kg.iloc[0])}


# ------------------------------------------------------------------------------------------- one run
def _run_ours(
    cfg: Config, device: str, budget_steps: int, eval_every_steps: int, seed: int, out: Path, site: str
) -> pd.DataFrame:
    """Train our script on ``site`` in this process; returns its eval curve (global_step, train_wall_s, co2_kg)."""
    import importlib

    module = importlib.import_module(f"algos.{cfg.algo}")
    argv = [
        *cfg.args,
        "--seed",
        str(seed),
        "--total-timesteps",
        str(budget_steps),
        "--output-dir",
        str(out),
        "--checkpoint-every",
        "0",
        "--site",
        site,
        "--cuda" if device == "cuda" else "--no-cuda",
    ]
    args = harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, argv)
    sized = args  # the preset's values are the parsed defaults
    per_iteration = sized.num_envs * getattr(sized, "num_steps", 1)  # env steps per iteration
    args = dataclasses.replace(args, eval_every=max(1, eval_every_steps // max(per_iteration, 1)))
    result = module.main(args)
    curve = pd.read_parquet(out / "eval_curve.parquet")
    curve.attrs["sps"] = result["sps"]
    curve.attrs["sps_steady"] = result["sps_steady"]
    curve.attrs["train_wall_s"] = result["train_wall_s"]
    curve.attrs["env_steps"] = result["global_step"]
    curve.attrs["num_envs"] = result["num_envs"]  # after any out-of-memory halving, as trained
    return curve


def _run_sb3(
    cfg: Config, device: str, budget_steps: int, budget_s: float, eval_every_steps: int, seed: int, site_name: str
) -> pd.DataFrame:
    """Train Stable-Baselines3 on ``site_name`` in this process; returns its eval curve (global_step, train_wall_s,
    co2_kg)."""
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    from envs import load_site
    from envs.evhub import EVHubEnv
    from envs.kpis import evaluate_policy

    site = load_site(site_name)

    def make_env():
        torch.set_num_threads(1)
        return EVHubEnv(site=site_name, bess_action="surplus")

    rows: list[dict] = []

    class EvalCallback(BaseCallback):
        """Evaluates every ``eval_every_steps`` env steps; stops after ``budget_s`` of training."""

        def _on_training_start(self) -> None:
            self.t0, self.paused, self.next_eval = time.perf_counter(), 0.0, eval_every_steps

        def train_wall(self) -> float:
            return time.perf_counter() - self.t0 - self.paused

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next_eval:
                self.next_eval += eval_every_steps
                self.evaluate()
            return self.train_wall() < budget_s

        def _on_training_end(self) -> None:
            if not rows or rows[-1]["global_step"] != self.num_timesteps:
                self.evaluate()

        def evaluate(self) -> None:
            t = time.perf_counter()
            wall = t - self.t0 - self.paused
            model = self.model

            def policy(obs: torch.Tensor, env_) -> torch.Tensor:
                action, _ = model.predict(obs.cpu().numpy().astype(np.float32), deterministic=True)
                return torch.as_tensor(action, dtype=obs.dtype)

            row, _ = evaluate_policy(policy, site, "test", cfg.name, "hub", bess_action="surplus")
            rows.append(
                {
                    "global_step": int(self.num_timesteps),
                    "train_wall_s": wall,
                    "co2_kg": float(row.co2_kg.iloc[0]),
                    "unserved_kwh": float(row.unserved_kwh.iloc[0]),
                }
            )
            self.paused += time.perf_counter() - t

    cb = EvalCallback()
    if cfg.algo == "ppo":
        venv = SubprocVecEnv([make_env] * 8, start_method="forkserver")
        model = PPO(
            "MlpPolicy",
            venv,
            n_steps=512,
            batch_size=256,
            n_epochs=10,
            policy_kwargs={"net_arch": [256, 256]},
            seed=seed,
            device="cpu",
            verbose=0,
        )  # SB3 runs MLP PPO on the CPU (its own advice)
        num_envs = 8
    else:
        venv = DummyVecEnv([make_env])
        model = SAC(
            "MlpPolicy",
            venv,
            batch_size=256,
            learning_starts=5000,
            policy_kwargs={"net_arch": [256, 256]},
            seed=seed,
            device=device,
            verbose=0,
        )
        num_envs = 1
    try:
        model.learn(total_timesteps=budget_steps, callback=cb)
    finally:
        venv.close()
    curve = pd.DataFrame(rows)
    wall = cb.train_wall()
    sps = model.num_timesteps / max(wall, 1e-9)
    curve.attrs.update(sps=sps, sps_steady=sps, train_wall_s=wall, env_steps=model.num_timesteps, num_envs=num_envs)
    return curve


def run_one(
    name: str,
    device: str,
    budget_steps: int,
    budget_s: float,
    eval_every_steps: int,
    seed: int,
    out_dir: Path,
    site: str = "caltech",
) -> dict:
    """Run configuration ``name`` on ``site`` (a shipped site's name or a site TOML's path) in this process and return
    its summary (JSON-able) with its eval curve.

    Raises:
        KeyError: unknown configuration name.
    """
    cfg = CONFIGS[name]
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    run_dir = out_dir / "runs" / f"{name}_{device}"
    if cfg.library == "ours":
        curve = _run_ours(cfg, device, budget_steps, eval_every_steps, seed, run_dir, site)
    else:
        curve = _run_sb3(cfg, device, budget_steps, budget_s, eval_every_steps, seed, site)
    return {
        "config": name,
        **{k: float(v) for k, v in curve.attrs.items()},
        "peak_rss_mb": peak_rss_mb(),
        "cuda_peak_mb": cuda_peak_mb(dev),
        "curve": curve[["global_step", "train_wall_s", "co2_kg"]].to_dict("list"),
    }


# ------------------------------------------------------------------------------------------- all runs
BUDGETS = {
    # (env steps, training seconds for SB3, eval every N env steps) per settings x device
    ("study", "ppo", "cpu"): (200_000, 150.0, 12_288),
    ("preset", "ppo", "cpu"): (1_500_000, 600.0, 107_520),
    ("study", "sac", "cpu"): (25_000, 100.0, 2_500),
    ("preset", "sac", "cpu"): (100_000, 600.0, 8_192),
    ("study", "ppo", "cuda"): (200_000, 150.0, 12_288),
    ("preset", "ppo", "cuda"): (20_000_000, 600.0, 2_752_512),
    ("gpu_max", "ppo", "cuda"): (50_000_000, 600.0, 8_388_608),
    ("study", "sac", "cuda"): (25_000, 100.0, 2_500),
    ("preset", "sac", "cuda"): (300_000, 600.0, 25_600),
    ("gpu_max", "sac", "cuda"): (20_000_000, 600.0, 4_096_000),
}
"""Default ``(env steps, SB3 training seconds, eval every N env steps)`` per (settings, algo, device)."""


def time_to_target(curve: pd.DataFrame, target_kg: float) -> tuple[float, float]:
    """``(train wall s, env steps)`` at the first evaluation with ``co2_kg <= target_kg``; NaNs if none."""
    hit = curve[curve.co2_kg <= target_kg]
    if hit.empty:
        return math.nan, math.nan
    return float(hit.train_wall_s.iloc[0]), float(hit.global_step.iloc[0])


def run(
    configs: Sequence[str] | None = None,
    device: str = "cpu",
    seed: int = 1,
    target_share: float = 0.5,
    scale: float = 1.0,
    out_dir: str | Path | None = None,
    timeout_s: float = 1200.0,
    reference: dict[str, float] | None = None,
    site: str = "caltech",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the training benchmark, one subprocess per configuration, and write its tables.

    Args:
        configs: names from :data:`CONFIGS` (default: every one that runs on ``device``).
        device: ``"cpu"`` or ``"cuda"`` (our agents and the env; SB3's PPO always uses the CPU).
        seed: training seed of every run.
        target_share: share of the oracle's test-split CO2 saving that defines "quality" (0.5 = 50%).
        scale: multiplies every budget of :data:`BUDGETS` (tests use a tiny one).
        out_dir: folder of ``training.parquet`` and ``training_curves.parquet`` (default ``outputs/bench``).
        timeout_s: wall limit of one configuration's subprocess.
        reference: ``{"uncontrolled_kg", "oracle_kg"}`` of the test split (default: :func:`reference_co2` of
            ``site``).
        site: a shipped site's name or a site TOML's path, the site every configuration trains and evaluates on.

    Returns:
        ``(summary, curves)``: one summary row per configuration (``config, library, algo, settings,
        device, num_envs, env_steps, train_wall_s, sps, sps_steady, sps_vs_sb3, target_co2_kg, time_to_target_s,
        steps_to_target, best_co2_kg, final_co2_kg, peak_rss_mb, cuda_peak_mb, status``) and the
        evaluation curves (``config, device, global_step, train_wall_s, co2_kg``).

    Raises:
        ValueError: unknown configuration, a configuration that does not run on ``device``, or CUDA
            requested without it.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    names = list(configs) if configs else [n for n, c in CONFIGS.items() if device in c.devices]
    for n in names:
        if n not in CONFIGS:
            raise ValueError(f"unknown training benchmark config {n!r}: known are {list(CONFIGS)}")
        if device not in CONFIGS[n].devices:
            raise ValueError(f"config {n!r} does not run on {device!r} (only {CONFIGS[n].devices})")
    out = Path(out_dir or BENCH_DIR)
    ref = reference or reference_co2(site)
    target = ref["uncontrolled_kg"] - target_share * (ref["uncontrolled_kg"] - ref["oracle_kg"])
    print(
        f"training benchmark on {device}: target test CO2 <= {target:.1f} kg ({target_share:.0%} of the oracle's "
        f"saving; uncontrolled {ref['uncontrolled_kg']:.1f}, oracle {ref['oracle_kg']:.1f})",
        flush=True,
    )
    rows, curves = [], []
    for n in names:
        cfg = CONFIGS[n]
        steps, secs, every = BUDGETS[(cfg.settings, cfg.algo, device)]
        steps, secs, every = max(int(steps * scale), 1), secs * scale, max(int(every * scale), 1)
        cmd = ["--one", n, "--device", device, "--seed", str(seed), "--budget-steps", str(steps), "--budget-s"]
        cmd += [str(secs), "--eval-every-steps", str(every), "--out-dir", str(out), "--site", site]
        print(
            f"[{n} on {device}] {steps:,} env steps (SB3: at most {secs:.0f} s of training), evaluation every "
            f"{every:,} steps",
            flush=True,
        )
        t0 = time.perf_counter()
        base = {"config": n, "library": cfg.library, "algo": cfg.algo, "settings": cfg.settings, "device": device}
        try:
            res = run_worker("benchmarks.training", cmd, timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"[{n}] failed: {exc}", flush=True)
            rows.append(base | {"status": f"failed: {str(exc).splitlines()[0][:200]}"})
            _save(rows, curves, device, out)
            continue
        curve = pd.DataFrame(res.pop("curve"))
        curves.append(curve.assign(config=n, device=device))
        rows.append(base | _summary_row(res, curve, target))
        r, tt_s = rows[-1], rows[-1]["time_to_target_s"]
        reached = f"{tt_s:.1f} s" if math.isfinite(tt_s) else "not reached"
        _save(rows, curves, device, out)
        print(
            f"[{n}] {r['env_steps']:,.0f} steps, {r['sps']:,.0f} SPS, target {reached}, best CO2 "
            f"{r['best_co2_kg']:.1f} kg ({time.perf_counter() - t0:.0f} s with evaluations)",
            flush=True,
        )
    return _save(rows, curves, device, out)


def _summary_row(res: dict, curve: pd.DataFrame, target: float) -> dict:
    """A run's summary columns (:func:`run`) from its worker's result ``res`` and evaluation ``curve``, for the test
    CO2 ``target`` (kg)."""
    tt_s, tt_steps = time_to_target(curve, target)
    kept = ("num_envs", "env_steps", "train_wall_s", "sps", "sps_steady", "peak_rss_mb", "cuda_peak_mb")
    return {k: res[k] for k in kept} | {
        "target_co2_kg": target,
        "time_to_target_s": tt_s,
        "steps_to_target": tt_steps,
        "best_co2_kg": float(curve.co2_kg.min()),
        "final_co2_kg": float(curve.co2_kg.iloc[-1]),
        "status": "ok",
    }


def _save(rows: list[dict], curves: list[pd.DataFrame], device: str, out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Summary and curves tables of the runs so far, written to ``out`` (after every run, so a killed
    benchmark keeps what it measured)."""
    summary = pd.DataFrame(rows)
    for col in (
        "num_envs",
        "env_steps",
        "train_wall_s",
        "sps",
        "sps_steady",
        "peak_rss_mb",
        "cuda_peak_mb",
        "target_co2_kg",
        "time_to_target_s",
        "steps_to_target",
        "best_co2_kg",
        "final_co2_kg",
    ):
        if col not in summary:
            summary[col] = math.nan
    sb3 = {r.algo: r.sps for r in summary.itertuples() if r.library == "sb3" and r.status == "ok"}
    summary["sps_vs_sb3"] = [r.sps / sb3[r.algo] if r.algo in sb3 else math.nan for r in summary.itertuples()]
    summary["machine"] = json.dumps(machine_info(device))
    curves_df = (
        pd.concat(curves, ignore_index=True)
        if curves
        else pd.DataFrame(columns=["global_step", "train_wall_s", "co2_kg", "config", "device"])
    )
    suffix = "" if device == "cpu" else f"_{device}"
    save_table(summary, f"training{suffix}", out)
    save_table(curves_df, f"training_curves{suffix}", out)
    return summary, curves_df


def markdown(summary: pd.DataFrame) -> str:
    """Markdown table of a :func:`run` summary (SPS in env steps per second, times in s, CO2 in kg, memory in MiB)."""
    head = (
        "| config | device | envs | env steps | SPS | SPS steady | ours ÷ SB3 | time to target s | steps to target | "
        "best CO2 kg | peak RSS MiB | CUDA peak MiB | status |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )

    lines = [head]
    for r in summary.itertuples():
        tt = fmt_num(r.time_to_target_s, ".1f") or ("not reached" if r.status == "ok" else "")
        lines.append(
            f"| {r.config} | {r.device} | {fmt_num(r.num_envs, '.0f')} | {fmt_num(r.env_steps, ',.0f')} | "
            f"{fmt_num(r.sps, ',.0f')} | {fmt_num(r.sps_steady, ',.0f')} | {fmt_num(r.sps_vs_sb3, '.1f')} | {tt} | "
            f"{fmt_num(r.steps_to_target, ',.0f')} | {fmt_num(r.best_co2_kg, '.1f')} | {fmt_num(r.peak_rss_mb, '.0f')} "
            f"| {fmt_num(r.cuda_peak_mb, '.0f')} | {r.status} |"
        )
    return "\n".join(lines)


@dataclass
class Args:
    """Training throughput and time to quality: our PPO/SAC against Stable-Baselines3's on EVHub-v0."""

    configs: tuple[str, ...] = ()
    """configurations to run (default: all that run on the device): sb3_ppo_study, ours_ppo_study, ours_ppo_preset,
    ours_ppo_gpu_max, sb3_sac_study, ours_sac_study, ours_sac_preset"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """device of our agents and the env ('auto': cuda when available); SB3's PPO always runs on the CPU"""
    seed: int = 1
    """training seed of every run"""
    target_share: float = 0.5
    """share of the oracle's test-split CO2 saving that counts as reaching quality"""
    scale: float = 1.0
    """multiplies every env-step and time budget (0.01 for a quick check)"""
    out_dir: str | None = None
    """folder of the Parquet tables (None: outputs/bench)"""
    timeout_s: float = 1200.0
    """wall limit of one configuration, seconds"""
    site: str = "caltech"
    """the site every configuration trains and evaluates on: a shipped site's name or a site TOML's path"""
    one: str | None = None
    """(internal) run only this configuration in this process and print its result as JSON"""
    budget_steps: int = 0
    """(internal, with --one) env steps of the run"""
    budget_s: float = 0.0
    """(internal, with --one) training seconds of an SB3 run"""
    eval_every_steps: int = 0
    """(internal, with --one) env steps between evaluations"""


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    device = resolve_device(args.device)
    if args.one:
        res = run_one(
            args.one,
            device,
            args.budget_steps,
            args.budget_s,
            args.eval_every_steps,
            args.seed,
            Path(args.out_dir or BENCH_DIR),
            args.site,
        )
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return
    summary, _ = run(
        args.configs or None,
        device,
        args.seed,
        args.target_share,
        args.scale,
        args.out_dir,
        args.timeout_s,
        site=args.site,
    )
    print(markdown(summary))


if __name__ == "__main__":
    main()
