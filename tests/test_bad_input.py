"""Bad input stops ``doit run pipeline`` before any training or output, with a message that says where.

Each kind of bad input is one corruption of a small synthetic site (``conftest.make_site``) written to a temp
folder. The real ``doit run pipeline`` (for every config and variable defect, and one data defect per table;
the other data defects go through the same validation task in the test's process) then has to exit non-zero
with a message naming the file (or, for a doit variable, the variable), the column or config key, and the row,
key or time, and leave the output folder empty. A defect in the data has to be raised by the Dask validation
tasks (``validate_input``), so no other task starts; a defect in the site config or in a doit variable already
stops doit while it loads ``dodo.py``, so no task starts at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import doit, files_under, make_site, write_site

from envs.site import Site


@dataclass
class Bad:
    """One bad input: how to break the site, and what the error message must contain."""

    hourly: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    sessions: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    toml: Callable[[str], str] | None = None
    """Edit of the site TOML's text."""
    after: Callable[[Path], None] | None = None
    """Called with the written site TOML's path (e.g. to overwrite a data file)."""
    args: tuple[str, ...] = ()
    """Extra doit variables."""
    needles: Callable[[Site, Path], list[str]] = lambda site, toml: []
    """Strings the message must contain, from the clean site and the TOML path: file, column/key, row/time."""
    data: bool = True
    """Raised by the Dask validation tasks (True) or while doit loads dodo.py (False)."""


def _hourly(toml: Path) -> str:
    return str(toml.parent / "synthetic" / "series_60min.parquet")


def _sessions(toml: Path) -> str:
    return str(toml.parent / "synthetic" / "sessions.parquet")


def _replace(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new)

    return edit


def _json_under_parquet_name(toml: Path) -> None:
    path = Path(_sessions(toml))
    path.write_text(pd.read_parquet(path).to_json(orient="records", date_format="iso"))


KINDS = {
    "missing-column": Bad(
        hourly=lambda h: h.drop(columns="moer_fc_h1"),
        needles=lambda s, t: [_hourly(t), "column 'moer_fc_h1' is missing", "all rows"],
    ),
    "wrong-dtype": Bad(
        sessions=lambda s: s.assign(energy_kwh=s.energy_kwh.astype(str)),
        needles=lambda s, t: [
            _sessions(t),
            "column 'energy_kwh' has dtype",
            "expected float32",
            f"row 0 (session {s.sessions.session_id[0]})",
        ],
    ),
    "nan-in-series": Bad(
        hourly=lambda h: h.assign(pv_kw_per_kwp=h.pv_kw_per_kwp.where(h.index != 17, np.nan)),
        needles=lambda s, t: [_hourly(t), "column 'pv_kw_per_kwp' row 17", f"(time {s.series.time[17]})", "NaN"],
    ),
    "negative-energy": Bad(
        sessions=lambda s: s.assign(energy_kwh=s.energy_kwh.where(s.index != 3, np.float32(-5.0))),
        needles=lambda s, t: [
            _sessions(t),
            "column 'energy_kwh' row 3",
            f"(session {s.sessions.session_id[3]})",
            "-5.0",
        ],
    ),
    "duplicate-timestamps": Bad(
        hourly=lambda h: pd.concat([h.iloc[:11], h.iloc[10:]]),  # row 10 twice
        needles=lambda s, t: [_hourly(t), "column 'time' row 10", f"(time {s.series.time[10]})", "duplicate"],
    ),
    "gap-in-hourly-index": Bad(
        hourly=lambda h: h.drop(index=10),
        needles=lambda s, t: [_hourly(t), "column 'time'", f"first missing {s.series.time[10]}"],
    ),
    "departure-not-after-arrival": Bad(
        sessions=lambda s: s.assign(departure=s.departure.where(s.index != 5, s.arrival)),
        needles=lambda s, t: [
            _sessions(t),
            "column 'departure' row 5",
            f"(session {s.sessions.session_id[5]})",
            "departure > arrival",
        ],
    ),
    "carbon-in-g-per-kwh": Bad(
        hourly=lambda h: h.assign(moer_kg_per_kwh=h.moer_kg_per_kwh * np.float32(1000)),
        needles=lambda s, t: [_hourly(t), "column 'moer_kg_per_kwh' row 0", f"(time {s.series.time[0]})", "g/kWh"],
    ),
    "empty-split": Bad(  # the test split's dates lie a year after the data
        toml=_replace('test = ["2019-05-08", "2019-05-14"]', 'test = ["2020-05-08", "2020-05-14"]'),
        needles=lambda s, t: [_hourly(t), str(t), "column 'time'", "key 'splits.test'", "2020-05-08 07:00:00+00:00"],
    ),
    "overlapping-splits": Bad(
        toml=_replace('test = ["2019-05-08", "2019-05-14"]', 'test = ["2019-05-07", "2019-05-14"]'),
        needles=lambda s, t: [str(t), "key 'splits.test'", "overlaps splits.train", "2019-05-07"],
        data=False,
    ),
    "soc-min-ge-soc-max": Bad(
        toml=_replace("soc_min = 0.1", "soc_min = 0.9"),  # equal to soc_max
        needles=lambda s, t: [str(t), "key 'bess.soc_min'", "(0.9)", "bess.soc_max (0.9)"],
        data=False,
    ),
    "zero-sockets": Bad(
        toml=_replace("n_sockets = 6", "n_sockets = 0"),
        needles=lambda s, t: [str(t), "key 'ev.n_sockets'", "got 0"],
        data=False,
    ),
    "negative-kwp": Bad(
        toml=_replace("kwp = 10.0", "kwp = -5.0"),
        needles=lambda s, t: [str(t), "key 'pv.kwp'", "got -5.0"],
        data=False,
    ),
    "unknown-algorithm": Bad(
        args=("algos=ppo,foo",),
        needles=lambda s, t: ["doit variable algos='ppo,foo'", "unknown algorithm(s) 'foo'", "known: ppo"],
        data=False,
    ),
    "unknown-config-key": Bad(
        toml=_replace("capacity_kwh = ", "capacity_kwhh = "),
        needles=lambda s, t: [str(t), "unknown key 'bess.capacity_kwhh'", "did you mean 'bess.capacity_kwh'?"],
        data=False,
    ),
    "not-parquet-or-csv": Bad(  # a JSON export saved under the data file's name
        after=_json_under_parquet_name,
        needles=lambda s, t: [_sessions(t), "not readable as parquet", "JSON text", "starts with 'PAR1'"],
    ),
}


