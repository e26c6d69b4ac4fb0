"""The CO2 comparison report: table layout, relative KPIs, figures, Markdown and the HTML page, from real env
rollouts."""

from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_site

from envs.kpis import KPI_COLUMNS, TRACE_COLUMNS, add_relative_kpis, evaluate_policy, write_parquet
from pipeline.control import registry
from pipeline.study.comparison import (
    GAP_VS_RULE,
    SAVING_VS_ORACLE,
    SEED_COLUMNS,
    START_COLUMNS,
    best_controllers,
    read_kpi_files,
)
from pipeline.study.document import Definitions, Paragraph, Table
from pipeline.study.figures import KIND_COLORS, controller_kind, ranked_by_saving, saving_figure
from pipeline.study.report import (
    answer_blocks,
    controller_legend,
    definitions,
    kpi_markdown_table,
    results_table,
    site_data_sources,
    summary_paragraph,
    write_report,
)

CONTROLLERS = ("ppo", "uncontrolled", "a2c", "oracle", "rule_based")  # deliberately not in report order
SPLITS = ("test", "train")


def _uncontrolled(obs: torch.Tensor, env) -> torch.Tensor:
    return torch.tensor([[0.0, 1.0]], dtype=obs.dtype, device=obs.device)


def _latest_charging(obs: torch.Tensor, env) -> torch.Tensor:
    """Stand-in for a second agent: EVs at their least-laxity floor only (as late as possible), BESS idle."""
    return torch.tensor([[0.0, -1.0]], dtype=obs.dtype, device=obs.device)


def _random_linear(seed: int):
    """Stand-in for a trained agent: a fixed random linear policy ``tanh(obs @ W)``."""
    gen = torch.Generator().manual_seed(seed)
    weights: dict[int, torch.Tensor] = {}

    def policy(obs: torch.Tensor, env) -> torch.Tensor:
        if obs.shape[1] not in weights:
            weights[obs.shape[1]] = torch.randn(obs.shape[1], 2, generator=gen, dtype=torch.float64) * 0.3
        a = torch.tanh(obs.to(torch.float64) @ weights[obs.shape[1]])
        a[:, 1] = 0.5 + 0.5 * a[:, 1]  # mostly charging, so it serves most EV energy
        return a.to(obs.dtype)

    return policy


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """KPI and trace Parquet files for 5 controllers x 2 splits of the synthetic site, plus metrics."""
    root = tmp_path_factory.mktemp("report_inputs")
    site = make_site()
    kpi_files, trace_files, rows = [], {}, {}
    for split in SPLITS:
        # random linear seed 3 has the lowest CO2 of seeds 0-7 on both splits: the stand-in oracle; seed 0 emits
        # between a2c and ppo on both: the stand-in rule, so ppo and uncontrolled close a negative gap from it
        policies = {
            "uncontrolled": _uncontrolled,
            "oracle": _random_linear(3),
            "ppo": _random_linear(1),
            "a2c": _latest_charging,
            "rule_based": _random_linear(0),
        }
        for name in CONTROLLERS:
            extra = {"train_wall_s": 12.5} if name == "ppo" else {}
            kpi, traces = evaluate_policy(policies[name], site, split, name, **extra)
            kpi["seed"] = 1  # an extra column the report must drop
            kpi_files.append(write_parquet(kpi, root / f"kpi_{name}_{split}.parquet"))
            trace_files[(name, split)] = write_parquet(traces, root / f"traces_{name}_{split}.parquet")
            rows[(name, split)] = kpi.iloc[0]
    steps = np.arange(1, 41) * 480
    metrics = pd.DataFrame(
        {
            "global_step": steps,
            "wall_s": steps / 1000.0,
            "sps": np.full(len(steps), 1000.0),
            "episodic_return": -np.linspace(50, 20, len(steps)),
            "episodic_co2_kg": np.linspace(40, 25, len(steps)) + np.sin(steps),
            "episodic_unserved_kwh": np.linspace(10, 1, len(steps)),
        }
    )
    metrics_files = {"ppo": write_parquet(metrics, root / "ppo_metrics.parquet"), "sac": root / "missing.parquet"}
    return {
        "kpi_files": kpi_files,
        "trace_files": trace_files,
        "metrics_files": metrics_files,
        "rows": rows,
        "site": site,
    }


