"""The one place where the study's Dask cluster is chosen: a scheduler address if the user gives one, else an
embedded ``LocalCluster`` (started once per process and size, by whichever thread asks first).

Where training runs is decided here too (:func:`training_placement`): on a cluster whose workers declare the resource
``GPU`` (``dask worker ... --resources GPU=1``, :func:`gpu_workers`) each training task asks for ``GPU=1``; on the
embedded cluster of a machine with CUDA the agents train one after another on its GPU; on a CPU-only machine they
train side by side, one per worker (each worker has one thread, so as many at once as there are workers, and the
simulated controllers fill the workers left). Workers must see the same file system paths as the client (outputs
and site data are passed as paths).
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass

_CLIENTS: dict[str | None, object] = {}
_LOCK = threading.Lock()  # doit runs the study's stages in threads of one process: one LocalCluster for all of them

PRIORITY = {"collect": 100, "train": 10, "tune": 2, "simulate": 1, "backtest": 0}
"""Dask priorities of the study's tasks (a free worker takes the highest waiting one):

- ``collect``: a task that only gathers others' results (a stage's file list, the validation stamps, the week
  tables), so a stage ends when its work does, not when a queue of other stages' work lets a worker reach it;
- ``train``: a training run, so the longest indivisible tasks start early and the short simulations fill in around
  them;
- ``tune``: the tuning's backtests (CMA-ES's generations wait for each other, and the learned planners for the
  tuning);
- ``simulate``: a controller's run over a whole split (up to a minute: started early, it does not end a stage alone);
- ``backtest``: the week backtests of ``mpc_adaptive``'s tables."""


def get_client(scheduler_address: str | None = None, n_workers: int | None = None):
    """A ``distributed.Client`` for the study: the given scheduler, else an embedded LocalCluster (cached).

    Args:
        scheduler_address: an existing Dask scheduler; None starts a LocalCluster.
        n_workers: worker processes of the LocalCluster (one thread each; default ``min(4, cores)``); ignored
            with a scheduler address. A LocalCluster is cached per size.

    Raises:
        OSError / TimeoutError: the scheduler cannot be reached (message names the address).
    """
    with _LOCK:
        return _get_client(scheduler_address, n_workers)


def _get_client(scheduler_address: str | None, n_workers: int | None):
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
        n = n_workers or local_workers()
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


def local_workers() -> int:
    """Worker processes of the embedded LocalCluster: one per core, at most 4 (each has one thread)."""
    return max(1, min(4, os.cpu_count() or 1))


def local_cuda() -> bool:
    """Whether this machine has a CUDA device (torch's view)."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class TrainingPlacement:
    """Where the study's training tasks run.

    Attributes:
        resources: Dask resources each training task asks for (``{"GPU": 1}`` on a cluster with GPU workers).
        one_at_a_time: each training waits for the one before it (the embedded cluster of a CUDA machine: one GPU).
    """

    resources: dict | None
    one_at_a_time: bool

    @property
    def options(self) -> dict:
        """``client.submit`` keywords of a training task: its resources and priority."""
        return {"resources": self.resources, "priority": PRIORITY["train"]}


def training_placement(client, scheduler_address: str | None) -> TrainingPlacement:
    """The placement of training tasks on ``client``'s cluster (module docstring)."""
    if gpu_workers(client):
        return TrainingPlacement({"GPU": 1}, one_at_a_time=False)
    return TrainingPlacement(None, one_at_a_time=not scheduler_address and local_cuda())


def stages_side_by_side(scheduler_address: str | None) -> bool:
    """Whether the study's stages may run at once (doit's parallel execution): not on the embedded cluster of a CUDA
    machine, where the agents train one after another on its GPU and each stage waits as before; everywhere else
    the cluster places the work (:func:`training_placement`)."""
    return bool(scheduler_address) or not local_cuda()
