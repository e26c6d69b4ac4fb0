"""The README and the docs pages point at things that exist.

For README.md, every docs/*.md and every docs/lab/*.md:

- every relative link resolves to a file or folder of the project, and a ``#anchor`` to a heading of the
  linked page by GitHub's anchor rules (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2``
  for repeated headings);
- every ``python -m <module>`` names a module of the project (a file under the project root) or an installed one;
- every backticked path under a tracked top-level folder (``envs/``, ``algos/``, ``pipeline/``, ...) exists
  (globs and ``{a,b}`` alternatives expanded, ``::test`` suffixes dropped); ``outputs/`` is generated, so not checked;
- every backticked dotted name of the project (``pipeline.control.oracle.assemble_lp``) is a module, or a
  module and a name it defines.

Fast and offline: the files are read as text, nothing of the project is imported.
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "lab").glob("*.md"))]
PAGE_IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]

CHECKED_DIRS = ("envs", "algos", "pipeline", "tests", "benchmarks", "docs", ".ci")
CHECKED_FILES = ("dodo.py", "pyproject.toml", "README.md")
PACKAGES = ("envs", "algos", "pipeline", "benchmarks")

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
PY_MODULE = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")
PATH_TOKEN = re.compile(r"(?:\.?[\w*{},-]+/)+[\w*{},.<>-]*")
DOTTED = re.compile(r"^(?:envs|algos|pipeline|benchmarks)(?:\.[A-Za-z_]\w*)+$")


def split_page(text: str) -> tuple[str, list[str]]:
    """The page's prose (fenced blocks removed) and its fenced blocks' lines."""
    prose, code, in_fence = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        (code if in_fence else prose).append(line)
    return "\n".join(prose), code


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = split_page(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def code_spans(page: Path) -> list[str]:
    """Inline code spans of the prose (line breaks inside a span read as spaces) and fenced code lines."""
    prose, code = split_page(page.read_text(encoding="utf-8"))
    spans = [" ".join(m.group(2).split()) for m in INLINE_CODE.finditer(prose)]
    return spans + code


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand_braces(pattern[: m.start()] + alt + pattern[m.end() :])]


def project_path_exists(token: str) -> bool:
    token = token.split("::")[0].rstrip(".,;:)")
    for pattern in expand_braces(token):
        if not any(ch in pattern for ch in "*?[") and (ROOT / pattern).exists():
            continue
        if not list(ROOT.glob(pattern.rstrip("/"))):
            return False
    return True


def module_file(parts: list[str]) -> Path | None:
    """The file of the project module ``parts`` (a package may be a folder without ``__init__.py``)."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() else None


def defines(source: Path, name: str) -> bool:
    if source.is_dir():
        return module_file([*source.relative_to(ROOT).parts, name]) is not None
    text = source.read_text(encoding="utf-8")
    return (
        re.search(rf"^(?:async\s+def|def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", text, re.M)
        is not None
    )


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_relative_links_resolve(page):
    prose, _ = split_page(page.read_text(encoding="utf-8"))
    prose = INLINE_CODE.sub("", prose)
    bad = []
    for target in [m.group(1) for m in LINK.finditer(prose)] + [m.group(1) for m in IMAGE.finditer(prose)]:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            bad.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            bad.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT).as_posix()}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_modules_exist(page):
    bad = []
    for span in code_spans(page):
        for module in PY_MODULE.findall(span):
            parts = module.split(".")
            if parts[0] in PACKAGES or (ROOT / f"{parts[0]}.py").exists():
                if module_file(parts) is None:
                    bad.append(module)
            elif importlib.util.find_spec(parts[0]) is None:
                bad.append(module)
    assert not bad, f"{page.name}: `python -m` of modules that do not exist: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_project_paths_exist(page):
    bad = []
    for span in code_spans(page):
        for token in span.split():
            token = token.strip("`'\"(),;")
            if token in CHECKED_FILES and not (ROOT / token).exists():
                bad.append(token)
            for m in PATH_TOKEN.finditer(token):
                path = m.group(0)
                if path.split("/")[0] in CHECKED_DIRS and "<" not in path and not project_path_exists(path):
                    bad.append(path)
            py = re.fullmatch(r"([\w.]+\.py)(?:::\w+)?", token)
            if py and "/" not in token and py.group(1) in CHECKED_FILES and not (ROOT / py.group(1)).exists():
                bad.append(token)
    assert not bad, f"{page.name}: paths that do not exist: {sorted(set(bad))}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_project_dotted_names_exist(page):
    bad = []
    for span in code_spans(page):
        name = span.strip().removesuffix("()")
        if not DOTTED.match(name):
            continue
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            found = module_file(parts[:cut])
            if found is not None:
                if cut < len(parts) and not defines(found, parts[cut]):
                    bad.append(name)
                break
        else:
            bad.append(name)
    assert not bad, f"{page.name}: dotted names that are not in the project: {bad}"


