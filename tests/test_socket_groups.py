"""Socket groups (``[[ev.sockets]]``: sockets of different power side by side) and the export credit
(``grid.export_credit``), on a tiny synthetic site: 2 Level-2 sockets of 6.6 kW for ``L2-*`` stations and one
50 kW DC socket for ``DC-*``."""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_site, write_site

from envs.config import ConfigError, config_from_dict
from envs.evhub import EVHubVectorEnv
from envs.kpis import balance_residual, evaluate_policy, kpis_from_traces
from envs.site import Site, load_site
from pipeline.control.baselines import POLICIES, rule_based, uncontrolled
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.oracle import build_lp, solve_oracle

GROUPS = [{"count": 2, "kw": 6.6, "stations": "L2-*"}, {"count": 1, "kw": 50.0, "stations": "DC-*"}]
SOCKET_KW = np.array([6.6, 6.6, 50.0])


def _params(data, horizon_h: int) -> PlannerParams:
    """The site's ``[mpc]`` parameters at ``horizon_h``."""
    return dataclasses.replace(PlannerParams.of_site(data.config), horizon_h=horizon_h)


def _sessions(days: int, seed: int) -> pd.DataFrame:
    """Per local day 3-4 Level-2 sessions (three stations on two sockets) and two short DC sessions of 15-45 kWh."""
    rng = np.random.default_rng(seed)
    tz = "America/Los_Angeles"
    rows = []
    for d in range(2 * days):
        day = pd.Timestamp("2019-05-01").tz_localize(tz) + pd.Timedelta(days=d)
        kinds = [("L2", 6, 12, 1.0, 9.0, 2.0, 25.0)] * int(rng.integers(3, 5)) + [
            ("DC", 8, 18, 0.6, 1.4, 15.0, 45.0)
        ] * 2
        for k, (kind, a0, a1, s0, s1, e0, e1) in enumerate(kinds):
            arr = day + pd.Timedelta(hours=float(rng.uniform(a0, a1)))
            dep = arr + pd.Timedelta(hours=float(rng.uniform(s0, s1)))
            station = f"L2-{rng.integers(1, 4)}" if kind == "L2" else "DC-1"
            rows.append(
                {
                    "session_id": f"s{d}_{k}",
                    "station_id": station,
                    "arrival": arr.tz_convert("UTC"),
                    "departure": dep.tz_convert("UTC"),
                    "energy_kwh": np.float32(rng.uniform(e0, e1)),
                    "requested_energy_kwh": np.float32(rng.uniform(e0, e1)),
                }
            )
    s = pd.DataFrame(rows).sort_values(["arrival", "session_id"]).reset_index(drop=True)
    for c in ("arrival", "departure"):
        s[c] = pd.to_datetime(s[c], utc=True).astype("datetime64[ns, UTC]")
    return s


def group_site(days: int = 3, seed: int = 0, **overrides) -> Site:
    """The tiny two-group site (``overrides`` are config tables, as for ``make_site``)."""
    base = make_site(days=days, n_sockets=3, seed=seed, **overrides)
    cfg = base.config.replace(ev={"sockets": GROUPS})
    source = {
        "config": "synthetic.toml",
        "series": "synthetic/series_60min.parquet",
        "sessions": "synthetic/sessions.parquet",
    }
    return Site(cfg, base.series, _sessions(days, seed), source)


@pytest.fixture(scope="module")
def site() -> Site:
    return group_site()


# ---------------------------------------------------------------------------------------------- config


def test_toml_groups_derive_the_one_kind_keys():
    text = """
[ev]
deadline_floor = true
[[ev.sockets]]
count = 2
kw = 6.6
stations = "L2-*"
[[ev.sockets]]
count = 1
kw = 50.0
stations = ["DC-*", "FAST-?"]
"""
    cfg = config_from_dict(tomllib.loads(text), "site.toml")
    assert cfg.ev.n_sockets == 3 and cfg.ev.socket_kw == 50.0
    np.testing.assert_array_equal(cfg.ev.socket_kw_array(), SOCKET_KW)
    assert cfg.ev.groups[1].matches("FAST-1") and not cfg.ev.groups[1].matches("L2-1")
    assert cfg.replace() == cfg  # the round trip through dicts keeps the groups
    one = config_from_dict({"ev": {"n_sockets": 4, "socket_kw": 7.0}})
    assert one.ev.sockets == () and [(g.count, g.kw, g.stations) for g in one.ev.groups] == [(4, 7.0, ("*",))]
    assert one.replace(ev={"sockets": GROUPS}).ev.n_sockets == 3  # new groups: n_sockets and socket_kw follow


