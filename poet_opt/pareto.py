"""Energy-memory Pareto fronts: solve one model over a range of RAM budgets, on several devices and
modes, and plot what each byte of RAM buys in joules.

Plain functions a notebook can call (``sweep``, ``non_dominated``, ``write_csv``, ``plot_front``,
``plot_timeline``); ``poet-opt pareto`` and ``poet-opt plot`` are thin wrappers (docs/pareto.md).

A sweep is a list of rows (dicts, one per device x mode x RAM budget, columns in ``COLUMNS``). A
point that fails is a row with its status, never a lost sweep. Points run on a local process pool
or a Dask cluster. Each series (device, mode) is solved from its smallest budget up, each point
starting from the schedule of the budget below it (which fits: it needs no more RAM than that
smaller budget). A budget that is infeasible makes every smaller one infeasible too, and the
minimum-peak search behind it proves a lower bound on the smallest feasible budget: the budgets
below are marked infeasible without solving.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
from collections import Counter
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from .errors import InfeasibleError, NoScheduleFound, PoetError
from .units import format_bytes, parse_size

COLUMNS = [
    "model", "device", "mode", "ram_bytes", "runtime_budget_s", "status",
    "energy_j", "compute_j", "page_in_j", "page_out_j", "runtime_s", "peak_ram_bytes",
    "recomputes", "page_ins", "page_outs", "gap", "solve_s",
    "plain_energy_j", "plain_peak_bytes", "min_feasible_ram_bytes", "error",
]
# statuses of a row that carries a schedule (and so an energy)
SOLVED = ("optimal", "gap_limit", "time_limit")
STATUSES = SOLVED + ("infeasible", "no_schedule", "error")

_INT_COLUMNS = {"ram_bytes", "peak_ram_bytes", "recomputes", "page_ins", "page_outs", "plain_peak_bytes",
                "min_feasible_ram_bytes"}
_FLOAT_COLUMNS = {"runtime_budget_s", "energy_j", "compute_j", "page_in_j", "page_out_j", "runtime_s", "gap",
                  "solve_s", "plain_energy_j"}


class SweepResult(list):
    """The rows of a sweep; ``interrupted`` is True when Ctrl-C stopped it (the rows are those that
    finished)."""

    interrupted: bool = False


# ---------------------------------------------------------------- budgets


def ram_range(start, stop, points: int) -> list[int]:
    """``points`` RAM budgets from ``start`` to ``stop`` (both included), spaced geometrically:
    each budget is the previous one times a constant factor, so a front that spans 100 KB to 10 MB
    gets as many points per decade at the small end, where the energy changes fastest, as at the
    large one. Sizes as ``units.parse_size`` reads them ('256KiB', '1.5MB', 4096); whole bytes,
    increasing, without duplicates (a very narrow range can give fewer than ``points``)."""
    lo = parse_size(start, field="--ram-from")
    hi = parse_size(stop, field="--ram-to")
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise PoetError(f"need at least 2 points for a range, got {points!r}", field="--points")
    if lo >= hi:
        raise PoetError(f"the range is empty or reversed: {format_bytes(lo)} to {format_bytes(hi)}; "
                        "give --ram-from below --ram-to", field="--ram-from/--ram-to")
    ratio = (hi / lo) ** (1.0 / (points - 1))
    values = [lo] + [int(round(lo * ratio**k)) for k in range(1, points - 1)] + [hi]
    return sorted(set(values))


def parse_ram_list(text: str | Iterable) -> list[int]:
    """'256KB,512KB,1MB' (or a list of sizes) -> increasing whole bytes without duplicates."""
    items = [s for s in (text.split(",") if isinstance(text, str) else list(text))]
    if isinstance(text, str):
        items = [s.strip() for s in items]
    if not items or any(s == "" for s in items):
        raise PoetError(f"give a comma-separated list of sizes such as 256KB,512KB,1MB, got {text!r}", field="--ram")
    return sorted({parse_size(s, field="--ram") for s in items})


# ---------------------------------------------------------------- the sweep


_GRAPHS: dict = {}  # per process: (model, kwargs, bytes per element) -> graph


def _graph_for(model, model_kwargs: dict, profile):
    if not isinstance(model, str):
        return model
    key = (model, tuple(sorted(model_kwargs.items())), profile.memory.bytes_per_element)
    if key not in _GRAPHS:
        from .zoo import build_model

        _GRAPHS[key] = build_model(model, bytes_per_element=profile.memory.bytes_per_element, **model_kwargs)
    return _GRAPHS[key]


def _empty_row(model_name: str, device_name: str, mode: str, ram: int) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(model=model_name, device=device_name, mode=mode, ram_bytes=int(ram))
    return row


def _run_point(task: dict) -> dict:
    """Solve one point; never raises (except KeyboardInterrupt): failures become a row's status,
    and solve_s is the point's wall time. Module-level and fed plain data, so a process pool can
    run it."""
    import time

    started = time.perf_counter()
    row = _empty_row(task["model_name"], task["device_name"], task["mode"], task["ram"])
    try:
        row.update(_solve_point(task, row))
    finally:
        row["solve_s"] = time.perf_counter() - started
    return row


def _solve_point(task: dict, row: dict) -> dict:
    import math as _math

    from .costs import node_costs
    from .profiles import load_profile
    from .solve import plain_summary, resolve_budgets, solve
    from .units import parse_runtime

    try:
        device = task["device"]
        profile = device if not isinstance(device, (str, os.PathLike)) else load_profile(device)
        graph = _graph_for(task["model"], task["model_kwargs"], profile)
        costs = node_costs(graph, profile)
        plain = plain_summary(graph, costs)
        row.update(plain_energy_j=plain["energy_j"], plain_peak_bytes=plain["peak_ram_bytes"])
        if task["runtime"] is not None:
            row["runtime_budget_s"] = parse_runtime(task["runtime"], costs.plain_runtime_s, field="--runtime")
        start = task.get("start")
        if start is not None:  # the budget below's plan fits; with the extra RAM it can do less work
            budgets = resolve_budgets(graph, profile, costs, task["ram"], task["runtime"])
            start = loosen(graph, costs, start, budgets.ram_bytes, budgets.runtime_s)
        schedule = solve(graph, profile, ram=task["ram"], runtime=task["runtime"], mode=task["mode"],
                         time_limit=task["time_limit"], gap=task["gap"], model_name=task["model_name"],
                         start=start)
    except InfeasibleError as exc:
        # no message: a point skipped below it would say something else, and rows must not depend
        # on which points a pool happened to solve
        row.update(status="infeasible", min_feasible_ram_bytes=exc.min_ram_bytes,
                   _min_ram_lower_bound=exc.min_ram_lower_bound)
        return row
    except NoScheduleFound as exc:
        status = "interrupted" if "interrupted" in exc.message else "no_schedule"
        row.update(status=status, error=exc.one_line())
        return row
    except PoetError as exc:
        row.update(status="error", error=exc.one_line())
        return row
    except Exception as exc:  # a bug on our side: keep the sweep, say what happened
        row.update(status="error", error=f"internal error: {type(exc).__name__}: {exc}")
        return row
    t, solver = schedule.totals, schedule.solver
    row.update(
        status=solver["status"], energy_j=t["energy_j"], compute_j=t["compute_j"], page_in_j=t["page_in_j"],
        page_out_j=t["page_out_j"], runtime_s=t["runtime_s"], peak_ram_bytes=t["peak_ram_bytes"],
        recomputes=t["recomputes"], page_ins=t["page_ins"], page_outs=t["page_outs"], gap=solver["gap"],
    )
    if _math.isfinite(schedule.budgets.runtime_s):
        row["runtime_budget_s"] = float(schedule.budgets.runtime_s)
    if task.get("warm"):  # the start of the next budget up; the sweep takes it out of the row
        row["_decisions"] = schedule.decisions
    return row


def loosen(graph, costs, decisions, ram_bytes: float, runtime_s: float = math.inf):
    """A plan made for a smaller RAM budget, improved for a larger one: tensor by tensor, most
    energy first, keep a recomputed or paged tensor in RAM from its computation to its last reader
    (as plain training does) wherever the replayed plan still fits the budgets. The result is never
    worse than the plan given, and is the MIP start a sweep hands to the next budget up."""
    from .formulation import Decisions
    from .schedule import build_steps, totals_of

    last = graph.last_use()
    saving: dict[int, float] = {}
    for _t, i in decisions.recompute:
        saving[i] = saving.get(i, 0.0) + float(costs.compute_j[i])
    for _t, i in decisions.page_in:
        saving[i] = saving.get(i, 0.0) + float(costs.page_in_j[i])
    for i in decisions.page_out:
        saving[i] = saving.get(i, 0.0) + float(costs.page_out_j[i])
    for i in sorted(saving, key=lambda i: (-saving[i], i)):
        trial = Decisions(
            recompute=frozenset(p for p in decisions.recompute if p[1] != i),
            page_in=frozenset(p for p in decisions.page_in if p[1] != i),
            page_out=decisions.page_out - {i},
            keep=decisions.keep | {(t, i) for t in range(i + 1, last[i] + 1)},
        )
        try:
            totals = totals_of(graph, costs, build_steps(graph, trial))
        except RuntimeError:  # not a consistent plan: leave this tensor as it was
            continue
        if totals["peak_ram_bytes"] <= ram_bytes and totals["runtime_s"] <= runtime_s * (1 + 1e-9):
            decisions = trial
    return decisions


def _worker_init() -> None:
    """Ctrl-C reaches the workers too: an idle one ignores it (no traceback from each), a solving one
    still stops (the solver installs its own handler), and the sweep ends the workers itself."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _skipped(task: dict, cause: dict) -> dict:
    """A point below a budget proven infeasible in the same series: infeasible, not solved."""
    row = _empty_row(task["model_name"], task["device_name"], task["mode"], task["ram"])
    for key in ("runtime_budget_s", "plain_energy_j", "plain_peak_bytes", "min_feasible_ram_bytes"):
        row[key] = cause[key]
    row.update(status="infeasible", solve_s=0.0)
    return row


