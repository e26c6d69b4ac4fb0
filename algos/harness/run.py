"""The run: one training run's folder and bookkeeping (:class:`Run`), shared by the scripts: the TensorBoard writer and
``metrics.parquet`` (one host read per log interval), the progress bar and SPS clocks, the finite-loss guard,
checkpoint save and resume, the deterministic evaluation on the site's split, policy export and the hand-over of the
live state on a CUDA out-of-memory error."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import envs
from envs.files import atomic_write
from envs.kpis import evaluate_policy, write_parquet
from envs.vector import RecordEpisodeStatistics, is_evhub

from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    cannot_resume,
    load_optimizer_state,
    read_checkpoint,
    rng_states,
    set_rng_states,
)
from .cli import EVHUB_ONLY_ARGS, env_kwargs_of, output_dir, presets_table, setup
from .episodes import evaluate_episodes
from .gpu import gpu_stats
from .oom import OutOfMemoryRestart, out_of_memory_message, to_cpu
from .policy import export_run_policy, load_policy
from .speed import COMPILE_CLOCK, synced_clock


class NonFiniteLossError(RuntimeError):
    """A loss (or a gradient norm) became NaN or infinite; training stops, the last checkpoint is kept."""


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

    def __init__(self, algo: str, args, loss_names: tuple[str, ...], presets: dict, env_defaults: dict):
        self.algo, self.args, self.loss_names = algo, args, tuple(loss_names)
        self.device = setup(args)
        self.evhub = is_evhub(args.env_id)
        self.out_dir = output_dir(args, algo)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = self.out_dir / "checkpoint.pt"
        if args.resume and not self.ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {self.ckpt_path}")
        if args.resume:
            self.args = args = self._resumed_env_kwargs(args)
        self._created = time.perf_counter()
        self.stop_reason: str | None = None
        self.stop_signal: int | None = None
        self.presets_text = presets_table(presets, env_defaults, args)
        self._writer: SummaryWriter | None = None
        self.oom_history: list[str] = []
        self.rows: list[dict] = []
        self.curve: list[dict] = []
        self.global_step, self.iteration, self.train_wall_prev = 0, 0, 0.0
        self.resumes: list[dict] = []  # one entry per --resume of this run (kept in the checkpoints)
        self.sps = self.sps_steady = 0.0
        self.bar = None
        self._site = None
        COMPILE_CLOCK.reset()
        self._compile_shown = 0.0

    def _resumed_env_kwargs(self, args):
        """``args`` with the run's recorded ``--env-kwargs`` (``config.json``) where none are given.

        Raises:
            CheckpointError: other ``--env-kwargs`` than the run was trained with."""
        config = self.out_dir / "config.json"
        if not config.is_file():
            return args
        recorded = json.loads(config.read_text()).get("env_kwargs", "")
        if not args.env_kwargs:
            if recorded:
                print(f"resume: --env-kwargs {recorded} (from {config})")
            return dataclasses.replace(args, env_kwargs=recorded)
        if env_kwargs_of(args.env_kwargs) != env_kwargs_of(recorded):
            raise CheckpointError(
                cannot_resume(
                    self.ckpt_path,
                    f"it was trained with --env-kwargs {recorded or '(none)'!r}, not {args.env_kwargs!r} "
                    f"({config}); give the same or none",
                )
            )
        return args

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
        where = (
            f"site={args.site} action_mode={getattr(args, 'action_mode', 'discrete')}"
            if self.evhub
            else ("torch-batched" if env.torch_batched else f"vector_mode={env.vector_mode}")
        )
        print(
            f"{self.algo.upper()} on {args.env_id} {where} device={self.device} preset={args.preset}: {what}; "
            f"output {self.out_dir}"
        )
        print(f"presets (* = {args.preset}; any field can be set on the command line):\n{self.presets_text}")
        print("args: " + ", ".join(f"{k}={v}" for k, v in self.shown_args(**sizes).items()), flush=True)
        config = {**dataclasses.asdict(args), "algo": self.algo}
        atomic_write(
            self.out_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2, default=str))
        )
        if getattr(env, "flattened", None) is not None:
            note = (
                f"observations of {args.env_id} flattened from {env.flattened} to {env.obs_shape[0]} floats by "
                f"gymnasium's FlattenObservation"
            )
            print(f"note: {note}")
            self.writer.add_text("notes", note, self.global_step)
        if not self.evhub and args.eval_split.lower() != "none":
            print(
                f"note: no split evaluation for {args.env_id} (eval_split={args.eval_split!r} applies to EVHub-v0 only)"
            )
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
        return {
            "format": CHECKPOINT_FORMAT,
            "algo": self.algo,
            "env_id": self.args.env_id,
            "global_step": self.global_step,
            "iteration": self.iteration,
            "train_wall_s": self.wall(),
            "args": dataclasses.asdict(self.args),
            "rng": rng_states(),
            "resumes": self.resumes,
        }

    @staticmethod
    def _load(state: dict, modules: dict[str, nn.Module], optimizers: dict, lrs: dict | None, error) -> None:
        """Load ``modules`` and ``optimizers`` from the entries of ``state`` of the same name (:meth:`restore`);
        ``error(what)`` is the message of the :class:`CheckpointError` raised when they do not fit."""
        try:
            for name, module in modules.items():
                module.load_state_dict(state[name])
            for name, opt in optimizers.items():
                if opt is not None and state.get(name) is not None:
                    load_optimizer_state(opt, state[name], (lrs or {}).get(name))
        except (KeyError, RuntimeError, ValueError) as exc:
            what = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            raise CheckpointError(error(f"it does not fit this run's networks ({what})")) from exc

    def restore(
        self, state: dict | None, modules: dict[str, nn.Module], optimizers: dict, env, lrs: dict | None = None
    ):
        """Load the live ``state`` handed over after an out-of-memory error, else, with ``--resume``, the checkpoint;
        returns the loaded dict (None for a fresh start, whose networks ``--init-from`` may have set) and sets the
        counters.

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
            if self.args.init_from:  # fine-tuning: the networks only (their observation statistics included)
                init = Path(self.args.init_from)
                init = init / "checkpoint.pt" if init.is_dir() else init
                initial = read_checkpoint(init, self.device, self.algo, self.args.env_id)
                self._load(initial, modules, {}, None, lambda what: f"--init-from {init}: {what}")
            return None
        path = self.ckpt_path
        if state is None:
            state = read_checkpoint(path, self.device, self.algo, self.args.env_id)
        self._load(state, modules, optimizers, lrs, lambda what: cannot_resume(path, what))
        self.global_step, self.iteration = int(state["global_step"]), int(state["iteration"])
        self.train_wall_prev = float(state.get("train_wall_s", 0.0))
        set_rng_states(state["rng"])
        same = state.get("env") is not None and state.get("num_envs") == env.num_envs and env.torch_batched
        if same:
            env.load_state_dict(state["env"])
        else:
            if state.get("env") is not None or not env.torch_batched:
                reason = (
                    f"num_envs changed ({state.get('num_envs')} -> {env.num_envs})"
                    if env.torch_batched
                    else f"the state of a gymnasium env ({self.args.env_id}) cannot be checkpointed"
                )
                print(f"resume: {reason}; envs start new episodes")
            if state.get("env") is not None:
                env.load_state_dict(state["env"], statistics_only=True)
        if self.args.resume and not self.oom_history:  # exact: every state of the interrupted run is back
            self.resumes = [*state.get("resumes", []), {"from_global_step": self.global_step, "exact": same}]
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

    def resume_note(self, **facts) -> None:
        """Add ``facts`` to this resume's entry in :attr:`resumes` and print them (the replay buffer's restore:
        ``replay_buffer`` what was done, ``exact=False`` where the buffer is not the interrupted run's). At the end
        the entries are written to ``resumes.json`` (:meth:`finish`)."""
        if self.resumes:
            self.resumes[-1].update(facts, exact=bool(self.resumes[-1]["exact"] and facts.get("exact", True)))
        for key, value in facts.items():
            if key != "exact":
                print(f"resume: {value}" if key == "replay_buffer" else f"resume: {key} {value}")

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
        previous = self._catch_stop_signals()
        try:
            for iteration in range(first, num_iterations + 1):
                if iteration == half:
                    self._steady = (synced_clock(self.device), self.global_step)
                self.iteration = iteration
                yield iteration
                self.bar.update()
                if self.stopping():
                    break
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self.bar.close()
        if self.stop_reason:
            print(
                f"{self.stop_reason}: stopped at global_step {self.global_step:,}, iteration {self.iteration} of "
                f"{num_iterations}; saving the checkpoint and the policy (--resume continues)",
                flush=True,
            )
        end = synced_clock(self.device)
        self.sps_steady = (
            (self.global_step - self._steady[1]) / max(end - self._steady[0], 1e-9) if self._steady else self.sps
        )
        self.train_wall_prev, self._start = self.train_wall_prev + end - self._start, None

    def steps_to_train(self, num_iterations: int, per_iteration: int) -> str:
        """The env steps the run trains to, as the scripts announce them: whole iterations of ``per_iteration`` steps
        up to iteration ``num_iterations``, with a note where that is not ``--total-timesteps``."""
        steps = self.global_step + (num_iterations - self.iteration) * per_iteration
        total = self.args.total_timesteps
        note = (
            "" if steps == total else f" (--total-timesteps {total:,} in whole iterations of {per_iteration:,} steps)"
        )
        return f"{steps:,} steps{note}"

    def _catch_stop_signals(self) -> dict:
        """Make SIGINT and SIGTERM stop the run after the iteration in progress (a second one acts at once); returns
        the handlers they replace. Only in the main thread (a Dask worker's thread keeps the process's handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}

        def stop(signum, frame):
            self.stop_reason, self.stop_signal = signal.Signals(signum).name, signum
            signal.signal(signum, previous[signum])
            print(f"\n{self.stop_reason}: stopping after this iteration (send it again to stop at once)", flush=True)

        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, stop)
        return previous

    def stopping(self) -> bool:
        """True once a stop is due: SIGINT or SIGTERM received, or ``--max-wall-s`` seconds since the run began (which
        sets :attr:`stop_reason`)."""
        limit = self.args.max_wall_s
        if not self.stop_reason and limit and time.perf_counter() - self._created >= limit:
            self.stop_reason = f"--max-wall-s {limit:g}"
        return self.stop_reason is not None

    def wall(self) -> float:
        """Training wall time so far in seconds (evaluations left out), over every session of the run."""
        return self.train_wall_prev + (time.perf_counter() - self._start if getattr(self, "_start", None) else 0.0)

    def last_iteration(self) -> bool:
        """True on the run's last iteration: the planned last, or the one a stop (:meth:`stopping`) ends with."""
        return self.iteration == self.num_iterations or self.stopping()

    def every(self, n: int) -> bool:
        """True on every ``n``-th iteration (never for ``n = 0``), not counting the last (its own work follows)."""
        return bool(n) and self.iteration % n == 0 and not self.last_iteration()

    def logging_now(self) -> bool:
        """True on the iterations that log: every ``args.log_every``-th and the last."""
        return self.iteration % max(1, self.args.log_every) == 0 or self.last_iteration()

    def new_guard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Device flags of the finite-loss guard: ``(bad_any (len(loss_names),) bool, first_bad_step () int64)``."""
        return (
            torch.zeros(len(self.loss_names), dtype=torch.bool, device=self.device),
            torch.full((), -1, dtype=torch.int64, device=self.device),
        )

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
            kept = (
                f"the last good checkpoint {self.ckpt_path} is left untouched"
                if self.ckpt_path.exists()
                else ("no checkpoint was written")
            )
            raise NonFiniteLossError(
                f"non-finite {', '.join(names)} in the update at global_step {step}; training stopped, {kept}"
            )

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
        totals, flags, rest = (
            values[:n_totals],
            values[n_totals : n_totals + len(self.loss_names) + 1],
            values[n_totals + len(self.loss_names) + 1 :],
        )
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
        if COMPILE_CLOCK.total_s() != self._compile_shown:  # new graphs compiled or captured since the last log
            self._compile_shown = COMPILE_CLOCK.total_s()
            print(COMPILE_CLOCK.summary(), flush=True)
            self.writer.add_scalar("perf/compile_s", self._compile_shown, step)
        for tag, value in {**host, "charts/SPS": int(self.sps), **gpu}.items():
            if math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        metrics = {
            "global_step": step,
            "wall_s": self.train_wall_prev + wall,
            "sps": self.sps,
            **{f"episodic_{k}": ep.get(k, math.nan) for k in ("return", "length", "co2_kg", "unserved_kwh")},
            **{tag.split("/", 1)[-1]: value for tag, value in host.items()},
            **row,
            **{key.removeprefix("perf/"): value for key, value in gpu.items()},
        }
        self.rows.append(metrics)
        write_parquet(pd.DataFrame(self.rows), self.out_dir / "metrics.parquet")
        self.bar.set_postfix(sps=int(self.sps), ret=f"{ep['return']:.1f}", refresh=False)
        last = self.last_iteration()
        tenth = max(1, self.num_iterations // max(1, self.args.log_every) // 10)
        if last or (self.bar.disable and (self.iteration // max(1, self.args.log_every)) % tenth == 0):
            site = f"co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} " if self.evhub else ""
            shown = " ".join(f"{t.split('/', 1)[-1]} {v:.4g}" for t, v in host.items() if t.startswith("losses/"))
            print(
                f"iter {self.iteration}/{self.num_iterations} step {step} SPS {int(self.sps)} return "
                f"{ep['return']:.2f} length {ep['length']:.1f} {site}{shown}",
                flush=True,
            )
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

        return evaluate_policy(
            policy,
            self.site(),
            self.args.eval_split,
            self.algo,
            action_mode,
            self.device,
            bess_action=self.args.bess_action,
            **extra,
        )

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
        self.curve.append(
            {
                "global_step": int(self.global_step),
                "train_wall_s": float(train_wall_s),
                **{c: float(k[c]) for c in ("co2_kg", "unserved_kwh", "ev_energy_served_pct")},
            }
        )
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
        path = export_run_policy(args, env, actor, self.out_dir, action_mode)
        spec = {"action_mode": action_mode or getattr(args, "action_mode", None)}
        if self.resumes:
            atomic_write(self.out_dir / "resumes.json", lambda tmp: tmp.write_text(json.dumps(self.resumes, indent=2)))
        train_wall = self.train_wall_prev
        print(
            f"training: {self.global_step:,} steps in {train_wall:.1f} s ({self.sps:.0f} SPS, {self.sps_steady:.0f} "
            f"over the second half); policy saved to {path}"
        )
        out = {
            "global_step": self.global_step,
            "train_wall_s": train_wall,
            "sps": self.sps,
            "sps_steady": self.sps_steady,
            "policy": str(path),
            "vector_mode": None if env.torch_batched else env.vector_mode,
            "resumes": self.resumes,
            "compile_s": COMPILE_CLOCK.total_s(),
            "compile_graphs": sum(COMPILE_CLOCK.graphs.values()),
            "recompiles": sum(COMPILE_CLOCK.late_graphs.values()),
            "stopped": self.stop_reason,
            "stopped_by_signal": self.stop_signal,
            **result,
        }
        if args.compile or args.cudagraphs:
            print(COMPILE_CLOCK.summary())
        self.close_env()
        if self.stop_reason:
            print("the run stopped early: no final evaluation (--resume trains on and evaluates)")
        elif not self.evhub and args.eval_episodes > 0:
            out["eval_episodes"] = self.evaluate_episodes(path)
        if self.evhub and args.eval_split.lower() != "none" and not self.stop_reason:
            row, traces = self.evaluate(
                actor,
                spec["action_mode"],
                train_wall_s=train_wall,
                env_steps=float(self.global_step),
                steps_per_s=self.sps,
            )
            write_parquet(row, self.out_dir / f"eval_{args.eval_split}.parquet")
            write_parquet(traces, self.out_dir / f"eval_{args.eval_split}_traces.parquet")
            kpis = row.iloc[0]
            print(f"deterministic evaluation on the {args.eval_split} split:")
            for key in (
                "co2_kg",
                "grid_import_kwh",
                "pv_self_consumption_pct",
                "ev_energy_served_pct",
                "unserved_kwh",
                "peak_import_kw",
            ):
                print(f"  {key:<26} {kpis[key]:.2f}")
                self.writer.add_scalar(f"eval/{key}", float(kpis[key]), self.global_step)
            out["eval"] = row
            if args.eval_every:
                self._curve_row(row, train_wall)
        self.close()
        return out

    def evaluate_episodes(self, policy_path: Path) -> pd.DataFrame:
        """``--eval-episodes`` episodes of the exported deterministic policy (:func:`evaluate_episodes`), written to
        ``eval_episodes.parquet`` and TensorBoard (``eval/episodic_return_mean``, ``_std``, ``eval/episodic_length``);
        returns the per-episode rows."""
        args = self.args
        rows = evaluate_episodes(
            load_policy(policy_path), args.env_id, env_kwargs_of(args.env_kwargs), args.eval_episodes, args.seed
        )
        write_parquet(rows, self.out_dir / "eval_episodes.parquet")
        mean, std = float(rows["return"].mean()), float(rows["return"].std(ddof=0))
        self.writer.add_scalar("eval/episodic_return_mean", mean, self.global_step)
        self.writer.add_scalar("eval/episodic_return_std", std, self.global_step)
        self.writer.add_scalar("eval/episodic_length", float(rows["length"].mean()), self.global_step)
        print(f"deterministic evaluation over {len(rows)} episodes of {args.env_id}: return {mean:.2f} +- {std:.2f}")
        return rows

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
