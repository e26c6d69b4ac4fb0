"""Expected errors read as one message: no Python traceback, a non-zero exit, the message naming what and where.

Every error the project raises on purpose (``envs.errors.is_expected``: a bad site config, bad data, a bad
``[sources]`` table or raw file, a bad doit variable, an experiment already running) is run through the real
``doit run pipeline`` (and ``python -m pipeline.data.ingest``): the output holds the message and no
"Traceback". Unexpected errors keep theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, doit, files_under, make_site, write_site
from test_download_folders import cut_short
from test_sources import template, write_garage  # noqa: F401  (template: the garage's raw files, a fixture)

from envs.errors import ExpectedError, InputError, is_expected


@dataclass
class Kind:
    """One expected error: the site it needs, how to break it, and what doit must print."""

    garage: bool
    """The garage site of ``test_sources.py`` (raw sources, ingested by the task ``ingest``), else a synthetic
    site with processed data only."""
    breaker: Callable[[Path], object] = lambda toml: None
    """Breaks the written site (gets the TOML path); a lock it returns is held while doit runs."""
    args: tuple[str, ...] = ()
    needles: Callable[[Path], list[str]] = lambda toml: []
    failed: str | None = None
    """The task that fails (``TaskFailed - taskid:<failed>``), or None: doit stops while loading dodo.py."""


def _edit(old: str, new: str) -> Callable[[Path], None]:
    def breaker(toml: Path) -> None:
        text = toml.read_text()
        assert old in text, old
        toml.write_text(text.replace(old, new))

    return breaker


def _negative_energy(toml: Path) -> None:
    import pandas as pd

    p = toml.parent / "synthetic" / "sessions.parquet"
    s = pd.read_parquet(p)
    s.loc[3, "energy_kwh"] = np.float32(-5.0)
    s.to_parquet(p, index=False)


def _busy(toml: Path):
    from pipeline.study.runstate import ExperimentLock

    return ExperimentLock(toml.parent.parent / "outputs" / "synthetic", describe="doit run pipeline (the test)")


KINDS = {
    "site-config": Kind(
        garage=False,
        breaker=_edit("n_sockets = 6", "n_sockets = 0"),
        needles=lambda t: [f"ERROR: {t}: key 'ev.n_sockets' must be >= 1, got 0"],
    ),
    "doit-variable": Kind(
        garage=False,
        args=("algos=ppo,foo",),
        needles=lambda t: ["ERROR: doit variable algos='ppo,foo': unknown algorithm(s) 'foo'"],
    ),
    "doit-variable-typo": Kind(
        garage=False,
        args=("seed=2",),
        needles=lambda t: ["ERROR: doit variable seed='2': unknown variable", "seeds"],
    ),
    "experiment-running": Kind(
        garage=False,
        breaker=_busy,
        needles=lambda t: ["ERROR: ", f"experiment folder {t.parent.parent / 'outputs' / 'synthetic'} is in use by"],
    ),
    "bad-data": Kind(
        garage=False,
        breaker=_negative_energy,
        failed="validate",
        needles=lambda t: [f"{t.parent / 'synthetic' / 'sessions.parquet'}: column 'energy_kwh' row 3", "-5.0"],
    ),
    "bad-sources": Kind(
        garage=True,
        breaker=_edit('unit = "kg/kWh"', 'units = "kg/kWh"'),
        failed="ingest",
        needles=lambda t: [f"{t}: unknown key 'sources.carbon.units'", "did you mean 'sources.carbon.unit'?"],
    ),
    "raw-file-cut-short": Kind(
        garage=True,
        breaker=cut_short,
        failed="ingest",
        needles=lambda t: [
            f"{t.parent / 'raw' / 'sessions' / 'october.csv.gz'}: cannot be read as gzip-compressed CSV",
            "looks cut short",
            "key 'sources.sessions.format' = 'csv'",
        ],
    ),
    "split-without-a-file": Kind(
        garage=True,
        failed="ingest",
        breaker=_edit('files = ["sessions/october.csv", "sessions/november.csv"]', 'files = ["sessions/october.csv"]'),
        needles=lambda t: [
            "no file of [sources.sessions] (files = 'sessions/october.csv') covers split 'test'",
            "The files cover (arrivals, local dates): sessions/october.csv 2023-10-23..2023-10-31",
        ],
    ),
}


@pytest.mark.parametrize("kind", list(KINDS), ids=list(KINDS))
def test_an_expected_error_prints_one_message_without_a_traceback(tmp_path, template, kind):
    k = KINDS[kind]
    folder = tmp_path / "site"
    toml = write_garage(folder, template) if k.garage else write_site(make_site(days=7), folder)
    held = k.breaker(toml)
    out = tmp_path / "outputs"
    try:
        result = doit(["run", "pipeline", *k.args], toml, out)
    finally:
        if hasattr(held, "release"):
            held.release()
    message = result.stdout + result.stderr
    assert result.returncode != 0, message[-3000:]
    assert "Traceback" not in message, message[-4000:]
    for needle in k.needles(toml):
        assert needle in message, f"{needle!r} not in:\n{message[-4000:]}"
    started = [line for line in result.stdout.splitlines() if line.startswith(".  ")]
    if k.failed is None:  # stopped while doit loads dodo.py: doit's one-line ERROR, exit 3
        assert result.returncode == 3 and started == [] and "TaskError" not in message, message[-3000:]
        assert [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")] == [
            result.stderr.strip().splitlines()[0]
        ]
    else:
        assert result.returncode == 1 and started == [f".  {k.failed}"], message[-3000:]
        assert f"TaskFailed - taskid:{k.failed}" in result.stdout and "TaskError" not in message, message[-3000:]
    assert [p for p in files_under(out) if p.name not in (".doit.lock",)] == []


def test_ingest_on_the_command_line_prints_one_message_and_exits_1(tmp_path, template):
    toml = write_garage(tmp_path, template)
    bad = cut_short(toml)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeline.data.ingest", "--site", str(toml)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {bad}: cannot be read as gzip-compressed CSV (EOFError: "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "garage").exists()


def test_unexpected_errors_keep_their_traceback(tmp_path, monkeypatch):
    from doit.exceptions import TaskFailed

    from pipeline.data import ingest as ingest_module
    from pipeline.study.failures import doit_action

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    def bad_input(*args, **kwargs):
        raise InputError("site.toml: key 'x' is wrong: fix it")

    assert isinstance(doit_action(bad_input)(), TaskFailed)
    assert doit_action(bad_input)().message == "site.toml: key 'x' is wrong: fix it"
    assert isinstance(doit_action(lambda: (_ for _ in ()).throw(ValueError("v")), also=(ValueError,))(), TaskFailed)
    with pytest.raises(ZeroDivisionError):
        doit_action(broken)()
    with pytest.raises(ValueError):
        doit_action(lambda: (_ for _ in ()).throw(ValueError("a bug too")))()
    monkeypatch.setattr(ingest_module, "ingest", broken)
    with pytest.raises(ZeroDivisionError):
        ingest_module.main(["--site", "caltech"])
    monkeypatch.setattr(ingest_module, "ingest", bad_input)
    assert ingest_module.main(["--site", "caltech"]) == 1


def test_the_errors_raised_on_purpose_share_one_base():
    from envs.schemas import DataValidationError
    from envs.site import ConfigError
    from pipeline.data.sources import SourceError
    from pipeline.study.runstate import DamagedState, ExperimentBusy

    for cls in (ConfigError, DataValidationError, SourceError):
        assert issubclass(cls, InputError) and issubclass(cls, ValueError)  # callers catching ValueError still do
    for cls in (ExperimentBusy, DamagedState):
        assert issubclass(cls, ExpectedError) and issubclass(cls, RuntimeError)
    assert is_expected(FileNotFoundError("x")) and not is_expected(ValueError("x")) and not is_expected(KeyError("x"))
