"""Compile once: the clock that charges compile and capture time to each hot function and flags a recompilation
(``harness.COMPILE_CLOCK``), and the persistent compile cache that serves a second process (``--compile-cache``).
Every agent's compiled run is checked for recompilations in ``tests/test_algo_contracts.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from algos import harness

ROOT = Path(__file__).resolve().parents[1]


def _square(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x * k).square().sum()


def test_the_clock_charges_compiling_to_its_function_and_flags_a_recompilation():
    harness.COMPILE_CLOCK.reset()
    args = SimpleNamespace(compile=True, cudagraphs=False)
    (steady,) = harness.bind(args, steady=lambda x: _square(x, 3))
    (drifting,) = harness.bind(args, drifting=_square)
    x = torch.arange(4.0)
    for k in range(1, 6):
        steady(x)
        drifting(x, k if k < 4 else 3.5)  # an int that settles into a symbol, then a float: a new graph
    clock = harness.COMPILE_CLOCK
    assert clock.graphs["steady"] == 1 and clock.seconds["steady"] > 0
    assert "steady" not in clock.late_graphs
    assert clock.late_graphs.get("drifting", 0) >= 1
    assert "RECOMPILED" in clock.summary() and "drifting" in clock.summary()
    eager = SimpleNamespace(compile=False, cudagraphs=False)
    (plain,) = harness.bind(eager, plain=_square)
    assert plain is _square  # no switch, nothing wrapped


def test_an_uncompiled_function_stays_eager_under_compile():
    args = SimpleNamespace(compile=True, cudagraphs=False)
    (fn,) = harness.bind(args, compile=False, gae=_square)
    harness.COMPILE_CLOCK.reset()
    assert float(fn(torch.ones(2), 2)) == 8.0
    assert harness.COMPILE_CLOCK.graphs.get("gae", 0) == 0


@pytest.mark.slow
def test_a_second_process_loads_the_graphs_from_the_cache(tmp_path):
    """The first process compiles and writes the cache; the second, with the same folder, hits it (Inductor's FX
    graph cache) and compiles no kernel anew."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from algos.harness import use_compile_cache
        from torch._dynamo.utils import counters
        use_compile_cache(sys.argv[1])
        f = torch.compile(lambda x: (x.sin() * 2 + 1).relu().sum())
        f(torch.randn(64))
        print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
        """
    )
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    runs = [
        subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, env=env, timeout=300)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.split() for run in runs)
    assert first[1:4:2] == ["0", "1"], runs[0].stdout  # a miss: compiled and stored
    assert second[1:4:2] == ["1", "0"], runs[1].stdout  # a hit: loaded
    assert any(cache.rglob("*"))
