"""An offline install: a folder of wheels ("wheelhouse") holding the project's dependencies other than torch, for a
given Python and platform, so a machine without network whose torch is already installed (a GPU cluster's image)
installs the project with ``pip install --no-index``.

The dependencies are the closure of this project's ``[project] dependencies`` (extras left out) over the installed
distributions' metadata, markers evaluated for the target Python, each at the version installed here; torch and
everything only torch needs (``filelock``, ``sympy``, the CUDA wheels, ...) are left out, being there already. pip
downloads binary wheels only (``--only-binary=:all:``), so the folder fits the target whatever this machine is.

    python -m pipeline.wheelhouse                                   # CPython 3.12, manylinux x86-64
    python -m pipeline.wheelhouse --python 3.12 --platform manylinux_2_28_aarch64 --dest outputs/wheelhouse-arm
    doit wheelhouse python=3.12
    # then, on the target machine, from the project's root (torch already installed):
    pip install --no-index --find-links outputs/wheelhouse --no-build-isolation -e .
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

PROJECT = "evhub-rl"
"""The distribution name of this project (``pyproject.toml``)."""

MANYLINUX_X86_64 = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
"""The platform tags pip accepts by default for a glibc 2.28 x86-64 Linux (pip matches each tag exactly)."""

PVLIB_UNUSED = ("pvlib/data/", "pvlib/tests/")
"""Folders of pvlib's wheel the project never reads (its bundled data sets: 19 MB of the 19.4 MB wheel)."""


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str, python: str, extras: frozenset[str] = frozenset()) -> list[tuple[str, frozenset[str]]]:
    """The distributions ``dist`` with ``extras`` needs on CPython ``python``: (canonical name, its extras asked)."""
    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        for extra in ("", *extras):
            env = {"python_version": python, "python_full_version": f"{python}.0", "extra": extra}
            if req.marker is None or req.marker.evaluate(env):
                out.append((canonical(req.name), frozenset(req.extras)))
                break
    return out


def closure(roots: list[tuple[str, frozenset[str]]], python: str) -> set[str]:
    """Every installed distribution that ``roots`` (name, extras) need on CPython ``python``, themselves included
    (canonical names).

    Raises:
        metadata.PackageNotFoundError: a needed distribution is not installed here (install the project first).
    """
    seen, todo = set(), [(canonical(name), extras) for name, extras in roots]
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        todo += _requirements(key[0], python, key[1])
    return {name for name, _ in seen}


def dependencies(python: str, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """The wheelhouse's contents: name -> installed version of every distribution the project needs on CPython
    ``python``, less torch's own closure (except what the project needs apart from torch) and less ``exclude``
    (names of distributions the target has already, e.g. its numpy and pandas)."""
    direct = [r for r in _requirements(PROJECT, python) if r[0] != "torch"]
    ours = closure(direct, python)
    torch_only = closure([("torch", frozenset())], python) - ours
    drop = torch_only | {"torch"} | {canonical(e) for e in exclude}
    return {name: metadata.version(name) for name in sorted(ours - drop)}


def strip_pvlib(folder: Path) -> None:
    """Rewrite pvlib's wheel in ``folder`` without :data:`PVLIB_UNUSED` (and their lines of its ``RECORD``)."""
    for wheel in folder.glob("pvlib-*.whl"):
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for item in src.infolist():
                if item.filename.startswith(PVLIB_UNUSED):
                    continue
                data = src.read(item)
                if item.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(x for x in lines if not x.startswith(PVLIB_UNUSED)).encode()
                dst.writestr(item, data)
        tmp.replace(wheel)


def build(
    dest: Path,
    python: str = "3.12",
    platforms: tuple[str, ...] = MANYLINUX_X86_64,
    exclude: tuple[str, ...] = (),
    keep_pvlib_data: bool = False,
) -> list[Path]:
    """Download the wheels of :func:`dependencies` into ``dest`` (binary wheels for CPython ``python`` on one of
    ``platforms``, or pure-Python ones) and return them.

    Raises:
        subprocess.CalledProcessError: pip found no wheel of some distribution for that Python and platform (its
            message names it; add the platform tag it has, e.g. ``manylinux_2_24_x86_64``).
    """
    deps = dependencies(python, exclude)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python, "--implementation", "cp", "--dest", str(dest)]
    for tag in (*platforms, "any"):
        cmd += ["--platform", tag]
    subprocess.run(cmd + [f"{name}=={version}" for name, version in deps.items()], check=True)
    if not keep_pvlib_data:
        strip_pvlib(dest)
    wanted = {canonical(n) for n in deps}
    return sorted(w for w in dest.glob("*.whl") if canonical(w.name.split("-")[0]) in wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.wheelhouse",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dest", type=Path, default=Path("outputs/wheelhouse"), help="folder of the wheels")
    parser.add_argument("--python", default="3.12", help="the target's CPython version, X.Y (default 3.12)")
    parser.add_argument(
        "--platform",
        action="append",
        help=f"a platform tag the target accepts, repeatable (default: {' '.join(MANYLINUX_X86_64)})",
    )
    parser.add_argument(
        "--exclude", action="append", default=[], help="a distribution the target has already, repeatable"
    )
    parser.add_argument("--keep-pvlib-data", action="store_true", help="keep pvlib's bundled data sets (19 MB)")
    args = parser.parse_args(argv)
    wheels = build(args.dest, args.python, tuple(args.platform or MANYLINUX_X86_64), tuple(args.exclude),
                   args.keep_pvlib_data)  # fmt: skip
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {args.dest}; on the target, from the project's root:")
    print(f"  pip install --no-index --find-links {args.dest} --no-build-isolation -e .")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
