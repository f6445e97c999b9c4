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
from poet_opt.model.batch import check_batch, check_x, divergence, finite_or_none, load_batch
from poet_opt.model.load import strips_value
from poet_opt.model.network import NO_KERNEL, Network, lower_network, rows_only
from poet_opt.model.operators import parse_full_shape
from poet_opt.model.torch_rows import tokens_in_rows
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
    # torch buffer name -> batch norms' running means and variances after the steps (--weights-out)
    running: dict[str, np.ndarray] = field(default_factory=dict)

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
                "weights": "streamed" if self.network.graph.streams_weights else "resident",
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
        message = exc.message.replace(NO_KERNEL, "the PyTorch executor has no rule for it")
        raise PoetError(message, source=exc.source, field=exc.field) from None


def lower_for_run(torch_model, input_shape, *, trainable="all", weights="auto", tile_bytes=None, strips="auto",
                  device_ram_bytes=None, stack_reserve_bytes: int = 0, ram_bytes=None, x=None) -> Network:
    """The network `run` trains, lowered as `poet-opt solve --torch` lowers the module for the same
    options (model/load.py), so that the plan solve writes is one of this network's: ``weights``
    "auto" streams them when resident weights, their gradients and the working memory would not fit
    ``device_ram_bytes`` (``needs_streaming``); streamed layers over ``tile_bytes`` are sliced (None:
    a quarter of ``ram_bytes``, solve's default); ``strips`` "auto" splits the activations along H
    only when some node would not fit the device otherwise, "off" never, N: N strips per tensor.
    A streamed network is always lowered through the strip builder (one strip per tensor where none
    are asked: the same nodes), whose replay runs it (executor/tiled.py). ``x``: the batch's input,
    checked against what the model reads (float32 features or token ids, model/batch.py's check_x)
    as soon as the module is traced, before any row graph is built."""
    from poet_opt.model.load import default_tile_bytes, needs_streaming, weights_for_strips
    from poet_opt.model.torch_import import resolve_module

    if weights not in ("auto", "resident", "streamed"):
        raise PoetError(f"unknown weights placement {weights!r}; choose auto, resident or streamed", field="--weights")
    strips = strips if isinstance(strips, dict) else strips_value(strips)  # a dict: a plan's {H: N}
    weights = weights_for_strips(strips if not isinstance(strips, dict) else 1, weights)
    module, name = resolve_module(torch_model)  # once: a factory would give other initial weights each call
    try:
        resident, unrunnable = prepare(module, input_shape, trainable=trainable, name=name), None
    except PoetError as exc:  # a row graph may still run what whole lowering refuses: solve's graph decides
        from poet_opt.model.torch_import import import_torch

        resident, unrunnable = None, exc
        plain = import_torch(module, input_shape, trainable=trainable, name=name)
    else:
        plain = resident.graph
    if x is not None:  # features or token ids, as the model reads them: before a row graph is built
        check_x(x, resident.vocabulary if resident is not None else _vocabulary(module, input_shape))
    # a transformer no backend runs whole goes into row tiles under --strips auto, as solve plans it
    in_rows = resident is None and tokens_in_rows(plain.nodes) and strips == "auto" and weights != "resident"
    if weights == "resident" or weights == "auto" and not in_rows and not needs_streaming(
            plain, device_ram_bytes, stack_reserve_bytes, ram_bytes):
        if resident is None and tokens_in_rows(plain.nodes) and strips != "off":
            raise PoetError(f"{unrunnable.message}; in row tiles it runs: give --weights auto or streamed",
                            field="--weights") from None
        if resident is None:
            raise unrunnable
        return resident
    tile = tile_bytes if tile_bytes is not None else default_tile_bytes([ram_bytes])
    budget = ram_bytes
    if device_ram_bytes is not None:  # every node must fit the budget and the device beside its stack
        room = device_ram_bytes - stack_reserve_bytes
        budget = room if budget is None else min(budget, room)
    shape = parse_full_shape(input_shape)
    if tokens_in_rows(plain.nodes):
        return _row_network(module, shape, resident, name=name, trainable=trainable, weights=weights, strips=strips,
                            tile=tile, budget=budget, device_ram_bytes=device_ram_bytes,
                            stack_reserve_bytes=stack_reserve_bytes)

    def lowered(counts):
        return lower_network(module, shape, trainable=trainable, name=name, weights="streamed", strips=counts,
                             strip_budget=budget, tile_bytes=tile)

    if resident is None:
        raise unrunnable
    try:
        streamed = lowered(1)
    except PoetError as exc:  # the strip builder's layer table speaks of the firmware generator
        from poet_opt.units import format_bytes

        g = resident.graph
        need = g.param_bytes + g.param_grad_bytes + stack_reserve_bytes + g.min_working_set_bytes()
        where = f" of the device's {format_bytes(device_ram_bytes)}" if device_ram_bytes is not None else ""
        raise PoetError(f"{exc.message.split(';')[0]}: the PyTorch executor streams weights only through the strip "
                        f"builder's layers (convolution, pooling, batch norm, the activations of docs/operators.md, add, "
                        f"concat, linear, embedding); with "
                        f"--weights resident the weights, their gradients, the stack reserve and the smallest working "
                        f"set need {format_bytes(need)}{where}", field="--weights") from None
    too_big = device_ram_bytes is not None and \
        streamed.graph.largest_working_set()[0] + stack_reserve_bytes > device_ram_bytes
    convolutions = any(n.op == "conv2d" for n in streamed.graph.nodes)
    if strips not in ("off", 1) and convolutions and (strips != "auto" or too_big):
        striped = lowered(strips)
        if strips != "auto" or striped.graph.largest_working_set()[0] <= budget:
            streamed = striped  # as solve: auto strips that do not bring every node within the budget are dropped
    working, node = streamed.graph.largest_working_set()
    if weights == "auto" and device_ram_bytes is not None and working + stack_reserve_bytes > device_ram_bytes:
        # as solve: streaming does not fit either, and the resident plan's refusal says what it would need
        resident.graph.meta["streamed_working_set"] = {"bytes": working, "node": node.name}
        resident.graph.meta["strips_tried"] = strips != "off" and convolutions
        return resident
    from poet_opt.executor.tiled import check_runnable

    check_runnable(streamed)  # before a solve: a layer the strip replay cannot run
    return streamed


