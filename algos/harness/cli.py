"""The command line and the set-up of a run: :class:`RunArgs` (the fields every script has), the presets chosen before
parsing (:func:`cli`, :func:`preset_args`, :func:`script`), the run folder, the seeds and switches (:func:`setup`) and
the script's vector env (:func:`make_env`, :func:`network_inputs`)."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
import tyro

import envs
from envs import timestep
from envs.errors import InputError, is_expected, json_object, one_message
from envs.evhub import DEFAULT_BESS_ACTION
from envs.vector import EVHUB_ID, RecordEpisodeStatistics, env_name, is_evhub, make_vec

from .checkpoint import CheckpointError
from .speed import use_compile_cache

EVHUB_ONLY_ARGS = (
    "site",
    "train_split",
    "train_window_end",
    "action_mode",
    "bess_action",
    "socket_features",
    "weekday_features",
    "context_features",
    "dc_prior",
    "exo_prior",
    "eval_split",
    "eval_every",
)
"""Arguments that only EVHub-v0 reads: left out of the printed and logged hyperparameters of other envs."""


# ---------------------------------------------------------------------------------------------- arguments
@dataclass
class RunArgs:
    """The fields every script has; an algorithm's ``Args`` subclasses it and adds its own (and gives ``exp_name``,
    ``log_every`` and ``checkpoint_every`` its own defaults)."""

    exp_name: str = ""
    """the name of this experiment (part of the default output folder; empty: the script's name)"""
    seed: int = 1
    """seed of the experiment (Python, NumPy, torch and the env's random draws)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    deterministic_algorithms: bool = False
    """bitwise-reproducible CUDA runs (slower): `torch.use_deterministic_algorithms(True)` and
    `CUBLAS_WORKSPACE_CONFIG=:4096:8`; an op without a deterministic CUDA kernel then stops the run with PyTorch's
    error. CPU runs repeat exactly without it"""
    cuda: bool = True
    """if toggled, use CUDA when it is available (agent and env on the same device)"""
    preset: Literal["auto", "cpu", "gpu"] = "auto"
    """size preset ('auto': 'gpu' on CUDA, 'cpu' otherwise); chosen before the other flags are read, so --help and
    the printed table show its values, and any flag overrides them"""
    env_id: str = EVHUB_ID
    """the id of the environment: EVHub-v0 (the site), Snake-v0, or any registered gymnasium id (a user's own too as
    'module:EnvId-v0'); the site options apply to EVHub-v0 only"""
    env_kwargs: str = ""
    """keyword arguments for the env's constructor, as a JSON object ('{"g": 9.81}') or key=value pairs separated by
    commas ('g=9.81,render_mode=rgb_array'; each value read as JSON where it parses, else as a string); recorded in
    the run's config.json and taken from there by --resume when not given"""
    vector_mode: Literal["sync", "async"] = "sync"
    """how a gymnasium env without a torch vector entry point is vectorised: 'sync' (one process) or 'async' (one
    worker process per env, for CPU- or I/O-bound envs; falls back to sync with a warning if the workers cannot
    start); ignored for the torch-batched envs (EVHub-v0, Snake-v0)"""
    site: str = "caltech"
    """site to train on (EVHub-v0 only): a shipped site name or a path to a site TOML file"""
    train_split: str = "train"
    """split the training windows are drawn from (EVHub-v0 only)"""
    train_window_end: int = 0
    """training windows end before this step of train_split (0: anywhere in it; EVHub-v0 only): training on a
    split's realised past, as the online learners do (pipeline/control/online.py)"""
    bess_action: Literal["surplus", "setpoint"] = DEFAULT_BESS_ACTION
    """meaning of the BESS action (EVHub-v0 only): 'surplus' (the PV surplus is always stored; -1 = cover the
    deficit, the self-consumption rule; 0 = hold at a deficit; +1 = charge at full power) or 'setpoint' (a_bess
    times the BESS power limit)"""
    socket_features: bool = True
    """feed the per-socket observations to the networks (False: only the site-level features); EVHub-v0 only"""
    weekday_features: bool = False
    """feed the day-of-week features (sin/cos) to the networks (EVHub-v0 only; off: the policy reads the EV demand
    from the sockets instead of learning the weekday pattern of the training year, which transfers worse)"""
    context_features: bool = False
    """feed the context features to the networks (EVHub-v0 only; envs/context.py): the EV energy expected per socket
    group over the next 1-6 and 7-24 h from the acting split's last 21 same-type days, and the MOER at 3-5 h from the
    last week's same hours (off: the networks read what they always read)"""
    dc_prior: bool = False
    """training windows also draw sessions at the DC sockets from a prior of public DC fast-charging figures (EVHub-v0
    only; envs/context.py): for a training split whose DC charger has no sessions"""
    exo_prior: bool = False
    """training windows see the MOER (level and contrast) and the PV scaled by per-window factors drawn within the
    training steps' month-to-month spread (EVHub-v0 only; envs/context.py): other years' carbon and weather"""
    compile: bool = False
    """torch.compile the hot functions"""
    cudagraphs: bool = False
    """capture the hot functions in CUDA graphs (capturable optimizers, device-tensor learning rates); needs CUDA"""
    amp: bool = False
    """bf16 autocast of the network forward passes (CUDA or CPU)"""
    compile_cache: str = "outputs/compile_cache"
    """with --compile: the folder of the persistent compile cache (Inductor's FX graph and AOTAutograd caches, Triton's
    kernels), shared by every script and run: a graph compiled once is loaded from it afterwards; "" keeps torch's
    default under the system's temporary folder"""
    num_threads: int = 1
    """torch intra-op CPU threads, 0 keeps torch's default (cpu presets: 1, the tensors of a few hundred envs and these
    small nets gain nothing from more, and spinning threads cost a lot on a busy machine; gpu presets: 0)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_{action_mode}_seed{seed} for EVHub-v0,
    outputs/runs/{exp_name}_{env_id}_seed{seed} otherwise)"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (networks, optimizers, counters, RNG and env state)"""
    init_from: str | None = None
    """fine-tune: start the networks (their observation statistics included) from this checkpoint.pt, or a run
    folder's, of the same algorithm and env; optimizers, counters, the env and the replay buffer start afresh
    (--resume wins)"""
    log_every: int = 1
    """iterations between host reads of the statistics (TensorBoard, metrics.parquet, the progress bar)"""
    checkpoint_every: int = 0
    """iterations between checkpoints (0: only at the end)"""
    eval_split: str = "test"
    """split for the final deterministic evaluation ('none' skips it); EVHub-v0 only"""
    eval_every: int = 0
    """iterations between deterministic evaluations on eval_split during training (0: only the final one; EVHub-v0
    only); each is logged as eval/co2_kg etc. and added to eval_curve.parquet with the training wall time so far"""
    max_wall_s: float = 0.0
    """stop training after this many seconds of wall time (0: no limit); like SIGINT (Ctrl-C) and SIGTERM, the run
    stops after the iteration in progress, writes its checkpoint and exports its policy (--resume continues it)"""
    eval_episodes: int = 0
    """after training, run the deterministic policy for this many episodes of the env (gymnasium's
    RecordEpisodeStatistics) and log their return, mean and std (eval_episodes.parquet, TensorBoard eval/*); not for
    EVHub-v0, evaluated on eval_split instead; 0: none"""
    max_oom_retries: int = 3
    """shrinks allowed after CUDA out-of-memory errors (the algorithm's rule: fewer envs or a smaller batch); each
    re-enters training from the live state and trains on to total_timesteps; one more error stops the run with
    OutOfMemoryBackoffError, its last checkpoint kept (0: stop at the first)"""


def _pre_parse(argv: list[str]) -> dict[str, str]:
    """The values of ``--preset``, ``--env-id``, ``--cuda`` / ``--no-cuda`` in ``argv`` (needed to choose the
    defaults before tyro parses the rest)."""
    found: dict[str, str] = {}
    for i, token in enumerate(argv):
        for flag in ("--preset", "--env-id", "--env_id"):
            if token == flag and i + 1 < len(argv):
                found[flag.lstrip("-").replace("-", "_")] = argv[i + 1]
            elif token.startswith(flag + "="):
                found[flag.lstrip("-").replace("-", "_")] = token.split("=", 1)[1]
        if token in ("--no-cuda", "--cuda"):
            found["cuda"] = token
    return found


def preset_name(preset: str, cuda: bool = True) -> str:
    """``'auto'`` -> ``'gpu'`` where CUDA is available and wanted, else ``'cpu'``; other names as they are."""
    if preset != "auto":
        return preset
    return "gpu" if cuda and torch.cuda.is_available() else "cpu"


def preset_args(args_cls, presets: dict, env_defaults: dict, **overrides) -> Any:
    """An ``Args`` instance: the dataclass defaults, then ``presets[<preset>]``, then ``env_defaults[<env>]`` and
    ``env_defaults["<env>/<preset>"]``, then ``overrides``. ``preset`` (``'auto'`` resolved by :func:`preset_name`)
    and ``env_id`` are taken from ``overrides``.

    Raises:
        ValueError: an unknown preset.
    """
    name = preset_name(overrides.get("preset", "auto"), overrides.get("cuda", True))
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}: expected auto or one of {', '.join(presets)}")
    values = {**presets[name], **env_own_defaults(env_defaults, overrides.get("env_id", EVHUB_ID), name), **overrides}
    return args_cls(**{**values, "preset": name})


