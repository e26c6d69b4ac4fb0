"""Errors the project raises on purpose, whose message is all a user needs.

An *expected* error says what is wrong, where (the file and the key, column or row) and what to do; the front
ends (``doit run ...``, ``python -m pipeline.data.ingest``) print its message alone, without a Python traceback,
and exit non-zero. Any other exception is a bug and keeps its traceback.

- :class:`ExpectedError`: the base of every such error.
- :class:`InputError`: the user's input is wrong (a site config, a data file, a raw source); also a
  ``ValueError``. :class:`envs.site.ConfigError`, :class:`envs.schemas.DataValidationError` and
  ``pipeline.data.sources.SourceError`` derive from it.

``FileNotFoundError`` (a site config or a data file that is not there; its message names the path) counts as
expected too: :func:`is_expected` is the one place that decides.

This module imports nothing from the rest of the project.
"""

from __future__ import annotations

import json

__all__ = ["ExpectedError", "InputError", "exit_code", "is_expected", "json_object", "one_message"]


class ExpectedError(Exception):
    """An error raised on purpose: its message says what is wrong, where, and what to do (printed alone)."""


class InputError(ExpectedError, ValueError):
    """The user's input (a site config, a data file, a raw source, a setting) is wrong; the message names the
    file and the key, column or row."""


def is_expected(exc: BaseException) -> bool:
    """Whether ``exc`` is an error the project raises on purpose (:class:`ExpectedError` or
    ``FileNotFoundError``): its message is printed alone, without a traceback."""
    return isinstance(exc, (ExpectedError, FileNotFoundError))


def one_message(exc: BaseException) -> str:
    """The message of an expected error as printed: ``str(exc)``, or the class name where that is empty."""
    return str(exc).strip() or type(exc).__name__


def exit_code(action) -> int:
    """Run ``action()`` for a command's ``main``: 0 when it returns; 1 after printing ``error: <message>`` (one line
    on stderr, no traceback) when it raises an expected error (:func:`is_expected`); any other exception propagates
    with its traceback."""
    import sys

    try:
        action()
    except Exception as exc:  # noqa: BLE001 - only the expected kinds are caught, the others re-raised
        if not is_expected(exc):
            raise
        print(f"error: {one_message(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


def json_object(text: str, what: str) -> dict:
    """``text`` read as a JSON object.

    Raises:
        InputError: not JSON, or JSON that is not an object (the message begins with ``what``: the option or file).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what}: not a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise InputError(f"{what}: not a JSON object but a JSON {type(value).__name__}")
    return value
