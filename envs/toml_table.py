"""One reader of a TOML table, and the project's one "did you mean".

Every table of a site TOML is read through :class:`TomlTable`: the env's own tables (:mod:`envs.config`),
``[sources]`` (``pipeline.data.sources``) and ``[sizing]`` (``pipeline.study.sizing``). Key by key it checks

- that no key is unknown (:meth:`TomlTable.check_keys`: a typo is an error, and the message suggests the closest
  known key, :func:`did_you_mean`);
- the type: a number, an integer, true or false, a string, a list of numbers or of strings, a table, an array of
  tables (booleans are never numbers; NaN and, unless allowed, infinities are not numbers either);
- the range (:class:`Range`) or the allowed choices.

Every message names the file and the dotted key (``site.toml: key 'bess.soc_min' must be a fraction in [0, 1],
got 1.5``), or, for a value given elsewhere and passed in ``origins``, where it came from (``doit variable
kwp='0,x'``). The exception raised is the caller's (``ConfigError``, ``SourceError``, ...).

This module imports nothing else of the project, so that ``envs`` and the pipeline can both use it.
"""

from __future__ import annotations

import difflib
import math
import zoneinfo
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED: Any = object()
"""Default of a getter whose key must be present (a missing key is an error)."""


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name closest to ``name``, or None when none is close.

    A name equal to ``name`` but for case and surrounding spaces wins; otherwise :func:`difflib.get_close_matches`
    with ``cutoff`` (a similarity ratio in [0, 1]).
    """
    known = [str(k) for k in known]
    folded = {k.lower().strip(): k for k in known}
    if name.lower().strip() in folded:
        return folded[name.lower().strip()]
    close = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str], prefix: str = "", cutoff: float = 0.6) -> str:
    """``": did you mean '<prefix><x>'?"`` for the closest of ``known`` to ``name`` (:func:`closest`), or ``""``.

    ``prefix`` is put before the suggestion, e.g. the table of a dotted key (``"bess."``).
    """
    close = closest(name, known, cutoff)
    return f": did you mean '{prefix}{close}'?" if close is not None else ""


@dataclass(frozen=True)
class Range:
    """The allowed values of a number: bounds ``ge`` (>=), ``gt`` (>), ``le`` (<=), ``lt`` (<), each optional.

    ``str(Range(ge=0, le=90, unit="degrees"))`` is ``"in [0, 90] degrees"``; ``str(Range(gt=0, unit="kW"))`` is
    ``"> 0 kW"``; ``what`` names the kind of number before the bounds (``"a fraction in [0, 1]"``).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    unit: str = ""
    """Text after the bounds (a unit, or a note in parentheses)."""
    what: str = ""
    """Text before the bounds (``"a probability"``)."""

    def __contains__(self, v: float) -> bool:
        return not (
            (self.ge is not None and not v >= self.ge)
            or (self.gt is not None and not v > self.gt)
            or (self.le is not None and not v <= self.le)
            or (self.lt is not None and not v < self.lt)
        )

    def __str__(self) -> str:
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = (self.le, "]") if self.le is not None else (self.lt, ")") if self.lt is not None else None
        if lo and hi:
            bounds = f"in {lo[0]}{lo[1]:g}, {hi[0]:g}{hi[1]}"
        elif lo:
            bounds = f"{'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
        elif hi:
            bounds = f"{'<=' if hi[1] == ']' else '<'} {hi[0]:g}"
        else:
            bounds = "a number"
        return " ".join(part for part in (self.what, bounds, self.unit) if part)

    def check(self, v: float, where: str, error: type[Exception] = ValueError) -> None:
        """Raise ``error("<where> must be <self>, got <v>")`` when ``v`` is outside the range."""
        if v not in self:
            raise error(f"{where} must be {self}, got {v!r}")


