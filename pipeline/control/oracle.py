"""The perfect-foresight oracle: a linear program over a whole split, solved with HiGHS.

The oracle sees the whole split at once (PV, load, MOER, every session's arrival, departure and energy)
and minimises the site's CO2 subject to a *relaxation* of the constraints of :mod:`envs.evhub`, so that
no controller run through the environment can emit less while delivering the same EV energy. It is the
physical limit every controller is reported against: the 100% of ``gap_closed_vs_rule_pct`` and of
``saving_vs_oracle_pct`` (:func:`envs.kpis.add_relative_kpis`).

Formulation (``T`` steps of ``dt`` hours, accepted sessions ``s`` with steps ``[a_s, d_s)``):

Variables, all continuous:
    ``p[s, t]``  EV power of session ``s`` in step ``t``, kW, ``0 <= p <= socket_kw[socket_s]`` (the power of
                 the session's own socket, ``SplitData.socket_kw``), only for ``a_s <= t < d_s``.
    ``ch[t]``    BESS charge power, kW, ``0 <= ch <= power_kw``.
    ``dis[t]``   BESS discharge power, kW, ``0 <= dis <= power_kw``.
    ``E[t]``     BESS energy at the END of step ``t``, kWh, ``soc_min*cap <= E <= soc_max*cap``.
    ``g[t]``     grid import, kW, ``0 <= g <= max(import_limit_kw, load[t] - pv[t])`` (the env cannot
                 cut the base load, so it may exceed the limit by that much and no more).
    ``u[t]``     PV curtailment, kW, ``0 <= u <= pv[t]``.
    ``x[t]``     grid export, kW, ``x >= 0`` if ``grid.export_allowed`` else ``x = 0``.
    ``slack[s]`` EV energy of session ``s`` not delivered by its departure, kWh, ``>= 0``.

Constraints:
    balance      ``pv[t] - u[t] + g[t] + dis[t] = load[t] + sum_s p[s, t] + ch[t] + x[t]``   (T rows)
    storage      ``E[t] = E[t-1] + eta_c*ch[t]*dt - dis[t]*dt/eta_d``, ``E[-1] = soc_initial*cap`` (T rows)
    EV energy    ``sum_t p[s, t]*dt + slack[s] = need_kwh[s]``                               (S rows)

Objective: ``min sum_t moer[t]*g[t]*dt + UNSERVED_PENALTY * sum_s slack[s]`` (kg CO2 + penalty); with
``grid.export_credit = "moer"`` the CO2 term is ``sum_t moer[t]*(g[t] - x[t])*dt`` (export credited at its
hour's MOER). The penalty (per kWh) is far above any MOER, so all EV energy is served wherever physically
possible. There is no terminal SOC constraint (the env has none either).

With the export credit the LP has no arbitrage within a step: importing and exporting in the same step cost
and earn the same MOER (a wash; the traces net such pairs out) and both are bounded (import by the limit,
export by the balance). Across steps it may store energy (from PV or from the grid at a low MOER) and later
release it while exporting at a higher MOER, paying the round-trip losses: physically allowed and intended
under marginal accounting (a kWh exported in a high-MOER hour displaces that hour's marginal generation).
The env's battery only discharges into the site's deficit, so a controller reaches this only where stored
energy covers the load and EVs while PV is exported; the oracle's bound is the looser for it.

Why it is a relaxation of the env: the env's EV power is additionally bounded below by the least-laxity
floor and above by ``need/dt`` per step and is shared earliest-deadline-first in hub mode; its battery
cannot charge and discharge in one step and discharges only into the site's deficit; it curtails only a
surplus. The LP drops all of these. Every trajectory of the env is feasible for the LP with the same CO2, so
for any controller that serves all EV energy, ``CO2_oracle <= CO2_controller``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
import scipy.sparse as sp

from envs.config import SiteConfig
from envs.kpis import TRACE_COLUMNS, check_balance, kpi_row
from envs.site import Site, SplitData, load_site

UNSERVED_PENALTY = 1e3
"""Objective weight per kWh of EV energy not delivered, kg-CO2-equivalent (MOER is below ~2 kg/kWh)."""


@dataclass(frozen=True)
class Offsets:
    """The first column of each variable of the LP (module docstring) in each block: ``(K,)`` int64 each, or one
    block's as ints (:meth:`block`). ``E`` is the BESS energy; ``defer`` (the energy a session may leave for after
    the LP's last step) is None where the LP has no such variable (the oracle's)."""

    p: np.ndarray | int
    ch: np.ndarray | int
    dis: np.ndarray | int
    E: np.ndarray | int
    g: np.ndarray | int
    u: np.ndarray | int
    x: np.ndarray | int
    slack: np.ndarray | int
    defer: np.ndarray | int | None = None

    def per_step(self) -> tuple:
        """The first columns of the per-step variables ``(ch, dis, E, g, u, x)``, in their column order (``T``
        columns each)."""
        return self.ch, self.dis, self.E, self.g, self.u, self.x

    def block(self, m: int) -> Offsets:
        """Block ``m``'s first columns, as ints (``defer`` None where the LP has none)."""
        first = {f.name: getattr(self, f.name) for f in fields(self)}
        return Offsets(**{k: None if v is None else int(v[m]) for k, v in first.items()})