@pytest.mark.parametrize(
    "ev, needles",
    [
        ({"sockets": [{"count": 0, "kw": 6.6}]}, ["ev.sockets[0].count", ">= 1"]),
        ({"sockets": [{"count": 1, "kw": 6.6}, {"count": 1, "kw": 0.0}]}, ["ev.sockets[1].kw", "> 0"]),
        ({"sockets": [{"count": 1, "kw": "fast"}]}, ["ev.sockets[0].kw", "number"]),
        ({"sockets": [{"count": 1, "kw": 6.6, "stations": ""}]}, ["ev.sockets[0].stations", "pattern"]),
        ({"sockets": [{"count": 1, "kw": 6.6, "stations": [3]}]}, ["ev.sockets[0].stations"]),
        ({"sockets": [{"count": 1, "kw": 6.6, "power": 3}]}, ["ev.sockets[0].power", "known in [[ev.sockets]]"]),
        ({"sockets": [{"count": 1}]}, ["ev.sockets[0].kw", "missing"]),
        ({"sockets": {"count": 1, "kw": 6.6}}, ["ev.sockets", "array of tables"]),
        ({"n_sockets": 4, "sockets": GROUPS}, ["ev.n_sockets", "sum of the ev.sockets counts (3)"]),
        ({"socket_kw": 6.6, "sockets": GROUPS}, ["ev.socket_kw", "largest ev.sockets kw (50)"]),
    ],
)
def test_bad_groups_name_the_dotted_key(ev, needles):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"ev": ev}, "site.toml")
    for n in ["site.toml", *needles]:
        assert n in str(err.value), str(err.value)


def test_a_station_matching_no_group_is_an_error_before_anything_runs(site, tmp_path):
    sessions = site.sessions.copy()
    sessions.loc[[5, 9], "station_id"] = "XX-7"
    toml = write_site(Site(site.config, site.series, site.sessions, {}), tmp_path)
    sessions.to_parquet(toml.parent / "synthetic" / "sessions.parquet", index=False)
    for validate in (True, False):
        with pytest.raises(ConfigError) as err:
            load_site(toml, validate=validate)
        msg = str(err.value)
        for n in [
            str(toml),
            "key 'ev.sockets'",
            "station 'XX-7'",
            "sessions.parquet",
            "row 5",
            f"session {sessions.session_id[5]}",
            "2 session(s)",
            "'L2-*'",
            "'DC-*'",
        ]:
            assert n in msg, msg


# ---------------------------------------------------------------------------------------------- the env


def test_sessions_map_to_their_group_and_needs_are_capped_by_their_socket(site):
    for split in ("train", "test"):
        d = site.split(split)
        np.testing.assert_array_equal(d.socket_kw, SOCKET_KW)
        s = d.sessions[~d.sessions.rejected]
        dc = s.station_id == "DC-1"
        assert (s.socket[dc] == 2).all() and s.socket[~dc].isin([0, 1]).all()
        stay = s.departure_step - s.arrival_step
        np.testing.assert_allclose(s.need_kwh, np.minimum(s.energy_kwh, SOCKET_KW[s.socket] * stay))
        assert (s.need_kwh[dc] > 6.6 * stay[dc]).any()  # what a 6.6 kW socket could not have delivered


def test_uncontrolled_charges_a_dc_session_at_dc_power(site):
    env = EVHubVectorEnv(1, site=site, split="test", full_split=True, dtype=torch.float64, bess_action="setpoint")
    env.reset(seed=0)
    dc_kw = []
    for _ in range(env.data.num_steps):
        floor, cap = env._ev_bounds()
        assert (cap <= env._socket_kw + 1e-12).all()
        need = env.ev_need_kwh[0, 2].item()
        _, _, _, _, info = env.step(torch.tensor([[0.0, 1.0]], dtype=torch.float64))
        dc_kw.append(need - env.ev_need_kwh[0, 2].item() if env.ev_steps_left[0, 2] > 0 else need)
    assert max(dc_kw) > 6.6 * 2 and max(dc_kw) <= 50.0 + 1e-9
    kpi, _ = evaluate_policy(uncontrolled, site, "test", "uncontrolled")
    assert float(kpi.unserved_kwh.iloc[0]) < 1e-9 and float(kpi.ev_energy_served_pct.iloc[0]) == pytest.approx(100.0)


