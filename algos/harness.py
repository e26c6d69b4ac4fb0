"""What every training script shares and is not its algorithm (the role of CleanRL's ``cleanrl_utils``).

An algorithm file (``algos/ppo.py`` ...) holds its ``Args``, networks, hot functions and a CleanRL-shaped loop; it
takes from here:

* :class:`RunArgs`, the fields every script has, and :func:`cli` / :func:`preset_args`: the CPU and GPU presets and
  an env's own defaults (``Snake-v0``'s) are ``Args`` instances chosen *before* parsing, so ``--help`` prints the
  real default of each field and ``Args`` is never mutated afterwards;
* :func:`make_env`: the script's vector env (:func:`envs.vector.make_vec`, the site for ``EVHub-v0``) with device-side
  episode statistics, and :func:`network_inputs`, the features the networks read (from the env's published
  observation layout);
* :class:`Run`: the run folder, TensorBoard writer and ``metrics.parquet`` (one host read per log interval), the
  progress bar and SPS clocks, the finite-loss guard, checkpoint save / load through :func:`envs.files.atomic_write`
  and resume, the deterministic evaluation on the site's split, and policy export with one contract;
* :func:`bind`: the ``--compile`` / ``--cudagraphs`` switches, applied once to the plain hot functions (LeanRL's
  pattern); :class:`CudaGraphed` replays one from a CUDA graph;
* :func:`train_with_oom_restarts`: on a CUDA out-of-memory error the loop hands over its live state, the algorithm's
  own shrink rule makes the sizes smaller, and training re-enters from that state.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import random
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import gymnasium as gym
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:
    import envs
except ModuleNotFoundError:  # run as `python algos/<algo>.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs
from envs.evhub import DEFAULT_BESS_ACTION
from envs.files import atomic_write
from envs.kpis import evaluate_policy, write_parquet, write_policy_spec
from envs.vector import EVHUB_ID, BoxScaling, RecordEpisodeStatistics, env_name, fold_moments, is_evhub, make_vec

CHECKPOINT_FORMAT = 2
"""Version of the checkpoint layout written by :meth:`Run.save`; a checkpoint of another version is refused."""

EVHUB_ONLY_ARGS = ("site", "action_mode", "bess_action", "socket_features", "weekday_features", "eval_split", "eval_every")
"""Arguments that only EVHub-v0 reads: left out of the printed and logged hyperparameters of other envs."""


class NonFiniteLossError(RuntimeError):
    """A loss (or a gradient norm) became NaN or infinite; training stops, the last checkpoint is kept."""


class OutOfMemoryBackoffError(RuntimeError):
    """CUDA ran out of memory and the sizes cannot shrink further (``max_oom_retries`` reached, or nothing left to
    shrink); training stops, the last checkpoint is kept."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: unreadable, of another format, algorithm or env."""


class OutOfMemoryRestart(Exception):
    """Raised by :meth:`Run.out_of_memory`: CUDA ran out of memory ``where``; ``state`` is the live training state
    (on the CPU) to re-enter from, ``in_update`` whether it struck in the gradient steps."""

    def __init__(self, where: str, error: str, state: dict | None, in_update: bool):
        super().__init__(error)
        self.where, self.error, self.state, self.in_update = where, error, state, in_update


