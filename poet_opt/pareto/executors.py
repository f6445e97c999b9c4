"""Running a sweep's points: in this process, on a local process pool, or on a Dask cluster, all
through one hand-out loop (``Driver``) that keeps each chain of budgets in order and skips the
budgets a proven infeasible point rules out."""

from __future__ import annotations

import concurrent.futures as cf
from collections import Counter
from typing import Optional

from poet_opt.errors import PoetError
from poet_opt.pareto.points import error_row, run_point, skipped_row
from poet_opt.pareto.table import INFEASIBLE, SweepResult


class Driver:
    """Hands out points chain by chain and records what they prove.

    A point is handed out when the one before it in its chain has finished, with that chain's last
    schedule as its start. Once a point is infeasible, every budget at or below it is too (less RAM
    never helps), and so is every budget below the proven lower bound of the minimum-peak search
    behind it: those points become ``infeasible`` rows without being solved."""

    def __init__(self, chains: list[list[dict]], total: int, progress):
        self.chains = chains
        self.chains_series = [points[0]["series"] for points in chains]
        self.total = total
        self.progress = progress
        self.busy: set[int] = set()
        self.plans: dict[int, object] = {}  # chain -> Decisions of its last solved point
        self.floor: dict[int, tuple[float, dict]] = {}  # series -> (budgets below are infeasible, cause)
        self.rows = SweepResult()

    def take(self) -> Optional[dict]:
        """The next point to solve, or None. Of the idle chains, one of the series with the fewest
        points in flight, and of those the one with the smallest budgets: small budgets are the
        slow points (time limits, minimum-peak searches), so they start first and no worker is
        left alone with them at the end."""
        while True:
            idle = [c for c, points in enumerate(self.chains) if points and c not in self.busy]
            if not idle:
                return None
            in_flight = Counter(self.chains_series[c] for c in self.busy)
            c = min(idle, key=lambda c: (in_flight[self.chains_series[c]], self.chains[c][0]["piece"], c))
            task = self.chains[c].pop(0)
            floor, cause = self.floor.get(task["series"], (0, None))
            if task["ram"] < floor:
                self._record(skipped_row(task, cause))
                continue
            self.busy.add(c)
            return dict(task, start=self.plans.get(c))

    def give_back(self, task: dict) -> None:
        """A point whose worker died: first in its chain again."""
        self.busy.discard(task["chain"])
        self.chains[task["chain"]].insert(0, {k: v for k, v in task.items() if k != "start"})

    def finish(self, task: dict, row: dict) -> None:
        decisions = row.pop("_decisions", None)
        lower_bound = row.pop("_min_ram_lower_bound", None)
        self.busy.discard(task["chain"])
        if decisions is not None:
            self.plans[task["chain"]] = decisions
        if row["status"] in INFEASIBLE:
            floor = max(row["ram_bytes"] + 1, lower_bound or 0)
            if floor > self.floor.get(task["series"], (0, None))[0]:
                self.floor[task["series"]] = (floor, row)
        self._record(row)

    def _record(self, row: dict) -> None:
        self.rows.append(row)
        if self.progress is not None:
            self.progress(len(self.rows), self.total, row)

    def unfinished(self) -> bool:
        return any(self.chains) or bool(self.busy)


def _worker_init() -> None:
    """Ctrl-C reaches the workers too: an idle one ignores it (no traceback from each), a solving one
    still stops (the solver installs its own handler), and the sweep ends the workers itself."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a forked worker inherits the CLI's SIGTERM handler; the sweep's terminate() must end it outright
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _process_pool(workers: int) -> cf.ProcessPoolExecutor:
    """A pool whose workers start from a clean interpreter, not a fork of this one: a fork copies
    the memory of HiGHS's thread scheduler but not its threads, and the first solve in such a
    worker waits for them forever (seen with highspy 1.16 after any solve in the parent)."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if context.get_start_method() == "forkserver":
        # each worker forks from a server that has already imported the solver, not from scratch
        context.set_forkserver_preload(["poet_opt.pareto.points"])
    return cf.ProcessPoolExecutor(max_workers=workers, initializer=_worker_init, mp_context=context)


def run_here(driver: Driver) -> None:
    try:
        while (task := driver.take()) is not None:
            row = run_point(task)
            if row["status"] == "interrupted":  # the solver took the Ctrl-C
                raise KeyboardInterrupt
            driver.finish(task, row)
    except KeyboardInterrupt:
        driver.rows.interrupted = True