@pytest.fixture(scope="module")
def report(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "out"
    return write_report(
        inputs["kpi_files"],
        inputs["trace_files"],
        inputs["metrics_files"],
        out,
        "Synthetic site: CO2 comparison",
        {"site": "synthetic", "PV": "10 kWp", "BESS": "20 kWh / 10 kW", "timezone": "America/Los_Angeles"},
    )


def test_files_exist(report: Path):
    out = report.parent
    assert report.name == "report.md"
    for name in (
        "co2_comparison.parquet",
        "co2_by_controller.png",
        "test_week_traces.png",
        "learning_curves.png",
        "report.md",
    ):
        assert (out / name).is_file(), name
        assert (out / name).stat().st_size > 1000 or name == "co2_comparison.parquet", name
    for name in ("co2_by_controller.png", "test_week_traces.png", "learning_curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not list(out.glob(".*.tmp")), "temporary files left behind"


def test_comparison_table(report: Path, inputs):
    table = pd.read_parquet(report.parent / "co2_comparison.parquet")
    assert list(table.columns) == ["controller", "split", *KPI_COLUMNS, *SEED_COLUMNS, *START_COLUMNS]
    assert (table.n_seeds == 1).all() and table.co2_kg_std.isna().all()  # one seed each: no spread
    assert (table.start == "").all() and table.co2_vs_start_kg.isna().all()  # no learned planner here
    # one row per controller x split, ordered train then test: the registry's order, the causal controllers and the
    # agents (by name) before the bounds
    order = ["uncontrolled", "rule_based", "a2c", "ppo", "oracle"]
    assert list(zip(table.split, table.controller)) == [(s, c) for s in ("train", "test") for c in order]
    for _, r in table.iterrows():
        src = inputs["rows"][(r.controller, r.split)]
        assert r.co2_kg == pytest.approx(src.co2_kg)
        assert r.unserved_kwh == pytest.approx(src.unserved_kwh)
    by = table.set_index(["controller", "split"])
    for split in SPLITS:
        base, rule, orc, ppo = (by.loc[(c, split)] for c in ("uncontrolled", "rule_based", "oracle", "ppo"))
        assert orc.co2_kg < rule.co2_kg < ppo.co2_kg < base.co2_kg  # the stand-ins keep the study's order
        assert base.co2_reduction_pct == 0.0
        # the saving vs oracle counts from uncontrolled, the gap closed vs rule from rule_based: 0% at each reference
        assert base.saving_vs_oracle_pct == 0.0 and rule.gap_closed_vs_rule_pct == 0.0
        assert orc.saving_vs_oracle_pct == pytest.approx(100.0) and orc.gap_closed_vs_rule_pct == pytest.approx(100.0)
        assert ppo.co2_reduction_pct == pytest.approx(100 * (base.co2_kg - ppo.co2_kg) / base.co2_kg)
        assert ppo.saving_vs_oracle_pct == pytest.approx(100 * (base.co2_kg - ppo.co2_kg) / (base.co2_kg - orc.co2_kg))
        gap = 100 * (rule.co2_kg - ppo.co2_kg) / (rule.co2_kg - orc.co2_kg)
        assert ppo.gap_closed_vs_rule_pct == pytest.approx(gap)
        assert ppo.gap_closed_vs_rule_pct < 0 < ppo.saving_vs_oracle_pct  # above the rule, below uncontrolled
    assert by.loc[("ppo", "test"), "train_wall_s"] == 12.5
    assert math.isnan(by.loc[("uncontrolled", "test"), "train_wall_s"])


def test_markdown(report: Path, inputs):
    text = report.read_text()
    assert text.startswith("# Synthetic site: CO2 comparison")
    for name in CONTROLLERS:
        assert f"| {name} |" in text
    assert "- **PV**: 10 kWp" in text
    assert "### train split" in text and "### test split" in text
    assert "CO2 (kg)" in text and "Unserved energy (kWh)" in text and "Sessions rejected" in text
    assert "lowest CO2 apart from the oracle" in text
    for split in SPLITS:  # the sentence names the non-oracle controller with the least CO2 on each split
        co2 = {
            name: float(row.co2_kg) for (name, sp), row in inputs["rows"].items() if sp == split and name != "oracle"
        }
        best = min(co2, key=co2.get)
        assert f"On the **{split}** split the lowest CO2 apart from the oracle is **{best}**'s" in text
    assert "Every agent delivers at least 99% of the EV energy" in text
    assert "Unserved energy always stands beside CO2" in text
    # each share of a gap is defined once, as a formula, and every table names which one it gives
    for name, _, _, formula in SHARES:
        assert text.count(formula) == 1 and text.count(f"- **{name} (%)**: ") == 1, name
    headers = [c.strip() for line in text.splitlines() if line.startswith("| Controller |") for c in line.split("|")]
    assert "Gap closed vs rule (%)" in headers and "Saving vs oracle (%)" in headers
    assert not any(h.lower().startswith("gap closed (") for h in headers)
    # the long "knows" texts stand once each in a legend, not in the tables
    for name in CONTROLLERS:
        knows = registry.describe(name).knows
        assert f"- **{name}** ({registry.describe(name).family}" in text and f"): {knows}" in text
        assert not any(knows in line for line in text.splitlines() if line.startswith("|"))
    # every KPI, folded in the page, is a plain section here
    assert "**Every KPI of the train split, and its ordering by CO2**" in text and "Peak import (kW)" in text
    for png in ("co2_by_controller.png", "test_week_traces.png", "learning_curves.png"):
        assert f"]({png})" in text


def test_week_is_monday_with_most_ev_energy(report: Path, inputs):
    """The synthetic test split (2019-05-15..28) has exactly one whole local Monday week: from 05-20."""
    assert "test-split week from 2019-05-20" in report.read_text()


def test_missing_metrics_and_traces_are_skipped(inputs, tmp_path: Path):
    empty = write_parquet(pd.DataFrame({"global_step": pd.Series([], dtype="int64")}), tmp_path / "empty.parquet")
    md = write_report(
        inputs["kpi_files"], {}, {"ppo": empty, "dqn": tmp_path / "nope.parquet"}, tmp_path / "out", "T", {}
    )
    assert (tmp_path / "out" / "co2_by_controller.png").is_file()
    assert not (tmp_path / "out" / "learning_curves.png").exists()
    assert not (tmp_path / "out" / "test_week_traces.png").exists()
    assert "learning curves are omitted" in md.read_text()


def test_missing_kpi_column_names_file(inputs, tmp_path: Path):
    bad = pd.read_parquet(inputs["kpi_files"][0]).drop(columns=["unserved_kwh"])
    bad_path = write_parquet(bad, tmp_path / "broken_kpis.parquet")
    with pytest.raises(ValueError, match=r"broken_kpis\.parquet.*unserved_kwh"):
        write_report([*inputs["kpi_files"][1:], bad_path], {}, {}, tmp_path / "out", "T", {})


def test_duplicate_controller_split_rejected(inputs, tmp_path: Path):
    dup = write_parquet(pd.read_parquet(inputs["kpi_files"][0]), tmp_path / "dup.parquet")
    with pytest.raises(ValueError, match="dup.parquet"):
        write_report([*inputs["kpi_files"], dup], {}, {}, tmp_path / "out", "T", {})


def test_trace_file_missing_column_names_file(inputs, tmp_path: Path):
    key = ("uncontrolled", "test")
    tr = pd.read_parquet(inputs["trace_files"][key])
    assert list(tr.columns) == list(TRACE_COLUMNS)
    bad = write_parquet(tr.drop(columns=["soc"]), tmp_path / "bad_traces.parquet")
    with pytest.raises(ValueError, match=r"bad_traces\.parquet.*soc"):
        write_report(inputs["kpi_files"], {key: bad}, {}, tmp_path / "out", "T", {})


def test_summary_flags_agent_that_starves_evs(report: Path):
    table = pd.read_parquet(report.parent / "co2_comparison.parquet")
    rows = table[table.split == "test"].copy()
    base = float(rows.loc[rows.controller == "uncontrolled", "ev_energy_delivered_kwh"].iloc[0])
    starving = rows.controller == "a2c"
    rows.loc[starving, "ev_energy_delivered_kwh"] = 0.9 * base
    rows.loc[starving, "co2_kg"] = 1.0  # a CO2 "saving" bought by not charging
    text = summary_paragraph("test", rows)
    assert "lowest CO2 apart from the oracle is **a2c**" in text
    assert "Not every agent serves the EVs" in text and "a2c (90.0%)" in text and "ppo" not in text.split("are ")[-1]


def test_seeds_are_averaged_with_their_spread(tmp_path):
    def kpi(controller, co2, seed=None, served=100.0):
        row = {
            "controller": controller,
            "split": "test",
            **{k: 1.0 for k in KPI_COLUMNS},
            "co2_kg": co2,
            "ev_energy_served_pct": served,
        }
        if seed is not None:
            row["seed"] = float(seed)
        return write_parquet(pd.DataFrame([row]), tmp_path / f"{controller}_{seed}.parquet")

    files = [
        kpi("uncontrolled", 1000.0),
        kpi("oracle", 500.0),
        kpi("ppo", 700.0, 1),
        kpi("ppo", 800.0, 2),
        kpi("ppo", 900.0, 3, served=99.0),
        kpi("dqn", 650.0, 1),
    ]
    table = read_kpi_files(files).set_index("controller")
    ppo, dqn = table.loc["ppo"], table.loc["dqn"]
    assert ppo.n_seeds == 3 and ppo.co2_kg == pytest.approx(800.0) and ppo.co2_kg_std == pytest.approx(100.0)
    assert ppo.ev_energy_served_pct == pytest.approx(99 + 2 / 3)
    # relative KPIs per seed, then averaged: (1000 - co2) / (1000 - 500) -> 60, 40, 20 %
    assert ppo.saving_vs_oracle_pct == pytest.approx(40.0) and ppo.saving_vs_oracle_pct_std == pytest.approx(20.0)
    assert math.isnan(ppo.gap_closed_vs_rule_pct) and math.isnan(ppo.gap_closed_vs_rule_pct_std)  # no rule_based row
    assert dqn.n_seeds == 1 and math.isnan(dqn.co2_kg_std)
    assert table.loc["uncontrolled"].n_seeds == 1
    md = kpi_markdown_table(table.reset_index())
    assert "| ppo | 3 | 800.0 ± 100.0 |" in md
    assert "| dqn | 1 (single seed) | 650.0 |" in md
    assert "| uncontrolled | – | 1,000.0 |" in md
    compact = results_table(table.reset_index())
    assert compact.header[:3] == ("Controller", "Seeds", "CO2 (kg)") and "Unserved (kWh)" in compact.header
    assert ("ppo", "3", "800.0 ± 100.0") == compact.rows[list(table.index).index("ppo")][:3]
    with pytest.raises(ValueError, match="with seed 2"):
        read_kpi_files([*files, shutil.copy(files[3], tmp_path / "again.parquet")])


def test_each_share_of_a_gap_counts_from_its_own_reference():
    """``gap_closed_vs_rule_pct`` counts from ``rule_based``, ``saving_vs_oracle_pct`` from ``uncontrolled``, both up
    to the ``oracle``; each is NaN on a split without its references or without a gap between them."""
    co2 = {"uncontrolled": 1000.0, "rule_based": 800.0, "oracle": 500.0, "mpc": 650.0}
    rows = [{"controller": c, "split": "test", "co2_kg": v} for c, v in co2.items()]
    rows += [{"controller": c, "split": "flat", "co2_kg": v} for c, v in (co2 | {"rule_based": 500.0}).items()]
    rows += [{"controller": c, "split": "no_base", "co2_kg": v} for c, v in co2.items() if c != "uncontrolled"]
    by = add_relative_kpis(pd.DataFrame(rows)).set_index(["split", "controller"])
    test = by.loc["test"]
    assert test.saving_vs_oracle_pct.to_dict() == pytest.approx(
        {"uncontrolled": 0.0, "rule_based": 40.0, "oracle": 100.0, "mpc": 70.0}
    )
    assert test.gap_closed_vs_rule_pct.to_dict() == pytest.approx(
        {"uncontrolled": -200 / 3, "rule_based": 0.0, "oracle": 100.0, "mpc": 50.0}
    )
    assert by.loc["flat"].gap_closed_vs_rule_pct.isna().all()  # the rule emits no more than the oracle
    assert by.loc["flat"].saving_vs_oracle_pct["mpc"] == pytest.approx(70.0)
    no_base = by.loc["no_base"]
    assert no_base.saving_vs_oracle_pct.isna().all() and no_base.co2_reduction_pct.isna().all()
    assert no_base.gap_closed_vs_rule_pct["mpc"] == pytest.approx(50.0)


def test_learning_is_credited_only_against_its_untrained_start(tmp_path):
    """Each learned planner's row names its start and its CO2 against it; the answer never names a learned controller
    that does not beat its start on the train split (whatever it does on the test split), and says so."""

    def kpi(controller, train, test, seed=None):
        rows = [
            {"controller": controller, "split": sp, **{k: 1.0 for k in KPI_COLUMNS}, "co2_kg": co2}
            | ({} if seed is None else {"seed": float(seed)})
            for sp, co2 in (("train", train), ("test", test))
        ]
        return write_parquet(pd.DataFrame(rows), tmp_path / f"{controller}.parquet")

    files = [
        kpi("uncontrolled", 1000.0, 1000.0),
        kpi("oracle", 500.0, 500.0),
        kpi("mpc_rl_start", 700.0, 800.0),
        kpi("mpc_rl", 710.0, 750.0, seed=1),  # best on test, but no better than its start on train
        kpi("mpc_tuned_start", 720.0, 820.0),
        kpi("mpc_tuned", 690.0, 830.0, seed=1),  # beats its start on train
        kpi("mpc_adaptive", 695.0, 760.0, seed=1),  # its start is mpc_tuned, which it does not beat on train
    ]
    table = read_kpi_files(files)
    by = table.set_index(["controller", "split"])
    assert by.loc[("mpc_rl", "train"), "start"] == "mpc_rl_start" and by.loc[("mpc_adaptive", "test"), "start"] == (
        "mpc_tuned"
    )
    assert by.loc[("mpc_rl", "train"), "co2_vs_start_kg"] == pytest.approx(10.0)
    assert by.loc[("mpc_rl", "test"), "co2_vs_start_kg"] == pytest.approx(-50.0)
    assert by.loc[("mpc_tuned", "train"), "co2_vs_start_kg"] == pytest.approx(-30.0)
    assert by.loc[("mpc_rl_start", "train"), "start"] == "" and math.isnan(
        by.loc[("oracle", "test"), "co2_vs_start_kg"]
    )
    assert best_controllers(table) == {"causal": "mpc_rl_start", "learned": "mpc_tuned", "bound": "oracle"}
    text = " ".join(b.text for b in answer_blocks(table) if isinstance(b, Paragraph))
    assert "Run **mpc_rl_start**" in text and "**mpc_rl** (no lower than its untrained start, mpc_rl_start," in text
    assert "**mpc_adaptive** (no lower than its untrained start, mpc_tuned," in text and "**mpc_tuned** (" not in text
    # the compact table keeps each learned row's CO2 against its start; the legend names the start
    compact = results_table(table[table.split == "test"])
    col = compact.header.index("CO2 vs untrained start (kg)")
    assert {r[0]: r[col] for r in compact.rows}["mpc_rl"] == "-50.0"
    assert "credited against its untrained start, `mpc_tuned`" in controller_legend(["mpc_adaptive"]).items[0]
    # without the start rows there is nothing to credit against: the learned rows compete as before
    alone = read_kpi_files([f for f in files if "start" not in f.name])
    assert best_controllers(alone)["causal"] == "mpc_rl"


def test_report_shows_a_shipped_site_config_relative_to_the_project(tmp_path):
    from pipeline.study.config import PROJECT_ROOT, shown_path

    assert shown_path(PROJECT_ROOT / "envs" / "sites" / "caltech.toml") == "envs/sites/caltech.toml"
    assert shown_path(tmp_path / "site.toml") == str(tmp_path / "site.toml")  # a user's own file: as given


# ------------------------------------------------------------------------------------------- report.html
class _Page(HTMLParser):
    """What a reader sees in report.html: headings, list items (a definition as ``term: definition``), table rows,
    paragraphs, fold summaries and captions (text without tags, in document order), the attributes of every <img>, and
    the rows of tables inside a fold."""

    def __init__(self, text: str):
        super().__init__()
        self.headings: list[str] = []
        self.items: list[str] = []
        self.rows: list[list[str]] = []
        self.texts: list[str] = []  # <p> and <figcaption>
        self.imgs: list[dict] = []
        self.tags: set[str] = set()
        self.folded_rows = 0  # rows of tables inside a <details>
        self._depth = 0  # open <details>
        self._buf: list[str] | None = None
        self._cell: list[str] | None = None
        self._term = ""  # the <dt> a <dd> defines
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag in ("h1", "h2", "h3", "li", "p", "figcaption", "summary", "dt", "dd"):
            self._buf = []
        elif tag == "details":
            self._depth += 1
        elif tag == "tr":
            self.rows.append([])
            self.folded_rows += self._depth > 0
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.imgs.append(dict(attrs))

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "details":
            self._depth -= 1
        elif tag == "dt" and self._buf is not None:
            self._term, self._buf = "".join(self._buf).strip(), None
        elif tag == "dd" and self._buf is not None:
            self.items.append(f"{self._term}: " + "".join(self._buf).strip())
            self._buf = None
        elif tag in ("h1", "h2", "h3", "li", "p", "figcaption", "summary") and self._buf is not None:
            text = "".join(self._buf).strip()
            texts = {"li": self.items, "p": self.texts, "figcaption": self.texts, "summary": self.texts}
            texts.get(tag, self.headings).append(text)
            self._buf = None

    def handle_data(self, data):
        for buf in (self._buf, self._cell):
            if buf is not None:
                buf.append(data)


def _markdown_view(md: str) -> dict[str, list]:
    """The same parts of report.md, inline Markdown removed."""
    plain = lambda s: s.replace("**", "").replace("`", "")  # noqa: E731
    out: dict[str, list] = {"headings": [], "items": [], "rows": [], "texts": [], "images": []}
    for line in md.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            out["headings"].append(line.lstrip("#").strip())
        elif line.startswith("- "):
            out["items"].append(plain(line[2:]))
        elif line.startswith("|"):
            if not set(line) <= set("|-: "):
                out["rows"].append([c.strip() for c in line.strip("|").split("|")])
        elif line.startswith("!["):
            out["images"].append(re.fullmatch(r"!\[(.*)\]\((.*)\)", line).groups())
        else:
            text = line[2:] if line.startswith("> ") else line
            caption = text.startswith("*") and text.endswith("*") and not text.startswith("**")
            out["texts"].append(plain(text[1:-1] if caption else text))
    return out


def test_html_page_has_the_markdown_content_and_embedded_figures(report: Path):
    out = report.parent
    page_path = out / "report.html"
    assert page_path.is_file()
    text = page_path.read_text(encoding="utf-8")
    page, md = _Page(text), _markdown_view(report.read_text())
    assert page.headings == md["headings"] and page.headings[0] == "Synthetic site: CO2 comparison"
    assert page.items == md["items"] and "PV: 10 kWp" in page.items
    # the answer first (header, the controller to run, the oracle: the best one is also the best learned), then per
    # split a compact table and, folded, every KPI
    assert page.headings[:3] == ["Synthetic site: CO2 comparison", "The answer", "Results"]
    assert page.rows == md["rows"] and len(page.rows) == 3 + 2 * 2 * (1 + len(CONTROLLERS))
    assert page.folded_rows == 2 * (1 + len(CONTROLLERS)) and text.count("<details>") == 2
    assert page.texts == md["texts"]
    assert "Every KPI of the test split, and its ordering by CO2" in page.texts
    assert any("lowest CO2 apart from the oracle is a2c's" in t for t in page.texts)
    # every figure is embedded, byte for byte, with its alt text
    assert [(i["alt"], i["src"].split(",")[0]) for i in page.imgs] == [
        (alt, "data:image/png;base64") for alt, _ in md["images"]
    ]
    for img, (_, file) in zip(page.imgs, md["images"]):
        assert base64.b64decode(img["src"].split(",", 1)[1]) == (out / file).read_bytes(), file
    # self-contained: nothing to fetch, no library
    assert not ({"link", "iframe", "object", "embed"} & page.tags)
    assert not re.search(r"""(src|href)\s*=\s*(?!["']?data:)""", text), "a resource outside the page"
    assert "default-src 'none'" in text and "<script src" not in text
    assert "Sizing results" not in text and "Data sources" not in text  # optional sections, not given here
    assert not list(out.glob(".*.tmp"))


def test_html_sizing_results_data_sources_and_escaping(inputs, tmp_path: Path):
    sizing = pd.DataFrame(
        {"pv_kwp": [20.0, 50.0], "bess_kwh": [40, 80], "co2_kg": [1234.5678, 987.0], "note": ["as built", "<larger>"]}
    ).set_index("pv_kwp")
    md_path = write_report(
        inputs["kpi_files"],
        {},
        {},
        tmp_path / "out",
        "T",
        {"site": "x & y"},
        notes=["A <b>raw</b> tag stays text."],
        data_sources=["**EV sessions**: made up, see https://example.org/data."],
        sizing=sizing,
    )
    md = md_path.read_text()
    text = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    page = _Page(text)
    assert "## Sizing results" in md and "| pv_kwp | bess_kwh | co2_kg | note |" in md
    assert "| 20 | 40 | 1,234.568 | as built |" in md and "| 50 | 80 | 987 | <larger> |" in md
    assert "Sizing results" in page.headings and "Data sources" in page.headings
    assert ["pv_kwp", "bess_kwh", "co2_kg", "note"] in page.rows and ["50", "80", "987", "<larger>"] in page.rows
    assert page.rows == _markdown_view(md)["rows"]
    assert "&lt;larger&gt;" in text and "A &lt;b&gt;raw&lt;/b&gt; tag" in text and "x &amp; y" in text
    assert (
        '<strong>EV sessions</strong>: made up, see <a href="https://example.org/data">https://example.org/data</a>.'
        in text
    )
    assert len(page.imgs) == 1 and page.imgs[0]["alt"] == "Saving vs oracle by controller"  # no traces, no metrics


def test_the_forecasting_section_names_the_gap_without_defining_it_again(inputs, tmp_path: Path):
    """With the value-of-information table the report still defines the gap closed vs rule once (under the answer); the
    table's own page defines it for itself."""
    from pipeline.study import information
    from pipeline.study.document import render_markdown

    co2 = {"rule_based": 10.0, "oracle": 5.0, "mpc_perfect": 5.5, "mpc_rl_start": 9.0}
    served = {"ev_energy_served_pct": 100.0, "unserved_kwh": 0.0}
    kpis = pd.DataFrame(
        [
            {"controller": c, "split": sp, "co2_kg": co2.get(c, 8.0), **served}
            for c in information.controllers()
            for sp in ("train", "test")
        ]
    )
    rows = information.table(kpis)
    md = write_report(inputs["kpi_files"], {}, {}, tmp_path / "out", "T", {}, information=rows).read_text()
    assert "## What forecasting is worth" in md and "its gap closed vs rule is defined above" in md
    assert "| the planner knows | train: gap closed vs rule (%) |" in md
    for _, _, _, formula in SHARES:
        assert md.count(formula) == 1
    own = render_markdown(information.page_blocks(rows))
    assert own.count(SHARES[0][3]) == 1  # its own page: defined there
    # a table written before the column was named gap_closed_vs_rule_pct still reads
    assert render_markdown(
        information.page_blocks(rows.rename(columns={"gap_closed_vs_rule_pct": "gap_closed_pct"}))
    ) == (own)


def test_site_data_sources_from_the_shipped_readmes(tmp_path: Path):
    from pipeline.study.config import PROJECT_ROOT

    caltech = site_data_sources(PROJECT_ROOT / "envs" / "sites" / "caltech" / "README.md")
    assert len(caltech) == 4 and caltech[0].startswith("**EV charging sessions**: ACN-Data")
    assert "https://ev.caltech.edu/dataset" in caltech[0] and not any("sha256" in s for s in caltech)
    iquitos = site_data_sources(PROJECT_ROOT / "envs" / "sites" / "iquitos" / "README.md")
    assert len(iquitos) == 3 and "pvlib" in iquitos[1] and "\n" not in iquitos[1]
    assert site_data_sources(tmp_path / "missing.md") == []


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SCREEN = (1280, 900)  # the desktop window the page is laid out for: width, height in CSS px

# Measures the page as a reader's window shows it and writes the result, as JSON, into ``data-layout`` on <html>: the
# viewport, the page's scroll width, the answer's kg cells (text, right and bottom edge in px from the top-left of
# the page, before any scrolling), and every <table>'s width against its box, with every fold (<details>) opened;
# and what the page says, folds opened: every definition (<dt> term, <dd> text), every table header, all its text.
LAYOUT_SCRIPT = """<script>
window.addEventListener("load", function () {
  var each = function (list, f) { return Array.prototype.map.call(list, f); };
  var kg = [], answer = document.getElementById("answer");
  if (answer) {
    var heads = each(answer.querySelectorAll("thead th"), function (th) { return th.textContent; });
    each(answer.querySelectorAll("tbody tr"), function (tr) {
      each(tr.children, function (td, i) {
        if (heads[i].indexOf("(kg)") >= 0) {
          var r = td.getBoundingClientRect();
          kg.push({text: td.textContent.trim(), right: r.right, bottom: r.bottom});
        }
      });
    });
  }
  each(document.querySelectorAll("details"), function (d) { d.open = true; });
  var tables = each(document.querySelectorAll("table"), function (t) {
    return {width: t.scrollWidth, box: t.parentElement.clientWidth, folded: t.closest("details") !== null};
  });
  var definitions = each(document.querySelectorAll("dt"), function (dt) {
    var dd = dt.nextElementSibling;
    return {term: dt.innerText.trim(), text: dd && dd.tagName === "DD" ? dd.innerText.trim() : ""};
  });
  var headers = each(document.querySelectorAll("th"), function (th) { return th.innerText.trim(); });
  var root = document.documentElement;
  root.setAttribute("data-layout", JSON.stringify({
    viewport: [window.innerWidth, window.innerHeight], page_width: [root.scrollWidth, root.clientWidth],
    answer_kg: kg, tables: tables, definitions: definitions, headers: headers, text: document.body.innerText}));
});
</script>"""


def _headless(browser: str, profile: Path, page: Path, *args: str, window=SCREEN) -> subprocess.CompletedProcess:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={window[0]},{window[1]}",
        "--virtual-time-budget=5000",
        *args,
        page.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc


def _layout(browser: str, profile: Path, text: str, copy: Path) -> tuple[dict, str]:
    """``text`` (a report.html) measured in the browser at :data:`SCREEN` (:data:`LAYOUT_SCRIPT`), from a copy at
    ``copy``; returns the measurements and the dumped DOM."""
    copy.write_text(text.replace("</head>", LAYOUT_SCRIPT + "\n</head>", 1), encoding="utf-8")
    dom = _headless(browser, profile, copy, "--dump-dom").stdout
    found = re.search(r'data-layout="([^"]*)"', dom)
    assert found, dom[:500]
    return json.loads(html.unescape(found.group(1))), dom


SHARES = (
    (GAP_VS_RULE, "rule_based", "uncontrolled", "100 * (CO2_rule_based - CO2) / (CO2_rule_based - CO2_oracle)"),
    (
        SAVING_VS_ORACLE,
        "uncontrolled",
        "rule_based",
        "100 * (CO2_uncontrolled - CO2) / (CO2_uncontrolled - CO2_oracle)",
    ),
)
"""The two shares of a gap the report gives: its name in the page, the row it counts from, the other reference (which
its definition must not name), its formula."""


def _shares_defined(layout: dict) -> dict[str, list[dict]]:
    """``name -> the definitions (<dt>, <dd>) of the page`` whose term is that share's name."""
    return {name: [d for d in layout["definitions"] if d["term"].lower().startswith(name)] for name, *_ in SHARES}


def test_html_renders_in_headless_chromium(report: Path, tmp_path: Path):
    """At 1280 x 900 px every figure decodes, no table (folded ones opened) is wider than its box, the page does not
    scroll sideways, and the answer's kg figures are in the first screen; each share of a gap (the gap closed vs rule,
    the saving vs oracle) is defined once, naming its reference row, and every header that gives one names it; a
    screenshot of the first screen is taken."""
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(
            f"no headless browser on PATH (looked for {', '.join(BROWSERS)}); `apt-get install chromium` runs this test"
        )
    page = report.parent / "report.html"
    text = page.read_text(encoding="utf-8")
    n_figures = len(_Page(text).imgs)
    assert n_figures == 3

    layout, dom = _layout(browser, tmp_path / "profile", text, tmp_path / "measured.html")
    # the page's own check, written into the DOM on load: every <img> complete with a natural width
    assert f'data-figures-loaded="{n_figures}/{n_figures}"' in dom, dom[:500]
    assert layout["viewport"][0] == SCREEN[0]
    tables = layout["tables"]
    assert len(tables) == 1 + 2 * 2, tables  # the answer's, then per split the compact one and the folded one
    assert sum(t["folded"] for t in tables) == 2
    assert all(t["width"] <= t["box"] for t in tables), f"a table wider than its box: {tables}"
    assert layout["page_width"][0] <= layout["page_width"][1], layout["page_width"]
    # the answer's kg figures: the named controllers' CO2 on both splits, whole and in the first screen
    table = pd.read_parquet(report.parent / "co2_comparison.parquet")
    named = best_controllers(table)
    expected = {f"{r.co2_kg:,.1f}" for r in table.itertuples() if r.controller in named.values()}
    assert {c["text"] for c in layout["answer_kg"]} == expected and len(layout["answer_kg"]) == len(expected)
    assert all(c["bottom"] <= SCREEN[1] and c["right"] <= SCREEN[0] for c in layout["answer_kg"]), layout["answer_kg"]

    # one definition per share of a gap, in words and as a formula, each naming its own reference row only
    defined = _shares_defined(layout)
    for name, reference, other, formula in SHARES:
        assert len(defined[name]) == 1, (name, layout["definitions"])
        said = defined[name][0]["text"]
        assert reference in said and other not in said and formula in said, (name, said)
        assert layout["text"].count(formula) == 1, f"{name}'s formula stands more than once in the page"
        assert any(name in h.lower() for h in layout["headers"]), f"no table column gives the {name}"
    assert defined[GAP_VS_RULE][0]["text"] != defined[SAVING_VS_ORACLE][0]["text"]
    # every header that gives a share of a gap names which one
    for h in layout["headers"]:
        if "gap" in h.lower() or "saving" in h.lower():
            assert sum(name in h.lower() for name, *_ in SHARES) == 1, h

    shot = tmp_path / "first_screen.png"
    _headless(browser, tmp_path / "profile", page, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib import image as mimage

    pixels = mimage.imread(shot)
    assert pixels.shape[:2] == (SCREEN[1], SCREEN[0])
    rgb = np.round(pixels[..., :3] * 255).astype(np.uint32)
    colours = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]  # one int per pixel
    assert len(np.unique(colours)) > 100, "the screenshot is (nearly) one colour"

    # and the checks do fail: on a figure that does not decode, a table wider than its box, an answer pushed down,
    # the definitions given twice
    truncated = re.sub(r"data:image/png;base64,[^\"]+", "data:image/png;base64,iVBORw0KGgoAAAAA", text, count=1)
    broken = truncated.replace("</style>", "table { width: 1500px; } h1 { margin-bottom: 1000px; }\n</style>", 1)
    (dl,) = re.findall(r'<dl class="definitions".*?</dl>', broken, flags=re.S)
    broken = broken.replace("</main>", dl + "\n</main>", 1)
    layout, dom = _layout(browser, tmp_path / "profile", broken, tmp_path / "broken.html")
    assert all(len(d) == 2 for d in _shares_defined(layout).values()), layout["definitions"]
    assert all(layout["text"].count(formula) == 2 for *_, formula in SHARES)
    assert f'data-figures-loaded="{n_figures - 1}/{n_figures}"' in dom, dom[:500]
    assert all(t["width"] > t["box"] for t in layout["tables"]), layout["tables"]
    assert layout["answer_kg"] and all(c["bottom"] > SCREEN[1] for c in layout["answer_kg"]), layout["answer_kg"]


# ------------------------------------------------------------------------------------------- the main figure
def test_main_figure_ranks_the_saving_vs_oracle_by_kind(inputs):
    """One panel per split, the controllers sorted by their saving vs oracle (the share of the oracle's saving over
    uncontrolled), named so on the axis, one colour per kind, their CO2 and unserved energy beside each bar; a
    controller that starves the EVs is flagged in red."""
    from matplotlib.colors import to_hex

    table = read_kpi_files(inputs["kpi_files"])
    starving = (table.split == "test") & (table.controller == "a2c")
    base = float(table[(table.split == "test") & (table.controller == "uncontrolled")].ev_energy_delivered_kwh.iloc[0])
    table.loc[starving, "ev_energy_delivered_kwh"] = 0.9 * base
    table.loc[starving, "unserved_kwh"] = 12.34
    fig = saving_figure(table)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["train split", "test split"]  # no other panel
    for ax, split in zip(axes, ("train", "test")):
        rows = table[table.split == split]
        ranked = ranked_by_saving(rows)
        names = [t.get_text() for t in ax.get_yticklabels()]
        assert names == list(ranked.controller) and sorted(names) == sorted(CONTROLLERS)
        bars = ax.containers[0]
        widths = [b.get_width() for b in bars]
        assert widths == pytest.approx(list(ranked.saving_vs_oracle_pct)) and widths == sorted(widths, reverse=True)
        assert ax.get_xlabel().startswith(f"{SAVING_VS_ORACLE} (%): share of the oracle's CO2 saving")
        assert ax.yaxis_inverted() and widths[0] == pytest.approx(100.0) and names[0] == "oracle"  # most closed on top
        assert [to_hex(b.get_facecolor()) for b in bars] == [KIND_COLORS[controller_kind(c)] for c in names]
        texts = [t.get_text() for t in ax.texts]
        for r in rows.itertuples():  # CO2 and unserved energy stated beside every bar
            assert f"{r.co2_kg:,.0f}" in texts and f"{r.unserved_kwh:,.1f}" in texts
        red = {t.get_text() for t in ax.texts if to_hex(t.get_color()) == "#b00020"}
        assert red == ({"90.0% served", "12.3", f"{table[starving].co2_kg.iloc[0]:,.0f}"} if split == "test" else set())
    # agents share a colour, the oracle has its own; the legend names only the kinds shown
    assert controller_kind("a2c") == controller_kind("ppo") == "agents" and controller_kind("oracle") == "foresight"
    assert controller_kind("mpc_tuned_start") == "learned planners" and controller_kind("rule_based") == "baselines"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["baselines", "agents", "foresight"]


def test_rows_without_the_ratio_rank_last():
    rows = pd.DataFrame(
        {"controller": ["a", "b", "c", "d"], "saving_vs_oracle_pct": [10.0, math.nan, 50.0, 10.0],
         "co2_kg": [5.0, 1.0, 3.0, 4.0]}
    )  # fmt: skip
    assert list(ranked_by_saving(rows).controller) == ["c", "d", "a", "b"]
    # a split where the oracle saves nothing has no ratio: its panel has no bar and says why
    flat = rows.assign(split="test", saving_vs_oracle_pct=math.nan, unserved_kwh=0.0, ev_energy_delivered_kwh=1.0)
    (ax,) = saving_figure(flat).axes
    assert [b.get_width() for b in ax.containers[0]] == [0.0] * 4
    assert any(t.get_text().startswith("no saving vs oracle known") for t in ax.texts)


def test_answer_is_a_compact_table_of_numbers(report: Path):
    """The answer's table: role, controller and, per split (the held-out one first), CO2, cut, gap closed vs rule and
    unserved energy, all numbers; the columns' definitions and what the named controllers know follow it, not in
    it."""
    table = pd.read_parquet(report.parent / "co2_comparison.parquet")
    blocks = answer_blocks(table)
    (answer,) = [b for b in blocks if isinstance(b, Table)]
    assert answer.id == "answer"
    assert answer.header == (
        "",
        "Controller",
        *(
            f"{sp}: {h}"
            for sp in ("test", "train")
            for h in ("CO2 (kg)", "CO2 cut (%)", "gap closed vs rule (%)", "unserved (kWh)")
        ),
    )
    by = table.set_index(["controller", "split"])
    named = best_controllers(table)
    assert [r[1] for r in answer.rows] == list(dict.fromkeys(named.values()))
    for row in answer.rows:
        for k, sp in enumerate(("test", "train")):
            r = by.loc[(row[1], sp)]
            want = [f"{v:,.1f}" for v in (r.co2_kg, r.co2_reduction_pct, r.gap_closed_vs_rule_pct, r.unserved_kwh)]
            assert list(row[2 + 4 * k : 6 + 4 * k]) == want
    (defined,) = [b for b in blocks if isinstance(b, Definitions)]
    assert defined == definitions() and blocks.index(defined) == blocks.index(answer) + 1
    terms = [t for t, _ in defined.items]
    assert {h.split(": ", 1)[1] for h in answer.header[2:]} - {"CO2 (kg)"} <= set(terms)  # each ratio, unserved
    legend = blocks[-1].items
    assert [i.split("**")[1] for i in legend] == [r[1] for r in answer.rows]
    assert all(registry.describe(r[1]).knows in i for r, i in zip(answer.rows, legend))