THROUGH_DOIT = {"gap-in-hourly-index", "departure-not-after-arrival"}
"""The data defects run through ``doit run pipeline``, one per table; the others through the same validation
tasks in the test's process (every data defect takes one path: the Dask task ``validate_input``)."""


def _bad_site(tmp_path, bad: Bad) -> Path:
    site = make_site(days=7)
    if bad.hourly:
        site.series = bad.hourly(site.series.copy()).reset_index(drop=True)
    if bad.sessions:
        site.sessions = bad.sessions(site.sessions.copy()).reset_index(drop=True)
    site_toml = write_site(site, tmp_path / "site")
    if bad.toml:
        site_toml.write_text(bad.toml(site_toml.read_text()))
    if bad.after:
        bad.after(site_toml)
    return site_toml


@pytest.mark.parametrize("kind", [k for k, bad in KINDS.items() if bad.data and k not in THROUGH_DOIT])
def test_bad_data_is_rejected_by_the_validation_tasks(tmp_path, kind):
    """The validation task of one input raises the message that names the file, column and row or time."""
    from envs.errors import ExpectedError
    from pipeline.study.results import INPUTS
    from pipeline.study.tasks import validate_input

    bad = KINDS[kind]
    site_toml = _bad_site(tmp_path, bad)
    errors = []
    for name in INPUTS:
        try:
            validate_input(str(site_toml), name)
        except (ExpectedError, ValueError) as exc:
            errors.append(str(exc))
    assert errors, f"{kind}: no validation task raised"
    message = "\n".join(errors)
    for needle in bad.needles(make_site(days=7), site_toml):
        assert needle in message, f"{needle!r} not in:\n{message[-4000:]}"


