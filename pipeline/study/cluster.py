"""The one place where the study's Dask cluster is chosen: a scheduler address if the user gives one, else an
embedded ``LocalCluster`` (started once per process and size).

Training tasks ask for the worker resource ``GPU=1`` whenever some worker declares it (``dask worker ...
--resources GPU=1``, :func:`gpu_workers`). Workers must see the same file system paths as the client (outputs and
site data are passed as paths).
"""

from __future__ import annotations

import atexit

_CLIENTS: dict[str | None, object] = {}


def get_client(scheduler_address: str | None = None, n_workers: int | None = None):
    """A ``distributed.Client`` for the study: the given scheduler, else an embedded LocalCluster (cached).

    Args:
        scheduler_address: an existing Dask scheduler; None starts a LocalCluster.
        n_workers: worker processes of the LocalCluster (one thread each; default ``min(4, cores)``); ignored
            with a scheduler address. A LocalCluster is cached per size.

    Raises:
        OSError / TimeoutError: the scheduler cannot be reached (message names the address).
    """
    from distributed import Client, LocalCluster

    key = scheduler_address if scheduler_address or not n_workers else f"local:{n_workers}"
    if key in _CLIENTS:
        return _CLIENTS[key]
    if scheduler_address:
        try:
            client = Client(scheduler_address, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise OSError(f"cannot reach the Dask scheduler at {scheduler_address}: {exc}") from exc
    else:
        import os

        n = n_workers or max(1, min(4, os.cpu_count() or 1))
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
        atexit.register(lambda: (client.close(), cluster.close()))
    _CLIENTS[key] = client
    return client


def gpu_workers(client) -> int:
    """Number of workers that declare the resource ``GPU``."""
    try:
        info = client.scheduler_info(n_workers=-1)  # newer distributed lists only a few workers by default
    except TypeError:
        info = client.scheduler_info()
    return sum(1 for w in info["workers"].values() if w.get("resources", {}).get("GPU", 0) >= 1)
