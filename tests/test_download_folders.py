"""A site's ``[sources]`` pointed at whole download folders (``pipeline.data.readers``).

A folder of ACN-Data or WattTime downloads holds files of other years: a sessions or carbon file none of whose
rows lies in the site's period is skipped with one line naming it and why, and the data README lists it; the
data are exactly those of the files that do cover the period. Only a split that no file of a source covers is an
error, naming the source, the split and what the files cover. A raw file that cannot be decoded (a compressed
download cut short) names the file and says so. The site is the "garage" of ``test_sources.py``.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pandas as pd
import pytest
from test_sources import TZ, moer_frame, session_rows, template, write_garage  # noqa: F401  (template: a fixture)

from pipeline.data.ingest import ingest
from pipeline.data.readers import read_carbon, read_sessions
from pipeline.data.sources import SourceError, load_sources, period_index

TWO_FILES = 'files = ["sessions/october.csv", "sessions/november.csv"]'


def _folder_site(folder: Path, template: Path) -> Path:
    """The garage with its sessions and MOER patterns matching whole folders that also hold a 2024 sessions file
    and a 2022 MOER file (both outside the period 2023-10-23..2023-11-07); returns the TOML path."""
    toml = write_garage(folder, template)
    toml.write_text(toml.read_text().replace(TWO_FILES, 'files = "sessions/*.csv"'))
    raw = folder / "raw"
    session_rows(pd.date_range("2024-11-01", "2024-11-06", freq="D"), offsets=True).to_csv(
        raw / "sessions" / "2024-11.csv", index=False
    )
    moer_frame("2022-10-01", "2022-10-05").to_csv(raw / "moer_de" / "DE_2022.csv", index=False)
    return toml


def test_a_folder_with_files_outside_the_period_ingests_and_says_which_it_skipped(tmp_path, template, capsys):
    toml = _folder_site(tmp_path / "folder", template)
    summary = ingest(toml)
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("ingest: skipped")]
    assert skipped == [
        "ingest: skipped sessions/2024-11.csv: all 30 sessions arrive outside the site's period 2023-10-23..2023-11-07"
        " (Europe/Berlin, from the splits): they arrive 2024-11-01..2024-11-06",
        f"ingest: skipped moer_de/DE_2022.csv: all {4 * 288:,} rows lie outside the site's period "
        "2023-10-23..2023-11-07 (Europe/Berlin, from the splits): they cover 2022-10-01..2022-10-05",
    ], out
    info = summary["info"]
    assert [s["file"] for s in info["sessions"]["skipped"]] == ["sessions/2024-11.csv"]
    assert [s["file"] for s in info["carbon"]["skipped"]] == ["moer_de/DE_2022.csv"]
    assert [r["file"] for r in info["sessions"]["report"]] == ["sessions/november.csv", "sessions/october.csv"]
    readme = (tmp_path / "folder" / "garage" / "README.md").read_text()
    for needle in (
        "| `sessions/2024-11.csv` (skipped) |",
        "| `moer_de/DE_2022.csv` (skipped) |",
        "Skipped: 2 raw file(s) none of whose rows lies in the site's period 2023-10-23..2023-11-07",
    ):
        assert needle in readme, needle
    assert "(skipped)" not in readme.split("`moer_de/DE_part1.csv`")[1].splitlines()[0]

    # the same tables as from the two files that cover the period
    clean = load_sources(write_garage(tmp_path / "clean", template))
    folder = load_sources(toml)
    pd.testing.assert_frame_equal(read_sessions(folder)[0], read_sessions(clean)[0])
    index = period_index(clean.config)
    pd.testing.assert_frame_equal(read_carbon(folder, index)[0], read_carbon(clean, index)[0])
    hourly = pd.read_parquet(tmp_path / "folder" / "garage" / "series_60min.parquet")
    pd.testing.assert_series_equal(
        hourly.moer_kg_per_kwh,
        read_carbon(clean, index)[0].moer_kg_per_kwh.astype("float32").reset_index(drop=True),
        check_names=False,
    )


def test_a_source_with_no_file_in_a_split_fails_naming_the_source_the_split_and_what_the_files_cover(
    tmp_path, template
):
    toml = _folder_site(tmp_path, template)
    (tmp_path / "raw" / "moer_de" / "DE_part2.csv").unlink()  # DE_part1 ends on 2023-10-31: nothing for the test split
    with pytest.raises(SourceError) as info:
        ingest(toml)
    message = str(info.value)
    for needle in (
        f"{toml}: no file of [sources.carbon] (files = 'moer_de/*.csv') covers split 'test' (key 'splits.test' ="
        " 2023-11-01..2023-11-06, Europe/Berlin)",
        "The files cover (Europe/Berlin dates): moer_de/DE_2022.csv 2022-10-01..2022-10-05 (1,152 rows, skipped: "
        "outside the period), moer_de/DE_part1.csv 2023-10-21..2023-10-31",
        "Point key 'sources.carbon.files' at files covering the site's period 2023-10-23..2023-11-07",
    ):
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "garage").exists()

    # every sessions file outside the period: no split is covered, the first one is named
    for name in ("october.csv", "november.csv"):
        (tmp_path / "raw" / "sessions" / name).unlink()
    with pytest.raises(SourceError) as info:
        ingest(toml)
    message = str(info.value)
    for needle in (
        "key 'splits.train' (2023-10-23..2023-10-31, Europe/Berlin) selects none of the 0 sessions",
        "no file of [sources.sessions] (files = 'sessions/*.csv') covers split 'train'",
        "sessions/2024-11.csv 2024-11-01..2024-11-06 (30 sessions, skipped: outside the period)",
    ):
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "garage").exists()


def test_a_carbon_file_that_covers_part_of_the_period_still_names_the_first_missing_hour_and_the_files(
    tmp_path, template
):
    toml = write_garage(tmp_path, template)
    p = tmp_path / "raw" / "moer_de" / "DE_part2.csv"
    d = pd.read_csv(p, dtype=str)
    d[pd.to_datetime(d.time, utc=True) < pd.Timestamp("2023-11-05", tz="UTC")].to_csv(p, index=False)
    with pytest.raises(SourceError) as info:
        ingest(toml)
    message = str(info.value)
    for needle in (
        "does not cover the site's period",
        "in split 'test'",
        "The files of [sources.carbon] cover (Europe/Berlin dates): moer_de/DE_part1.csv",
        "moer_de/DE_part2.csv 2023-10-30..2023-11-05",
    ):
        assert needle in message, f"{needle!r} not in:\n{message}"


def cut_short(toml: Path) -> Path:
    """Replace the garage's october.csv by a gzip download of it broken off at half its bytes; returns its path."""
    raw = toml.parent / "raw" / "sessions"
    packed = gzip.compress((raw / "october.csv").read_bytes())
    (raw / "october.csv").unlink()
    bad = raw / "october.csv.gz"
    bad.write_bytes(packed[: len(packed) // 2])
    toml.write_text(toml.read_text().replace(TWO_FILES, 'files = ["sessions/october.csv.gz", "sessions/november.csv"]'))
    return bad


def test_a_raw_file_cut_short_names_the_file_and_says_so(tmp_path, template):
    toml = write_garage(tmp_path, template)
    bad = cut_short(toml)
    with pytest.raises(SourceError) as info:
        ingest(toml)
    message = str(info.value)
    for needle in (
        f"{bad}: cannot be read as gzip-compressed CSV (EOFError: Compressed file ended before the end-of-stream "
        "marker",
        "looks cut short (a download broken off?)",
        f"or is not what key 'sources.sessions.format' = 'csv' of {toml} says; download it again",
    ):
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "garage").exists()
    # a Parquet file where the TOML says CSV
    shutil.copy(tmp_path / "raw" / "moer_de" / "DE_part1.csv", tmp_path / "part1.csv")
    pd.read_csv(tmp_path / "part1.csv").to_parquet(tmp_path / "raw" / "moer_de" / "DE_part1.csv")
    bad.write_bytes(gzip.compress((template / "raw" / "sessions" / "october.csv").read_bytes()))
    with pytest.raises(
        SourceError,
        match=r"DE_part1\.csv: cannot be read as CSV \(.*\): the file looks cut short .* or is"
        r" not what key 'sources\.carbon\.format' = 'watttime-moer'",
    ):
        ingest(toml)