def _vocabulary(module, input_shape) -> int | None:
    """The rows of the table the traced input indexes (model/torch_rows.py), or None."""
    from poet_opt.model.torch_rows import input_vocabulary

    return input_vocabulary(module, parse_full_shape(input_shape))


def _row_network(module, shape, resident: Network | None, *, name, trainable, weights, strips, tile, budget,
                 device_ram_bytes, stack_reserve_bytes: int) -> Network:
    """A streamed transformer as solve lowers it (model/load.py): in row tiles when some node would not
    fit the device whole ("auto"), when no backend streams it whole (the firmware's lowering refuses
    it: model/network.py, rows_only), or N row blocks are asked, else whole, which the executor does
    not stream (a refusal naming --strips; emulate trains it); the resident network when rows do
    not fit either, as solve (``resident`` None: the executor cannot run it whole, a refusal naming
    --ram)."""
    from poet_opt.model.torch_import import import_torch
    from poet_opt.units import format_bytes

    whole = import_torch(module, shape, trainable=trainable, name=name, weights="streamed", tile_bytes=tile)
    working, node = whole.largest_working_set()
    too_big = device_ram_bytes is not None and working + stack_reserve_bytes > device_ram_bytes
    whole_refused = rows_only(module, shape, whole, trainable=trainable, streamed=True) \
        if strips in ("auto", "off") else None
    if strips == "off" and whole_refused is not None:
        raise PoetError(f"{whole_refused.message}; in row tiles it runs: give --strips auto or N",
                        field="--strips")
    if strips == "off" or strips == "auto" and not too_big and whole_refused is None:
        raise PoetError(f"the PyTorch executor streams a transformer's weights only in row tiles, and its largest "
                        f"node ({node.name}, {format_bytes(working)}) fits the device whole, so auto leaves them out: "
                        "ask for N row blocks with --strips N"
                        + (", or keep the weights resident (--weights resident)" if resident is not None else ""),
                        field="--strips")
    rows = lower_network(module, shape, trainable=trainable, name=name, weights="streamed", strips=strips,
                         strip_budget=budget)
    if rows.graph is not None and (strips != "auto" or rows.graph.largest_working_set()[0] <= budget):
        working, node = rows.graph.largest_working_set()
        if weights != "auto" or device_ram_bytes is None or working + stack_reserve_bytes <= device_ram_bytes:
            return rows
    if weights != "auto" or resident is None:
        raise PoetError(f"no row tiling brings every node of {name} within {format_bytes(budget)}", field="--ram")
    resident.graph.meta["streamed_working_set"] = {"bytes": working, "node": node.name}
    resident.graph.meta["strips_tried"] = True
    return resident


