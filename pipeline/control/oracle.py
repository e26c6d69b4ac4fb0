"""The perfect-foresight oracle: a linear program over a whole split, solved with HiGHS.

The oracle sees the whole split at once (PV, load, MOER, every session's arrival, departure and energy)
and minimises the site's CO2 subject to a *relaxation* of the constraints of :mod:`envs.evhub`, so that
no controller run through the environment can emit less while delivering the same EV energy. It is the
physical limit every controller is reported against (``oracle_gap_closed_pct``).

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

import numpy as np
import pandas as pd
import scipy.sparse as sp

from envs.config import SiteConfig
from envs.kpis import TRACE_COLUMNS, check_balance, kpi_row
from envs.site import Site, SplitData, load_site

UNSERVED_PENALTY = 1e3
"""Objective weight per kWh of EV energy not delivered, kg-CO2-equivalent (MOER is below ~2 kg/kWh)."""


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


def build_lp(data: SplitData) -> dict:
    """Build the oracle's LP for one split (see the module docstring for the formulation).

    Args:
        data: the discretised split (``Site.split``).

    Returns:
        dict with ``c`` (objective, shape ``(n,)``), ``A_eq`` (CSC, ``(T + T + S, n)``), ``b_eq``,
        ``bounds`` (``(n, 2)``), and the index helpers ``T``, ``S``, ``n_p`` (number of EV power
        variables), ``p_sess``, ``p_step`` (session and step of each EV variable, ``(n_p,)``),
        ``off`` (dict: first column of each variable block ``p, ch, dis, E, g, u, x, slack``),
        ``dep`` (departure step of each accepted session, ``(S,)``).
        Column order: ``[p (n_p), ch (T), dis (T), E (T), g (T), u (T), x (T), slack (S)]``.

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
) -> dict:
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
            block ``defer`` (``sum_t p*dt + slack + defer = need``, ``0 <= defer <= defer_kwh``) with zero cost;
            None: no such block (the oracle).
        block: each session's block, ``(S,)`` int in ``[0, n_blocks)``, non-decreasing; None: one block.
        n_blocks: ``K``, the number of blocks.

    Returns:
        the dict described in :func:`build_lp`; with ``defer_kwh`` each block's columns end with ``defer (S_k)``.
        With ``block`` given, the LP is the ``K`` blocks' LPs one after another (columns and rows, each block laid
        out as one LP is, its sessions in their order), the same matrix as ``scipy.sparse.block_diag`` of the
        ``K`` LPs built one by one; then ``off`` maps each name to a ``(K,)`` int64 array (each block's first
        column of it), and the dict adds ``row_off`` (``(K,)``: each block's first row), ``col_block`` (``(n,)``:
        the block of each column), ``p_col`` (``(n_p,)``: the column of each EV variable, in ``p_sess`` order) and
        ``s_local`` (``(S,)``: each session's index within its block).

    Raises:
        ValueError: ``block`` out of range or decreasing, or ``moer`` of another shape.
    """
    b, dt = cfg.bess, cfg.dt_h
    T = len(pv_kw)
    S = len(arr)
    K = int(n_blocks)
    blk = np.zeros(S, np.int64) if block is None else np.asarray(block, dtype=np.int64)
    if len(blk) != S or (S and (blk[0] < 0 or blk[-1] >= K or (np.diff(blk) < 0).any())):
        raise ValueError(f"assemble_lp: block must be {S} non-decreasing ints in [0, {K}), got {blk}")
    moer_k = np.asarray(moer, dtype=np.float64)
    moer_k = np.broadcast_to(moer_k, (K, T)) if moer_k.ndim == 1 else moer_k
    if moer_k.shape != (K, T):
        raise ValueError(f"assemble_lp: moer must be ({T},) or ({K}, {T}), got {np.shape(moer)}")
    p_max = np.full(S, cfg.ev.socket_kw) if p_max is None else np.asarray(p_max, dtype=np.float64)

    # EV power variables: one per (session, step of its stay), vectorised
    stay = dep - arr
    n_p = int(stay.sum())
    p_sess = np.repeat(np.arange(S, dtype=np.int64), stay)
    starts = np.cumsum(stay) - stay  # first EV variable of each session
    p_step = np.arange(n_p, dtype=np.int64) - np.repeat(starts, stay) + np.repeat(arr, stay)

    # the blocks: each [p (n_p_k), ch, dis, E, g, u, x (T each), slack (S_k), defer (S_k)], rows [balance, storage, EV]
    s_k = np.bincount(blk, minlength=K)  # (K,) sessions per block
    np_k = np.bincount(blk, weights=stay, minlength=K).astype(np.int64)  # (K,) EV variables per block
    with_defer = defer_kwh is not None
    size = np_k + 6 * T + s_k * (2 if with_defer else 1)
    base = np.cumsum(size) - size
    row_off = np.cumsum(2 * T + s_k) - (2 * T + s_k)
    off = {"p": base}
    for i, name in enumerate(("ch", "dis", "E", "g", "u", "x")):
        off[name] = base + np_k + i * T
    off["slack"] = base + np_k + 6 * T
    if with_defer:
        off["defer"] = off["slack"] + s_k
    n = int(size.sum())
    n_row = int((2 * T + s_k).sum())
    s_local = np.arange(S, dtype=np.int64) - (np.cumsum(s_k) - s_k)[blk]  # each session's index in its block
    p_blk = blk[p_sess]
    p_col = base[p_blk] + np.arange(n_p, dtype=np.int64) - (np.cumsum(np_k) - np_k)[p_blk]
    steps = np.arange(T, dtype=np.int64)

    def cols(name: str, k: np.ndarray = steps) -> np.ndarray:  # the columns of a per-step block at steps k, (K*len(k),)
        return (off[name][:, None] + k).ravel()

    balance = (row_off[:, None] + steps).ravel()  # (K*T,)
    storage = balance + T
    ev_row = row_off[blk] + 2 * T + s_local  # (S,)

    # ---- equality rows: balance (0..T-1), storage (T..2T-1), EV energy (2T..2T+S-1) of each block
    rows, cols_, vals = [], [], []

    def add(r, c, v):
        rows.append(np.asarray(r, dtype=np.int64))
        cols_.append(np.asarray(c, dtype=np.int64))
        vals.append(np.broadcast_to(np.asarray(v, dtype=np.float64), np.shape(r)))

    # balance: -u + g + dis - ch - x - sum_s p = load - pv
    add(row_off[p_blk] + p_step, p_col, -1.0)
    add(balance, cols("ch"), -1.0)
    add(balance, cols("dis"), 1.0)
    add(balance, cols("g"), 1.0)
    add(balance, cols("u"), -1.0)
    add(balance, cols("x"), -1.0)
    # storage: E[t] - E[t-1] - eta_c*dt*ch[t] + dt/eta_d*dis[t] = (E_init if t == 0 else 0)
    add(storage, cols("E"), 1.0)
    add((row_off[:, None] + T + steps[1:]).ravel(), cols("E", steps[:-1]), -1.0)
    add(storage, cols("ch"), -b.eta_charge * dt)
    add(storage, cols("dis"), dt / b.eta_discharge)
    # EV energy: sum_t p*dt + slack (+ defer) = need
    add(ev_row[p_sess], p_col, dt)
    add(ev_row, off["slack"][blk] + s_local, 1.0)
    if with_defer:
        add(ev_row, off["defer"][blk] + s_local, 1.0)

    A_eq = _csc(np.concatenate(rows), np.concatenate(cols_), np.concatenate(vals), (n_row, n))
    b_eq = np.zeros(n_row)
    b_eq[balance] = np.tile(load_kw - pv_kw, K)
    b_eq[row_off + T] = energy_init_kwh
    b_eq[ev_row] = need

    # ---- bounds
    lo = np.zeros(n)
    hi = np.full(n, np.inf)
    hi[p_col] = p_max[p_sess]
    hi[cols("ch")] = b.power_kw
    hi[cols("dis")] = b.power_kw
    lo[cols("E")] = b.soc_min * b.capacity_kwh
    hi[cols("E")] = b.soc_max * b.capacity_kwh
    hi[cols("g")] = np.tile(np.maximum(cfg.grid.import_limit_kw, load_kw - pv_kw), K)
    hi[cols("u")] = np.tile(pv_kw, K)
    if not cfg.grid.export_allowed:
        hi[cols("x")] = 0.0
    if with_defer:
        hi[off["defer"][blk] + s_local] = defer_kwh

    # ---- objective: kg CO2 of import (minus the export credit) + penalty on unserved EV energy
    c = np.zeros(n)
    c[cols("g")] = (moer_k * dt).ravel()
    if cfg.grid.export_credit == "moer":
        c[cols("x")] = (-moer_k * dt).ravel()
    c[off["slack"][blk] + s_local] = UNSERVED_PENALTY

    out = {
        "c": c,
        "A_eq": A_eq,
        "b_eq": b_eq,
        "bounds": np.stack([lo, hi], axis=1),
        "T": T,
        "S": S,
        "n_p": n_p,
        "p_sess": p_sess,
        "p_step": p_step,
        "off": {k: int(v[0]) for k, v in off.items()} if block is None else off,
        "dep": dep,
    }
    if block is not None:
        out.update(row_off=row_off, col_block=np.repeat(np.arange(K), size), p_col=p_col, s_local=s_local)
    return out


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


def solve_oracle(site: Site | str, split: str, time_limit_s: float = 300.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Solve the perfect-foresight LP over one split and return its KPIs and hourly traces.

    Args:
        site: a loaded :class:`~envs.site.Site` (or anything :func:`envs.site.load_site` accepts).
        split: ``"train"`` or ``"test"``.
        time_limit_s: HiGHS wall-clock limit, seconds.

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
    cfg = data.config
    b, dt = cfg.bess, cfg.dt_h
    t0 = time.perf_counter()
    lp = build_lp(data)
    T, S, off = lp["T"], lp["S"], lp["off"]
    n_var, n_con, nnz = lp["A_eq"].shape[1], lp["A_eq"].shape[0], lp["A_eq"].nnz
    t1 = time.perf_counter()
    from scipy.optimize import linprog  # heavy (about 1 s): imported by the solve, not by the registry

    res = linprog(
        lp["c"],
        A_eq=lp["A_eq"],
        b_eq=lp["b_eq"],
        bounds=lp["bounds"],
        method="highs",
        options={"time_limit": float(time_limit_s), "presolve": True},
    )
    t2 = time.perf_counter()
    if res.status != 0 or res.x is None:
        raise RuntimeError(
            f"oracle LP for split '{split}' not solved to optimality: HiGHS status {res.status} ({res.message}); "
            f"{n_var} variables, {n_con} constraints, {t2 - t1:.1f} s (time limit {time_limit_s} s)"
        )
    z = res.x

    def block(name: str, size: int) -> np.ndarray:
        lo_b = lp["bounds"][off[name] : off[name] + size, 0]
        hi_b = lp["bounds"][off[name] : off[name] + size, 1]
        return np.clip(z[off[name] : off[name] + size], lo_b, hi_b)  # drop solver-tolerance excursions

    p = np.clip(z[: lp["n_p"]], 0.0, lp["bounds"][: lp["n_p"], 1])  # each session's socket power
    ev_kw = np.bincount(lp["p_step"], weights=p, minlength=T)
    slack = block("slack", S)
    unserved = np.bincount(lp["dep"] - 1, weights=slack, minlength=T) if S else np.zeros(T)
    g, u, x = block("g", T), block("u", T), block("x", T)
    # In hours with MOER = 0 (the data has some) importing while curtailing or exporting costs nothing, so
    # the LP's optimum may do both; net them out (balance kept, CO2 unchanged or lower where MOER >= 0).
    tidy = data.moer >= 0
    both = np.where(tidy, np.minimum(g, u), 0.0)
    g, u = g - both, u - both
    both = np.where(tidy, np.minimum(g, x), 0.0)
    g, x = g - both, x - both
    energy = block("E", T)
    traces = pd.DataFrame(
        {
            "time": data.time,
            "pv_kw": data.pv_kw,
            "pv_curtailed_kw": u,
            "grid_import_kw": g,
            "grid_export_kw": x,
            "bess_charge_kw": block("ch", T),
            "bess_discharge_kw": block("dis", T),
            "ev_charge_kw": ev_kw,
            "load_kw": data.load_kw,
            "co2_kg": (g - x * (cfg.grid.export_credit == "moer")) * data.moer * dt,
            "unserved_kwh": unserved,
            "soc": energy / max(b.capacity_kwh, 1e-9),
            "moer_kg_per_kwh": data.moer,
        }
    )[list(TRACE_COLUMNS)]
    check_balance(traces, f"oracle, {split} split")
    print(
        f"oracle {split}: {T} steps, {S} sessions, {n_var} variables ({lp['n_p']} EV), {n_con} constraints, "
        f"{nnz} nonzeros; build {t1 - t0:.2f} s, HiGHS {t2 - t1:.2f} s; CO2 {traces.co2_kg.sum():.1f} kg, "
        f"unserved {slack.sum():.3f} kWh",
        flush=True,
    )
    row = kpi_row("oracle", split, traces, data, env_steps=float(T), train_wall_s=0.0)
    return row, traces


def simulate(site: Site, split: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`solve_oracle` with its default time limit: ``(kpi_row, traces)`` (the registry's runner)."""
    return solve_oracle(site, split)
