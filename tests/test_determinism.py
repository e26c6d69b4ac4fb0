"""Determinism on the CPU: the same inputs and seed give byte-identical baseline KPI files (the oracle's
included), in separate processes. For every agent, the same seed giving the same training curve and trained policy in
another process (with ``--deterministic-algorithms``) is checked by ``tests/test_faults.py``, whose uninterrupted run
is that process.

On a GPU, ``--deterministic-algorithms`` is the switch for bitwise-repeatable runs (see the README)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

from pipeline.control.baselines import POLICIES
from pipeline.study import tasks


def _baselines_in_a_subprocess(site_toml, out) -> None:
    code = (
        "import sys; from pipeline.study import tasks; from pipeline.control.baselines import POLICIES\n"
        "for c in (*POLICIES, 'oracle'): tasks.run_controller(sys.argv[1], c, 'test', sys.argv[2])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(site_toml), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_baseline_kpi_files_are_byte_identical_across_processes(site_toml, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for c in (*POLICIES, "oracle"):
        tasks.run_controller(str(site_toml), c, "test", str(first))
    _baselines_in_a_subprocess(site_toml, second)
    names = sorted(p.name for p in first.glob("*.parquet"))
    assert len(names) == 2 * (len(POLICIES) + 1)  # KPI row + traces per controller, oracle included
    assert names == sorted(p.name for p in second.glob("*.parquet"))
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
