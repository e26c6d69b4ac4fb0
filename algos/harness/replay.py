"""The replay memory of the off-policy scripts (``algos/dqn.py``, ``algos/sac.py``) and what a checkpoint keeps of it.

:class:`ReplayBuffer` is the circular memory itself. :class:`ReplayLog` makes a resumed run equal the uninterrupted
one without storing the buffer's rows: a torch-batched env is deterministic given its state and the actions, so the
checkpoint keeps a snapshot of the env (state and observation) from before the buffer's oldest row and every action
taken since, and the resume steps the env through those actions again, writing the same rows in the same places.
The actions are a small part of a row (one int64 for DQN's 184-float observations, twice over), and the replay
costs env steps only, no network call and no gradient step.

Sizes (rows of ``buffer_size`` transitions, EVHub-v0 on the shipped caltech site; the observation is 184 float32):
the rows themselves are ``2 x 184 x 4 + 16`` bytes a transition (obs, next_obs, action, reward, done), the log at most
``2 x buffer_size`` actions and one env snapshot per lap of the buffer; :func:`checkpoint_buffer` says which it wrote.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checkpoint import rng_states, set_rng_states


class ReplayBuffer:
    """Circular replay memory of preallocated tensors on ``device``.

    Fields (:data:`FIELDS`): ``obs`` and ``next_obs`` ``(capacity, *obs_shape)`` of ``obs_dtype``, ``actions``
    ``(capacity, *action_shape)`` of ``action_dtype`` (DQN: ``()`` int64 indices; SAC: ``(act_dim,)`` float32 in
    [-1, 1]), ``rewards`` and ``dones`` (0/1) float32 ``(capacity,)``.

    :meth:`add` writes ``n`` rows at the write position, wrapping past the end over the oldest rows. ``pos`` (next row
    written) and ``size`` (rows filled) are host ints that only the writer changes, by known amounts, so nothing is
    read back from the device; ``size_t`` is ``size`` as a device scalar for a sampler that must not sync (DQN's
    captured update sees the buffer grow), and ``pos_t`` is ``pos`` as an int64 ``(1,)`` device tensor that
    :meth:`write` reads and advances in place, so a compiled or captured env step writes at the right rows on every
    call (one element, not 0-d: torch.compile drops in-place updates of 0-d CPU tensors it takes for constants).
    Until the buffer wraps, its filled rows are ``0 .. size - 1``.
    """

    FIELDS = ("obs", "actions", "rewards", "next_obs", "dones")

    def __init__(
        self,
        capacity: int,
        obs_shape: int | tuple[int, ...],
        device: torch.device,
        action_shape: tuple[int, ...] = (),
        action_dtype: torch.dtype = torch.int64,
        obs_dtype: torch.dtype = torch.float32,
    ):
        self.capacity, self.device = int(capacity), torch.device(device)
        obs_shape = (obs_shape,) if isinstance(obs_shape, int) else tuple(obs_shape)
        z = lambda shape, dtype=torch.float32: torch.zeros(self.capacity, *shape, device=device, dtype=dtype)  # noqa: E731
        self.data = {
            "obs": z(obs_shape, obs_dtype),
            "actions": z(tuple(action_shape), action_dtype),
            "rewards": z(()),
            "next_obs": z(obs_shape, obs_dtype),
            "dones": z(()),
        }
        self.pos, self.size = 0, 0
        self.pos_t = torch.zeros(1, dtype=torch.int64, device=device)
        self.size_t = torch.zeros((), device=device)

    def add(self, obs, actions, rewards, next_obs, dones) -> None:
        """Write ``n`` transitions (first dimension ``n``; ``dones`` may be bool).

        Raises:
            ValueError: ``n > capacity``.
        """
        n = obs.shape[0]
        if n > self.capacity:
            raise ValueError(f"buffer_size {self.capacity} is smaller than one batch of {n} transitions")
        self.write(obs, actions, rewards, next_obs, dones)
        self.advance(n)

    def write(self, obs, actions, rewards, next_obs, dones) -> None:
        """The tensor half of :meth:`add`: the ``n`` rows written at ``pos_t``, which advances in place. No host state
        read or changed, no host sync: it runs inside a compiled or captured step."""
        n = obs.shape[0]
        idx = (self.pos_t + torch.arange(n, device=self.device)) % self.capacity
        for key, value in zip(self.FIELDS, (obs, actions, rewards, next_obs, dones)):
            self.data[key].index_copy_(0, idx, value.to(self.data[key].dtype))
        self.pos_t.add_(n).remainder_(self.capacity)

    def advance(self, n: int) -> None:
        """The host half of :meth:`add`: ``pos``, ``size`` and ``size_t`` after a :meth:`write` of ``n`` rows."""
        self.seek((self.pos + n) % self.capacity, min(self.size + n, self.capacity))

    def seek(self, pos: int, size: int) -> None:
        """Set the write position and the filled-row count (host and device copies)."""
        self.pos, self.size = int(pos), int(size)
        self.pos_t.fill_(self.pos)
        self.size_t.fill_(self.size)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``batch_size`` rows drawn uniformly with replacement among the filled ones: a dict of the :data:`FIELDS`.

        Raises:
            ValueError: the buffer is empty.
        """
        if self.size == 0:
            raise ValueError("sample from an empty replay buffer")
        idx = torch.randint(0, self.size, (batch_size,), device=self.device, generator=generator)
        return {key: value.index_select(0, idx) for key, value in self.data.items()}

    def sample_on_device(self, batch_size: int) -> dict[str, torch.Tensor]:
        """:meth:`sample` that reads the filled-row count from the device (``size_t``), never from the host, so a
        compiled or captured update sees the buffer grow: ``floor(u * size)`` for ``u ~ U[0, 1)`` (``torch.rand``;
        other draws than :meth:`sample`'s ``torch.randint``). An empty buffer gives row 0."""
        idx = (torch.rand(batch_size, device=self.device) * self.size_t).long().clamp(max=self.capacity - 1)
        return {key: value[idx] for key, value in self.data.items()}

    def rows(self, key: str, first: int, end: int) -> torch.Tensor:
        """Field ``key`` of the transitions numbered ``first .. end - 1`` since the buffer's first write (transition
        ``j`` sits in row ``j % capacity``), oldest first; only those still held are meaningful."""
        idx = torch.arange(first, end, device=self.device) % self.capacity
        return self.data[key].index_select(0, idx)

    def state_dict(self) -> dict:
        """``{"pos", "size", "capacity"}`` and the ``size`` filled rows of each field, copied to the CPU with their own
        storage (a slice would make ``torch.save`` write all ``capacity`` rows)."""
        rows = {key: value[: self.size].to("cpu", copy=True) for key, value in self.data.items()}
        return {"pos": self.pos, "size": self.size, "capacity": self.capacity, **rows}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` in place: into the same ``capacity`` exactly (rows, ``pos``, ``size``); into
        another, the newest ``min(size, capacity)`` transitions, oldest first from row 0.

        Raises:
            ValueError: the stored rows do not fit this buffer (another observation or action shape) or disagree
                with ``size``.
        """
        n, old_capacity, pos = int(state["size"]), int(state["capacity"]), int(state["pos"])
        for key in self.FIELDS:
            if state[key].shape[0] != n or state[key].shape[1:] != self.data[key].shape[1:]:
                raise ValueError(
                    f"stored replay buffer field {key!r} has shape {tuple(state[key].shape)}, expected "
                    f"({n}, {', '.join(map(str, self.data[key].shape[1:]))}) for this buffer"
                )
        if old_capacity == self.capacity:
            for key in self.FIELDS:
                self.data[key][:n].copy_(state[key])
            self.seek(pos, n)
            return
        order = torch.arange(n) if n < old_capacity else (torch.arange(n) + pos) % n  # oldest first
        keep = order[max(0, n - self.capacity) :]
        for key in self.FIELDS:
            self.data[key][: len(keep)].copy_(state[key].index_select(0, keep.to(state[key].device)))
        self.seek(len(keep) % self.capacity, len(keep))


@dataclass
class Snapshot:
    """The env at global step ``step`` (transitions written before it): its ``state`` (``env.state_dict()``, which
    copies) and the observation ``obs`` its next step acts on."""

    step: int
    state: dict
    obs: torch.Tensor

    def to(self, device) -> Snapshot:
        """A copy with every tensor on ``device``."""
        return Snapshot(self.step, _tree_to(self.state, device), self.obs.to(device, copy=True))


def _tree_to(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device, copy=True)
    if isinstance(tree, dict):
        return {k: _tree_to(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_to(v, device) for v in tree)
    return tree


class ReplayLog:
    """The actions since an env snapshot older than a :class:`ReplayBuffer`'s oldest row, from which the buffer is
    rebuilt on resume (module docstring).

    Call :meth:`mark` at every iteration boundary, before the iteration steps the envs. Transition ``j`` (counted by
    the global step) sits in buffer row ``j % capacity``. Before the next iteration would write over the first action
    the log does not yet hold, the log copies the buffer's actions since then and takes a snapshot of the env; the
    snapshots no checkpoint can start from any more (one at or before the oldest row ``capacity`` transitions ago
    is kept) are dropped with their actions. The log holds at most about ``2 x capacity`` actions and two or three
    snapshots, and does nothing between those points but compare two ints.

    Args:
        rb: the buffer; its ``pos`` must equal the global step modulo its capacity when the log starts.
        iteration_steps: transitions written per iteration (``num_envs x num_steps``); a log needs
            ``iteration_steps <= capacity``.
    """

    def __init__(self, rb: ReplayBuffer, iteration_steps: int):
        self.rb, self.iteration_steps = rb, int(iteration_steps)
        self.snapshots: list[Snapshot] = []
        self.actions = rb.data["actions"][:0].clone()  # the actions of transitions start .. end - 1
        self.start = self.end = 0

    def mark(self, env, obs: torch.Tensor, global_step: int) -> None:
        """At an iteration boundary (``global_step`` transitions written, the envs about to act on ``obs``)."""
        j, cap = int(global_step), self.rb.capacity
        if not self.snapshots:
            self.start = self.end = j
        elif j + self.iteration_steps - cap > self.end:  # the next iteration overwrites action `end`
            self.actions = torch.cat([self.actions, self.rb.rows("actions", self.end, j)])
            self.end = j
        else:
            return
        self.snapshots.append(Snapshot(j, env.state_dict(), obs.clone()))
        usable = [i for i, s in enumerate(self.snapshots) if s.step <= j - cap]  # every later checkpoint can use
        if usable and usable[-1] > 0:
            self.snapshots = self.snapshots[usable[-1] :]
            first = self.snapshots[0].step
            self.actions = self.actions[first - self.start :].clone()
            self.start = first

    def state(self, global_step: int) -> dict | None:
        """What a checkpoint at ``global_step`` (an iteration boundary) keeps to rebuild the buffer: the snapshots
        from the last one at or before the oldest row on (on the CPU), every action since the first of them, the
        buffer's ``size`` and the log's bookkeeping. None where the log cannot rebuild it: the buffer holds rows from
        before the log's first snapshot (a run resumed from stored rows, or from a hand-over after an out-of-memory
        error, during its first lap), or its rows are not where the global step puts them."""
        j, rb = int(global_step), self.rb
        if self.iteration_steps > rb.capacity or rb.pos != j % rb.capacity:
            return None
        anchors = [i for i, s in enumerate(self.snapshots) if s.step <= j - rb.size]
        if not anchors:
            return None
        kept = self.snapshots[anchors[-1] :]
        first = kept[0].step
        actions = torch.cat([self.actions[first - self.start :], rb.rows("actions", self.end, j)])
        return {
            "snapshots": [s.to("cpu") for s in kept],
            "actions": actions.to("cpu"),
            "logged_to": self.end,
            "global_step": j,
            "size": rb.size,
        }

    def rebuild(
        self, saved: dict, env, step: Callable, num_envs: int, final_state: dict, final_obs: torch.Tensor
    ) -> bool:
        """Rebuild the buffer from :meth:`state` ``saved``: the env is loaded with the first snapshot and stepped
        through the saved actions, ``num_envs`` at a time, each step's transitions written by ``step(obs, actions)``
        (the script's env step and buffer write: it returns the next observation); the log is restored to what it
        was. The global random-number states are left as they were, and the env is then loaded with the
        checkpoint's ``final_state``. Returns whether the replay ended at the checkpoint's observation
        ``final_obs`` (False: the env was not deterministic, e.g. a compiled step whose arithmetic differs).

        Raises:
            ValueError: the saved actions do not fill whole steps of ``num_envs`` (another ``num_envs``).
        """
        rb, device = self.rb, self.rb.device
        first = saved["snapshots"][0]
        actions = saved["actions"]
        j = int(saved["global_step"])
        if actions.shape[0] != j - first.step or actions.shape[0] % num_envs:
            raise ValueError(
                f"the checkpoint's replay log holds {actions.shape[0]} actions from global_step {first.step} to "
                f"{j}, not whole steps of {num_envs} envs"
            )
        rng = rng_states()
        try:
            env.load_state_dict(_tree_to(first.state, device))
            obs = first.obs.to(device)
            rb.seek(first.step % rb.capacity, max(0, int(saved["size"]) - actions.shape[0]))
            with torch.no_grad():
                for k in range(0, actions.shape[0], num_envs):
                    obs = step(obs, actions[k : k + num_envs].to(device))
        finally:
            set_rng_states(rng)
            env.load_state_dict(final_state)
        self.snapshots = [s.to(device) for s in saved["snapshots"]]
        self.start, self.end = first.step, int(saved["logged_to"])
        self.actions = actions[: self.end - self.start].to(device)
        return bool(torch.equal(obs, final_obs.to(device)))


def store(rb: ReplayBuffer, obs, actions, result: tuple, bootstrap_truncation: bool, reward_scale: float, advance=True):
    """Write the transitions of one env step into ``rb`` and return the next observation. ``result`` is the env's
    ``(next_obs, reward, terminated, truncated, info)``; the stored next state is ``info["final_obs"]`` (an ended
    episode's last observation), the stored reward is scaled by ``reward_scale``, and ``done`` is ``terminated``,
    or also ``truncated`` unless ``bootstrap_truncation``. ``advance=False`` writes only the tensors
    (:meth:`ReplayBuffer.write`, for a compiled or captured step; the caller advances). No host sync."""
    next_obs, rewards, terminated, truncated, info = result
    dones = terminated if bootstrap_truncation else terminated | truncated
    (rb.add if advance else rb.write)(obs, actions, rewards * reward_scale, info["final_obs"], dones)
    return next_obs


def checkpoint_buffer(rb: ReplayBuffer, log: ReplayLog | None, global_step: int, rows: bool) -> dict | None:
    """The checkpoint's ``replay_buffer`` entry: ``{"rows": ...}`` (:meth:`ReplayBuffer.state_dict`) when ``rows``,
    else ``{"log": ...}`` (:meth:`ReplayLog.state`) where the log can rebuild the buffer, else the rows where the
    buffer is all the run has of it (no log: a gymnasium env, whose state a checkpoint cannot hold) only if ``rows``;
    None: a resumed run refills the buffer."""
    if rows:
        return {"rows": rb.state_dict()}
    state = None if log is None else log.state(global_step)
    return None if state is None else {"log": state}


def restore_buffer(
    rb: ReplayBuffer,
    log: ReplayLog | None,
    saved: dict | None,
    env,
    step: Callable,
    num_envs: int,
    final_state: dict | None,
    final_obs: torch.Tensor,
) -> tuple[str, bool]:
    """Restore a checkpoint's ``replay_buffer`` entry (:func:`checkpoint_buffer`) into ``rb``: the stored rows, or the
    rows rebuilt by :meth:`ReplayLog.rebuild` (``final_state``: the checkpoint's env state, None where the env
    starts new episodes and cannot be replayed). Returns ``(message, exact)``: what was done, for the run's log, and
    whether the buffer is the one the interrupted run had (False: refilled, or a replay that diverged)."""
    if saved is None:
        return "replay buffer not stored, refilling it", False
    if "rows" in saved:
        rb.load_state_dict(saved["rows"])
        return f"replay buffer {rb.size:,} rows restored", True
    if log is None or final_state is None:
        return "replay buffer not stored, only its replay log, which these envs cannot replay; refilling it", False
    t0 = time.perf_counter()
    try:
        exact = log.rebuild(saved["log"], env, step, num_envs, final_state, final_obs)
    except ValueError as exc:
        return f"replay buffer not rebuilt ({exc}); refilling it", False
    steps = saved["log"]["actions"].shape[0] // num_envs
    how = "the same" if exact else "NOT the same: the env did not replay deterministically"
    message = (
        f"replay buffer {rb.size:,} rows rebuilt by replaying {steps:,} env steps from global_step "
        f"{saved['log']['snapshots'][0].step:,} in {time.perf_counter() - t0:.1f} s ({how} as the interrupted run's)"
    )
    return message, exact
