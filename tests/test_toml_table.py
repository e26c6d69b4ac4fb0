"""The one reader of a TOML table (``envs.toml_table``): unknown keys, types, ranges, and where each message points."""

from __future__ import annotations

import pytest

from envs.toml_table import Range, TomlTable, closest, did_you_mean


class Bad(ValueError):
    pass


def _table(raw, key="bess", **kw) -> TomlTable:
    return TomlTable(raw, key, "site.toml", Bad, **kw)


def test_did_you_mean_and_closest():
    assert did_you_mean("capacity_kwhh", ["capacity_kwh", "power_kw"], prefix="bess.") == (
        ": did you mean 'bess.capacity_kwh'?"
    )
    assert did_you_mean("zzz", ["capacity_kwh"]) == ""
    assert closest("Energy [kWh]", ["energy [kwh]", "other"]) == "energy [kwh]"  # case and spaces first


@pytest.mark.parametrize(
    "rng, text",
    [
        (Range(ge=0, le=90, unit="degrees"), "in [0, 90] degrees"),
        (Range(gt=0, le=1), "in (0, 1]"),
        (Range(ge=0, lt=1, what="a yearly rate"), "a yearly rate in [0, 1)"),
        (Range(gt=0, unit="kW"), "> 0 kW"),
        (Range(ge=-0.1, le=0, unit="per K"), "in [-0.1, 0] per K"),
        (Range(le=5), "<= 5"),
    ],
)
def test_range_text(rng, text):
    assert str(rng) == text


def test_unknown_keys_name_the_file_the_dotted_key_and_the_closest():
    with pytest.raises(
        Bad,
        match=r"^site\.toml: unknown key 'bess\.soc_mni': did you mean 'bess\.soc_min'\? "
        r"\(known in \[bess\]: soc_min, soc_max\)$",
    ):
        _table({"soc_mni": 0.1}).check_keys(("soc_min", "soc_max"))
    with pytest.raises(Bad, match=r"unknown key 'nmae': did you mean 'name'\? \(known: name\)$"):
        _table({"nmae": "x"}, key="").check_keys(("name",))
    groups = _table({"sockets": [{"count": 1}, {"count": 1, "kww": 2}]}, key="ev").tables("sockets")
    with pytest.raises(
        Bad, match=r"'ev\.sockets\[1\]\.kww': did you mean 'ev\.sockets\[1\]\.kw'\? \(known in \[\[ev\.sockets\]\]"
    ):
        groups[1].check_keys(("count", "kw"))


def test_types_ranges_and_defaults():
    t = _table({"a": 1, "b": True, "c": "x", "d": float("nan"), "e": [1, 2], "f": -1, "g": None, "h": float("inf")})
    assert t.number("a") == 1.0 and isinstance(t.number("a"), float)
    assert t.number("missing", 2.5) == 2.5 and t.number("g", None) is None
    for k, what in (
        ("b", "must be a number, got True"),
        ("c", "must be a number, got 'x'"),
        ("d", "must be a number, got nan"),
        ("h", "must be a finite number, got inf"),
        ("g", "must be a number, got None"),
        ("missing", "is missing"),
    ):
        with pytest.raises(Bad, match=rf"^site\.toml: key 'bess\.{k}' {what}"):
            t.number(k)
    assert t.number("h", finite=False) == float("inf")
    with pytest.raises(Bad, match=r"key 'bess\.f' must be >= 0 kWh, got -1\.0$"):
        t.number("f", range=Range(ge=0, unit="kWh"))
    with pytest.raises(Bad, match=r"key 'bess\.a' must be an integer, got 1\.5"):
        _table({"a": 1.5}).integer("a")
    with pytest.raises(Bad, match=r"key 'bess\.a' must be true or false, got 1"):
        t.boolean("a")
    with pytest.raises(Bad, match=r"key 'bess\.c' must be one of 'csv', 'epw', got 'x'$"):
        t.string("c", choices=("csv", "epw"))
    with pytest.raises(Bad, match=r"must be one of 'csv', 'epw', got 'cvs' \(did you mean 'csv'\?\)$"):
        _table({"c": "cvs"}).string("c", choices=("csv", "epw"))
    assert t.numbers("e", length=2) == (1.0, 2.0) and t.numbers("a", scalar=True) == (1.0,)
    with pytest.raises(Bad, match=r"key 'bess\.e' must be two numbers \[a, b\], got \[1, 2\]"):
        t.numbers("e", length=3, expect="two numbers [a, b]")
    with pytest.raises(Bad, match=r"key 'bess\.e' is an empty grid"):
        _table({"e": []}).numbers("e", empty="is an empty grid")
    assert _table({"s": "CA-*"}).strings("s", scalar=True) == ("CA-*",)
    with pytest.raises(Bad, match=r"key 'bess\.s' must be a string or a non-empty list of strings, got \[''\]"):
        _table({"s": [""]}).strings("s", scalar=True)
    with pytest.raises(Bad, match=r"key 'bess\.tz' is not a known IANA time zone: 'Mars/Base'"):
        _table({"tz": "Mars/Base"}).timezone("tz")
    with pytest.raises(Bad, match=r"^site\.toml: key 'pv' must be a table, got 3$"):
        _table({"pv": 3}, key="").table("pv")


def test_a_value_from_elsewhere_names_its_origin():
    t = _table({"kwp": [-40]}, key="sizing", origins={"kwp": "doit variable kwp='-40'"})
    with pytest.raises(Bad, match=r"^doit variable kwp='-40' must be >= 0 kWp, got -40\.0$"):
        t.numbers("kwp", range=Range(ge=0, unit="kWp"))