def is_number(v: Any) -> bool:
    """Whether ``v`` is an int or a float (a bool is not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class TomlTable:
    """One table of a TOML file, read key by key; every error names the file and the dotted key.

    Args:
        raw: the table as parsed (a mapping; nested tables are mappings, arrays are lists or tuples).
        key: its dotted key in the file (``"bess"``, ``"sources.carbon"``, ``"ev.sockets[1]"``; ``""`` for the
            file's top level).
        source: the file, named in every message.
        error: the exception class raised.
        origins: ``key -> text`` for values that did not come from the file (e.g. ``"doit variable kwp='0,20'"``):
            their messages name that text instead of the file and the key.

    Getters (:meth:`string`, :meth:`number`, :meth:`integer`, :meth:`boolean`, :meth:`numbers`, :meth:`strings`,
    :meth:`table`, :meth:`tables`) take a ``default``, returned when the key is absent (or, for a default of None,
    when its value is None); without one (:data:`REQUIRED`) an absent key is an error ``"... is missing"``.

    Raises:
        error: ``raw`` is not a mapping.
    """

    def __init__(
        self,
        raw: Any,
        key: str,
        source: str | Path,
        error: type[Exception] = ValueError,
        origins: Mapping[str, str] | None = None,
    ):
        self.key, self.source, self.error = key, str(source), error
        self.origins = dict(origins or {})
        if not isinstance(raw, Mapping):
            what = f"key '{key}'" if key else "the file"
            raise error(f"{self.source}: {what} must be a table, got {raw!r}")
        self.raw = raw

    # ------------------------------------------------------------------------------------------ naming
    def dotted(self, k: str) -> str:
        """The dotted key of ``k`` in the file (``"bess.soc_min"``)."""
        return f"{self.key}.{k}" if self.key else k

    def where(self, k: str) -> str:
        """``"<file>: key '<dotted key>'"``, or the origin of a value given elsewhere."""
        return self.origins.get(k) or f"{self.source}: key '{self.dotted(k)}'"

    def err(self, k: str, msg: str) -> Exception:
        """The error ``"<where(k)> <msg>"`` (returned, for the caller to raise)."""
        return self.error(f"{self.where(k)} {msg}")

    @property
    def label(self) -> str:
        """How the table is written in the file: ``[bess]``, ``[[ev.sockets]]`` for an element of an array of
        tables, ``""`` for the top level."""
        if not self.key:
            return ""
        if self.key.endswith("]") and "[" in self.key:
            return f"[[{self.key.rsplit('[', 1)[0]}]]"
        return f"[{self.key}]"

    # ------------------------------------------------------------------------------------------ keys
    def __contains__(self, k: str) -> bool:
        return k in self.raw

    def check_keys(self, known: Iterable[str], what: str = "") -> None:
        """Every key of the table is one of ``known``.

        Args:
            known: the allowed keys.
            what: words put after "known" in the message (e.g. ``" for format 'csv'"``).

        Raises:
            error: ``"<file>: unknown key '<dotted>': did you mean '<dotted closest>'? (known<what> in
                [<table>]: ...)"``, the hint left out when no known key is close.
        """
        known = tuple(known)
        for k in self.raw:
            if k not in known:
                hint = did_you_mean(str(k), known, prefix=f"{self.key}." if self.key else "")
                inside = f" in {self.label}" if self.label else ""
                raise self.error(
                    f"{self.source}: unknown key '{self.dotted(str(k))}'{hint} (known{what}{inside}: "
                    f"{', '.join(known)})"
                )

    def require(self, *keys: str, why: str = "") -> None:
        """Each of ``keys`` is present.

        Raises:
            error: ``"<where> is missing<why>"`` for the first absent key.
        """
        for k in keys:
            if k not in self.raw:
                raise self.err(k, f"is missing{why}")

    def get(self, k: str, default: Any = REQUIRED) -> Any:
        """The value of ``k`` as written, unchecked (``default`` when absent).

        Raises:
            error: absent and no default.
        """
        if k not in self.raw:
            if default is REQUIRED:
                raise self.err(k, "is missing")
            return default
        return self.raw[k]

    def _absent(self, k: str, default: Any) -> bool:
        if k in self.raw and not (self.raw[k] is None and default is None):
            return False
        if default is REQUIRED:
            raise self.err(k, "is missing")
        return True

    # ------------------------------------------------------------------------------------------ scalars
    def _number(self, k: str, v: Any, rng: Range | None, finite: bool) -> float:
        if not is_number(v) or math.isnan(v):
            raise self.err(k, f"must be a number, got {v!r}")
        if finite and math.isinf(v):
            raise self.err(k, f"must be a finite number, got {v!r}")
        v = float(v)
        if rng is not None:
            rng.check(v, self.where(k), self.error)
        return v

    def number(self, k: str, default: Any = REQUIRED, range: Range | None = None, finite: bool = True) -> Any:
        """A number (int or float), as float.

        Raises:
            error: not a number (a bool, a string, NaN; an infinity unless ``finite`` is False), or outside
                ``range``.
        """
        if self._absent(k, default):
            return default
        return self._number(k, self.raw[k], range, finite)

    def integer(self, k: str, default: Any = REQUIRED, range: Range | None = None) -> Any:
        """An integer.

        Raises:
            error: not an integer (a bool or a float is not), or outside ``range``.
        """
        if self._absent(k, default):
            return default
        v = self.raw[k]
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.err(k, f"must be an integer, got {v!r}")
        if range is not None:
            range.check(v, self.where(k), self.error)
        return v

    def boolean(self, k: str, default: Any = REQUIRED) -> Any:
        """``true`` or ``false``.

        Raises:
            error: anything else.
        """
        if self._absent(k, default):
            return default
        v = self.raw[k]
        if not isinstance(v, bool):
            raise self.err(k, f"must be true or false, got {v!r}")
        return v

    def _choice(self, k: str, v: str, choices: Iterable[str] | None) -> str:
        if choices is not None and v not in (choices := tuple(choices)):
            close = closest(v, choices, cutoff=0.5)
            hint = f" (did you mean {close!r}?)" if close is not None else ""
            raise self.err(k, f"must be one of {', '.join(map(repr, choices))}, got {v!r}{hint}")
        return v

    def string(
        self, k: str, default: Any = REQUIRED, choices: Iterable[str] | None = None, nonempty: bool = False
    ) -> Any:
        """A string, one of ``choices`` when given.

        Raises:
            error: not a string, empty or blank with ``nonempty``, or not one of ``choices`` (the message lists
                them and suggests the closest).
        """
        if self._absent(k, default):
            return default
        v = self.raw[k]
        if not isinstance(v, str):
            raise self.err(k, f"must be a string, got {v!r}")
        if nonempty and not v.strip():
            raise self.err(k, f"must be a non-empty string, got {v!r}")
        return self._choice(k, v, choices)

    def timezone(self, k: str, default: Any = REQUIRED) -> Any:
        """An IANA time zone name (``"Europe/Berlin"``).

        Raises:
            error: not a string, or not a zone :mod:`zoneinfo` knows.
        """
        tz = self.string(k, default)
        if k in self.raw and tz is not None:
            try:
                zoneinfo.ZoneInfo(tz)
            except Exception as exc:
                raise self.err(k, f"is not a known IANA time zone: {tz!r}") from exc
        return tz

    # ------------------------------------------------------------------------------------------ lists
    def _items(self, k: str, v: Any, scalar: bool, length: int | None, expect: str, empty: str | None) -> list:
        items = [v] if scalar and not isinstance(v, (list, tuple)) else v
        if not isinstance(items, (list, tuple)) or (length is not None and len(items) != length):
            raise self.err(k, f"must be {expect}, got {v!r}")
        if not items:
            raise self.err(k, empty if empty is not None else f"must be {expect}, got {v!r}")
        return list(items)

    def numbers(
        self,
        k: str,
        default: Any = REQUIRED,
        range: Range | None = None,
        *,
        length: int | None = None,
        scalar: bool = False,
        expect: str | None = None,
        empty: str | None = None,
    ) -> Any:
        """A non-empty list of numbers (or, with ``scalar``, one number standing for a list of one), as a tuple
        of floats.

        Args:
            range: the range of every element.
            length: the exact number of elements.
            expect: what the value must be, in words, for the message (default from ``length`` / ``scalar``).
            empty: the message's words after the key for an empty list (default ``"must be <expect>"``).

        Raises:
            error: not a list (or number) of the length, an element not a finite number, an element outside
                ``range``, or an empty list.
        """
        if self._absent(k, default):
            return default
        if expect is None:
            expect = (
                f"a list of {length} numbers"
                if length
                else "a number or a non-empty list of numbers"
                if scalar
                else "a non-empty list of numbers"
            )
        v = self.raw[k]
        items = self._items(k, v, scalar, length, expect, empty)
        if not all(is_number(x) and math.isfinite(x) for x in items):
            raise self.err(k, f"must be {expect}, got {v!r}")
        return tuple(self._number(k, x, range, True) for x in items)

    def strings(
        self,
        k: str,
        default: Any = REQUIRED,
        choices: Iterable[str] | None = None,
        *,
        length: int | None = None,
        scalar: bool = False,
        expect: str | None = None,
    ) -> Any:
        """A non-empty list of non-blank strings (or, with ``scalar``, one string standing for a list of one), as a
        tuple, each one of ``choices`` when given.

        Raises:
            error: not a list (or string) of the length, empty, an element not a non-blank string, or not one of
                ``choices`` (the message suggests the closest).
        """
        if self._absent(k, default):
            return default
        if expect is None:
            expect = (
                f"a list of {length} strings"
                if length
                else "a string or a non-empty list of strings"
                if scalar
                else "a non-empty list of strings"
            )
        v = self.raw[k]
        items = self._items(k, v, scalar, length, expect, None)
        if not all(isinstance(x, str) and x.strip() for x in items):
            raise self.err(k, f"must be {expect}, got {v!r}")
        return tuple(self._choice(k, x, choices) for x in items)

    # ------------------------------------------------------------------------------------------ tables
    def table(self, k: str, default: Any = REQUIRED) -> Any:
        """The sub-table ``k`` as a :class:`TomlTable` (its key ``<key>.<k>``).

        Raises:
            error: ``k`` absent without a default, or not a table.
        """
        if self._absent(k, default):
            return default
        return TomlTable(self.raw[k], self.dotted(k), self.source, self.error)

    def tables(self, k: str, default: Any = REQUIRED, expect: str | None = None) -> Any:
        """The array of tables ``[[<key>.<k>]]`` as a list of :class:`TomlTable` (keys ``<key>.<k>[i]``; an empty
        array gives ``[]``).

        Raises:
            error: absent without a default, or not a list of tables (``expect``: what it must be, in words).
        """
        if self._absent(k, default):
            return default
        v = self.raw[k]
        if not isinstance(v, (list, tuple)) or not all(isinstance(t, Mapping) for t in v):
            expect = expect or f"an array of tables ([[{self.dotted(k)}]])"
            raise self.err(k, f"must be {expect}, got {v!r}")
        return [TomlTable(t, f"{self.dotted(k)}[{i}]", self.source, self.error) for i, t in enumerate(v)]