@pytest.mark.parametrize("kind", [k for k, bad in KINDS.items() if not bad.data or k in THROUGH_DOIT])
def test_bad_input_stops_before_training_and_output(tmp_path, kind):
    bad = KINDS[kind]
    clean = make_site(days=7)
    site_toml = _bad_site(tmp_path, bad)
    out = tmp_path / "outputs"

    result = doit(["run", "pipeline", *bad.args], site_toml, out)

    message = result.stdout + result.stderr
    assert result.returncode != 0, message[-3000:]
    for needle in bad.needles(clean, site_toml):
        assert needle in message, f"{needle!r} not in:\n{message[-4000:]}"
    assert files_under(out) == []
    started = [line for line in result.stdout.splitlines() if line.startswith(".  ")]
    if bad.data:
        # the Dask validation raised it, and no later task (baselines, training) started; one message, no traceback
        assert "TaskFailed - taskid:validate" in result.stdout, message[-3000:]
        assert "Traceback" not in message, message[-3000:]
        assert started == [".  validate"], started
    else:
        # raised while doit loads dodo.py: no task started, doit's one-line ERROR
        assert started == [] and "TaskError" not in message and "Traceback" not in message, message[-3000:]


# ----------------------------------------------------------- variants of the kinds above, without doit


def test_algos_from_the_environment_and_a_typo_in_a_doit_variable(monkeypatch):
    from doit import doit_cmd

    from pipeline.study.config import from_environment

    monkeypatch.setenv("EVHUB_ALGOS", "ppo,sacc")
    with pytest.raises(ValueError, match=r"environment variable EVHUB_ALGOS='ppo,sacc'.*'sacc': did you mean 'sac'"):
        from_environment(site="caltech")
    monkeypatch.delenv("EVHUB_ALGOS")
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"total_timestep": "100"})
    with pytest.raises(ValueError, match=r"doit variable total_timestep='100'.*did you mean 'total_timesteps'"):
        from_environment(site="caltech")
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"seeds": "1,x"})
    with pytest.raises(ValueError, match=r"doit variable seeds='1,x'"):
        from_environment(site="caltech")
    for bad in ("0", "two"):  # the embedded cluster's size (the pipeline's and the sizing's)
        monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"workers": bad})
        with pytest.raises(ValueError, match=f"doit variable workers='{bad}': workers must be a positive integer"):
            from_environment(site="caltech")
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {})
    monkeypatch.setenv("EVHUB_WORKERS", "3")
    assert from_environment(site="caltech").workers == 3
    monkeypatch.delenv("EVHUB_WORKERS")
    assert from_environment(site="caltech").workers is None  # one per core (pipeline.study.cluster.local_workers)


def test_reversed_split_dates_and_a_split_without_sessions(tmp_path):
    from envs.config import ConfigError, load_config
    from pipeline.study.tasks import validate_input

    toml = write_site(make_site(days=7), tmp_path)
    text = toml.read_text()
    toml.write_text(text.replace('train = ["2019-05-01", "2019-05-07"]', 'train = ["2019-05-07", "2019-05-01"]'))
    empty = rf"{re.escape(str(toml))}: key 'splits.train' is empty: end 2019-05-01 before start 2019-05-07"
    with pytest.raises(ConfigError, match=empty):
        load_config(toml)
    toml.write_text(text)
    sessions = Path(_sessions(toml))
    s = pd.read_parquet(sessions)
    s[s.arrival < pd.Timestamp("2019-05-08", tz="America/Los_Angeles")].to_parquet(sessions, index=False)
    no_sessions = rf"{re.escape(str(toml))}: key 'splits.test' selects no EV sessions in {re.escape(str(sessions))}"
    with pytest.raises(ValueError, match=no_sessions):
        validate_input(str(toml), "config")


def test_data_in_another_format_beside_the_config(tmp_path):
    from envs.schemas import DataValidationError, read_table
    from envs.site import load_site

    toml = write_site(make_site(days=7), tmp_path)
    sessions = Path(_sessions(toml))
    pd.read_parquet(sessions).to_json(sessions.with_suffix(".json"), date_format="iso")
    sessions.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(sessions))} is missing \(found sessions.json"):
        load_site(toml)
    with pytest.raises(DataValidationError, match=r"sessions\.json: unsupported file type '\.json'"):
        read_table(sessions.with_suffix(".json"))
    csv_named = sessions.with_suffix(".csv")
    csv_named.write_bytes(Path(_hourly(toml)).read_bytes())  # a Parquet file under a CSV name
    with pytest.raises(DataValidationError, match=r"sessions\.csv: not readable as csv: the file is Parquet"):
        read_table(csv_named)