@dataclass(frozen=True)
class LP:
    """A linear program of the module docstring's form, ``min c @ z`` subject to ``A_eq @ z = b_eq`` and
    ``bounds[:, 0] <= z <= bounds[:, 1]``, and its layout (:func:`assemble_lp`): ``K`` blocks one after another,
    each laid out as one LP is, columns ``[p (n_p_k), ch, dis, E, g, u, x (T each), slack (S_k), defer (S_k, where
    present)]`` and rows ``[balance (T), storage (T), EV energy (S_k)]``; the oracle's LP is one block.

    Attributes:
        c: objective, ``(n,)`` float64 (kg CO2 per unit of each column, and the unserved-energy penalty).
        A_eq: equality rows, ``(rows, n)`` sparse (CSC as assembled).
        b_eq: their right-hand sides, ``(rows,)`` float64.
        bounds: each column's lower and upper bound, ``(n, 2)`` float64 (upper ``inf`` where unbounded).
        T, S, n_p: steps, sessions and EV power columns.
        p_sess, p_step: session and step of each EV power variable, ``(n_p,)`` int64, session by session.
        p_col: the column of each EV power variable, ``(n_p,)`` int64 (in ``p_sess`` order).
        dep: each session's end step (exclusive), ``(S,)`` int64.
        off: :class:`Offsets`, each block's first column of each variable, ``(K,)`` int64 each.
        row_off: each block's first row, ``(K,)`` int64.
        col_block: the block of each column, ``(n,)`` int64.
        s_local: each session's index within its block, ``(S,)`` int64.
        nonanticipativity_rows: rows after the blocks' that tie columns of several blocks together (a two-stage LP,
            :meth:`pipeline.control.scenario.ScenarioMPC.two_stage`); 0 in :func:`assemble_lp`'s LP.
    """

    c: np.ndarray
    A_eq: sp.spmatrix
    b_eq: np.ndarray
    bounds: np.ndarray
    T: int
    S: int
    n_p: int
    p_sess: np.ndarray
    p_step: np.ndarray
    p_col: np.ndarray
    dep: np.ndarray
    off: Offsets
    row_off: np.ndarray
    col_block: np.ndarray
    s_local: np.ndarray
    nonanticipativity_rows: int = 0

    @property
    def K(self) -> int:
        """The number of blocks."""
        return len(self.row_off)