def test_the_checks_catch_what_they_should(tmp_path):
    """The helpers themselves: GitHub anchors, brace expansion, a missing path, a missing name."""
    assert github_anchor("What `doit run pipeline` does") == "what-doit-run-pipeline-does"
    assert github_anchor("Several runs at once: locks") == "several-runs-at-once-locks"
    assert github_anchor("The `[sizing]` table") == "the-sizing-table"
    assert expand_braces("algos/{ppo,sac}.py") == ["algos/ppo.py", "algos/sac.py"]
    assert project_path_exists("algos/{ppo,sac,a2c,dqn}.py")
    assert project_path_exists("tests/test_*.py::test_x")
    assert not project_path_exists("pipeline/no_such_module.py")
    assert module_file(["pipeline", "control", "oracle"]) is not None
    assert defines(module_file(["pipeline", "control", "oracle"]), "assemble_lp")
    assert not defines(module_file(["pipeline", "control", "oracle"]), "no_such_function")
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n```\n# not a heading\n```\n## A heading\n")
    assert anchors(page) == {"a-heading", "a-heading-1"}
    for f in ("pipeline/control/mpc.py", "pipeline/control/lp_x.py", "envs/site.py", "pipeline/__init__.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    assert layout_misses(["pipeline/", "  control/  mpc.py (the LP)", "envs/  site.py"], tmp_path) == [
        "pipeline/control/lp_x.py"
    ]
    assert layout_misses(["pipeline/ the_mpc.py", "envs/ site.py"], tmp_path) == [
        "pipeline/control/lp_x.py",
        "pipeline/control/mpc.py",
    ]


def readme_layout() -> list[str]:
    """The lines of the README's ``## Layout`` section's fenced block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    return split_page(section)[1]


def layout_misses(lines: list[str], root: Path = ROOT) -> list[str]:
    """The project's modules (``envs/*.py``, ``algos/harness/*.py``, ``pipeline/**/*.py``; packages' ``__init__``
    and ``__main__`` aside) whose file name the layout ``lines`` do not mention."""
    text = "\n".join(lines)
    files = [*root.glob("envs/*.py"), *root.glob("algos/harness/*.py"), *root.glob("pipeline/**/*.py")]
    return [
        path.relative_to(root).as_posix()
        for path in sorted(files)
        if path.name not in ("__init__.py", "__main__.py")
        and not re.search(rf"(?<![\w/]){re.escape(path.name)}(?!\w)", text)
    ]


def test_the_readme_layout_names_every_module():
    missing = layout_misses(readme_layout())
    assert not missing, f"README.md's layout does not name: {missing}"


def test_the_readme_is_an_entrance():
    """The title, then the answer in one paragraph, then the two set-up commands; no line over 120 characters."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# ")
    fence = next(i for i, line in enumerate(lines) if FENCE.match(line))
    commands = lines[fence + 1 : fence + 3]
    assert all(c.startswith('python -m pip install torch==2.13.0 -e ".[dev]" && ') for c in commands), commands
    assert "doit run pipeline" in commands[0] and "python -m pytest -n auto" in commands[1]
    assert fence < 15, "the commands stand within the README's first lines"
    long = [f"line {i + 1}: {len(line)}" for i, line in enumerate(lines) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters: {long}"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1].split("#")[0].strip() in ci, ".ci/run runs the README's test command"
