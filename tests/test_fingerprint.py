"""A training run's and a tuning's fingerprints cover exactly the code their doit tasks depend on.

``pipeline.study.tasks.run_fingerprint`` decides whether a training attempt may resume the last one's checkpoint:
it must change with every file of ``pipeline.depends.training(algo)`` (the agent's script, the harness,
every ``envs/**/*.py``), and with nothing else of the code; doit's ``train:<algo>`` task re-runs on a change of the
same files. ``pipeline.control.tuning.fingerprint`` decides whether a cached tuning may be used: it must change with
every file of ``pipeline.depends.controllers()`` (``envs/`` and ``pipeline/control/``), what the backtests it scored
run. The tests edit each file of a copy of the project and watch the fingerprint, and compare the files each
fingerprint reads with the ``file_dep`` of the doit tasks, as doit's loader reads them from ``dodo.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import make_site, write_site

from pipeline import depends
from pipeline.control import registry, tuning
from pipeline.paths import PROJECT_ROOT
from pipeline.study.tasks import run_fingerprint

ALGO, OTHER = "ppo", "sac"
CMD = [sys.executable, f"algos/{ALGO}.py", "--seed", "1"]


def _copy(files: list[Path], root: Path) -> None:
    for f in files:
        dst = root / f.relative_to(PROJECT_ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dst)


def _append(path: Path, text: bytes = b"\n# an edit\n") -> bytes:
    before = path.read_bytes()
    path.write_bytes(before + text)
    return before


def _unseen_edits(files: list[Path], fingerprint, root: Path) -> list[str]:
    """The files (relative to ``root``) whose edit leaves ``fingerprint()`` unchanged; each file is restored after."""
    base = fingerprint()
    unseen = []
    for f in files:
        before = _append(f)
        if fingerprint() == base:
            unseen.append(f.relative_to(root).as_posix())
        f.write_bytes(before)
    return unseen


def test_each_file_of_a_training_run_changes_its_fingerprint_and_no_other_does(tmp_path, site_toml):
    root = tmp_path / "project"
    code = depends.training(ALGO)
    unrelated = [PROJECT_ROOT / "algos" / f"{OTHER}.py", PROJECT_ROOT / "pipeline" / "study" / "tasks.py"]
    _copy(code + unrelated, root)
    files = depends.training(ALGO, root)
    assert [f.relative_to(root) for f in files] == [f.relative_to(PROJECT_ROOT) for f in code]
    rel = {f.relative_to(root).as_posix() for f in files}
    assert f"algos/{ALGO}.py" in rel and any(r.startswith("algos/harness") for r in rel)
    assert {"envs/config.py", "envs/site.py", "envs/toml_table.py", "envs/evhub.py"} <= rel

    def fingerprint() -> str:
        return run_fingerprint(CMD, str(site_toml), ALGO, root=root)

    base = fingerprint()
    assert fingerprint() == base
    unseen = _unseen_edits(files, fingerprint, root)
    assert not unseen, f"edits the fingerprint does not see: {unseen}"
    assert fingerprint() == base

    for f in unrelated:  # another agent's script, the pipeline's own code
        _append(root / f.relative_to(PROJECT_ROOT))
    assert fingerprint() == base
    (root / "envs" / "new_module.py").write_text("X = 1\n")  # globbed: a new module of envs is a dependency
    assert fingerprint() != base


def test_each_file_of_envs_and_control_changes_the_tuning_fingerprint_and_no_other_does(tmp_path, site_toml):
    root = tmp_path / "project"
    code = depends.controllers()
    unrelated = [PROJECT_ROOT / "algos" / f"{ALGO}.py", PROJECT_ROOT / "pipeline" / "study" / "tasks.py"]
    _copy(code + unrelated, root)
    files = depends.controllers(root)
    rel = {f.relative_to(root).as_posix() for f in files}
    assert {"envs/evhub.py", "envs/site.py", "pipeline/control/mpc.py", "pipeline/control/tuning.py"} <= rel
    assert len([r for r in rel if r.startswith("envs/")]) >= 13

    def fingerprint(split: str = "train") -> str:
        return tuning.fingerprint(site_toml, split, root=root)

    base = fingerprint()
    assert fingerprint() == base and fingerprint("test") != base
    unseen = _unseen_edits(files, fingerprint, root)
    assert not unseen, f"edits the tuning's fingerprint does not see: {unseen}"
    for f in depends.site_files(site_toml):  # the site's config and data
        before = _append(f, b"\n")
        assert fingerprint() != base, f
        f.write_bytes(before)
    assert fingerprint() == base
    for f in unrelated:  # an agent's script, the study's own code
        _append(root / f.relative_to(PROJECT_ROOT))
    assert fingerprint() == base


def _file_deps(site_toml, tmp_path) -> dict[str, list[str]]:
    """The ``file_dep`` of doit's ``train:*`` and ``tune:*`` tasks for ``site_toml``, as doit's loader reads them."""
    loader = (
        "import json, dodo\n"
        "from doit.loader import load_tasks\n"
        "tasks = load_tasks(vars(dodo), command_names=('list',))\n"
        "print(json.dumps({t.name: sorted(t.file_dep) for t in tasks if t.name.startswith(('train:', 'tune:'))}))\n"
    )
    env = {**os.environ, "EVHUB_SITE": str(site_toml), "EVHUB_OUTPUT_DIR": str(tmp_path / "outputs")}
    for k in ("EVHUB_ALGOS", "DASK_SCHEDULER_ADDRESS"):
        env.pop(k, None)
    cmd = [sys.executable, "-c", loader]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _reads(monkeypatch, fn) -> set[Path]:
    """The files of the project that ``fn()`` reads with ``Path.read_bytes``."""
    read: list[Path] = []
    read_bytes = Path.read_bytes

    def spy(self: Path) -> bytes:
        read.append(Path(self))
        return read_bytes(self)

    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", spy)
        fn()
    return {p for p in read if p.is_relative_to(PROJECT_ROOT)}  # the site's files lie in a temp folder


def _in_project(files: list[str]) -> set[Path]:
    return {Path(f) for f in files if Path(f).is_relative_to(PROJECT_ROOT)}


def test_dodo_train_tasks_depend_on_the_files_the_fingerprint_reads(tmp_path, site_toml, monkeypatch):
    file_dep = _file_deps(site_toml, tmp_path)
    assert sorted(k for k in file_dep if k.startswith("train:")) == sorted(f"train:{a}" for a in registry.agents())
    for algo in registry.agents():
        hashed = _reads(monkeypatch, lambda algo=algo: run_fingerprint(CMD, str(site_toml), algo))
        deps = _in_project(file_dep[f"train:{algo}"])
        assert hashed == deps == set(depends.training(algo)), (algo, sorted(hashed ^ deps))


def test_dodo_tune_tasks_depend_on_the_files_their_fingerprints_read(tmp_path, monkeypatch):
    """``tune:mpc_tuned`` re-runs on a change of the files its cache's fingerprint reads (every file of ``envs`` and
    ``pipeline/control``, the site's files), ``tune:mpc_rl`` on those and PPO's script and harness, as its run's."""
    site = write_site(make_site(days=15, n_sockets=4), tmp_path / "site")  # long enough for the learned planners
    file_dep = _file_deps(site, tmp_path)
    assert {"tune:mpc_tuned", "tune:mpc_rl"} <= set(file_dep)
    hashed = _reads(monkeypatch, lambda: tuning.fingerprint(site))
    assert hashed == _in_project(file_dep["tune:mpc_tuned"]) == set(depends.controllers())
    assert {str(f) for f in depends.site_files(site)} <= set(file_dep["tune:mpc_tuned"])
    rl = _reads(monkeypatch, lambda: run_fingerprint(CMD, str(site), "ppo", code=depends.CONTROL))
    assert rl == _in_project(file_dep["tune:mpc_rl"]) == set(depends.controllers()) | set(depends.training("ppo"))