@pytest.mark.parametrize("mode", ["hub", "socket"])
def test_balance_holds_every_step_with_groups(site, mode):
    env = EVHubVectorEnv(4, site=site, split="train", action_mode=mode, dtype=torch.float64, episode_steps=48)
    env.reset(seed=3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        a = torch.rand(4, env.single_action_space.shape[0], generator=gen, dtype=torch.float64) * 2 - 1
        _, _, _, _, i = env.step(a)
        supply = i["pv_kw"] - i["pv_curtailed_kw"] + i["grid_import_kw"] + i["bess_discharge_kw"]
        demand = i["load_kw"] + i["ev_charge_kw"] + i["bess_charge_kw"] + i["grid_export_kw"]
        assert (supply - demand).abs().max() < 1e-6
        assert (i["ev_charge_kw"] <= SOCKET_KW.sum() + 1e-9).all()


def test_one_kind_equals_one_group_of_the_same_power():
    a = make_site(days=3, n_sockets=4)
    b = Site(a.config.replace(ev={"sockets": [{"count": 4, "kw": 6.6}]}), a.series, a.sessions, a.source)
    assert b.config.ev.sockets and not a.config.ev.sockets
    for split in ("train", "test"):
        da, db = a.split(split), b.split(split)
        pd.testing.assert_frame_equal(da.sessions, db.sessions)
        np.testing.assert_array_equal(da.arrival_need_kwh, db.arrival_need_kwh)
        np.testing.assert_array_equal(da.socket_kw, db.socket_kw)
    for mode, dim in (("hub", 2), ("socket", 5)):
        envs = [EVHubVectorEnv(4, site=s, action_mode=mode) for s in (a, b)]
        outs = [e.reset(seed=1)[0] for e in envs]
        assert torch.equal(*outs)
        gen = torch.Generator().manual_seed(2)
        for _ in range(50):
            act = torch.rand(4, dim, generator=gen) * 2 - 1
            (oa, ra, _, ta, ia), (ob, rb, _, tb, ib) = (e.step(act) for e in envs)
            assert torch.equal(oa, ob) and torch.equal(ra, rb) and torch.equal(ta, tb)
            assert all(torch.equal(ia[k], ib[k]) for k in ia)
    assert float(solve_oracle(a, "train")[0].co2_kg.iloc[0]) == float(solve_oracle(b, "train")[0].co2_kg.iloc[0])


# ---------------------------------------------------------------------------------------------- oracle and MPC


def test_oracle_and_mpc_respect_each_socket_and_the_oracle_bounds_them(site):
    data = site.split("train")
    lp = build_lp(data)
    ok = data.sessions[~data.sessions.rejected]
    np.testing.assert_array_equal(lp.bounds[: lp.n_p, 1], SOCKET_KW[ok.socket.to_numpy()][lp.p_sess])
    oracle, otr = solve_oracle(site, "train")
    assert float(oracle.unserved_kwh.iloc[0]) < 1e-6
    assert otr.ev_charge_kw.max() > 2 * 6.6  # the DC socket gives more than every Level-2 socket together
    rows = [evaluate_policy(p, site, "train", c)[0] for c, p in POLICIES.items()]
    for perfect in (False, True):
        mpc = MPCController(data, _params(data, 24), perfect=perfect, keep_plans=True)
        row, tr = evaluate_policy(mpc, site, "train", "mpc", action_mode="socket", bess_action="setpoint")
        rows.append(row)
        ev = np.stack([p.ev_kw for p in mpc.plans])
        assert (ev <= SOCKET_KW + 1e-9).all() and ev[:, 2].max() > 6.6
        np.testing.assert_allclose(tr.ev_charge_kw, ev.sum(1), atol=1e-5)  # the plan's first step is what the env does
        np.testing.assert_allclose(tr.grid_import_kw, [p.grid_import_kw for p in mpc.plans], atol=1e-5)
    for row in rows:
        assert float(row.unserved_kwh.iloc[0]) < 1e-6
        assert float(oracle.co2_kg.iloc[0]) <= float(row.co2_kg.iloc[0]) + 1e-6, row.controller.iloc[0]
    # perfect foresight over the whole split, applied through the env, reaches the oracle: its bounds are the env's
    full = MPCController(data, _params(data, data.num_steps), perfect=True)
    row, _ = evaluate_policy(full, site, "train", "mpc_perfect", action_mode="socket", bess_action="setpoint")
    assert float(row.co2_kg.iloc[0]) == pytest.approx(float(oracle.co2_kg.iloc[0]), rel=1e-4, abs=1e-3)


# ---------------------------------------------------------------------------------------------- export credit

EXPORT = {"grid": {"export_allowed": True}, "pv": {"kwp": 40.0}}


def test_export_credit_config():
    with pytest.raises(ConfigError, match=r"grid\.export_credit.*export_allowed"):
        config_from_dict({"grid": {"export_credit": "moer"}}, "site.toml")
    with pytest.raises(ConfigError, match=r"grid\.export_credit.*'none', 'moer'"):
        config_from_dict({"grid": {"export_allowed": True, "export_credit": "average"}}, "site.toml")
    assert config_from_dict({}).grid.export_credit == "none"


def test_env_credits_export_at_the_moer_of_its_hour():
    site = group_site(grid={**EXPORT["grid"], "export_credit": "moer"}, pv=EXPORT["pv"])
    env = EVHubVectorEnv(2, site=site, split="train", dtype=torch.float64)
    env.reset(seed=0)
    moer, dt, exported = torch.as_tensor(site.split("train").moer), site.config.dt_h, 0.0
    r = site.config.reward
    for _ in range(72):
        m = moer[env.t]
        _, reward, _, _, i = env.step(torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64))
        torch.testing.assert_close(
            i["co2_kg"], (i["grid_import_kw"] - i["grid_export_kw"]) * m * dt, rtol=0, atol=1e-12
        )
        torch.testing.assert_close(
            reward, -r.scale * (r.w_co2 * i["co2_kg"] + r.w_unserved * i["unserved_kwh"]), rtol=0, atol=1e-12
        )
        exported += float(i["grid_export_kw"].sum())
    assert exported > 1.0
    kpi, tr = evaluate_policy(uncontrolled, site, "train", "uncontrolled")
    credit = float((tr.grid_export_kw * tr.moer_kg_per_kwh).sum() * dt)
    assert credit > 0 and float(kpi.co2_export_credit_kg.iloc[0]) == pytest.approx(credit)
    assert float(kpi.co2_kg.iloc[0]) == pytest.approx(
        float((tr.grid_import_kw * tr.moer_kg_per_kwh).sum() * dt) - credit
    )
    none = group_site(**EXPORT)  # same flows, no credit: CO2 is the import's alone
    k0 = kpis_from_traces(evaluate_policy(uncontrolled, none, "train", "u")[1], none.split("train"))
    assert k0["co2_export_credit_kg"] == 0.0 and k0["co2_kg"] == pytest.approx(float(kpi.co2_kg.iloc[0]) + credit)


