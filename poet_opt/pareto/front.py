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

import math
import os
from typing import Callable, Iterable, Optional, Sequence

from poet_opt.errors import PoetError
from poet_opt.pareto.executors import Driver, dask_client, run_alone, run_here, run_on_dask, run_on_pool
from poet_opt.pareto.points import graph_for
from poet_opt.pareto.table import INFEASIBLE, SOLVED, SweepResult
from poet_opt.units import format_bytes, parse_size


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


def sweep(model_or_graph, devices, rams, *, runtime=None, modes: Sequence[str] = ("joint",),
          time_limit: Optional[float] = 60.0, gap: float = 1e-3, jobs: Optional[int] = None,
          progress: Optional[Callable[[int, int, dict], None]] = None, model_kwargs: Optional[dict] = None,
          model_name: Optional[str] = None, warm: bool = True, scheduler: Optional[str] = None,
          order: str = "auto", allow_oversize: bool = False, min_lifetime_steps: Optional[int] = None) -> SweepResult:
    """Solve every (device, mode, RAM budget) and return one row per point (``COLUMNS``), sorted by
    device, mode and budget in the order given.

    model_or_graph: a zoo model name (built per device with its bytes per element and
    ``model_kwargs`` such as batch_size, input_shape) or a TrainingGraph. devices: names, YAML paths
    or DeviceProfile objects. rams: sizes (see ``ram_range``). runtime: as for ``solve`` (``'1.2x'``,
    ``'2.5s'`` or None). jobs: points solved at once (default ``os.cpu_count()``, or the Dask
    cluster's worker threads; 1 without a scheduler runs in this process). warm: start each point
    from the schedule of the next smaller budget in its series (it fits the larger budget).
    scheduler: ``'tcp://HOST:PORT'`` of a Dask scheduler (or a ``distributed.Client``) to run the
    points on instead of a local process pool (needs the ``dask`` extra). allow_oversize: also solve
    budgets above a device's RAM (by default each device's series stops at its RAM).
    min_lifetime_steps: a wear budget for every point, as for ``solve``.
    progress(done, total, row) is called in this process
    as each point finishes. Ctrl-C stops the sweep and returns the rows that finished, with
    ``.interrupted`` set.
    """
    from poet_opt.device.profiles import DeviceProfile, load_profile
    from poet_opt.solver.formulation import MODES

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
        graph_for(model_or_graph, model_kwargs, profiles[0])
        name = model_name or model_or_graph
    else:
        name = model_name or model_or_graph.name
    if runtime is not None:
        _check_runtime(model_or_graph, model_kwargs, profiles, runtime)

    series = []  # (device, mode) in the order given; each runs from its smallest budget up
    for profile in profiles:
        fitting = [ram for ram in budgets if allow_oversize or ram <= profile.memory.ram_bytes]
        if not fitting:
            raise PoetError(f"every budget exceeds {profile.name}'s {format_bytes(profile.memory.ram_bytes)} of RAM; "
                            "give smaller budgets, or --allow-oversize", field="--ram")
        for mode in modes:
            series.append([{
                "model": model_or_graph, "model_kwargs": model_kwargs, "model_name": name,
                "device": profile,  # loaded here: a Dask worker need not see the user's YAML file
                "device_name": profile.name, "mode": mode, "ram": ram, "runtime": runtime,
                "time_limit": time_limit, "gap": gap, "series": len(series), "warm": warm, "order": order,
                "min_lifetime_steps": min_lifetime_steps,
            } for ram in fitting])
    total = sum(map(len, series))

    client = owned = None
    if scheduler is not None:
        owned = not hasattr(scheduler, "submit")  # an address, not a distributed.Client of the caller's
        client = dask_client(scheduler) if owned else scheduler
        capacity = jobs or max(1, sum(client.nthreads().values()))
    else:
        capacity = jobs or os.cpu_count() or 1
    driver = Driver(_chains(series, capacity, warm), total, progress)
    try:
        if client is not None:
            run_on_dask(driver, client, capacity)
        elif capacity == 1:
            run_here(driver)
        else:
            # A worker that dies (killed for memory, a crash in the solver) breaks the whole pool, and
            # which point killed it is unknown: then each unfinished point gets a pool of its own, one
            # at a time, so that a point that kills its worker again costs only its own row.
            if run_on_pool(driver, capacity) and not driver.rows.interrupted:
                run_alone(driver)
    finally:
        if owned:
            client.close()
    return _sorted(driver.rows, devices, profiles, modes)


def _check_runtime(model_or_graph, model_kwargs: dict, profiles, runtime) -> None:
    """A runtime budget that no device can meet is bad input, refused before any solve (an 'x'
    multiple below 1 never can: every node runs at least once). One that only some devices cannot
    meet makes their points infeasible, each row saying why (points.run_point)."""
    from poet_opt.device.costs import node_costs
    from poet_opt.units import format_seconds, parse_runtime

    short = []
    for profile in profiles:
        costs = node_costs(graph_for(model_or_graph, model_kwargs, profile), profile)
        if parse_runtime(runtime, costs.plain_runtime_s, field="--runtime") < costs.plain_runtime_s * (1 - 1e-9):
            short.append(f"{profile.name} {format_seconds(costs.plain_runtime_s)}")
    if len(short) == len(profiles):
        raise PoetError(f"the runtime budget {runtime} is below plain training on every device ({', '.join(short)}); "
                        "every node must run at least once", field="--runtime")


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
        if r["status"] in INFEASIBLE and peak is not None:
            found = r["min_feasible_ram_bytes"]
            r["min_feasible_ram_bytes"] = peak if found is None else min(found, peak)
    out.interrupted = rows.interrupted
    return out


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
