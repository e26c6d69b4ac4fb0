"""Each learned run's settings and evaluation as a TensorBoard HParams summary (pipeline/study/hparams.py), read back
with TensorBoard's own reader."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

from envs.files import write_parquet
from pipeline.study.hparams import HPARAMS_DIR, write_hparams


def _kpis(folder, rows) -> list:
    paths = []
    for i, row in enumerate(rows):
        path = folder / f"kpi{i}.parquet"
        write_parquet(pd.DataFrame([row]), path)
        paths.append(path)
    return paths


def _read(folder) -> tuple[dict, dict]:
    """``(hyper-parameters, metrics)`` of the HParams summary in ``folder``."""
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    info = metadata.parse_session_start_info_plugin_data(content)
    settings = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    metrics = {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}
    return settings, metrics


def test_each_learned_run_gets_its_settings_and_evaluation_per_split(tmp_path):
    root = tmp_path / "experiment"
    rows = []
    for split, rule, oracle in (("train", 100.0, 60.0), ("test", 50.0, 50.0)):
        rows += [
            {"controller": "rule_based", "split": split, "co2_kg": rule, "unserved_kwh": 0.0},
            {"controller": "oracle", "split": split, "co2_kg": oracle, "unserved_kwh": 0.0},
            {"controller": "ppo", "split": split, "co2_kg": 90.0, "unserved_kwh": 1.5, "seed": 1.0},
            {"controller": "ppo", "split": split, "co2_kg": 70.0, "unserved_kwh": 0.0, "seed": 2.0},
            {"controller": "mpc_tuned", "split": split, "co2_kg": 80.0, "unserved_kwh": 0.0, "seed": 1.0},
            {"controller": "mpc_tuned", "split": split, "co2_kg": 85.0, "unserved_kwh": 0.0, "seed": 2.0},
        ]
    (root / "runs" / "ppo_seed1").mkdir(parents=True)
    (root / "runs" / "ppo_seed1" / "config.json").write_text(json.dumps({"learning_rate": 3e-4, "seed": 1}))
    (root / "tuned").mkdir()
    for seed, horizon in ((1, 24), (2, 12)):
        summary = {"params": {"horizon_h": horizon, "expected_demand_weight": 0.4}, "budget": "small"}
        (root / "tuned" / f"mpc_tuned_seed{seed}.json").write_text(json.dumps(summary))
    paths = _kpis(tmp_path, rows)

    written = write_hparams(paths, root)
    assert sorted(p.name for p in written) == ["mpc_tuned_seed1", "mpc_tuned_seed2", "ppo_seed1", "ppo_seed2"]
    settings, metrics = _read(root / HPARAMS_DIR / "ppo_seed1")
    assert settings["learning_rate"] == pytest.approx(3e-4) and settings["controller"] == "ppo"
    assert metrics["co2_kg/train"] == 90.0 and metrics["unserved_kwh/train"] == 1.5
    assert metrics["gap_closed_vs_rule_pct/train"] == pytest.approx(25.0)  # (100 - 90) / (100 - 60)
    assert math.isnan(metrics["gap_closed_vs_rule_pct/test"])  # the rule emits no more than the oracle there
    settings, metrics = _read(root / HPARAMS_DIR / "mpc_tuned_seed1")
    assert settings["horizon_h"] == 24 and settings["budget"] == "small"  # the budget is always shown
    assert "expected_demand_weight" not in settings  # one value in every run: not what tells them apart
    assert metrics["gap_closed_vs_rule_pct/train"] == pytest.approx(50.0)
    _, metrics = _read(root / HPARAMS_DIR / "ppo_seed2")  # no config.json: the seed and its evaluation still
    assert metrics["gap_closed_vs_rule_pct/train"] == pytest.approx(75.0)

    write_hparams(paths, root)  # a report made again: one summary per run, not two
    assert len(list((root / HPARAMS_DIR / "ppo_seed1").glob("events.out.tfevents.*"))) == 1


def test_no_seeded_row_writes_nothing(tmp_path):
    paths = _kpis(tmp_path, [{"controller": "rule_based", "split": "train", "co2_kg": 1.0, "unserved_kwh": 0.0}])
    assert write_hparams(paths, tmp_path / "experiment") == []
    assert not (tmp_path / "experiment" / HPARAMS_DIR).exists()
