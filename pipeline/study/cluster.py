"""The one place where the study's Dask cluster is chosen: a scheduler address if the user gives one, else an
embedded cluster on this machine (started once per process and size, by whichever thread asks first).

Where training runs is decided here too (:func:`training_placement`): on a cluster whose workers declare the resource
``GPU`` (``dask worker ... --resources GPU=1``, :func:`gpu_workers`) each training task asks for ``GPU=1``. The
embedded cluster of a machine with CUDA is such a cluster: one of its workers declares the GPU, so the agents take
turns on it (or share it, :func:`gpu_slots`) while the other workers run the simulations and the tuning
(:func:`local_cluster`). On a CPU-only
machine the agents train side by side, one per worker (each worker has one thread, so as many at once as there are
workers, and the simulated controllers fill the workers left). Workers must see the same file system paths as the
client (outputs and site data are passed as paths).
"""

from __future__ import annotations

import atexit
import logging
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
    """A ``distributed.Client`` for the study: the given scheduler, else the embedded cluster (cached).

    Args:
        scheduler_address: an existing Dask scheduler; None starts :func:`local_cluster`.
        n_workers: worker processes of the embedded cluster (one thread each; default :func:`local_workers`);
            ignored with a scheduler address. The embedded cluster is cached per size.

    Raises:
        OSError / TimeoutError: the scheduler cannot be reached (message names the address).
    """
    with _LOCK:
        return _get_client(scheduler_address, n_workers)