def env_own_defaults(env_defaults: dict, env_id: str, preset: str) -> dict:
    """``env_defaults[<env>]`` (``env_defaults["*"]``, where given, for an env without an entry of its own) with
    ``env_defaults["<env>/<preset>"]`` on top."""
    env = env_name(env_id)
    return {**env_defaults.get(env, env_defaults.get("*", {})), **env_defaults.get(f"{env}/{preset}", {})}


def cli(args_cls, presets: dict, env_defaults: dict, argv: list[str] | None = None, description: str | None = None):
    """Parse the command line into ``args_cls`` with :func:`preset_args`'s defaults for the preset and env named on it
    (so ``--help`` shows the values in use)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = _pre_parse(argv)
    chosen = {"preset": pre.get("preset", "auto"), "cuda": pre.get("cuda") != "--no-cuda"}
    if "env_id" in pre:
        chosen["env_id"] = pre["env_id"]
    try:
        default = preset_args(args_cls, presets, env_defaults, **chosen)
    except ValueError:  # an unknown preset: let tyro print its error and the choices
        default = None
    return tyro.cli(args_cls, args=argv, default=default, description=description)


def script(main: Callable, args_cls, presets: dict, env_defaults: dict, description: str | None = None) -> None:
    """A script's ``__main__``: parse the command line (:func:`cli`) and run ``main``. A checkpoint that cannot be
    resumed from, an unknown env id (gymnasium's error), or an expected error (:func:`envs.errors.is_expected`: an
    env's space the script cannot drive, a constructor's refused ``--env-kwargs``, a bad site) ends the process with
    its message (exit status 2), not a traceback; a run stopped by SIGINT or SIGTERM exits with ``128 + signal``
    after saving (:meth:`Run.iterations`)."""
    args = cli(args_cls, presets, env_defaults, description=description)
    try:
        out = main(args)
    except Exception as exc:  # noqa: BLE001 - only the expected kinds are caught, the others re-raised
        if not (isinstance(exc, (CheckpointError, gym.error.Error)) or is_expected(exc)):
            raise
        print(f"error: {one_message(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    signum = (out or {}).get("stopped_by_signal") if isinstance(out, dict) else None
    if signum:
        raise SystemExit(128 + int(signum))


def env_kwargs_of(text: str) -> dict[str, Any]:
    """``--env-kwargs`` as a dict: a JSON object, or ``key=value`` pairs separated by commas (each value JSON where it
    parses, else the string); ``""`` gives ``{}``.

    Raises:
        InputError: JSON that is not an object, or a pair without ``=``.
    """
    text = text.strip()
    if not text:
        return {}
    if text[0] in '{["':  # JSON
        return json_object(text, f"--env-kwargs {text!r}")
    out: dict[str, Any] = {}
    for pair in text.split(","):
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--env-kwargs: {pair!r} is not key=value (give a JSON object or key=value,key=value)")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def presets_table(presets: dict, env_defaults: dict, args) -> str:
    """The presets as Markdown: one row per field they set, one column per preset (the chosen one marked ``*``), the
    env's own defaults when it has any, and the value in use."""
    env = env_name(args.env_id)
    own = env_own_defaults(env_defaults, args.env_id, args.preset)
    keys = list(dict.fromkeys([k for p in presets.values() for k in p] + list(own)))
    head = ["field"] + [f"{n}*" if n == args.preset else n for n in presets] + ([env] if own else []) + ["used"]
    lines = ["|" + "|".join(head) + "|", "|" + "|".join("-" for _ in head) + "|"]
    for key in keys:
        row = [key] + [str(p.get(key, "")) for p in presets.values()] + ([str(own.get(key, ""))] if own else [])
        lines.append("|" + "|".join(row + [str(getattr(args, key))]) + "|")
    return "\n".join(lines)


