"""`poet-opt run`: train N steps of a torch module in PyTorch, following a schedule file step for step
(`--schedule`, what `poet-opt solve --out` wrote), or a schedule solved here as `solve` would.

Everything the command does is :func:`run_training`, a plain function a notebook can call. The
conventions are `poet-opt emulate`'s: a batch file with ``x`` and ``y``, mean cross-entropy over
the batch, plain SGD at ``lr``, the same batch every step, the module's own initial weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poet_opt.device.profiles import load_profile
from poet_opt.errors import PoetError
from poet_opt.executor.runner import SCHEDULE_FIELD, ScheduleExecutor, StepStats, Storage
from poet_opt.model.batch import divergence, finite_or_none, load_batch
from poet_opt.model.network import Network, lower_network
from poet_opt.model.operators import parse_full_shape
from poet_opt.schedule.fit import check_ram_within_device


@dataclass
class RunResult:
    network: Network
    schedule: dict  # the schedule document the executor followed (docs/schedule-format.md)
    stats: list[StepStats]
    weights: dict[str, np.ndarray]  # torch name -> trained value (float32, PyTorch's shape)
    planned_bytes_written: int = 0
    planned_bytes_read: int = 0
    device: str = "cpu"
    schedule_file: str | None = None  # --schedule, or None: the plan was solved here
    extra: dict = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.stats]

    @property
    def diverged(self):
        """TrainingDiverged saying why, when a loss or a trained weight is not finite; else None."""
        return divergence(self.losses, self.weights)

    def summary(self) -> dict:
        """The figures as JSON: a loss that is not finite is null, and ``diverged`` true is added."""
        totals = self.schedule["totals"]
        last = self.stats[-1]
        out = {"steps": len(self.stats), "loss": [finite_or_none(s.loss) for s in self.stats],
                "peak_live_bytes": max(s.peak_live_bytes for s in self.stats),
                "planned_peak_bytes": int(totals["peak_ram_bytes"]),
                "storage_bytes_written": sum(s.storage_bytes_written for s in self.stats),
                "storage_bytes_read": sum(s.storage_bytes_read for s in self.stats),
                "planned_storage_bytes_written": self.planned_bytes_written * len(self.stats),
                "planned_storage_bytes_read": self.planned_bytes_read * len(self.stats),
                "step_s": [s.wall_s for s in self.stats],
                "planned_step_s": float(totals["runtime_s"]),
                "recomputes": int(totals["recomputes"]),
                "page_outs": int(totals["page_outs"]),
                # what the executor did in its last step, counted as it went, beside the plan's counts
                "executed": {"computes": last.computes, "page_outs": last.page_outs, "page_ins": last.page_ins,
                             "steps": len(last.executed)},
                "schedule": self.schedule_file,
                "torch_device": self.device}
        if self.diverged:
            out["diverged"] = True
        return out


def prepare(torch_model, input_shape, *, trainable="all", name=None) -> Network:
    """The module traced for the executor (views and fused attention allowed)."""
    if input_shape is None:
        raise PoetError("--torch needs --input-shape (the whole input, batch first)", field="--input-shape")
    try:
        return lower_network(torch_model, input_shape, trainable=trainable, name=name, views=True)
    except PoetError as exc:  # the layer table speaks of the firmware generator; here the executor runs it
        message = exc.message.replace("the firmware generator has no kernel for it",
                                      "the PyTorch executor has no rule for it")
        raise PoetError(message, source=exc.source, field=exc.field) from None


def run_training(*, torch_model, input_shape, steps: int, lr: float, data, device=None, ram=None,
                 schedule=None, costs=None, runtime=None, mode: str | None = None, time_limit: float | None = None,
                 trainable="all", storage=None, torch_device=None, progress=None) -> RunResult:
    """Train ``steps`` SGD steps of ``torch_model`` (a module, factory or ``FILE.py:FACTORY``) on the
    batch in ``data``, following ``schedule`` step for step: a schedule file (what `poet-opt solve
    --out` wrote), its dict or a Schedule. Without one, solve the least-energy schedule on ``device``
    within ``ram`` first, as `poet-opt solve` would with the same ``costs`` (a measured-costs file),
    ``runtime``, ``mode`` (None: joint) and ``time_limit`` (None: none), the defaults of `solve`.

    With a schedule, ``device``, ``ram``, ``runtime`` and ``mode`` may be left out; any that is given
    must be what the plan was solved for, and the traced module must be the plan's model with the
    same input shape and trainable layers: else a PoetError naming ``--schedule`` and what differs.
    ``storage``: the directory paged tensors go to (None: a private temporary directory, removed
    afterwards, also on an error or an interrupt)."""
    say = progress or (lambda text: None)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise PoetError(f"expected a positive whole number of steps, got {steps!r}", field="--steps")
    if not (isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0):
        raise PoetError(f"expected a positive finite learning rate, got {lr!r}", field="--lr")
    if not lr <= float(np.finfo(np.float32).max):  # a float, not a float32: 1e39 would overflow in the cast
        raise PoetError(f"{lr:g} is beyond float32, the weights' number type (at most "
                        f"{float(np.finfo(np.float32).max):.4g})", field="--lr")
    if input_shape is None:
        raise PoetError("--torch needs --input-shape (the whole input, batch first)", field="--input-shape")
    doc = source = None
    if schedule is not None:
        for flag, value in (("--costs", costs), ("--time-limit", time_limit)):
            if value is not None:
                raise PoetError("only for the plan `run` solves itself; the plan in --schedule is already solved "
                                "(give it to `poet-opt solve` instead)", field=flag)
        doc, source = _read_schedule(schedule)
    else:
        for flag, value in (("--device", device), ("--ram", ram)):
            if value is None:
                raise PoetError(f"give {flag}, or a plan with --schedule PLAN.json", field=flag)
    profile = load_profile(device) if device is not None else None
    if profile is not None and ram is not None:
        check_ram_within_device(ram, profile)
    if doc is not None:  # the model, its shape and trainable set: once traced (ScheduleExecutor)
        _check_budgets(doc, profile, ram, runtime, mode)
    # a missing or malformed batch, or one of another shape, and a storage directory that cannot be
    # written fail before the trace and the solve
    x, y = load_batch(data, parse_full_shape(input_shape))  # the traced network takes exactly this shape
    if storage is not None:
        Storage(storage).close()
    table = None
    if costs is not None:  # the loader `solve --costs` uses, read before the trace so a bad file fails first
        from poet_opt.model.measured_costs import load_costs

        table = load_costs(costs)
    say("tracing the model")
    network = prepare(torch_model, input_shape, trainable=trainable)
    if doc is None:
        doc = _solve(network, profile, ram=ram, costs=table, runtime=runtime, mode=mode or "joint",
                     time_limit=time_limit, say=say)
    stats = []
    with ScheduleExecutor(network, doc, lr=lr, storage=storage, device=torch_device) as step:
        step._check_batch(x, y)  # labels out of range fail before the first step
        for k in range(steps):
            step(x, y)
            stats.append(step.last)
            say(f"step {k + 1}/{steps}: loss {step.last.loss:.6g}, {step.last.wall_s:.3f} s")
        written, read = step.planned_traffic()
        params = step.kernels.params
        weights = {name: p.detach().to("cpu").float().numpy().copy() for name, p in params.items()
                   if _trainable(network, name)}
        used = str(step.device)
    return RunResult(network, doc, stats, weights, written, read, used, source)


def _solve(network: Network, profile, *, ram, costs, runtime, mode, time_limit, say) -> dict:
    """The plan `poet-opt solve --torch ... --costs` finds for the same module, budgets and costs."""
    from poet_opt.model.strips import refuse_needing_strips
    from poet_opt.solver.backends import ctrl_c_ends_everything
    from poet_opt.solver.driver import solve

    refuse_needing_strips(network.graph, profile.memory.ram_bytes, profile.memory.stack_reserve_bytes,
                          "the PyTorch executor", profile.name)
    graph = network.graph
    if costs is not None:
        from poet_opt.model.measured_costs import apply_costs

        graph = apply_costs(graph, costs)
    say("solving")
    with ctrl_c_ends_everything():
        return solve(graph, profile, ram=ram, runtime=runtime, mode=mode, time_limit=time_limit).to_dict()


def _read_schedule(schedule) -> tuple[dict, str | None]:
    """(document, file name or None): a file must parse and validate; a broken one is bad input to
    `run` (exit 2), whatever rule it breaks."""
    from poet_opt.schedule.validator import load_and_validate, validate

    if isinstance(schedule, (str, Path)):
        try:
            doc, _ = load_and_validate(schedule)
        except PoetError as exc:
            raise PoetError(exc.message, source=str(schedule), field=SCHEDULE_FIELD) from None
        return doc, str(schedule)
    doc = schedule.to_dict() if hasattr(schedule, "to_dict") else schedule
    validate(doc)
    return doc, None


def _check_budgets(doc: dict, profile, ram, runtime, mode) -> None:
    """Each of --device, --ram, --runtime, --mode that is given must be what the plan was solved for."""
    from poet_opt.units import format_bytes, parse_runtime, parse_size

    planned = doc.get("device", {}).get("name")
    if profile is not None and profile.name != planned:
        raise PoetError(f"the plan is for device {planned}, not --device {profile.name}", field=SCHEDULE_FIELD)
    budget = doc["budgets"]["ram_bytes"]
    if ram is not None and parse_size(ram, field="--ram") != budget:
        raise PoetError(f"the plan is for a RAM budget of {format_bytes(budget)} ({budget:,} B), not --ram {ram} "
                        f"({parse_size(ram, field='--ram'):,} B)", field=SCHEDULE_FIELD)
    if runtime is not None:
        limit = doc["budgets"]["runtime_s"]
        asked = parse_runtime(runtime, float(doc["plain"]["runtime_s"]), field="--runtime")
        if limit is None or not math.isclose(asked, limit, rel_tol=1e-9):
            planned = "no runtime budget" if limit is None else f"a runtime budget of {limit:.6g} s"
            raise PoetError(f"the plan is for {planned}, not --runtime {runtime} ({asked:.6g} s)",
                            field=SCHEDULE_FIELD)
    if mode is not None and mode != doc.get("mode"):
        raise PoetError(f"the plan is for --mode {doc.get('mode')}, not --mode {mode}", field=SCHEDULE_FIELD)


def _trainable(network: Network, torch_name: str) -> bool:
    return any(layer.trainable and any(p.torch_name == torch_name for p in layer.params.values())
               for layer in network.layers.values())