# ---------------------------------------------------------------------------------------------- arguments
@dataclass
class RunArgs:
    """The fields every script has; an algorithm's ``Args`` subclasses it and adds its own."""

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
    vector_mode: Literal["sync", "async"] = "sync"
    """how a gymnasium env without a torch vector entry point is vectorised: 'sync' (one process) or 'async' (one
    worker process per env, for CPU- or I/O-bound envs; falls back to sync with a warning if the workers cannot
    start); ignored for the torch-batched envs (EVHub-v0, Snake-v0)"""
    site: str = "caltech"
    """site to train on (EVHub-v0 only): a shipped site name or a path to a site TOML file"""
    bess_action: Literal["surplus", "setpoint"] = DEFAULT_BESS_ACTION
    """meaning of the BESS action (EVHub-v0 only): 'surplus' (the PV surplus is always stored; -1 = cover the
    deficit, the self-consumption rule; 0 = hold at a deficit; +1 = charge at full power) or 'setpoint' (a_bess
    times the BESS power limit)"""
    socket_features: bool = True
    """feed the per-socket observations to the networks (False: only the site-level features); EVHub-v0 only"""
    weekday_features: bool = False
    """feed the day-of-week features (sin/cos) to the networks (EVHub-v0 only; off: the policy reads the EV demand
    from the sockets instead of learning the weekday pattern of the training year, which transfers worse)"""
    compile: bool = False
    """torch.compile the hot functions"""
    cudagraphs: bool = False
    """capture the hot functions in CUDA graphs (capturable optimizers, device-tensor learning rates); needs CUDA"""
    amp: bool = False
    """bf16 autocast of the network forward passes (CUDA or CPU)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_{action_mode}_seed{seed} for EVHub-v0,
    outputs/runs/{exp_name}_{env_id}_seed{seed} otherwise)"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (networks, optimizers, counters, RNG and env state)"""
    eval_split: str = "test"
    """split for the final deterministic evaluation ('none' skips it); EVHub-v0 only"""
    eval_every: int = 0
    """iterations between deterministic evaluations on eval_split during training (0: only the final one; EVHub-v0
    only); each is logged as eval/co2_kg etc. and added to eval_curve.parquet with the training wall time so far"""
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
    """A script's ``__main__``: parse the command line (:func:`cli`) and run ``main``; a checkpoint that cannot be
    resumed from ends the process with its message (exit status 2), not a traceback."""
    args = cli(args_cls, presets, env_defaults, description=description)
    try:
        main(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


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
    """``args.output_dir``, or the default run folder of the module docstring of :class:`RunArgs` (named after
    ``args.exp_name`` where the script has that field, else ``exp_name``)."""
    if args.output_dir is not None:
        return Path(args.output_dir)
    exp_name = getattr(args, "exp_name", None) or exp_name
    if is_evhub(args.env_id):
        mode = getattr(args, "action_mode", "discrete")
        return Path("outputs") / "runs" / f"{exp_name}_{Path(args.site).stem}_{mode}_seed{args.seed}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.env_id)
    return Path("outputs") / "runs" / f"{exp_name}_{safe}_seed{args.seed}"


def setup(args, num_threads: int = 0) -> torch.device:
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
    if num_threads:
        torch.set_num_threads(num_threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    return device


# ---------------------------------------------------------------------------------------------- environments
def make_env(args, num_envs: int, device: torch.device, action_mode: str | None = None) -> RecordEpisodeStatistics:
    """The script's training env: :func:`envs.vector.make_vec` of ``args.env_id`` (EVHub-v0 on the train split of
    ``args.site`` with ``action_mode`` and ``args.bess_action``) inside :class:`envs.vector.RecordEpisodeStatistics`
    (EVHub-v0's ``co2_kg`` and ``unserved_kwh`` besides return and length)."""
    kwargs = {}
    if is_evhub(args.env_id):
        kwargs = dict(site=envs.load_site(args.site), split="train", action_mode=action_mode, bess_action=args.bess_action)
    return RecordEpisodeStatistics(make_vec(args.env_id, num_envs, device, args.vector_mode, **kwargs))


def network_inputs(env, args) -> list[int] | None:
    """The observation features the networks read: None (all) but for EVHub-v0, where the env's
    ``observation_layout`` names the per-socket and day-of-week features that ``--socket-features`` and
    ``--weekday-features`` leave out."""
    if not is_evhub(args.env_id):
        return None
    layout = env.observation_layout
    drop = set() if args.socket_features else set(layout["sockets"])
    drop |= set() if args.weekday_features else set(layout["day_of_week"])
    return [i for i in range(int(np.prod(env.single_observation_space.shape))) if i not in drop]


# ---------------------------------------------------------------------------------------------- network blocks
def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights of gain ``std`` and constant biases (CleanRL's ``layer_init``), in place, for a ``Linear``
    or a ``Conv2d``; returns the layer."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class RunningObsNorm(nn.Module):
    """Running mean/variance of the observations (CleanRL's ``NormalizeObservation``, as buffers on the device).

    ``forward`` standardises and clips to ``[-clip, clip]``; :meth:`update` folds a batch into the statistics in
    place (no host sync). Part of the networks, it travels with the checkpoint and the
    exported policy. ``dim``: the size of flat observations, or the shape of one (``(C, H, W)``: per pixel).
    """

    def __init__(self, dim: int | tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.full((), 1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``x`` float32 ``(B, *dim)`` into the running mean/variance (:func:`envs.vector.fold_moments`)."""
        fold_moments(self.mean, self.var, self.count, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standardised and clipped ``x``: float32 ``(B, *dim)`` -> ``(B, *dim)``."""
        return ((x - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)


class Select(nn.Module):
    """Keeps the observation features listed in ``keep`` (the networks' inputs): ``(B, obs_dim)`` -> ``(B, len(keep))``."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.keep)


def select(inputs: list[int] | None, obs_dim: int) -> nn.Module:
    """:class:`Select` of ``inputs`` (:func:`network_inputs`), or the identity where they are every feature."""
    return nn.Identity() if inputs is None or len(inputs) == obs_dim else Select(list(inputs))


def cnn_torso(obs_shape: tuple[int, ...], channels: tuple[int, int], hidden: int, init=layer_init) -> nn.Sequential:
    """The CNN torso of image observations: float32 ``(B, C, H, W)`` -> features ``(B, hidden)``, ``Conv2d(C, c1, 3,
    padding=1)-ReLU-Conv2d(c1, c2, 3, padding=1)-ReLU-Flatten-Linear(c2 * H * W, hidden)-ReLU`` with ``(c1, c2) =
    channels``; the padding keeps the board size, so every cell stays in place up to the linear layer. ``init``
    initialises each layer (CleanRL's :func:`layer_init` by default; ``lambda m: m`` keeps torch's own).

    Raises:
        ValueError: ``channels`` is not two positive ints, or ``obs_shape`` is not ``(C, H, W)``.
    """
    if len(obs_shape) != 3:
        raise ValueError(f"a CNN torso takes image observations (C, H, W), got shape {tuple(obs_shape)}")
    channels = tuple(int(x) for x in channels)
    if len(channels) != 2 or min(channels) < 1:
        raise ValueError(f"--cnn-channels takes two positive channel counts (C1 C2), got {channels}")
    (c, h, w), (c1, c2) = (int(x) for x in obs_shape), channels
    return nn.Sequential(
        init(nn.Conv2d(c, c1, 3, padding=1)), nn.ReLU(), init(nn.Conv2d(c1, c2, 3, padding=1)), nn.ReLU(),
        nn.Flatten(), init(nn.Linear(c2 * h * w, hidden)), nn.ReLU(),
    )  # fmt: skip


def explained_variance(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 - Var[y - y_pred] / Var[y]`` of float ``(B,)`` tensors as a device scalar (NaN where ``Var[y] == 0``)."""
    var_y = y.var()
    ev = 1.0 - (y - y_pred).var() / var_y
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), ev)


# ---------------------------------------------------------------------------------------------- speed switches
class CudaGraphed:
    """Replays ``fn(*tensors)`` from a CUDA graph: ``warmup`` eager calls on a side stream, then capture.

    Inputs are copied into static buffers before each replay; the returned tensors are the graph's static outputs,
    overwritten by the next call. ``fn`` must not sync with the host, and every call must pass tensors of the shapes
    of the captured call.
    """

    def __init__(self, fn, warmup: int = 3):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: tuple[torch.Tensor, ...] = ()
        self.static_out = None

    def __call__(self, *args: torch.Tensor):
        if self.graph is not None:
            for dst, src in zip(self.static_in, args):
                dst.copy_(src)
            self.graph.replay()
            return self.static_out
        self.calls += 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if self.calls <= self.warmup:
            with torch.cuda.stream(stream):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            return out
        self.static_in = tuple(a.clone() for a in args)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self.fn(*self.static_in)
        self.graph.replay()  # capture records the work without running it
        return self.static_out


def bind(args, graphs: bool = True, **fns: Callable | None) -> tuple:
    """The hot functions (already bound to their networks with :func:`functools.partial`) as the speed switches
    say: ``torch.compile`` with ``--compile`` (eager's random kernels, so a seed gives the same run), then, unless
    ``graphs`` is False (a function replayed inside a larger graph, see :func:`capture`), :class:`CudaGraphed` with
    ``--cudagraphs``. None stays None. Returns them in the order given."""
    out = []
    if args.compile:
        torch._inductor.config.fallback_random = True
    for fn in fns.values():
        if fn is not None and args.compile:
            fn = torch.compile(fn)
        if fn is not None and args.cudagraphs and graphs:
            fn = CudaGraphed(fn)
        out.append(fn)
    return tuple(out)


def capture(args, fn: Callable) -> Callable:
    """``fn`` (tensors in, tensors out, no host sync, every state it touches updated in place) replayed from one CUDA
    graph with ``--cudagraphs``, e.g. a whole rollout of a torch-batched env: policy and env steps of ``num_steps``
    steps in one launch. As it is otherwise."""
    return CudaGraphed(fn) if args.cudagraphs else fn


def device_lr(value: float, device: torch.device) -> torch.Tensor:
    """A learning rate as a device tensor, annealed in place: no recompilation, and CUDA graphs see the new value. On
    CUDA float32 (Adam takes a tensor LR only as capturable); on the CPU float64, which Adam reads back as a Python
    number, so the steps are those of a plain float LR."""
    return torch.tensor(value, device=device, dtype=torch.float32 if device.type == "cuda" else torch.float64)


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a host sync on CUDA), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------- GPU statistics
GPU_STAT_KEYS = ("perf/gpu_mem_allocated_gb", "perf/gpu_mem_reserved_gb", "perf/gpu_mem_peak_gb", "perf/gpu_util_pct")
"""The TensorBoard tags of :func:`gpu_stats`; ``metrics.parquet`` has them as columns without ``perf/``."""

_HAVE_PYNVML = importlib.util.find_spec("pynvml") is not None


def gpu_stats(device: torch.device) -> dict[str, float]:
    """GPU memory (GB = 1e9 bytes; the caching allocator's host-side counters, no sync) and utilisation (percent of
    the last sample period with a kernel running, via NVML: NaN unless ``pynvml`` imports) of ``device``, keyed by
    :data:`GPU_STAT_KEYS`. NaN on a non-CUDA device; never raises (a failed reading is NaN)."""
    stats = {key: math.nan for key in GPU_STAT_KEYS}
    if device.type != "cuda":
        return stats
    try:
        stats["perf/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        stats["perf/gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        stats["perf/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception:  # noqa: BLE001 - monitoring must not stop training
        pass
    if _HAVE_PYNVML:
        try:
            stats["perf/gpu_util_pct"] = float(torch.cuda.utilization(device))
        except Exception:  # noqa: BLE001
            pass
    return stats


# ---------------------------------------------------------------------------------------------- policy export
class EnvUnitsPolicy(nn.Module):
    """A deterministic actor with its output put into the env's own units (the one export contract).

    ``actor`` maps raw observations float32 ``(B, *obs_shape)`` to, for a Box action space, actions float32
    ``(B, act_dim)`` meant in [-1, 1]: they are clipped there and rescaled affinely to the Box's finite
    ``[low, high]``; for a ``Discrete(n, start)``, indices int64 ``(B,)`` in ``0..n-1``: ``start`` is added.
    """

    def __init__(self, actor: nn.Module, space: gym.Space):
        super().__init__()
        self.actor = actor
        self.discrete = isinstance(space, gym.spaces.Discrete)
        if self.discrete:
            self.register_buffer("start", torch.tensor(int(space.start), dtype=torch.int64))
        else:
            scaling = BoxScaling(space)
            self.register_buffer("center", torch.as_tensor(scaling.mid, dtype=torch.float32))
            self.register_buffer("scale", torch.as_tensor(scaling.half, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Raw observations -> actions in the env's units (class docstring)."""
        if self.discrete:
            return self.actor(obs) + self.start
        return self.center + self.scale * self.actor(obs).clamp(-1.0, 1.0)


def export_policy(actor: nn.Module, obs_shape: tuple[int, ...], space: gym.Space, out_dir: Path, spec: dict | None) -> Path:
    """Save the deterministic policy for code that does not import ``algos``: ``policy.pt2``, a ``torch.export``
    program of :class:`EnvUnitsPolicy` with a dynamic batch dimension (load with ``torch.export.load(path).module()``;
    raw observations float32 ``(B, *obs_shape)`` -> actions in the env's own units). ``spec`` (EVHub-v0's env
    settings: ``env_id``, ``action_mode``, ``bess_action``) goes into ``policy.json`` beside it and into the program
    itself (extra file ``policy.json``), so a policy moved without its JSON still acts under its own rule. If export
    fails, a TorchScript trace to ``policy.pt``. Written atomically. Returns the written path."""
    import copy

    module = EnvUnitsPolicy(copy.deepcopy(actor), space).cpu().float().eval()
    example = torch.zeros(2, *obs_shape)
    extra = {"policy.json": json.dumps(spec or {})}
    try:
        program = torch.export.export(module, (example,), dynamic_shapes={"obs": {0: torch.export.Dim("batch", min=1)}})
        path = out_dir / "policy.pt2"
        atomic_write(path, lambda tmp: torch.export.save(program, tmp, extra_files=extra), suffix=".tmp.pt2")
    except Exception as exc:  # noqa: BLE001 - any export failure falls back to TorchScript
        print(f"torch.export failed ({type(exc).__name__}: {exc}); saving a TorchScript trace instead", file=sys.stderr)
        path = out_dir / "policy.pt"
        traced = torch.jit.trace(module, example)
        atomic_write(path, lambda tmp: torch.jit.save(traced, str(tmp), _extra_files=extra))
    if spec:
        write_policy_spec(out_dir, spec["env_id"], spec["action_mode"], spec["bess_action"])
    return path


# ---------------------------------------------------------------------------------------------- out of memory
def out_of_memory_message(exc: BaseException) -> str | None:
    """The first line of the CUDA out-of-memory error behind ``exc`` (itself, or what it was raised from or while
    handling: a failed compile or graph capture raises its own error on top), or None if there is none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return (str(exc).strip().splitlines() or ["CUDA out of memory"])[0]
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return None


def free_device_memory(device: torch.device) -> None:
    """Hand the memory of dropped tensors and CUDA graphs back: a garbage collection (tracebacks keep frames alive in
    cycles), then, on CUDA, the caching allocator's unused blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def to_cpu(tree):
    """A copy of a nested dict / list / tuple of tensors with every tensor on the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def allocate_halving(run: Run, make: Callable[[int], Any], size: int, floor: int, name: str) -> tuple[Any, int]:
    """``(make(size), size)``, halving ``size`` after each CUDA out-of-memory error while it stays ``>= floor`` (a
    replay buffer at setup: ``name`` is its field, ``"buffer_size"``). Each halving is warned on stderr and logged as
    TensorBoard text ``oom``; none counts against ``max_oom_retries``.

    Raises:
        OutOfMemoryBackoffError: halving once more would go below ``floor``.
    """
    while True:
        try:
            return make(size), size
        except RuntimeError as exc:
            error = out_of_memory_message(exc)
            if error is None:
                raise
        flag = "--" + name.replace("_", "-")
        if size // 2 < floor:
            raise OutOfMemoryBackoffError(
                f"CUDA out of memory at setup for {name} {size:,}, and halving it would go below {floor:,}; the run "
                f"stopped before training. Ask for less memory: a smaller {flag}, --num-envs or --batch-size.\n"
                f"The error: {error}"
            )
        free_device_memory(run.device)
        message = f"CUDA out of memory at setup: {name} {size:,} -> {size // 2:,}; continuing"
        print(f"warning: {message}", file=sys.stderr, flush=True)
        run.writer.add_text("oom", message, run.global_step)
        size //= 2


def train_with_oom_restarts(train: Callable, run: Run, sizes, shrink: Callable) -> dict:
    """Call ``train(run, sizes, state)`` until it returns; on a CUDA out-of-memory error, shrink and re-enter.

    ``train`` raises :class:`OutOfMemoryRestart` from its loop (through :meth:`Run.out_of_memory`) with the live
    state; an out-of-memory error anywhere else (setting up) re-enters from the state it was given. ``shrink(sizes,
    in_update)`` is the algorithm's rule: it returns ``(smaller sizes, "what changed")`` or raises ValueError with the
    reason it cannot. Each shrink is warned on stderr and logged as TensorBoard text ``oom``.

    Raises:
        OutOfMemoryBackoffError: ``max_oom_retries`` shrinks were made already, or ``shrink`` cannot.
    """
    state = None
    while True:
        try:
            return train(run, sizes, state)
        except OutOfMemoryRestart as restart:
            where, error, in_update = restart.where, restart.error, restart.in_update
            state = restart.state if restart.state is not None else state
        except RuntimeError as exc:
            error = out_of_memory_message(exc)
            if error is None:
                raise
            where, in_update = "at setup", False
        run.close_env()
        free_device_memory(run.device)
        reason = None
        if len(run.oom_history) >= run.args.max_oom_retries:
            reason = f"max_oom_retries={run.args.max_oom_retries} halvings were made already"
        else:
            try:
                sizes, change = shrink(sizes, in_update)
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            run.close()
            kept = f"the last good checkpoint {run.ckpt_path} is left untouched" if run.ckpt_path.exists() else (
                "no checkpoint was written")
            tried = "".join(f"\n  {h}" for h in run.oom_history) or " none"
            raise OutOfMemoryBackoffError(
                f"CUDA out of memory {where} with {sizes}, and no further back-off: {reason}. Training stopped; "
                f"{kept}.\nHalvings made:{tried}\nAsk for less memory: fewer --num-envs, a smaller --batch-size or "
                f"--hidden-size, no --cudagraphs or --compile; or allow more with --max-oom-retries.\nThe error: {error}"
            )
        message = f"CUDA out of memory {where}: {change}; continuing"
        print(f"warning: {message}", file=sys.stderr, flush=True)
        run.oom_history.append(message)
        run.writer.add_text("oom", message, run.global_step)


# ---------------------------------------------------------------------------------------------- the run
class Run:
    """One training run's folder and bookkeeping, shared by the scripts.

    Created once per run (it outlives the re-entries of :func:`train_with_oom_restarts`). Holds ``global_step`` and
    ``iteration``, the device flags of the finite-loss guard (``loss_names``), the ``metrics.parquet`` rows, the
    evaluation curve and the clocks (training wall time, SPS over the run and over its second half).

    Args:
        algo: the script's name (``"ppo"``), the controller name of its KPI rows.
        args: the parsed ``Args`` (a :class:`RunArgs`), never changed here.
        loss_names: the quantities whose finiteness the update reports, in the order of its ``bad`` flags.
        presets, env_defaults: the script's tables, printed and logged as text ``presets``.
    """

    def __init__(self, algo: str, args, loss_names: tuple[str, ...], presets: dict, env_defaults: dict, num_threads: int = 0):
        self.algo, self.args, self.loss_names = algo, args, tuple(loss_names)
        self.device = setup(args, num_threads)
        self.evhub = is_evhub(args.env_id)
        self.out_dir = output_dir(args, algo)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = self.out_dir / "checkpoint.pt"
        if args.resume and not self.ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {self.ckpt_path}")
        self.presets_text = presets_table(presets, env_defaults, args)
        self._writer: SummaryWriter | None = None
        self.oom_history: list[str] = []
        self.rows: list[dict] = []
        self.curve: list[dict] = []
        self.global_step, self.iteration, self.train_wall_prev = 0, 0, 0.0
        self.sps = self.sps_steady = 0.0
        self.bar = None
        self._site = None

    @property
    def writer(self) -> SummaryWriter:
        """The TensorBoard writer, opened at first use (so a refused ``--resume`` leaves the folder as it was)."""
        if self._writer is None:
            self._writer = SummaryWriter(str(self.out_dir))
            self._writer.add_text("hyperparameters", self.hyperparameters())
            self._writer.add_text("presets", self.presets_text)
        return self._writer

    # -- text
    def shown_args(self, **sizes) -> dict:
        """The arguments this env reads (EVHub-only ones left out elsewhere), with the runtime ``sizes``."""
        return {k: v for k, v in {**vars(self.args), **sizes}.items() if self.evhub or k not in EVHUB_ONLY_ARGS}

    def hyperparameters(self, **sizes) -> str:
        """:meth:`shown_args` as a Markdown table (TensorBoard text ``hyperparameters``)."""
        return "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in self.shown_args(**sizes).items())

    def announce(self, what: str, env, sizes: dict) -> None:
        """Print the run's headline, the presets table and the arguments; log the sizes and any env warning."""
        args = self.args
        self.env = env  # closed by close(), also on an error or before an out-of-memory re-entry
        if env.torch_batched and args.vector_mode != "sync":
            print(f"note: --vector-mode {args.vector_mode} is ignored: {args.env_id} is a torch-batched env")
        if getattr(env, "warning", None):
            self.writer.add_text("warnings", env.warning, self.global_step)
        where = f"site={args.site} action_mode={getattr(args, 'action_mode', 'discrete')}" if self.evhub else (
            "torch-batched" if env.torch_batched else f"vector_mode={env.vector_mode}")
        print(f"{self.algo.upper()} on {args.env_id} {where} device={self.device} preset={args.preset}: {what}; "
              f"output {self.out_dir}")
        print(f"presets (* = {args.preset}; any field can be set on the command line):\n{self.presets_text}")
        print("args: " + ", ".join(f"{k}={v}" for k, v in self.shown_args(**sizes).items()), flush=True)
        if not self.evhub and args.eval_split.lower() != "none":
            print(f"note: no split evaluation for {args.env_id} (eval_split={args.eval_split!r} applies to EVHub-v0 only)")
        if self.oom_history:
            self.writer.add_text("hyperparameters", self.hyperparameters(**sizes), self.global_step)

    # -- checkpoints
    def save(self, state: dict) -> None:
        """Write ``state`` (from the script's ``state()``: networks, optimizers, env and extras) with the counters,
        the RNG states and the format tag to ``checkpoint.pt``, atomically."""
        payload = {**self.counters(), **state}
        atomic_write(self.ckpt_path, lambda tmp: torch.save(payload, tmp))

    def counters(self) -> dict:
        """What every checkpoint holds besides the script's state: format, algorithm, env, counters and RNGs."""
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "format": CHECKPOINT_FORMAT, "algo": self.algo, "env_id": self.args.env_id,
            "global_step": self.global_step, "iteration": self.iteration, "train_wall_s": self.wall(),
            "args": dataclasses.asdict(self.args), "rng": rng,
        }  # fmt: skip

    def restore(self, state: dict | None, modules: dict[str, nn.Module], optimizers: dict, env, lrs: dict | None = None):
        """Load the live ``state`` handed over after an out-of-memory error, else, with ``--resume``, the checkpoint;
        returns the loaded dict (None for a fresh start) and sets the counters.

        ``modules`` and ``optimizers`` (name -> object) are loaded from the entries of the same name; an optimizer
        keeps this run's learning rate (``lrs[name]``: a float or device tensor) and ``capturable`` flag. The env's
        state is loaded where it was saved for the same ``num_envs``; otherwise the envs start new episodes (reset
        with ``seed + global_step``) and only the statistics that carry over (the reward normaliser's) are loaded.
        ``loaded["env_restored"]`` says which.

        Raises:
            CheckpointError: a checkpoint that is truncated or not a torch file, of another format, algorithm or env,
                or whose tensors do not fit these networks (another site's observation size): the message names the
                file, what is wrong and the way out.
        """
        if state is None and not self.args.resume:
            return None
        path = self.ckpt_path
        if state is None:
            state = self._read_checkpoint()
        try:
            for name, module in modules.items():
                module.load_state_dict(state[name])
            for name, opt in optimizers.items():
                if opt is not None and state.get(name) is not None:
                    load_optimizer_state(opt, state[name], (lrs or {}).get(name))
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(self._unusable(f"it does not fit this run's networks ({type(exc).__name__}: "
                                                 f"{str(exc).strip().splitlines()[0]})")) from exc
        self.global_step, self.iteration = int(state["global_step"]), int(state["iteration"])
        self.train_wall_prev = float(state.get("train_wall_s", 0.0))
        rng = state["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        same = state.get("env") is not None and state.get("num_envs") == env.num_envs and env.torch_batched
        if same:
            env.load_state_dict(state["env"])
        else:
            if state.get("env") is not None or not env.torch_batched:
                reason = (f"num_envs changed ({state.get('num_envs')} -> {env.num_envs})" if env.torch_batched
                          else f"the state of a gymnasium env ({self.args.env_id}) cannot be checkpointed")
                print(f"resume: {reason}; envs start new episodes")
            if state.get("env") is not None:
                env.load_state_dict(state["env"], statistics_only=True)
        if (self.out_dir / "metrics.parquet").is_file() and not self.rows:
            old = pd.read_parquet(self.out_dir / "metrics.parquet")
            self.rows = old[old.global_step <= self.global_step].to_dict("records")
        self.rows = [r for r in self.rows if r["global_step"] <= self.global_step]
        if (self.out_dir / "eval_curve.parquet").is_file() and not self.curve:
            old = pd.read_parquet(self.out_dir / "eval_curve.parquet")
            self.curve = old[old.global_step <= self.global_step].to_dict("records")
        if self.args.resume and not self.oom_history:
            print(f"resumed from {path} at global_step {self.global_step}, iteration {self.iteration}")
        return {**state, "env_restored": same}

    def _unusable(self, what: str) -> str:
        return (f"cannot resume from {self.ckpt_path}: {what}. Delete it (rm {self.ckpt_path}) to start afresh in "
                f"this folder, run without --resume, or give another --output-dir")

    def _read_checkpoint(self) -> dict:
        """The checkpoint file, checked for its format, algorithm and env (:meth:`restore`'s errors)."""
        try:
            state = torch.load(self.ckpt_path, map_location=self.device, weights_only=False)  # our own file
        except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, Exception) as exc:  # noqa: BLE001
            raise CheckpointError(self._unusable(
                f"it cannot be read ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else 'empty'}"
                f"; a file cut short by a crash or a full disk, or not a torch checkpoint)")) from exc
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format", "none") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(self._unusable(
                f"it was written by another version of this project (checkpoint format {found}, this one reads "
                f"{CHECKPOINT_FORMAT})"))
        if state.get("algo") != self.algo or env_name(state.get("env_id", "")) != env_name(self.args.env_id):
            raise CheckpointError(self._unusable(
                f"it is a {state.get('algo')} run on {state.get('env_id')}, not {self.algo} on {self.args.env_id}"))
        return state

    # -- the loop
    def iterations(self, num_iterations: int, global_step_of: Callable[[], int] | None = None):
        """The iteration numbers still to run, ``self.iteration + 1 .. num_iterations`` (also set as
        ``self.iteration``), with the progress bar and the clocks: training wall time and the steady-state SPS, timed
        over the second half of this session's iterations (past compilation, graph capture and the first updates).
        The loop adds to ``self.global_step`` itself."""
        first = self.iteration + 1
        half = first + (num_iterations - first + 1) // 2
        self.num_iterations = num_iterations
        self._start = time.perf_counter()
        self._session_step = self.global_step
        self._steady = None
        if self.rows:
            self.sps = float(self.rows[-1]["sps"])  # a resumed run with nothing left to train keeps its SPS
        self.bar = tqdm(initial=first - 1, total=num_iterations, disable=not sys.stderr.isatty(), desc=self.algo)
        for iteration in range(first, num_iterations + 1):
            if iteration == half:
                self._steady = (synced_clock(self.device), self.global_step)
            self.iteration = iteration
            yield iteration
            self.bar.update()
        self.bar.close()
        end = synced_clock(self.device)
        self.sps_steady = (self.global_step - self._steady[1]) / max(end - self._steady[0], 1e-9) if self._steady else self.sps
        self.train_wall_prev, self._start = self.train_wall_prev + end - self._start, None

    def wall(self) -> float:
        """Training wall time so far in seconds (evaluations left out), over every session of the run."""
        return self.train_wall_prev + (time.perf_counter() - self._start if getattr(self, "_start", None) else 0.0)

    def every(self, n: int) -> bool:
        """True on every ``n``-th iteration (never for ``n = 0``), not counting the last (its own work follows)."""
        return bool(n) and self.iteration % n == 0 and self.iteration != self.num_iterations

    def logging_now(self) -> bool:
        """True on the iterations that log: every ``args.log_every``-th and the last."""
        return self.iteration % max(1, getattr(self.args, "log_every", 1)) == 0 or self.iteration == self.num_iterations

    def new_guard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Device flags of the finite-loss guard: ``(bad_any (len(loss_names),) bool, first_bad_step () int64)``."""
        return (torch.zeros(len(self.loss_names), dtype=torch.bool, device=self.device),
                torch.full((), -1, dtype=torch.int64, device=self.device))

    def flag(self, guard: tuple[torch.Tensor, torch.Tensor], bad: torch.Tensor) -> None:
        """Fold an update's ``bad`` flags into ``guard`` in place, on the device (no sync)."""
        bad_any, first = guard
        first.copy_(torch.where((first < 0) & bad.any(), self.global_step, first))
        bad_any |= bad

    def check_finite(self, guard: tuple[torch.Tensor, torch.Tensor], host: list | None = None) -> None:
        """Raise :class:`NonFiniteLossError` if the guard saw a non-finite value (one host read, or none when
        ``host`` already holds ``[*bad_any, first_bad_step]``)."""
        values = host if host is not None else torch.cat([guard[0].double(), guard[1].double().reshape(1)]).tolist()
        step = int(values[-1])
        if step >= 0:
            names = [n for n, b in zip(self.loss_names, values[:-1]) if b]
            kept = f"the last good checkpoint {self.ckpt_path} is left untouched" if self.ckpt_path.exists() else (
                "no checkpoint was written")
            raise NonFiniteLossError(
                f"non-finite {', '.join(names)} in the update at global_step {step}; training stopped, {kept}")

    def log(self, env: RecordEpisodeStatistics, guard, scalars: dict[str, torch.Tensor | float], **row: float) -> dict:
        """One log interval, with one host read: the episode totals of ``env``, the guard and the device
        ``scalars`` (TensorBoard tag -> value; ``"losses/value_loss"`` ...) are stacked and read at once.

        Checks the guard (:class:`NonFiniteLossError`), writes TensorBoard (``charts/episodic_*``, ``charts/SPS``,
        the scalars, ``perf/gpu_*``) and appends a ``metrics.parquet`` row (``global_step``, ``wall_s``, ``sps``,
        ``episodic_return``, ``episodic_length``, ``episodic_co2_kg``, ``episodic_unserved_kwh`` (NaN but for
        EVHub-v0), each scalar under the name after its ``/``, ``row``'s extras, the GPU columns). Returns the row."""
        tags = [k for k, v in scalars.items() if isinstance(v, torch.Tensor)]
        parts = [env.pop(), guard[0].double(), guard[1].double().reshape(1)]
        parts += [scalars[k].detach().double().reshape(1) for k in tags]
        values = torch.cat([p.to(self.device) for p in parts]).tolist()  # the one host read
        n_totals = 1 + len(env.names)
        totals, flags, rest = values[:n_totals], values[n_totals : n_totals + len(self.loss_names) + 1], values[n_totals + len(self.loss_names) + 1 :]
        self.check_finite(guard, flags)
        host = {k: float(v) for k, v in scalars.items() if not isinstance(v, torch.Tensor)} | dict(zip(tags, rest))
        ep = env.episode_means(totals)
        if not self.evhub:
            ep = {**ep, "co2_kg": math.nan, "unserved_kwh": math.nan}
        wall = time.perf_counter() - self._start
        self.sps = (self.global_step - self._session_step) / max(wall, 1e-9)
        step, gpu = self.global_step, gpu_stats(self.device)
        if totals[0]:
            for key in ("return", "length", "co2_kg", "unserved_kwh") if self.evhub else ("return", "length"):
                self.writer.add_scalar(f"charts/episodic_{key}", ep[key], step)
        for tag, value in {**host, "charts/SPS": int(self.sps), **gpu}.items():
            if math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        metrics = {"global_step": step, "wall_s": self.train_wall_prev + wall, "sps": self.sps,
                   **{f"episodic_{k}": ep.get(k, math.nan) for k in ("return", "length", "co2_kg", "unserved_kwh")},
                   **{tag.split("/", 1)[-1]: value for tag, value in host.items()}, **row,
                   **{key.removeprefix("perf/"): value for key, value in gpu.items()}}  # fmt: skip
        self.rows.append(metrics)
        write_parquet(pd.DataFrame(self.rows), self.out_dir / "metrics.parquet")
        self.bar.set_postfix(sps=int(self.sps), ret=f"{ep['return']:.1f}", refresh=False)
        last = self.iteration == self.num_iterations
        tenth = max(1, self.num_iterations // max(1, getattr(self.args, "log_every", 1)) // 10)
        if last or (self.bar.disable and (self.iteration // max(1, getattr(self.args, "log_every", 1))) % tenth == 0):
            site = f"co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} " if self.evhub else ""
            shown = " ".join(f"{t.split('/', 1)[-1]} {v:.4g}" for t, v in host.items() if t.startswith("losses/"))
            print(f"iter {self.iteration}/{self.num_iterations} step {step} SPS {int(self.sps)} return "
                  f"{ep['return']:.2f} length {ep['length']:.1f} {site}{shown}", flush=True)
        return metrics

    # -- evaluation and the end
    def site(self):
        """The EVHub-v0 site of ``args.site``, loaded once."""
        if self._site is None:
            self._site = envs.load_site(self.args.site)
        return self._site

    def evaluate(self, actor: nn.Module, action_mode: str, **extra: float) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Run the deterministic ``actor`` (raw observations -> actions in [-1, 1] of ``action_mode``) over the whole
        ``eval_split`` of the site: ``(KPI row, hourly traces)``."""

        def policy(obs: torch.Tensor, env_) -> torch.Tensor:
            with torch.no_grad():
                return actor(obs.float()).to(obs.dtype)

        return evaluate_policy(policy, self.site(), self.args.eval_split, self.algo, action_mode, self.device,
                               bess_action=self.args.bess_action, **extra)

    def eval_during_training(self, actor: nn.Module, action_mode: str) -> None:
        """With ``--eval-every`` on EVHub-v0, on its iterations: evaluate, log ``eval/*``, append to
        ``eval_curve.parquet``; the time it takes is left out of the training clocks."""
        args = self.args
        if not (self.evhub and args.eval_split.lower() != "none" and self.every(args.eval_every)):
            return
        start = synced_clock(self.device)
        row, _ = self.evaluate(actor, action_mode)
        self._curve_row(row, self.train_wall_prev + start - self._start)
        paused = time.perf_counter() - start
        self._start += paused
        if self._steady is not None:
            self._steady = (self._steady[0] + paused, self._steady[1])

    def _curve_row(self, kpis: pd.DataFrame, train_wall_s: float) -> None:
        k = kpis.iloc[0]
        self.curve.append({"global_step": int(self.global_step), "train_wall_s": float(train_wall_s),
                           **{c: float(k[c]) for c in ("co2_kg", "unserved_kwh", "ev_energy_served_pct")}})
        write_parquet(pd.DataFrame(self.curve), self.out_dir / "eval_curve.parquet")
        self.writer.add_scalar("eval/co2_kg", self.curve[-1]["co2_kg"], self.global_step)
        self.writer.add_scalar("eval/unserved_kwh", self.curve[-1]["unserved_kwh"], self.global_step)

    def finish(self, state: dict, actor: nn.Module, env, action_mode: str | None = None, **result) -> dict:
        """The end of training: the final checkpoint, the exported policy (:func:`export_policy`, in the env's own
        units; EVHub-v0's settings in ``policy.json``), the final evaluation on ``eval_split`` (EVHub-v0;
        ``eval_{split}.parquet`` and ``eval_{split}_traces.parquet``) and the writer closed.

        ``actor`` maps raw observations to actions in [-1, 1] (Box) or indices ``0..n-1`` (Discrete) of ``env``'s
        action space, or, for EVHub-v0, of ``action_mode`` (the mode the policy acts in at evaluation).

        Returns ``{"global_step", "train_wall_s", "sps", "sps_steady", "policy", "vector_mode", **result}`` and, for
        EVHub-v0 unless ``eval_split`` is ``"none"``, ``"eval"`` (the one-row KPI DataFrame).
        """
        args = self.args
        self.save(state)
        space = env.single_action_space
        spec = None
        if self.evhub:
            mode = action_mode or args.action_mode
            space = gym.spaces.Box(-1.0, 1.0, (envs.evhub.action_dim(mode, env.n_sockets),), np.float32)
            spec = {"env_id": EVHUB_ID, "action_mode": mode, "bess_action": args.bess_action}
        path = export_policy(actor, tuple(env.obs_shape), space, self.out_dir, spec)
        train_wall = self.train_wall_prev
        print(f"training: {self.global_step:,} steps in {train_wall:.1f} s ({self.sps:.0f} SPS, {self.sps_steady:.0f} "
              f"over the second half); policy saved to {path}")
        out = {"global_step": self.global_step, "train_wall_s": train_wall, "sps": self.sps,
               "sps_steady": self.sps_steady, "policy": str(path),
               "vector_mode": None if env.torch_batched else env.vector_mode, **result}  # fmt: skip
        self.close_env()
        if self.evhub and args.eval_split.lower() != "none":
            row, traces = self.evaluate(actor, spec["action_mode"], train_wall_s=train_wall,
                                        env_steps=float(self.global_step), steps_per_s=self.sps)
            write_parquet(row, self.out_dir / f"eval_{args.eval_split}.parquet")
            write_parquet(traces, self.out_dir / f"eval_{args.eval_split}_traces.parquet")
            kpis = row.iloc[0]
            print(f"deterministic evaluation on the {args.eval_split} split:")
            for key in ("co2_kg", "grid_import_kwh", "pv_self_consumption_pct", "ev_energy_served_pct", "unserved_kwh",
                        "peak_import_kw"):
                print(f"  {key:<26} {kpis[key]:.2f}")
                self.writer.add_scalar(f"eval/{key}", float(kpis[key]), self.global_step)
            out["eval"] = row
            if args.eval_every:
                self._curve_row(row, train_wall)
        self.close()
        return out

    def out_of_memory(self, exc: BaseException, where: str, state: Callable[[], dict], in_update: bool = False):
        """In the loop's ``except RuntimeError``: re-raise anything but a CUDA out-of-memory error; for one, raise
        :class:`OutOfMemoryRestart` with the live ``state()`` copied to the CPU."""
        error = out_of_memory_message(exc)
        if error is None:
            raise exc
        if self.bar is not None:
            self.bar.close()
        self.train_wall_prev, self._start = self.wall(), None
        if not in_update:  # the iteration did not finish: it is repeated at the new size
            self.iteration -= 1
        raise OutOfMemoryRestart(where, error, to_cpu({**self.counters(), **state()}), in_update) from exc

    def close_env(self) -> None:
        """Close the env announced last (an async env's workers end), once."""
        env, self.env = getattr(self, "env", None), None
        if env is not None:
            env.close()

    def close(self) -> None:
        """Close the env, the writer and the progress bar (also on an error)."""
        self.close_env()
        if self.bar is not None:
            self.bar.close()
        if self._writer is not None:
            self._writer.close()


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, lr=None) -> None:
    """Load a saved optimizer ``state`` but keep this run's ``capturable`` flag and learning rate ``lr`` (a float or
    the device tensor annealed in place; None keeps the current one): a checkpoint from another device, or from a
    run with another LR, would bring settings this run cannot use."""
    groups = [{**saved, "capturable": group.get("capturable", False)}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    current = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict({**state, "param_groups": groups})
    for group, old in zip(optimizer.param_groups, current):
        group["lr"] = old if lr is None else lr
