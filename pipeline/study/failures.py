"""How the study's doit tasks report a failure: an expected error as one message, anything else with its traceback.

An expected error (:func:`envs.errors.is_expected`: a bad site config, bad data, a bad raw source, a missing
file, ...) already says what is wrong, where and what to do; :func:`doit_action` turns it into doit's
``TaskFailed`` with that message alone, so ``doit run ...`` prints it without a Python traceback and exits
non-zero. Any other exception propagates, and doit prints its traceback (for an error raised in a Dask task,
the client re-raises it with the worker's frames).

A Dask worker logs every task that raises ("Compute Failed", with the traceback's text) on its own; the workers
of the embedded ``LocalCluster`` write to the doit command's terminal, so :func:`quiet_worker_failures` drops that
record there, where the client re-raises the same error anyway.

``dodo.py`` reaches the error types through this module (:class:`~envs.errors.ExpectedError`,
:func:`~envs.errors.one_message`), never ``envs`` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from envs.errors import ExpectedError, is_expected, one_message

__all__ = ["ExpectedError", "doit_action", "is_expected", "one_message", "quiet_worker_failures"]


def doit_action(fn: Callable[[], object], also: tuple[type[BaseException], ...] = ()) -> Callable[[], object]:
    """``fn`` as a doit python-action: an expected error (:func:`envs.errors.is_expected`, or an instance of one
    of ``also``) is returned as ``doit.exceptions.TaskFailed`` carrying its message alone; any other exception
    propagates (doit reports it with its traceback); otherwise ``fn``'s result is returned."""

    def action():
        from doit.exceptions import TaskFailed

        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - only the expected kinds are caught, the others re-raised
            if is_expected(exc) or isinstance(exc, also):
                return TaskFailed(one_message(exc))
            raise

    action.__name__ = action.__qualname__ = getattr(fn, "__name__", "action")
    return action


class _NoComputeFailed(logging.Filter):
    """Drops the ``distributed.worker`` record of a task that raised (the client re-raises the error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Compute Failed")


def _install_worker_filter() -> None:
    log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _NoComputeFailed) for f in log.filters):
        log.addFilter(_NoComputeFailed())


def quiet_worker_failures(scheduler_address: str | None, workers: int | None = None) -> None:
    """On the embedded ``LocalCluster`` of ``workers`` processes (``scheduler_address`` None;
    :func:`pipeline.study.cluster.get_client`, the cluster the stage then runs on), stop its workers logging a failed
    task to this terminal: the client re-raises the error, which is then reported once. Workers of a scheduler the
    user runs are left as they are (their logs are their own)."""
    if scheduler_address:
        return
    from pipeline.study.cluster import get_client

    get_client(None, workers).run(_install_worker_filter)
