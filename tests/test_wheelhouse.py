"""The offline install's wheelhouse (``pipeline.wheelhouse``): which distributions it holds and pvlib's wheel without
its data sets. Downloading needs a network and is not tested here."""

from __future__ import annotations

import zipfile

from pipeline import wheelhouse


def test_the_wheelhouse_holds_every_dependency_but_torch_and_what_only_torch_needs():
    deps = wheelhouse.dependencies("3.12")
    assert "torch" not in deps and not any(name.startswith("nvidia-") for name in deps)
    assert "sympy" not in deps  # torch's alone
    # direct dependencies, an extra's (dask[distributed]) and dependencies of dependencies
    assert {"gymnasium", "tyro", "pvlib", "highspy", "dask", "distributed", "tornado", "pydantic-core"} <= set(deps)
    assert all(version for version in deps.values())
    fewer = wheelhouse.dependencies("3.12", exclude=("NumPy", "pandas"))
    assert set(deps) - set(fewer) == {"numpy", "pandas"}


def test_pvlib_s_wheel_loses_its_data_sets_and_their_record_lines(tmp_path):
    wheel = tmp_path / "pvlib-0.0.1-py3-none-any.whl"
    record = "pvlib/__init__.py,sha256=a,1\npvlib/data/big.h5,sha256=b,2\npvlib/tests/t.py,sha256=c,3\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pvlib/__init__.py", "x = 1\n")
        z.writestr("pvlib/data/big.h5", b"\0" * 1000)
        z.writestr("pvlib/tests/t.py", "")
        z.writestr("pvlib-0.0.1.dist-info/RECORD", record)
    wheelhouse.strip_pvlib(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == ["pvlib-0.0.1.dist-info/RECORD", "pvlib/__init__.py"]
        assert z.read("pvlib-0.0.1.dist-info/RECORD").decode() == "pvlib/__init__.py,sha256=a,1\n"