def _drain(driver: Driver, submit, capacity: int, futures: dict, lost) -> bool:
    """Keep up to ``capacity`` points in flight on an executor and hand each finished row to the
    driver, in a fixed order within a batch. A point whose future raises becomes ``lost(task, exc)``:
    a row, or None when the executor itself broke, which sends every point in flight back to the
    driver and returns True."""
    while True:
        while len(futures) < capacity and (task := driver.take()) is not None:
            futures[submit(run_point, task)] = task
        if not futures:
            return False
        done, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED)
        broken = False
        for fut in sorted(done, key=lambda f: (futures[f]["series"], futures[f]["ram"])):
            task = futures.pop(fut)
            try:
                row = fut.result()
            except Exception as exc:
                row = lost(task, exc)
                if row is None:
                    broken = True
                    driver.give_back(task)
                    continue
            if row["status"] == "interrupted":  # the solver took a Ctrl-C meant for us
                raise KeyboardInterrupt
            driver.finish(task, row)
        if broken:
            for task in futures.values():
                driver.give_back(task)
            futures.clear()
            return True


def run_on_pool(driver: Driver, jobs: int) -> bool:
    """Run the points on a local process pool; True if the pool broke (a worker died)."""
    pool = _process_pool(min(jobs, driver.total))

    def lost(task, exc):
        if isinstance(exc, cf.process.BrokenProcessPool):
            return None
        return error_row(task, f"the worker failed on this point: {type(exc).__name__}: {exc}")

    broken = False
    try:
        broken = _drain(driver, pool.submit, jobs, {}, lost)
    except KeyboardInterrupt:
        driver.rows.interrupted = True
    finally:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        stop = driver.rows.interrupted or broken
        pool.shutdown(wait=not stop, cancel_futures=True)
        if stop:
            for proc in processes:  # our own workers, still solving points nobody will read
                if proc.is_alive():
                    proc.terminate()
    return broken


def run_alone(driver: Driver) -> None:
    """After a worker died: each remaining point in a pool of its own."""
    while not driver.rows.interrupted and (task := driver.take()) is not None:
        if not _run_on_pool_once(driver, task):
            continue
        driver.finish(task, error_row(task, "the worker process solving this point died "
                                       "(out of memory?); try fewer --jobs or a smaller model"))


def _run_on_pool_once(driver: Driver, task: dict) -> bool:
    """One point on a one-worker pool; True if the worker died."""
    pool = _process_pool(1)
    try:
        row = pool.submit(run_point, task).result()
        if row["status"] == "interrupted":
            raise KeyboardInterrupt
        driver.finish(task, row)
        return False
    except cf.process.BrokenProcessPool:
        return True
    except KeyboardInterrupt:
        driver.rows.interrupted = True
        return False
    finally:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=not driver.rows.interrupted, cancel_futures=True)
        for proc in processes:
            if proc.is_alive() and driver.rows.interrupted:
                proc.terminate()


# ---------------------------------------------------------------- Dask


DASK_CONNECT_TIMEOUT_S = 10.0  # long enough for a busy scheduler, short enough to fail before a sweep


def dask_client(address: str):
    """A client of the Dask scheduler at ``address``; bad input (no dask, no scheduler there) is one
    line naming --scheduler."""
    try:
        from distributed import Client
    except ImportError:
        raise PoetError("running a sweep on a Dask cluster needs the dask extra: "
                        "pip install 'poet-opt[dask]'", field="--scheduler") from None
    if not isinstance(address, str) or "://" not in address:
        raise PoetError(f"give the scheduler's address as tcp://HOST:PORT, got {address!r}", field="--scheduler")
    import logging

    # distributed logs every failed connection attempt before giving up; the one line below says it
    quiet = logging.getLogger("distributed")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        client = Client(address, timeout=DASK_CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise PoetError(f"cannot reach the Dask scheduler at {address}: {type(exc).__name__}: {exc}",
                        field="--scheduler") from None
    finally:
        quiet.setLevel(level)
    if not client.nthreads():
        client.close()
        raise PoetError(f"the Dask scheduler at {address} has no workers", field="--scheduler")
    return client


def run_on_dask(driver: Driver, client, capacity: int) -> None:
    """The same hand-out as on the local pool, on a Dask cluster's workers (which need poet-opt
    installed): never more than ``capacity`` points in flight, so chains stay in order."""
    executor = client.get_executor(pure=False)
    futures: dict = {}

    def lost(task, exc):  # the cluster lost the point (a worker died too often): the sweep goes on
        return error_row(task, f"the Dask cluster failed on this point: {type(exc).__name__}: {exc}")

    try:
        _drain(driver, executor.submit, capacity, futures, lost)
    except KeyboardInterrupt:
        driver.rows.interrupted = True
    finally:
        for fut in futures:
            fut.cancel()
        executor.shutdown(wait=False)