def sweep(model_or_graph, devices, rams, *, runtime=None, modes: Sequence[str] = ("joint",),
          time_limit: Optional[float] = 60.0, gap: float = 1e-3, jobs: Optional[int] = None,
          progress: Optional[Callable[[int, int, dict], None]] = None, model_kwargs: Optional[dict] = None,
          model_name: Optional[str] = None, warm: bool = True, scheduler: Optional[str] = None) -> SweepResult:
    """Solve every (device, mode, RAM budget) and return one row per point (``COLUMNS``), sorted by
    device, mode and budget in the order given.

    model_or_graph: a zoo model name (built per device with its bytes per element and
    ``model_kwargs`` such as batch_size, input_shape) or a TrainingGraph. devices: names, YAML paths
    or DeviceProfile objects. rams: sizes (see ``ram_range``). runtime: as for ``solve`` (``'1.2x'``,
    ``'2.5s'`` or None). jobs: points solved at once (default ``os.cpu_count()``, or the Dask
    cluster's worker threads; 1 without a scheduler runs in this process). warm: start each point
    from the schedule of the next smaller budget in its series (it fits the larger budget).
    scheduler: ``'tcp://HOST:PORT'`` of a Dask scheduler (or a ``distributed.Client``) to run the
    points on instead of a local process pool (needs the ``dask`` extra). progress(done, total, row) is called in this process
    as each point finishes. Ctrl-C stops the sweep and returns the rows that finished, with
    ``.interrupted`` set.
    """
    from .formulation import MODES
    from .profiles import DeviceProfile, load_profile

    if isinstance(devices, (str, os.PathLike, DeviceProfile)):
        devices = [devices]
    if not devices:
        raise PoetError("give at least one device", field="--device")
    modes = [modes] if isinstance(modes, str) else list(modes)
    if not modes:
        raise PoetError("give at least one mode", field="--modes")
    for mode in modes:
        if mode not in MODES:
            raise PoetError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}", field="--modes")
    budgets = sorted({parse_size(r, field="--ram") for r in rams})
    if not budgets:
        raise PoetError("give at least one RAM budget", field="--ram")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise PoetError(f"--jobs must be a positive whole number, got {jobs!r}", field="--jobs")
    model_kwargs = dict(model_kwargs or {})
    # Bad input fails here, once, rather than as a row per point.
    profiles = [d if isinstance(d, DeviceProfile) else load_profile(d) for d in devices]
    if isinstance(model_or_graph, str):
        _graph_for(model_or_graph, model_kwargs, profiles[0])
        name = model_name or model_or_graph
    else:
        name = model_name or model_or_graph.name

    series = []  # (device, mode) in the order given; each runs from its smallest budget up
    for profile in profiles:
        for mode in modes:
            series.append([{
                "model": model_or_graph, "model_kwargs": model_kwargs, "model_name": name,
                "device": profile,  # loaded here: a Dask worker need not see the user's YAML file
                "device_name": profile.name, "mode": mode, "ram": ram, "runtime": runtime,
                "time_limit": time_limit, "gap": gap, "series": len(series), "warm": warm,
            } for ram in budgets])
    total = sum(map(len, series))

    client = owned = None
    if scheduler is not None:
        owned = not hasattr(scheduler, "submit")  # an address, not a distributed.Client of the caller's
        client = dask_client(scheduler) if owned else scheduler
        capacity = jobs or max(1, sum(client.nthreads().values()))
    else:
        capacity = jobs or os.cpu_count() or 1
    driver = _Driver(_chains(series, capacity, warm), total, progress)
    try:
        if client is not None:
            _run_on_dask(driver, client, capacity)
        elif capacity == 1:
            _run_here(driver)
        else:
            # A worker that dies (killed for memory, a crash in the solver) breaks the whole pool, and
            # which point killed it is unknown: then each unfinished point gets a pool of its own, one
            # at a time, so that a point that kills its worker again costs only its own row.
            if _run_on_pool(driver, capacity) and not driver.rows.interrupted:
                _run_alone(driver)
    finally:
        if owned:
            client.close()
    return _sorted(driver.rows, devices, profiles, modes)