def _get_client(scheduler_address: str | None, n_workers: int | None):
    from distributed import Client

    key = scheduler_address if scheduler_address or not n_workers else f"local:{n_workers}"
    if key in _CLIENTS:
        return _CLIENTS[key]
    if scheduler_address:
        try:
            client = Client(scheduler_address, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise OSError(f"cannot reach the Dask scheduler at {scheduler_address}: {exc}") from exc
    else:
        cluster = local_cluster(n_workers or local_workers(), gpu_slots=gpu_slots() if local_cuda() else 0)
        client = Client(cluster)
        atexit.register(lambda: (client.close(), cluster.close()))
    client.get_task_stream(count=0)  # the scheduler keeps its task stream from now on (for work_table)
    _CLIENTS[key] = client
    return client


def task_kind(key) -> str:
    """A Dask task's kind: its key's first word, the name of the function it runs (``run_controller``,
    ``run_window``, ``evaluate_agent``, ...) or the word the study's own keys start with (``simulate``, ``train``,
    ``validate``; :mod:`pipeline.study.graph`)."""
    name = key[0] if isinstance(key, tuple) else key
    return str(name).split("-", 1)[0]


def work_table(since: float) -> str:
    """The compute time of the Dask tasks that ended after ``since`` on the clusters of this process's clients
    (:func:`get_client`'s), by kind (:func:`task_kind`): tasks, core-minutes (each task's compute time on its
    worker's thread, from the scheduler's task stream, ``distributed.diagnostics.task_stream``) and share, most
    first, then all of them; "" when none ran.

    Args:
        since: seconds since the epoch (the workers' clock), e.g. a command's start.
    """
    work: dict[str, list] = {}
    with _LOCK:
        clients = list(_CLIENTS.values())
    for client in clients:
        for record in client.get_task_stream(start=since):
            seconds = sum(s["stop"] - s["start"] for s in record["startstops"] if s["action"] == "compute")
            entry = work.setdefault(task_kind(record["key"]), [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
    if not work:
        return ""
    total = sum(s for _, s in work.values())
    width = max(len(k) for k in [*work, "all"])
    lines = [f"{'kind':<{width}}  tasks  core-min  share"]
    for kind, (n, s) in sorted(work.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{kind:<{width}}  {n:5d}  {s / 60:8.1f}  {s / max(total, 1e-9):5.0%}")
    lines.append(f"{'all':<{width}}  {sum(n for n, _ in work.values()):5d}  {total / 60:8.1f}  {'100%':>5}")
    return "\n".join(lines)


def local_cluster(n_workers: int, gpu_slots: int = 0):
    """The embedded cluster: ``n_workers`` worker processes on 127.0.0.1, an equal share of this machine's memory each
    (``distributed.SpecCluster``, the class under Dask's ``LocalCluster``, given each worker's spec). Each has one
    thread, except that with ``gpu_slots`` > 0 one of them declares the resource ``GPU=gpu_slots`` and has as many
    threads (at least one other stays for the CPU work): the training tasks, which ask for ``GPU=1``
    (:func:`training_placement`), then run ``gpu_slots`` at a time on it, and the stages run side by side as on any
    cluster.

    Raises:
        ValueError: ``n_workers`` < 1, or < 2 with a GPU worker; ``gpu_slots`` < 0.
    """
    from distributed import Nanny, Scheduler, SpecCluster
    from distributed.system import MEMORY_LIMIT

    gpu = gpu_slots > 0
    if gpu_slots < 0 or n_workers < 1 + gpu:
        raise ValueError(
            f"the embedded cluster needs at least {1 + gpu} workers{' with a GPU' * gpu} and gpu_slots >= 0, "
            f"not {n_workers} and {gpu_slots}"
        )
    options = {"nthreads": 1, "host": "127.0.0.1", "memory_limit": MEMORY_LIMIT // n_workers}
    options["silence_logs"] = logging.WARNING  # as LocalCluster: the workers' INFO lines stay out of the terminal
    workers = {f"cpu-{i}": {"cls": Nanny, "options": options} for i in range(n_workers - gpu)}
    if gpu:
        workers["gpu"] = {"cls": Nanny, "options": options | {"nthreads": gpu_slots, "resources": {"GPU": gpu_slots}}}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING)


def gpu_slots() -> int:
    """Trainings at once on the GPU of a CUDA machine's embedded cluster: the doit variable ``gpu_slots``
    (``EVHUB_GPU_SLOTS``), default 1 (the agents take turns). More share the GPU, each in its own process.

    Raises:
        ValueError: not a positive integer (names the variable and the value).
    """
    from pipeline.study.config import variable

    given = variable("gpu_slots")
    if given is None or not given[0].strip():
        return 1
    text, origin = given
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{origin}: gpu_slots must be a positive integer (trainings at once on the GPU)")
    return int(text)


def gpu_workers(client) -> int:
    """Number of workers that declare the resource ``GPU``."""
    try:
        info = client.scheduler_info(n_workers=-1)  # newer distributed lists only a few workers by default
    except TypeError:
        info = client.scheduler_info()
    return sum(1 for w in info["workers"].values() if w.get("resources", {}).get("GPU", 0) >= 1)


def local_workers() -> int:
    """Worker processes of the embedded cluster: one per core, at least 2 on a machine with CUDA (one of them holds
    the GPU) and at most :data:`MAX_LOCAL_WORKERS` (each has one thread)."""
    return max(1 + local_cuda(), min(MAX_LOCAL_WORKERS, os.cpu_count() or 1))


MAX_LOCAL_WORKERS = 16
"""The embedded cluster's largest size: each worker holds the site's data and torch (about 0.5 GiB)."""


def local_cuda() -> bool:
    """Whether this machine has a CUDA device (torch's view)."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class TrainingPlacement:
    """Where the study's training tasks run.

    Attributes:
        resources: Dask resources each training task asks for (``{"GPU": 1}`` on a cluster with GPU workers, the
            embedded cluster of a CUDA machine included; None: any worker, side by side).
    """

    resources: dict | None

    @property
    def options(self) -> dict:
        """``client.submit`` keywords of a training task: its resources and priority."""
        return {"resources": self.resources, "priority": PRIORITY["train"]}


def training_placement(client) -> TrainingPlacement:
    """The placement of training tasks on ``client``'s cluster (module docstring)."""
    return TrainingPlacement({"GPU": 1} if gpu_workers(client) else None)