def output_dir(args, exp_name: str) -> Path:
    """``args.output_dir``, or the default run folder of :class:`RunArgs`' ``output_dir`` (named after
    ``args.exp_name``, or ``exp_name`` where that is empty)."""
    if args.output_dir is not None:
        return Path(args.output_dir)
    exp_name = args.exp_name or exp_name
    if is_evhub(args.env_id):
        mode = getattr(args, "action_mode", "discrete")
        return Path("outputs") / "runs" / f"{exp_name}_{Path(args.site).stem}_{mode}_seed{args.seed}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.env_id)
    return Path("outputs") / "runs" / f"{exp_name}_{safe}_seed{args.seed}"


def setup(args) -> torch.device:
    """Pick the device, seed Python, NumPy and torch, and set the determinism, thread and TF32 switches.

    Raises:
        ValueError: ``--cudagraphs`` without a CUDA device.
    """
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.cudagraphs and device.type != "cuda":
        raise ValueError("--cudagraphs needs CUDA (no CUDA device in use); drop the flag or run on a GPU")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if args.deterministic_algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before the first GEMM
        torch.use_deterministic_algorithms(True)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    if args.compile:
        use_compile_cache(args.compile_cache)
    return device


# ---------------------------------------------------------------------------------------------- environments
def make_env(args, num_envs: int, device: torch.device, action_mode: str | None = None) -> RecordEpisodeStatistics:
    """The script's training env: :func:`envs.vector.make_vec` of ``args.env_id`` (EVHub-v0 on ``args.train_split``
    of ``args.site``, windows before ``args.train_window_end``, with ``action_mode`` and ``args.bess_action``) inside
    :class:`envs.vector.RecordEpisodeStatistics`
    (EVHub-v0's ``co2_kg`` and ``unserved_kwh`` besides return and length); ``--env-kwargs`` go to the env's
    constructor (:func:`env_kwargs_of`).

    Raises:
        InputError: ``--env-kwargs`` the constructor refuses. SpaceError: an observation space with no flat vector.
    """
    kwargs = {}
    if is_evhub(args.env_id):
        kwargs = dict(
            site=envs.load_site(args.site),
            split=args.train_split,
            action_mode=action_mode,
            bess_action=args.bess_action,
            window_end=args.train_window_end or None,
            dc_prior=args.dc_prior,
            exo_prior=args.exo_prior,
        )
    kwargs |= env_kwargs_of(args.env_kwargs)
    return RecordEpisodeStatistics(make_vec(args.env_id, num_envs, device, args.vector_mode, **kwargs))


def per_step(args, rate_per_hour: float) -> float:
    """A discount (``gamma``, GAE's ``lambda``) given per hour of site time, as the factor per env step: on EVHub-v0
    ``rate ** dt_h`` at the site's step (:func:`envs.timestep.per_step`), so that a setting means the same at 60, 15 or
    5-minute steps; on any other env the rate is per step already, returned as given."""
    if not is_evhub(args.env_id):
        return float(rate_per_hour)
    return timestep.per_step(rate_per_hour, envs.load_config(args.site)[0].dt_h)


def network_inputs(env, args) -> list[int] | None:
    """The observation features the networks read: None (all) but for EVHub-v0, where the env's
    ``observation_layout`` names the per-socket, day-of-week and context features that ``--socket-features``,
    ``--weekday-features`` and ``--context-features`` leave out."""
    if not is_evhub(args.env_id):
        return None
    layout = env.observation_layout
    drop = set() if args.socket_features else set(layout["sockets"])
    drop |= set() if args.weekday_features else set(layout["day_of_week"])
    drop |= set() if args.context_features else set(layout["context"])
    return [i for i in range(int(np.prod(env.single_observation_space.shape))) if i not in drop]