def _chains(series: list[list[dict]], capacity: int, warm: bool) -> list[list[dict]]:
    """Cut each series (ascending budgets) into chains solved one point after the other, each point
    starting from its predecessor's schedule. With several workers, twice as many chains as workers
    (a chain's first point starts cold): series are seldom equally hard (a microcontroller's points
    hit the time limit while a Pi's finish early), and whole series as chains left workers idle
    behind the slowest one. Without warm starts every point is a chain of its own. The cut depends
    only on the counts, never on timing, so a sweep gives the same rows on any executor with the
    same number of workers."""
    chains = []
    for points in series:
        if not warm:
            pieces = len(points)
        elif capacity == 1:
            pieces = 1
        else:
            pieces = min(len(points), max(1, -(-2 * capacity // len(series))))
        size, extra = divmod(len(points), pieces)
        at = 0
        for k in range(pieces):
            n = size + (1 if k < extra else 0)
            chains.append([dict(t, chain=len(chains), piece=k) for t in points[at:at + n]])
            at += n
    return chains


class _Driver:
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
                self._record(_skipped(task, cause))
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
        if row["status"] == "infeasible":
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


def _run_here(driver: _Driver) -> None:
    try:
        while (task := driver.take()) is not None:
            row = _run_point(task)
            if row["status"] == "interrupted":  # the solver took the Ctrl-C
                raise KeyboardInterrupt
            driver.finish(task, row)
    except KeyboardInterrupt:
        driver.rows.interrupted = True


def _drain(driver: _Driver, submit, capacity: int, futures: dict, lost) -> bool:
    """Keep up to ``capacity`` points in flight on an executor and hand each finished row to the
    driver, in a fixed order within a batch. A point whose future raises becomes ``lost(task, exc)``:
    a row, or None when the executor itself broke, which sends every point in flight back to the
    driver and returns True."""
    while True:
        while len(futures) < capacity and (task := driver.take()) is not None:
            futures[submit(_run_point, task)] = task
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


def _error_row(task: dict, error: str) -> dict:
    row = _empty_row(task["model_name"], task["device_name"], task["mode"], task["ram"])
    row.update(status="error", error=error)
    return row


def _run_on_pool(driver: _Driver, jobs: int) -> bool:
    """Run the points on a local process pool; True if the pool broke (a worker died)."""
    pool = cf.ProcessPoolExecutor(max_workers=min(jobs, driver.total), initializer=_worker_init)

    def lost(task, exc):
        if isinstance(exc, cf.process.BrokenProcessPool):
            return None
        return _error_row(task, f"the worker failed on this point: {type(exc).__name__}: {exc}")

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


def _run_alone(driver: _Driver) -> None:
    """After a worker died: each remaining point in a pool of its own."""
    while not driver.rows.interrupted and (task := driver.take()) is not None:
        if not _run_on_pool_once(driver, task):
            continue
        driver.finish(task, _error_row(task, "the worker process solving this point died "
                                       "(out of memory?); try fewer --jobs or a smaller model"))


def _run_on_pool_once(driver: _Driver, task: dict) -> bool:
    """One point on a one-worker pool; True if the worker died."""
    pool = cf.ProcessPoolExecutor(max_workers=1, initializer=_worker_init)
    try:
        row = pool.submit(_run_point, task).result()
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


def _run_on_dask(driver: _Driver, client, capacity: int) -> None:
    """The same hand-out as on the local pool, on a Dask cluster's workers (which need poet-opt
    installed): never more than ``capacity`` points in flight, so chains stay in order."""
    executor = client.get_executor(pure=False)
    futures: dict = {}

    def lost(task, exc):  # the cluster lost the point (a worker died too often): the sweep goes on
        return _error_row(task, f"the Dask cluster failed on this point: {type(exc).__name__}: {exc}")

    try:
        _drain(driver, executor.submit, capacity, futures, lost)
    except KeyboardInterrupt:
        driver.rows.interrupted = True
    finally:
        for fut in futures:
            fut.cancel()
        executor.shutdown(wait=False)


def _sorted(rows: SweepResult, devices, profiles, modes) -> SweepResult:
    device_order = {p.name: k for k, p in enumerate(profiles)}
    mode_order = {m: k for k, m in enumerate(modes)}
    out = SweepResult(sorted(rows, key=lambda r: (device_order.get(r["device"], 0), mode_order.get(r["mode"], 0),
                                                  r["ram_bytes"])))
    # The minimum-peak search behind an infeasible point has a time limit: what it found is only an
    # upper bound on the smallest feasible budget, and a solved point of the same series can show a
    # smaller one (its own peak), or show that one exists where the search found none.
    smallest_peak: dict = {}
    for r in out:
        if r["status"] in SOLVED and r["peak_ram_bytes"] is not None:
            key = (r["device"], r["mode"])
            smallest_peak[key] = min(smallest_peak.get(key, r["peak_ram_bytes"]), r["peak_ram_bytes"])
    for r in out:
        peak = smallest_peak.get((r["device"], r["mode"]))
        if r["status"] == "infeasible" and peak is not None:
            found = r["min_feasible_ram_bytes"]
            r["min_feasible_ram_bytes"] = peak if found is None else min(found, peak)
    out.interrupted = rows.interrupted
    return out


# ---------------------------------------------------------------- the front


def non_dominated(rows: Iterable[dict]) -> list[dict]:
    """The Pareto-optimal rows in (ram_bytes, energy_j), separately per device and mode: a solved
    row is kept unless another solved row of its series needs no more RAM and no more energy, and
    less of one. Of rows equal in both, the first is kept. Sorted like the input's series, by RAM."""
    series: dict = {}
    for row in rows:
        if row.get("status") in SOLVED and row.get("energy_j") is not None:
            series.setdefault((row["device"], row["mode"]), []).append(row)
    front = []
    for members in series.values():
        best = math.inf
        for row in sorted(members, key=lambda r: (r["ram_bytes"], r["energy_j"])):
            if row["energy_j"] < best:
                front.append(row)
                best = row["energy_j"]
    return front


# ---------------------------------------------------------------- CSV


def write_csv(rows: Iterable[dict], path) -> None:
    """Rows as CSV with the ``COLUMNS`` header; empty cells for missing values."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_csv(path) -> list[dict]:
    """The inverse of ``write_csv``: numbers back as int/float, empty cells as None."""
    out = []
    with open(path, newline="") as fh:
        for raw in csv.DictReader(fh):
            row = {}
            for k, v in raw.items():
                if v == "" or v is None:
                    row[k] = None
                elif k in _INT_COLUMNS:
                    row[k] = int(float(v))
                elif k in _FLOAT_COLUMNS:
                    row[k] = float(v)
                else:
                    row[k] = v
            out.append(row)
    return out


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _bytes_axis(ax, axis: str = "x") -> None:
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _pos: format_bytes(v) if v > 0 else "0")
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(fmt)


def _energy_unit(values) -> tuple[float, str]:
    top = max((abs(v) for v in values if v is not None and math.isfinite(v)), default=1.0)
    for scale, unit in ((1.0, "J"), (1e-3, "mJ"), (1e-6, "uJ")):
        if top >= scale:
            return scale, unit
    return 1e-6, "uJ"


def _save(fig, path) -> list[Path]:
    """Write PNG at ``path`` (any other suffix: PNG and SVG side by side under its stem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".svg":
        targets = [path, path.with_suffix(".png")]
    elif path.suffix.lower() == ".png":
        targets = [path]
    else:
        targets = [path.with_suffix(".png"), path.with_suffix(".svg")]
    for target in targets:
        fig.savefig(target, dpi=150, bbox_inches="tight")
    return targets


def plot_front(rows: Sequence[dict], path) -> list[Path]:
    """Energy per training step against the RAM budget, one line per (device, mode).

    Solved points are joined by a line (hollow markers: not proven optimal); infeasible budgets are
    crosses on the axis with the region below the smallest feasible budget shaded; the smallest
    feasible budget is annotated; plain training (its peak RAM and energy) is a star. Writes PNG and
    SVG (``path`` without suffix or ending .svg) or PNG only (``path`` ending .png); returns the
    files written."""
    plt = _pyplot()
    rows = list(rows)
    series: dict = {}
    for row in rows:
        series.setdefault((row["device"], row["mode"]), []).append(row)
    energies = [r["energy_j"] for r in rows if r.get("energy_j") is not None]
    energies += [r["plain_energy_j"] for r in rows if r.get("plain_energy_j") is not None]
    scale, unit = _energy_unit(energies)
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    floor = min(energies) / scale if energies else 0.0
    for k, ((device, mode), members) in enumerate(series.items()):
        color = colors[k % len(colors)]
        members = sorted(members, key=lambda r: r["ram_bytes"])
        solved = [r for r in members if r["status"] in SOLVED and r.get("energy_j") is not None]
        label = f"{device} ({mode})"
        if solved:
            xs = [r["ram_bytes"] for r in solved]
            ys = [r["energy_j"] / scale for r in solved]
            ax.plot(xs, ys, "-", color=color, label=label)
            for r, x, y in zip(solved, xs, ys):
                proven = r["status"] in ("optimal", "gap_limit")  # hollow: stopped by the time limit
                ax.plot([x], [y], "o", color=color, markerfacecolor=color if proven else "white")
        else:
            ax.plot([], [], "-", color=color, label=label)
        infeasible = [r for r in members if r["status"] == "infeasible"]
        if infeasible:
            xs = [r["ram_bytes"] for r in infeasible]
            ax.plot(xs, [floor] * len(xs), "x", color=color, markersize=8)
            mins = [r["min_feasible_ram_bytes"] for r in infeasible if r.get("min_feasible_ram_bytes")]
            if mins:  # a solved point's own peak can undercut a time-limited minimum-peak search
                mins += [r["peak_ram_bytes"] for r in solved if r.get("peak_ram_bytes")]
            # proven infeasible: up to the largest infeasible budget, or the smallest feasible one
            edge = min(mins) if mins else max(xs)
            ax.axvspan(min(xs) * 0.97, edge, color=color, alpha=0.08, lw=0)
            if mins:
                m = min(mins)
                ax.axvline(m, color=color, ls=":", lw=1)
                ax.annotate(f"min feasible {format_bytes(m)}", xy=(m, floor), xytext=(4, 12),
                            textcoords="offset points", color=color, fontsize=8, rotation=90, va="bottom")
        plain = next((r for r in members if r.get("plain_energy_j") is not None), None)
        if plain is not None:
            ax.plot([plain["plain_peak_bytes"]], [plain["plain_energy_j"] / scale], "*", color=color, markersize=13,
                    markeredgecolor="black", markeredgewidth=0.5)
    if rows:
        ax.plot([], [], "*", color="grey", markeredgecolor="black", label="plain training (peak RAM)")
        if any(r["status"] == "infeasible" for r in rows):
            ax.plot([], [], "x", color="grey", label="infeasible budget")
    model = rows[0]["model"] if rows else ""
    runtime = next((r["runtime_budget_s"] for r in rows if r.get("runtime_budget_s") is not None), None)
    ax.set_title(f"{model}: energy per training step vs RAM budget"
                 + ("" if runtime is None else " (runtime budget applied)"))
    ax.set_xlabel("RAM budget for activations and gradients")
    ax.set_ylabel(f"energy per training step ({unit})")
    positive = [e / scale for e in energies if e > 0]
    if positive and max(positive) > 8 * min(positive):
        # devices an order of magnitude apart would flatten each other's curves on a linear axis
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        label = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(label)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(label)
        ax.set_ylabel(f"energy per training step ({unit}, log scale)")
    _bytes_axis(ax, "x")
    ax.grid(True, alpha=0.3)
    if rows:
        ax.legend(fontsize=8, loc="best")
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


# stage x node matrix codes and their colours
_CELLS = [("not resident", "#ffffff"), ("on storage", "#d9d2e9"), ("kept", "#9ecae1"), ("paged in", "#31a354"),
          ("recomputed", "#e6550d"), ("computed", "#08306b")]


def timeline(doc: dict) -> dict:
    """Replay a schedule document's steps: RAM after every step (total and per node), the steps
    that recompute or page, and the stage x node matrix (codes index ``_CELLS``). Stage t is the
    part of the plan that ends with node t's first computation (docs/schedule-format.md)."""
    nodes = doc["graph"]["nodes"]
    size = [int(n["bytes"]) for n in nodes]
    T = len(nodes)
    resident: set[int] = set()
    stored: set[int] = set()
    computed: set[int] = set()
    matrix = [[0] * T for _ in range(T)]
    total, per_node, marks = [], [], {"recompute": [], "page_in": [], "page_out": []}
    stage, opening = 0, True
    for k, step in enumerate(doc["steps"]):
        op, n = step["op"], int(step["node"])
        if op in ("compute", "page_in") and opening and stage < T:
            for i in resident:
                matrix[stage][i] = 2
            for i in stored - resident:
                matrix[stage][i] = max(matrix[stage][i], 1)
            opening = False
        row = matrix[min(stage, T - 1)]
        if op == "compute":
            resident.add(n)
            if n in computed:
                marks["recompute"].append(k)
                row[n] = max(row[n], 4)
            else:
                computed.add(n)
                matrix[min(n, T - 1)][n] = 5
                stage, opening = n + 1, True
        elif op == "page_in":
            resident.add(n)
            marks["page_in"].append(k)
            row[n] = max(row[n], 3)
        elif op == "page_out":
            stored.add(n)
            marks["page_out"].append(k)
        elif op == "free":
            resident.discard(n)
        total.append(sum(size[i] for i in resident))
        per_node.append(frozenset(resident))
    return {"total": total, "resident": per_node, "marks": marks, "matrix": matrix, "sizes": size}


def plot_timeline(doc: dict, path) -> list[Path]:
    """Two panels for one (validated) schedule document: RAM in use after every step, stacked by
    tensor (forward activations blue, gradients orange), with the budget and plain training's peak
    as lines and recomputations / page-ins / page-outs marked; and the stage x node matrix in the
    style of the Checkmate and POET papers. PNG at ``path``; with a .svg path, SVG and a PNG beside
    it; without a suffix both."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = _pyplot()
    tl = timeline(doc)
    nodes = doc["graph"]["nodes"]
    T, S = len(nodes), len(doc["steps"])
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1.6, 1]})
    steps = np.arange(S)
    stack = np.zeros((T, S))
    for k, res in enumerate(tl["resident"]):
        for i in res:
            stack[i, k] = tl["sizes"][i]
    used = [i for i in range(T) if stack[i].any()]
    blues, oranges = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
    colors = [(blues if nodes[i]["kind"] != "backward" else oranges)(0.35 + 0.5 * (i % 7) / 6) for i in used]
    if used:
        ax.stackplot(steps, stack[used], colors=colors, step="post", linewidth=0)
    ax.step(steps, tl["total"], where="post", color="black", lw=0.8, label="RAM in use")
    budget = (doc.get("budgets") or {}).get("ram_bytes")
    if budget is not None:
        ax.axhline(budget, color="red", ls="--", lw=1, label=f"budget {format_bytes(budget)}")
    plain_peak = (doc.get("plain") or {}).get("peak_ram_bytes")
    if plain_peak:
        ax.axhline(plain_peak, color="grey", ls=":", lw=1, label=f"plain training peak {format_bytes(plain_peak)}")
    top = max([*tl["total"], budget or 0, plain_peak or 0, 1])
    for key, marker, color, label in (("recompute", "v", "#e6550d", "recompute"), ("page_in", "^", "#31a354", "page-in"),
                                      ("page_out", "s", "#756bb1", "page-out")):
        xs = tl["marks"][key]
        if xs:
            ax.plot(xs, [top * 1.04] * len(xs), marker, color=color, markersize=4, ls="", label=f"{label} ({len(xs)})")
    ax.set_ylim(0, top * 1.1)
    ax.set_xlim(0, max(S - 1, 1))
    ax.set_xlabel("step")
    ax.set_ylabel("RAM in use (activations and gradients)")
    _bytes_axis(ax, "y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    totals = doc.get("totals") or {}
    energy = totals.get("energy_j")
    from .units import format_joules

    ax.set_title(f"{doc.get('model', '')} on {(doc.get('device') or {}).get('name', '')}, mode {doc.get('mode', '')}"
                 + ("" if energy is None else f": {format_joules(energy)}"))

    cmap = ListedColormap([c for _, c in _CELLS])
    mx.imshow(np.array(tl["matrix"]), cmap=cmap, vmin=-0.5, vmax=len(_CELLS) - 0.5, interpolation="nearest",
              aspect="auto", origin="upper")
    mx.set_xlabel("node (topological order)")
    mx.set_ylabel("stage")
    mx.set_title("what each stage computes, keeps and pages")
    mx.legend(handles=[Patch(facecolor=c, edgecolor="grey", label=name) for name, c in _CELLS[1:]], fontsize=7,
              loc="upper right")
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
