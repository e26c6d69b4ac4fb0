"""The observation's context features and the DC prior of training (envs/context.py)."""

import numpy as np
import pytest
import torch
from conftest import DC_SOCKETS as DC_SITE
from conftest import changed_future, make_site

from envs import context
from envs.evhub import EVHubVectorEnv


def test_the_context_reads_only_what_was_realised_by_its_step():
    """Sessions and MOER changed from step ``cut`` on leave the context of every step before ``cut`` unchanged, and
    the changes show from ``cut`` on (so the check has teeth)."""
    site, cut = make_site(days=21), 300
    before = context.context_table(site.split("train"))
    after = context.context_table(changed_future(site, "train", cut).split("train"))
    np.testing.assert_array_equal(before[:cut], after[:cut])
    assert not np.array_equal(before[cut:], after[cut:])


def test_expected_arrivals_are_the_mean_of_the_last_same_type_days():
    site = make_site(days=21)
    data = site.split("train")
    expected = context.expected_arrivals_kwh(data, days=3)
    arrived = context.group_arrivals_kwh(data)
    local = data.time.tz_convert(site.config.timezone)
    weekend = np.asarray(local.day_of_week >= 5)
    for u in (30, 200, 333, 490):
        js = [j for j in range(1, u // 24 + 1) if weekend[u - 24 * j] == weekend[u]][:3]
        want = arrived[[u - 24 * j for j in js]].mean(0) if js else np.zeros(arrived.shape[1])
        np.testing.assert_allclose(expected[u], want, rtol=1e-12)
    # the window features sum the next hours' expectations, scaled by the group's power
    table, expected = context.context_table(data), context.expected_arrivals_kwh(data)
    kw = site.config.ev.n_sockets * site.config.ev.socket_kw
    t = 200
    np.testing.assert_allclose(table[t, 0], expected[t + 1 : t + 7, 0].sum() / (kw * 6) * 4.0, rtol=1e-12)
    np.testing.assert_allclose(table[t, 1], expected[t + 7 : t + 25, 0].sum() / (kw * 18) * 4.0, rtol=1e-12)


def test_the_env_observes_the_context_last_and_leaves_the_default_networks_inputs_alone():
    site = make_site(days=7, **DC_SITE)
    env = EVHubVectorEnv(2, site=site, split="test", full_split=True, dtype=torch.float64)
    obs, _ = env.reset(seed=0)
    layout = env.observation_layout
    assert layout["context"] == list(range(19 + 3 * 6, 19 + 3 * 6 + 7))  # two groups: 2 x 2 windows + 3 MOER leads
    table = context.context_table(env.data)
    for t in range(30):
        got = obs[0, layout["context"]].numpy()
        np.testing.assert_allclose(got[:4], table[t, :4], rtol=1e-12)
        np.testing.assert_allclose(got[4:], (table[t, 4:] - 0.25) / 0.25, rtol=1e-12)
        obs, *_ = env.step(torch.tensor([[0.0, 1.0]] * 2))


def test_the_dc_prior_brings_cars_to_the_dc_socket_only_within_its_ranges():
    site = make_site(days=14, seed=3, **DC_SITE)
    data = site.split("train")
    assert (data.arrival_stay_steps[:, 0] == 0).all()  # the training split has no DC session
    env = EVHubVectorEnv(64, site=site, split="train", dc_prior=True, dtype=torch.float64)
    env.reset(seed=5)
    sessions, steps = 0, 0
    for _ in range(200):
        before = env.ev_steps_left.clone()
        env.step(torch.tensor([[0.0, 1.0]] * 64))
        new = (env.ev_steps_left[:, 0] > 0) & (before[:, 0] <= 1)
        need = env.ev_need_kwh[:, 0][new]
        assert ((need >= context.DC_SESSION_KWH[0]) & (need <= context.DC_SESSION_KWH[1])).all()
        assert (env.ev_steps_left[:, 0][new] == 1).all()  # under 50 kWh at 50 kW: one hourly step
        sessions += int(new.sum())
        steps += 64
    per_day = sessions / steps * 24
    assert 1.0 < per_day < context.DC_SESSIONS_PER_DAY_MAX  # mean rate 4 a day, less a few at the morning's peak
    assert float(env.dc_rate.min()) >= 0 and float(env.dc_rate.max()) < context.DC_SESSIONS_PER_DAY_MAX
    # the context of a DC group grows with the window's rate; the Level-2 group's does not change
    obs, _ = env.reset(seed=5)
    layout = env.observation_layout["context"]
    table = env._context_obs[env.t]
    extra = obs[:, layout] - table
    assert torch.allclose(extra[:, 2:], torch.zeros_like(extra[:, 2:]))
    share = np.tile(context.arrival_share(data)[:24], 30)  # starts at local midnight: the day's shares, repeated
    mean_kwh = sum(context.DC_SESSION_KWH) / 2
    for i, t in enumerate(env.t.tolist()):
        want = env.dc_rate[i] * mean_kwh * share[t + 1 : t + 7].sum() / (50.0 * 6) * 4.0
        assert float(extra[i, 0]) == pytest.approx(float(want), rel=1e-9)


def test_without_dc_sockets_or_at_evaluation_the_priors_change_nothing():
    """A site whose sockets are all Level-2 gets the same trajectory with the DC prior; a full-split run the same with
    either prior."""
    cases = ((make_site(days=7), False, "dc_prior"), (make_site(days=7, **DC_SITE), True, "dc_prior"))
    for site, full, flag in (*cases, (make_site(days=7), True, "exo_prior")):
        runs = []
        for prior in (False, True):
            kwargs = {flag: prior}
            env = EVHubVectorEnv(4, site=site, split="train", full_split=full, dtype=torch.float64, **kwargs)
            obs, _ = env.reset(seed=2)
            out = [obs]
            for _ in range(60):
                obs, reward, *_ = env.step(torch.tensor([[0.3, 0.5]] * 4))
                out += [obs, reward[:, None]]
            runs.append(torch.cat(out, 1))
        torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_training_with_the_prior_reads_nothing_of_the_test_split(monkeypatch):
    """The training bank (windows of the train split, the DC prior's sessions, the exogenous prior) is built without
    the test split: a site whose test split cannot be read trains the same."""
    site = make_site(days=7, **DC_SITE)
    real_split = type(site).split

    def train_only(self, name):
        if name != "train":
            raise AssertionError(f"training read the {name!r} split")
        return real_split(self, name)

    monkeypatch.setattr(type(site), "split", train_only)
    env = EVHubVectorEnv(8, site=site, split="train", dc_prior=True, exo_prior=True)
    env.reset(seed=0)
    for _ in range(100):
        env.step(torch.rand(8, 2))
    with pytest.raises(AssertionError, match="test"):
        EVHubVectorEnv(1, site=site, split="test")


# ---------------------------------------------------------------------------------------------- exogenous prior
def test_the_exo_spread_is_the_months_ratios_over_the_steps_training_may_read():
    """Each range is the lowest and highest calendar month's ratio to the whole (MOER mean, MOER standard deviation,
    PV mean) over steps before ``end``; what comes after ``end`` changes nothing; one month gives factors of 1."""
    site = make_site(days=45)  # train: 2019-05-01 .. 06-14, two months
    data = site.split("train")
    local = data.time.tz_convert(site.config.timezone)
    moer, pv = data.moer.astype(np.float64), data.pv_kw.astype(np.float64)
    may = np.asarray(local.month == 5)
    got = context.exo_spread(data)
    assert got["moer_mean"] == pytest.approx(moer.mean(), rel=1e-12)
    for key, f in (("level", np.mean), ("contrast", np.std)):
        ratios = sorted([f(moer[may]) / f(moer), f(moer[~may]) / f(moer)])
        assert got[key] == pytest.approx(tuple(ratios), rel=1e-9)
    assert got["pv_scale"] == pytest.approx(tuple(sorted([pv[may].mean() / pv.mean(), pv[~may].mean() / pv.mean()])))
    assert got["level"][0] < 1 < got["level"][1]
    cut = 24 * 38
    assert context.exo_spread(changed_future(site, "train", cut).split("train"), cut) == context.exo_spread(data, cut)
    assert context.exo_spread(data, 24 * 20) == {
        "moer_mean": pytest.approx(moer[: 24 * 20].mean()),
        "level": (1.0, 1.0),
        "contrast": (1.0, 1.0),
        "pv_scale": (1.0, 1.0),
    }


def test_the_exo_prior_draws_its_factors_in_range_and_the_step_and_observation_read_them():
    site = make_site(days=45)
    spread = context.exo_spread(site.split("train"))
    kwargs = dict(site=site, split="train", dtype=torch.float64, bess_action="surplus")
    env = EVHubVectorEnv(256, exo_prior=True, **kwargs)
    env.reset(seed=4)
    for j, key in enumerate(("level", "contrast", "pv_scale")):
        lo, hi = spread[key]
        f = env.exo_factors[:, j]
        assert lo <= float(f.min()) and float(f.max()) <= hi and float(f.max() - f.min()) > 0.8 * (hi - lo)
    # factors of 1: the plain env's trajectory (up to the rounding of mu + (m - mu))
    starts = {"start_steps": [5, 100, 333, 700]}
    plain, prior = EVHubVectorEnv(4, **kwargs), EVHubVectorEnv(4, exo_prior=True, **kwargs)
    out = {}
    for name, e in (("plain", plain), ("prior", prior)):
        e.reset(seed=1, options=starts)
        e.exo_factors.fill_(1.0)
        out[name] = [e.step(torch.tensor([[0.4, 0.6]] * 4))[:2] for _ in range(30)]
    for (o1, r1), (o2, r2) in zip(out["plain"], out["prior"], strict=True):
        torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
        torch.testing.assert_close(r1, r2, rtol=0, atol=1e-12)
    # other factors: the step's CO2 and PV, and the observation's MOER features, are the prior's
    prior.reset(seed=1, options=starts)
    factors = torch.tensor([[0.7, 1.1, 1.2], [1.2, 0.7, 0.8], [1.0, 1.0, 1.0], [0.9, 1.3, 1.0]], dtype=torch.float64)
    prior.exo_factors.copy_(factors)
    mu = spread["moer_mean"]
    data = prior.data
    for _ in range(30):
        t = prior.t.numpy().copy()
        obs, _, _, _, info = prior.step(torch.tensor([[0.4, 0.6]] * 4))
        moer = np.maximum(factors[:, 0].numpy() * mu + factors[:, 1].numpy() * (data.moer[t] - mu), 0.0)
        np.testing.assert_allclose(info["co2_kg"].numpy(), info["grid_import_kw"].numpy() * moer, rtol=1e-9)
        np.testing.assert_allclose(info["pv_kw"].numpy(), factors[:, 2].numpy() * data.pv_kw[t], rtol=1e-9)
        last = np.maximum(factors[:, 0].numpy() * mu + factors[:, 1].numpy() * (data.moer[t] - mu), 0.0)
        np.testing.assert_allclose(obs[:, 8].numpy(), (last - 0.25) / 0.25, rtol=1e-9, atol=1e-12)