def test_oracle_with_credit_is_below_without_and_below_every_controller():
    credit = group_site(grid={**EXPORT["grid"], "export_credit": "moer"}, pv=EXPORT["pv"])
    none = group_site(**EXPORT)
    o_credit, tr = solve_oracle(credit, "train")
    o_none, _ = solve_oracle(none, "train")
    assert float(o_credit.co2_kg.iloc[0]) <= float(o_none.co2_kg.iloc[0]) - 1.0  # the credit is worth something here
    np.testing.assert_allclose(tr.co2_kg, (tr.grid_import_kw - tr.grid_export_kw) * tr.moer_kg_per_kwh, atol=1e-9)
    assert balance_residual(tr).max() < 1e-6
    data = credit.split("train")
    rows = [
        evaluate_policy(p, credit, "train", c)[0]
        for c, p in (("uncontrolled", uncontrolled), ("rule_based", rule_based))
    ]
    for perfect in (False, True):
        mpc = MPCController(data, _params(data, 24), perfect=perfect, keep_plans=True)
        row, trm = evaluate_policy(mpc, credit, "train", "mpc", action_mode="socket", bess_action="setpoint")
        rows.append(row)
        # the plan's first step is what the env does, although the credit tempts the LP to break the env's
        # dispatch rules (discharge into the deficit only, PV surplus to the EVs first)
        for col in ("grid_import_kw", "grid_export_kw", "pv_curtailed_kw", "bess_charge_kw", "bess_discharge_kw"):
            np.testing.assert_allclose(trm[col], [getattr(p, col) for p in mpc.plans], atol=1e-5, err_msg=col)
        np.testing.assert_allclose(trm.ev_charge_kw, [p.ev_kw.sum() for p in mpc.plans], atol=1e-5)
    for row in rows:
        assert float(row.unserved_kwh.iloc[0]) < 1e-6
        assert float(o_credit.co2_kg.iloc[0]) <= float(row.co2_kg.iloc[0]) + 1e-6, row.controller.iloc[0]


@pytest.mark.slow
def test_the_step_with_groups_and_credit_compiles_as_one_graph(action_mode="hub", edf="pairwise"):
    """Per-socket powers and the export credit keep the step one graph (no host sync), equal to the eager step."""
    site = group_site(grid={**EXPORT["grid"], "export_credit": "moer"}, pv=EXPORT["pv"], episode={"train_h": 24})
    eager, graphed = (
        EVHubVectorEnv(4, site=site, action_mode=action_mode, edf=edf, dtype=torch.float64) for _ in range(2)
    )
    eager.reset(seed=2)
    graphed.reset(seed=2)
    step = torch.compile(graphed.step, fullgraph=True)  # any graph break raises here
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        a = torch.rand(4, eager.single_action_space.shape[0], generator=gen, dtype=torch.float64) * 2.4 - 1.2
        expected, got = eager.step(a), step(a)
        for x, y in zip(expected[:4], got[:4]):
            torch.testing.assert_close(y, x, rtol=1e-9, atol=1e-9)
        for key, value in expected[4].items():
            torch.testing.assert_close(got[4][key], value, rtol=1e-9, atol=1e-9, msg=key)