def _session_arrays(data: SplitData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Accepted sessions' ``(arrival_step, departure_step, need_kwh)``, each shape ``(S,)``."""
    s = data.sessions[~data.sessions.rejected.to_numpy(bool)]
    arr = s.arrival_step.to_numpy(np.int64)
    dep = s.departure_step.to_numpy(np.int64)
    need = s.need_kwh.to_numpy(np.float64)
    return arr, dep, need


def _session_sockets(data: SplitData) -> np.ndarray:
    """Accepted sessions' socket index, ``(S,)`` int64 (same order as :func:`_session_arrays`)."""
    return data.sessions.socket.to_numpy(np.int64)[~data.sessions.rejected.to_numpy(bool)]


def build_lp(data: SplitData) -> LP:
    """Build the oracle's LP for one split (see the module docstring for the formulation).

    Args:
        data: the discretised split (``Site.split``).

    Returns:
        :func:`assemble_lp`'s :class:`LP` over the whole split: one block, ``A_eq`` CSC ``(T + T + S, n)``, columns
        ``[p (n_p), ch (T), dis (T), E (T), g (T), u (T), x (T), slack (S)]``, no ``defer``.

    Raises:
        ValueError: a session whose steps lie outside ``[0, T]`` or whose stay is empty.
    """
    T = data.num_steps
    arr, dep, need = _session_arrays(data)
    if len(arr) and ((arr < 0).any() or (dep > T).any() or (dep <= arr).any()):
        raise ValueError(f"split '{data.split}': sessions with steps outside [0, {T}] or an empty stay")
    b = data.config.bess
    p_max = data.socket_kw[_session_sockets(data)]  # each session's own socket power, kW
    return assemble_lp(
        data.config, data.pv_kw, data.load_kw, data.moer, b.soc_initial * b.capacity_kwh, arr, dep, need, p_max=p_max
    )


def assemble_lp(
    cfg: SiteConfig,
    pv_kw: np.ndarray,
    load_kw: np.ndarray,
    moer: np.ndarray,
    energy_init_kwh: float,
    arr: np.ndarray,
    dep: np.ndarray,
    need: np.ndarray,
    p_max: np.ndarray | None = None,
    defer_kwh: np.ndarray | None = None,
    block: np.ndarray | None = None,
    n_blocks: int = 1,
    step_h: np.ndarray | None = None,
) -> LP:
    """The LP of the module docstring over ``T = len(pv_kw)`` steps from explicit arrays (shared by the
    oracle, over a whole split, and by :mod:`pipeline.control.mpc`, over a receding window); or ``K`` such LPs at
    once, stacked block-diagonally (the scenarios of :mod:`pipeline.control.scenario`).

    Args:
        cfg: the site config (BESS, EV socket power, grid limits and export credit, ``dt_h``).
        pv_kw, load_kw: the exogenous series over the ``T`` steps, ``(T,)`` each, kW; every block shares them.
        moer: kg/kWh, ``(T,)`` (every block) or ``(K, T)`` (each block its own).
        energy_init_kwh: BESS energy before step 0, kWh (every block).
        arr, dep, need: sessions' first step, end step (exclusive; ``0 <= arr < dep <= T``) and energy to
            deliver, kWh, ``(S,)`` each.
        p_max: each session's power limit, kW, ``(S,)``: the power of its socket (default ``cfg.ev.socket_kw``
            for all, right only for a site with one kind of socket).
        defer_kwh: energy of each session that may be left for after step ``T`` (kWh, ``(S,)``): adds the
            variable ``defer`` (``sum_t p*dt + slack + defer = need``, ``0 <= defer <= defer_kwh``) with zero cost;
            None: no such variable (the oracle; ``off.defer`` is None).
        block: each session's block, ``(S,)`` int in ``[0, n_blocks)``, non-decreasing; None: one block.
        n_blocks: ``K``, the number of blocks.
        step_h: each step's length, hours, ``(T,)`` (default: ``cfg.dt_h`` for all): the periods of a window whose
            later hours are planned as blocks of several steps (:mod:`pipeline.control.mpc`, move blocking); power
            stays in kW, each period's energy is its power times its length.

    Returns:
        the :class:`LP`: the ``K`` blocks' LPs one after another (columns and rows, each block laid out as one LP
        is, its sessions in their order), the same matrix as ``scipy.sparse.block_diag`` of the ``K`` LPs built
        one by one; ``A_eq`` CSC.

    Raises:
        ValueError: ``block`` out of range or decreasing, or ``moer`` of another shape.
    """
    T, S, K = len(pv_kw), len(arr), int(n_blocks)
    blk = np.zeros(S, np.int64) if block is None else np.asarray(block, dtype=np.int64)
    if len(blk) != S or (S and (blk[0] < 0 or blk[-1] >= K or (np.diff(blk) < 0).any())):
        raise ValueError(f"assemble_lp: block must be {S} non-decreasing ints in [0, {K}), got {blk}")
    moer_k = np.asarray(moer, dtype=np.float64)
    moer_k = np.broadcast_to(moer_k, (K, T)) if moer_k.ndim == 1 else moer_k
    if moer_k.shape != (K, T):
        raise ValueError(f"assemble_lp: moer must be ({T},) or ({K}, {T}), got {np.shape(moer)}")
    p_max = np.full(S, cfg.ev.socket_kw) if p_max is None else np.asarray(p_max, dtype=np.float64)
    lay = _layout(T, arr, dep, blk, K, defer_kwh is not None)
    dt = np.full(T, cfg.dt_h) if step_h is None else np.asarray(step_h, dtype=np.float64)
    A_eq, b_eq = _equalities(cfg, lay, pv_kw, load_kw, energy_init_kwh, need, dt)
    return LP(
        c=_objective(cfg, lay, moer_k, dt),
        A_eq=A_eq,
        b_eq=b_eq,
        bounds=_bounds(cfg, lay, pv_kw, load_kw, p_max, defer_kwh),
        T=T,
        S=S,
        n_p=len(lay.p_sess),
        p_sess=lay.p_sess,
        p_step=lay.p_step,
        p_col=lay.p_col,
        dep=dep,
        off=lay.off,
        row_off=lay.row_off,
        col_block=lay.col_block,
        s_local=lay.s_local,
    )


@dataclass(frozen=True)
class _Layout:
    """Where :func:`assemble_lp`'s variables and rows lie: the :class:`LP` fields of the same names, with ``blk``
    (each session's block, ``(S,)``), ``n`` and ``n_row`` (columns and rows in all)."""

    T: int
    K: int
    blk: np.ndarray
    p_sess: np.ndarray
    p_step: np.ndarray
    p_col: np.ndarray
    s_local: np.ndarray
    off: Offsets
    row_off: np.ndarray
    col_block: np.ndarray
    n: int
    n_row: int

    def cols(self, first: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
        """The columns of a per-step variable (its blocks' first columns ``first``, ``(K,)``) at steps ``k``
        (default all ``T``), block by block, ``(K * len(k),)``."""
        return (first[:, None] + (np.arange(self.T, dtype=np.int64) if k is None else k)).ravel()

    @property
    def balance(self) -> np.ndarray:
        """The balance rows, ``(K * T,)``, block by block (the storage rows follow each block's, ``+ T``)."""
        return (self.row_off[:, None] + np.arange(self.T, dtype=np.int64)).ravel()

    @property
    def ev_row(self) -> np.ndarray:
        """Each session's EV energy row, ``(S,)``."""
        return self.row_off[self.blk] + 2 * self.T + self.s_local


def _layout(T: int, arr: np.ndarray, dep: np.ndarray, blk: np.ndarray, K: int, with_defer: bool) -> _Layout:
    """The columns and rows of :func:`assemble_lp`'s ``K`` blocks over ``T`` steps for sessions ``[arr, dep)`` of
    blocks ``blk`` (``(S,)`` each); each block ``[p (n_p_k), ch, dis, E, g, u, x (T each), slack (S_k), defer (S_k,
    with_defer)]``, rows ``[balance, storage, EV]``."""
    S = len(arr)
    # EV power variables: one per (session, step of its stay), vectorised
    stay = dep - arr
    n_p = int(stay.sum())
    p_sess = np.repeat(np.arange(S, dtype=np.int64), stay)
    starts = np.cumsum(stay) - stay  # first EV variable of each session
    p_step = np.arange(n_p, dtype=np.int64) - np.repeat(starts, stay) + np.repeat(arr, stay)
    s_k = np.bincount(blk, minlength=K)  # (K,) sessions per block
    np_k = np.bincount(blk, weights=stay, minlength=K).astype(np.int64)  # (K,) EV variables per block
    size = np_k + 6 * T + s_k * (2 if with_defer else 1)
    base = np.cumsum(size) - size
    step_cols = [base + np_k + i * T for i in range(6)]  # ch, dis, E, g, u, x
    slack = base + np_k + 6 * T
    off = Offsets(base, *step_cols, slack, slack + s_k if with_defer else None)
    p_blk = blk[p_sess]
    return _Layout(
        T=T,
        K=K,
        blk=blk,
        p_sess=p_sess,
        p_step=p_step,
        p_col=base[p_blk] + np.arange(n_p, dtype=np.int64) - (np.cumsum(np_k) - np_k)[p_blk],
        s_local=np.arange(S, dtype=np.int64) - (np.cumsum(s_k) - s_k)[blk],  # each session's index in its block
        off=off,
        row_off=np.cumsum(2 * T + s_k) - (2 * T + s_k),
        col_block=np.repeat(np.arange(K), size),
        n=int(size.sum()),
        n_row=int((2 * T + s_k).sum()),
    )


def _equalities(
    cfg: SiteConfig,
    lay: _Layout,
    pv_kw: np.ndarray,
    load_kw: np.ndarray,
    energy_init_kwh: float,
    need: np.ndarray,
    dt: np.ndarray,
) -> tuple[sp.csc_matrix, np.ndarray]:
    """:func:`assemble_lp`'s equality rows, balance (``0..T-1``), storage (``T..2T-1``) and EV energy
    (``2T..2T+S_k-1``) of each block, for steps of ``dt`` hours (``(T,)``): ``(A_eq, b_eq)``, CSC ``(n_row, n)`` and
    ``(n_row,)``."""
    b, T, off = cfg.bess, lay.T, lay.off
    dt_k = np.tile(dt, lay.K)  # (K * T,) each block's steps
    steps = np.arange(T, dtype=np.int64)
    balance, ev_row = lay.balance, lay.ev_row
    storage = balance + T
    rows, cols_, vals = [], [], []

    def add(r, c, v):
        rows.append(np.asarray(r, dtype=np.int64))
        cols_.append(np.asarray(c, dtype=np.int64))
        vals.append(np.broadcast_to(np.asarray(v, dtype=np.float64), np.shape(r)))

    # balance: -u + g + dis - ch - x - sum_s p = load - pv
    add(lay.row_off[lay.blk[lay.p_sess]] + lay.p_step, lay.p_col, -1.0)
    add(balance, lay.cols(off.ch), -1.0)
    add(balance, lay.cols(off.dis), 1.0)
    add(balance, lay.cols(off.g), 1.0)
    add(balance, lay.cols(off.u), -1.0)
    add(balance, lay.cols(off.x), -1.0)
    # storage: E[t] - E[t-1] - eta_c*dt*ch[t] + dt/eta_d*dis[t] = (E_init if t == 0 else 0)
    add(storage, lay.cols(off.E), 1.0)
    add((lay.row_off[:, None] + T + steps[1:]).ravel(), lay.cols(off.E, steps[:-1]), -1.0)
    add(storage, lay.cols(off.ch), -b.eta_charge * dt_k)
    add(storage, lay.cols(off.dis), dt_k / b.eta_discharge)
    # EV energy: sum_t p*dt + slack (+ defer) = need
    add(ev_row[lay.p_sess], lay.p_col, dt[lay.p_step])
    add(ev_row, off.slack[lay.blk] + lay.s_local, 1.0)
    if off.defer is not None:
        add(ev_row, off.defer[lay.blk] + lay.s_local, 1.0)

    A_eq = _csc(np.concatenate(rows), np.concatenate(cols_), np.concatenate(vals), (lay.n_row, lay.n))
    b_eq = np.zeros(lay.n_row)
    b_eq[balance] = np.tile(load_kw - pv_kw, lay.K)
    b_eq[lay.row_off + T] = energy_init_kwh
    b_eq[ev_row] = need
    return A_eq, b_eq


def _bounds(
    cfg: SiteConfig,
    lay: _Layout,
    pv_kw: np.ndarray,
    load_kw: np.ndarray,
    p_max: np.ndarray,
    defer_kwh: np.ndarray | None,
) -> np.ndarray:
    """:func:`assemble_lp`'s column bounds, ``(n, 2)``: lower, upper (``inf`` where unbounded)."""
    b, off, K = cfg.bess, lay.off, lay.K
    lo = np.zeros(lay.n)
    hi = np.full(lay.n, np.inf)
    hi[lay.p_col] = p_max[lay.p_sess]
    hi[lay.cols(off.ch)] = b.power_kw
    hi[lay.cols(off.dis)] = b.power_kw
    lo[lay.cols(off.E)] = b.soc_min * b.capacity_kwh
    hi[lay.cols(off.E)] = b.soc_max * b.capacity_kwh
    hi[lay.cols(off.g)] = np.tile(np.maximum(cfg.grid.import_limit_kw, load_kw - pv_kw), K)
    hi[lay.cols(off.u)] = np.tile(pv_kw, K)
    if not cfg.grid.export_allowed:
        hi[lay.cols(off.x)] = 0.0
    if off.defer is not None:
        hi[off.defer[lay.blk] + lay.s_local] = defer_kwh
    return np.stack([lo, hi], axis=1)


def _objective(cfg: SiteConfig, lay: _Layout, moer_k: np.ndarray, dt: np.ndarray) -> np.ndarray:
    """:func:`assemble_lp`'s costs, ``(n,)``: kg CO2 of import (minus the export credit) and the penalty on unserved
    EV energy; ``moer_k`` ``(K, T)`` kg/kWh, ``dt`` ``(T,)`` hours."""
    off = lay.off
    c = np.zeros(lay.n)
    c[lay.cols(off.g)] = (moer_k * dt).ravel()
    if cfg.grid.export_credit == "moer":
        c[lay.cols(off.x)] = (-moer_k * dt).ravel()
    c[off.slack[lay.blk] + lay.s_local] = UNSERVED_PENALTY
    return c


def _csc(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, shape: tuple[int, int]) -> sp.csc_matrix:
    """The canonical CSC matrix of COO triplets (``(nnz,)`` each): columns in order, rows ascending within a column,
    duplicates summed; the arrays scipy's COO -> CSR -> CSC conversions give, in one sort (this runs once per MPC
    step)."""
    order = np.lexsort((rows, cols))
    r, c, v = rows[order], cols[order], vals[order]
    dup = (np.diff(c) == 0) & (np.diff(r) == 0)
    if dup.any():
        first = np.flatnonzero(np.r_[True, ~dup])
        r, c, v = r[first], c[first], np.add.reduceat(v, first)
    indptr = np.zeros(shape[1] + 1, np.int32)
    np.cumsum(np.bincount(c, minlength=shape[1]), out=indptr[1:])
    return sp.csc_matrix((v, r.astype(np.int32), indptr), shape=shape)


def solve_oracle(
    site: Site | str, split: str, time_limit_s: float = 300.0, physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Solve the perfect-foresight LP over one split and return its KPIs and traces, one row per step.

    Args:
        site: a loaded :class:`~envs.site.Site` (or anything :func:`envs.site.load_site` accepts).
        split: ``"train"`` or ``"test"``.
        time_limit_s: HiGHS wall-clock limit, seconds.
        physics_dt_h: solve it at that finer step instead (:meth:`envs.site.Site.physics_split`, the 5-minute site
            every controller is also scored on): the bound of what any controller reaches there.

    Returns:
        ``(kpi_row, traces)`` like :func:`envs.kpis.evaluate_policy`: a one-row DataFrame with
        ``controller="oracle"``, all KPI columns, ``env_steps = T`` and ``train_wall_s = 0`` (no training,
        as for the other baselines: no wall-clock figure goes into the row, so the same inputs give the same
        bytes; the build and HiGHS seconds are printed instead); and a ``(T,)``-row DataFrame with
        :data:`envs.kpis.TRACE_COLUMNS`: UTC step start ``time``, flows in kW over the step, ``co2_kg``
        (kg; import minus credited export with ``grid.export_credit = "moer"``), ``unserved_kwh`` (kWh, a
        session's undelivered energy on its last step ``departure_step-1``),
        ``soc`` at the END of the step (fraction of capacity) and ``moer_kg_per_kwh``. In steps with
        ``MOER >= 0`` the traces never import while curtailing or exporting (the LP's ties are netted out).

    Raises:
        KeyError: unknown split.
        RuntimeError: HiGHS did not reach an optimum (message names the split and HiGHS's status), or the
            solution breaks the energy balance by more than :data:`envs.kpis.BALANCE_TOL`.
    """
    site = load_site(site)
    data = site.split(split)
    if physics_dt_h is not None and physics_dt_h != data.dt_h:
        data = site.physics_split(split)
    t0 = time.perf_counter()
    lp = build_lp(data)
    T, S = lp.T, lp.S
    n_var, n_con, nnz = lp.A_eq.shape[1], lp.A_eq.shape[0], lp.A_eq.nnz
    t1 = time.perf_counter()
    from scipy.optimize import linprog  # heavy (about 1 s): imported by the solve, not by the registry

    res = linprog(
        lp.c,
        A_eq=lp.A_eq,
        b_eq=lp.b_eq,
        bounds=lp.bounds,
        method="highs",
        options={"time_limit": float(time_limit_s), "presolve": True},
    )
    t2 = time.perf_counter()
    if res.status != 0 or res.x is None:
        raise RuntimeError(
            f"oracle LP for split '{split}' not solved to optimality: HiGHS status {res.status} ({res.message}); "
            f"{n_var} variables, {n_con} constraints, {t2 - t1:.1f} s (time limit {time_limit_s} s)"
        )
    traces, slack = _oracle_traces(data, lp, res.x)
    check_balance(traces, f"oracle, {split} split")
    print(
        f"oracle {split}: {T} steps, {S} sessions, {n_var} variables ({lp.n_p} EV), {n_con} constraints, "
        f"{nnz} nonzeros; build {t1 - t0:.2f} s, HiGHS {t2 - t1:.2f} s; CO2 {traces.co2_kg.sum():.1f} kg, "
        f"unserved {slack.sum():.3f} kWh",
        flush=True,
    )
    row = kpi_row("oracle", split, traces, data, env_steps=float(T), train_wall_s=0.0)
    return row, traces


def _oracle_traces(data: SplitData, lp: LP, z: np.ndarray) -> tuple[pd.DataFrame, np.ndarray]:
    """The traces of the oracle's solution ``z`` (``(n,)``) of ``lp`` (:func:`build_lp` of ``data``), as
    :func:`solve_oracle` returns them, and each session's unserved energy, ``(S,)`` kWh."""
    cfg = data.config
    b, dt = cfg.bess, cfg.dt_h
    T, S, off = lp.T, lp.S, lp.off.block(0)

    def values(first: int, size: int) -> np.ndarray:  # a variable's columns, within their bounds
        lo_b = lp.bounds[first : first + size, 0]
        hi_b = lp.bounds[first : first + size, 1]
        return np.clip(z[first : first + size], lo_b, hi_b)  # drop solver-tolerance excursions

    p = np.clip(z[: lp.n_p], 0.0, lp.bounds[: lp.n_p, 1])  # each session's socket power
    ev_kw = np.bincount(lp.p_step, weights=p, minlength=T)
    slack = values(off.slack, S)
    unserved = np.bincount(lp.dep - 1, weights=slack, minlength=T) if S else np.zeros(T)
    g, u, x = values(off.g, T), values(off.u, T), values(off.x, T)
    # In hours with MOER = 0 (the data has some) importing while curtailing or exporting costs nothing, so
    # the LP's optimum may do both; net them out (balance kept, CO2 unchanged or lower where MOER >= 0).
    tidy = data.moer >= 0
    both = np.where(tidy, np.minimum(g, u), 0.0)
    g, u = g - both, u - both
    both = np.where(tidy, np.minimum(g, x), 0.0)
    g, x = g - both, x - both
    energy = values(off.E, T)
    traces = pd.DataFrame(
        {
            "time": data.time,
            "pv_kw": data.pv_kw,
            "pv_curtailed_kw": u,
            "grid_import_kw": g,
            "grid_export_kw": x,
            "bess_charge_kw": values(off.ch, T),
            "bess_discharge_kw": values(off.dis, T),
            "ev_charge_kw": ev_kw,
            "load_kw": data.load_kw,
            "co2_kg": (g - x * (cfg.grid.export_credit == "moer")) * data.moer * dt,
            "unserved_kwh": unserved,
            "soc": energy / max(b.capacity_kwh, 1e-9),
            "moer_kg_per_kwh": data.moer,
        }
    )[list(TRACE_COLUMNS)]
    return traces, slack


def simulate(site: Site, split: str, physics_dt_h: float | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`solve_oracle` with its default time limit: ``(kpi_row, traces)`` (the registry's runner)."""
    return solve_oracle(site, split, physics_dt_h=physics_dt_h)
