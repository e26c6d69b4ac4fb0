"""A training run's fingerprint covers exactly the code its doit task depends on.

``pipeline.study.tasks.run_fingerprint`` decides whether a training attempt may resume the last one's checkpoint:
it must change with every file of ``pipeline.study.depends.training(algo)`` (the agent's script, the harness,
every ``envs/**/*.py``), and with nothing else of the code; doit's ``train:<algo>`` task re-runs on a change of the
same files. The first test edits each file of a copy of the project and watches the fingerprint; the second
compares the files the fingerprint reads with the ``file_dep`` of doit's ``train:<algo>`` tasks, as doit's loader
reads them from ``dodo.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.control import registry
from pipeline.paths import PROJECT_ROOT
from pipeline.study import depends
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
    unseen = []
    for f in files:
        before = _append(f)
        if fingerprint() == base:
            unseen.append(f.relative_to(root).as_posix())
        f.write_bytes(before)
    assert not unseen, f"edits the fingerprint does not see: {unseen}"
    assert fingerprint() == base

    for f in unrelated:  # another agent's script, the pipeline's own code
        _append(root / f.relative_to(PROJECT_ROOT))
    assert fingerprint() == base
    (root / "envs" / "new_module.py").write_text("X = 1\n")  # globbed: a new module of envs is a dependency
    assert fingerprint() != base


def test_dodo_train_tasks_depend_on_the_files_the_fingerprint_reads(tmp_path, site_toml, monkeypatch):
    loader = (
        "import json, dodo\n"
        "from doit.loader import load_tasks\n"
        "tasks = load_tasks(vars(dodo), command_names=('list',))\n"
        "print(json.dumps({t.name: sorted(t.file_dep) for t in tasks if t.name.startswith('train:')}))\n"
    )
    env = {**os.environ, "EVHUB_SITE": str(site_toml), "EVHUB_OUTPUT_DIR": str(tmp_path / "outputs")}
    for k in ("EVHUB_ALGOS", "DASK_SCHEDULER_ADDRESS"):
        env.pop(k, None)
    cmd = [sys.executable, "-c", loader]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    file_dep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(file_dep) == sorted(f"train:{a}" for a in registry.agents())

    read: list[Path] = []
    read_bytes = Path.read_bytes

    def spy(self: Path) -> bytes:
        read.append(Path(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", spy)
    for algo in registry.agents():
        read.clear()
        run_fingerprint(CMD, str(site_toml), algo)
        hashed = {p for p in read if p.is_relative_to(PROJECT_ROOT)}  # the site's files lie in a temp folder
        deps = {Path(f) for f in file_dep[f"train:{algo}"] if Path(f).is_relative_to(PROJECT_ROOT)}
        assert hashed == deps == set(depends.training(algo)), (algo, sorted(hashed ^ deps))