def run_training(*, torch_model, input_shape, steps: int, lr: float, data, device=None, ram=None,
                 schedule=None, costs=None, runtime=None, mode: str | None = None, time_limit: float | None = None,
                 trainable="all", storage=None, torch_device=None, progress=None, weights="auto",
                 weight_tile=None, strips="auto") -> RunResult:
    """Train ``steps`` SGD steps of ``torch_model`` (a module, factory or ``FILE.py:FACTORY``) on the
    batch in ``data`` (an .npz file, or its ``(x, y)`` arrays already read), following ``schedule`` step for step: a schedule file (what `poet-opt solve
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
    # the traced network takes exactly this shape; integer token ids are checked against it once traced
    x, y = check_batch(*data, parse_full_shape(input_shape), token_ids=True) if isinstance(data, tuple) else \
        load_batch(data, parse_full_shape(input_shape), token_ids=True)
    if storage is not None:
        Storage(storage).close()
    table = None
    if costs is not None:  # the loader `solve --costs` uses, read before the trace so a bad file fails first
        from poet_opt.model.measured_costs import load_costs

        table = load_costs(costs)
    say("tracing the model")
    if doc is not None:  # the plan's device and budget decide the defaults, as they did for its solve
        if weights == "auto":  # and the plan says where its weights are
            weights = doc.get("memory", {}).get("weights", "auto")
        memory = doc["device"]
        device_ram, stack, ram_bytes = memory["ram_bytes"], memory["stack_reserve_bytes"], doc["budgets"]["ram_bytes"]
        # and how it was cut: the weight tile and the strips the plan's nodes were solved with
        tiling = doc["graph"].get("tiling") or {}
        if weight_tile is None and tiling.get("weight_tile_bytes") is not None:
            weight_tile = f"{int(tiling['weight_tile_bytes'])}B"
        if strips_value(strips) == "auto" and tiling.get("strips_per_height"):  # (row tiles: auto finds them)
            strips = {int(h): int(k) for h, k in tiling["strips_per_height"].items()}
    else:
        from poet_opt.units import parse_size

        device_ram, stack = profile.memory.ram_bytes, profile.memory.stack_reserve_bytes
        ram_bytes = parse_size(ram, field="--ram")
    tile = None
    if weight_tile is not None:
        from poet_opt.units import parse_size

        tile = parse_size(weight_tile, field="--weight-tile")
        if tile < 1:
            raise PoetError("must be at least 1 B", field="--weight-tile")
    network = lower_for_run(torch_model, input_shape, trainable=trainable, weights=weights, tile_bytes=tile,
                            strips=strips, device_ram_bytes=device_ram, stack_reserve_bytes=stack, ram_bytes=ram_bytes,
                            x=x)
    x = check_x(x, network.vocabulary)  # features or token ids, as the model reads them: before a solve
    tiled = network.graph.streams_weights
    if doc is None:
        doc = _solve(network, profile, ram=ram, costs=table, runtime=runtime, mode=mode or "joint",
                     time_limit=time_limit, say=say)
    stats = []
    if tiled:
        from poet_opt.executor.tiled import TiledExecutor

        if torch_device not in (None, "cpu"):  # the strip replay makes its scratch tensors on the CPU
            raise PoetError(f"a plan with streamed weights runs on the CPU, not torch_device={torch_device!r}")
        executor = TiledExecutor(network, doc, lr=lr, storage=storage)
    else:
        executor = ScheduleExecutor(network, doc, lr=lr, storage=storage, device=torch_device)
    with executor as step:
        step._check_batch(x, y)  # labels out of range fail before the first step
        for k in range(steps):
            step(x, y)
            stats.append(step.last)
            say(f"step {k + 1}/{steps}: loss {step.last.loss:.6g}, {step.last.wall_s:.3f} s")
        written, read = step.planned_traffic()
        if tiled:  # the weights live on storage: read back what the last update wrote
            weights_out, running = step.weights(), step.running_statistics()
        else:
            params = step.kernels.params
            weights_out = {name: p.detach().to("cpu").float().numpy().copy() for name, p in params.items()
                           if _trainable(network, name)}
            # the module's batch norms ran in training mode, so its own buffers moved as plain training's
            buffers = dict(network.module.named_buffers())
            running = {b.torch_name: buffers[b.torch_name].detach().to("cpu").float().numpy().copy()
                       for layer in network.layers.values() for b in layer.buffers.values()}
        used = str(step.device)
    return RunResult(network, doc, stats, weights_out, written, read, used, source, running=running)


def _solve(network: Network, profile, *, ram, costs, runtime, mode, time_limit, say) -> dict:
    """The plan `poet-opt solve --torch ... --costs` finds for the same module, budgets and costs."""
    from poet_opt.schedule.fit import check_weights_fit
    from poet_opt.solver.backends import ctrl_c_ends_everything
    from poet_opt.solver.driver import solve

    check_weights_fit(network.graph, profile)  # solve's refusal, naming what would make the model fit
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
