"""Ingestion end to end (marked slow): the shipped sites regenerate byte for byte from their ``[sources]`` (every
series file, at the step they were made at), and ``doit`` ingests a user's site, then validates it, then runs the
baselines; a bad raw file stops doit at ``ingest`` before any other task. The site is the "garage" of
``test_sources.py``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import doit, files_under
from test_sources import template, write_garage  # noqa: F401  (template: the garage's raw files, a fixture)

from envs.config import SITES_DIR
from envs.schemas import SERIES_COLUMNS
from pipeline.data.ingest import ingest
from pipeline.data.sources import load_sources

pytestmark = pytest.mark.slow


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_libraries(shipped: Path) -> bool:
    """Whether this environment writes Parquet and models PV as when the shipped files were made: the pyarrow of
    the shipped Parquet's ``created_by`` and the pvlib named in its README."""
    import pvlib
    import pyarrow
    import pyarrow.parquet as pq

    created_by = pq.ParquetFile(shipped / "series_60min.parquet").metadata.created_by
    return (
        f"version {pyarrow.__version__}" in created_by
        and f"pvlib {pvlib.__version__}" in (shipped / "README.md").read_text()
    )


def _shipped_step(shipped: Path) -> float:
    """The step, hours, the shipped data were ingested at: the finest series file holding every series column (the
    5-minute physics series holds fewer unless it is the site's step)."""
    full = [
        int(p.stem.split("_")[1].removesuffix("min"))
        for p in shipped.glob("series_*min.parquet")
        if set(SERIES_COLUMNS) <= set(pq.read_schema(p).names)
    ]
    return min(full) / 60


@pytest.mark.parametrize("name", ["caltech", "iquitos"])
def test_shipped_site_regenerates_byte_for_byte(tmp_path, name):
    """Re-ingesting a shipped site from its sources into a temporary folder, at the step its data were made at, gives
    the shipped files bit for bit (every series, the sessions and the README), with the libraries they were made with;
    with others, the same tables."""
    src = load_sources(name)
    if src.availability()[0] == "absent":
        pytest.skip(f"the raw files of {name} are not here ({src.availability()[1]})")
    shipped = SITES_DIR / name
    ingest(name, tmp_path, dt_h=_shipped_step(shipped))
    names = sorted(p.name for p in shipped.iterdir() if p.suffix in (".parquet", ".md"))
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    if _same_libraries(shipped):
        for f in names:
            assert _sha256(tmp_path / f) == _sha256(shipped / f), f
    else:
        pd.testing.assert_frame_equal(
            pd.read_parquet(tmp_path / "sessions.parquet"), pd.read_parquet(shipped / "sessions.parquet")
        )
        for f in names:
            if f.startswith("series_"):
                pd.testing.assert_frame_equal(
                    pd.read_parquet(tmp_path / f), pd.read_parquet(shipped / f), rtol=0, atol=1e-5
                )


def test_doit_ingests_then_validates_then_runs_a_users_site(tmp_path, template):
    toml = write_garage(tmp_path / "site", template)
    toml.write_text(toml.read_text() + "\n[mpc]\nenabled = false\n")
    out = tmp_path / "outputs"
    first = doit(["run", "baselines"], toml, out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    started = [line for line in first.stdout.splitlines() if line.startswith(".  ")]
    assert started == [".  ingest", ".  validate", ".  baselines"], started
    assert (tmp_path / "site" / "garage" / "series_60min.parquet").is_file()
    co2 = {
        c: pd.read_parquet(out / "garage" / "baselines" / f"{c}_test.parquet").co2_kg.iloc[0]
        for c in ("uncontrolled", "rule_based", "oracle")
    }
    assert co2["uncontrolled"] > co2["rule_based"] >= co2["oracle"] >= 0.0, co2

    second = doit(["run", "baselines"], toml, out)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "-- ingest" in second.stdout and "-- validate" in second.stdout, second.stdout

    # a changed raw file re-ingests; the data it gives are then validated again
    raw = tmp_path / "site" / "raw" / "sessions" / "november.csv"
    d = pd.read_csv(raw, dtype=str)
    d.loc[0, "Energy [kWh]"] = "12.5"
    d.to_csv(raw, index=False)
    third = doit(["run", "validate"], toml, out)
    assert third.returncode == 0, third.stdout[-3000:]
    assert ".  ingest" in third.stdout and ".  validate" in third.stdout, third.stdout


def test_a_bad_source_stops_doit_at_ingest_before_any_other_task(tmp_path, template):
    toml = write_garage(tmp_path / "site", template)
    part = tmp_path / "site" / "raw" / "moer_de" / "DE_part2.csv"
    d = pd.read_csv(part, dtype=str)
    d.assign(moer=(d.moer.astype(float) * 1000).astype(str)).to_csv(part, index=False)
    out = tmp_path / "outputs"
    result = doit(["run", "pipeline"], toml, out)
    message = result.stdout + result.stderr
    assert result.returncode != 0, message[-3000:]
    assert "TaskFailed - taskid:ingest" in message and "looks like g/kWh" in message and "DE_part2.csv" in message
    assert "Traceback" not in message, message[-3000:]
    started = [line for line in result.stdout.splitlines() if line.startswith(".  ")]
    assert started == [".  ingest"], started
    assert files_under(out) == [] and not (tmp_path / "site" / "garage").exists()
