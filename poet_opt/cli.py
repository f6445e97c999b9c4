"""The `poet-opt` command: a thin layer over plain functions that a notebook can call directly.

Bad input of any kind ends as one line on stderr and exit code 2; nothing is written unless the
schedule validated. Exit codes: 0 success, 1 a schedule that breaks a rule (`validate`), 2 bad input
or no schedule within the budgets, 3 an internal error (a bug: one line too; POET_OPT_DEBUG=1 shows
the traceback), 4 training diverged (`run`, `emulate`), 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from poet_opt.signals import (command_ending, end_unless_ended, install_early, leave_at_once, redeliver_lost_signals,
                              signal_behind)

install_early(__name__)

import click  # noqa: E402

from poet_opt import __version__  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.solver.time_budget import parse_time_limit  # noqa: E402
from poet_opt.schedule.fit import (check_fits_device, check_ram_within_device, check_weights_fit, check_weights_stored,
                                   device_fit)

EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a Ctrl-C would be, so that the same cleanup runs: finally blocks remove
    temporary files, a sweep stops its workers. By default SIGTERM ends the process on the spot."""

    signum = signal.SIGTERM  # what redeliver_lost_signals sends again when a finalizer swallowed it


_TERMINATED = threading.Event()  # for code that catches _Terminated as a KeyboardInterrupt, then reports


def _raise_terminated(signum, frame):
    _TERMINATED.set()
    end_unless_ended(EXIT_TERMINATED)
    raise _Terminated


def _fail(message: str, code: int) -> None:
    command_ending()  # a signal lost earlier and sent again now would replace this exit (signals.py)
    click.echo(f"poet-opt: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def _fail_if_signalled(exc: BaseException) -> None:
    if (stop := signal_behind(exc)) is not None:  # a signal inside an extension's import, wrapped
        _fail(f"{'terminated' if isinstance(stop, _Terminated) else 'interrupted'}; nothing was written",
              EXIT_TERMINATED if isinstance(stop, _Terminated) else EXIT_INTERRUPTED)


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PoetError as exc:
            _fail_if_signalled(exc)
            _fail(f"error: {exc.one_line()}", exc.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except _Terminated:
            _fail("terminated; nothing was written", EXIT_TERMINATED)
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written", EXIT_INTERRUPTED)
        except OSError as exc:  # the machine, not the input: a full disk, a vanished directory
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"error: {where}{exc.strerror or exc}", 2)
        except Exception as exc:
            _fail_if_signalled(exc)
            if os.environ.get("POET_OPT_DEBUG"):
                traceback.print_exc()
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            _fail(f"internal error: {type(exc).__name__}: {exc} (at {Path(frame.filename).name}:{frame.lineno}); "
                  "please report it with the command line; POET_OPT_DEBUG=1 shows the traceback", EXIT_INTERNAL)
    return wrapper


class _Group(click.Group):
    """The entry point: click's usage errors become one line like every other error (click prints
    three: Usage, Try, Error), and SIGTERM raises _Terminated while a command runs."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            self._main(args, prog_name, complete_var, **extra)
        except SystemExit as exc:
            from poet_opt.solver.backends import leave_now_if_abandoned

            code = exc.code
            leave_now_if_abandoned(code if isinstance(code, int) and not isinstance(code, bool) else (0 if code is None else 1))
            raise

    def _main(self, args, prog_name, complete_var, **extra):
        handled = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if handled else None
        early = handled and signal.getsignal(signal.SIGINT) is leave_at_once
        if early:  # Ctrl-C is a KeyboardInterrupt while the command runs: its cleanup runs
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _TERMINATED.clear()
        put_back_hook = redeliver_lost_signals() if handled else None
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `poet-opt`: the help, as click prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            command = " ".join(["poet-opt", *(exc.ctx.command_path.split()[1:] if exc.ctx else [])])
            _fail(f"error: {exc.format_message()} (see {command} --help)", exc.exit_code)
        except click.ClickException as exc:
            _fail(f"error: {exc.format_message()}", exc.exit_code)
        except click.exceptions.Abort as exc:  # a Ctrl-C or SIGTERM outside a command (click wraps it)
            terminated = isinstance(exc.__cause__, _Terminated)
            _fail(f"{'terminated' if terminated else 'interrupted'}; nothing was written",
                  EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)
        finally:
            if put_back_hook is not None:
                put_back_hook()
            if handled:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            if early:
                signal.signal(signal.SIGINT, leave_at_once)
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="poet-opt")
def main():
    """Energy-optimal rematerialization + paging schedules for training on edge devices."""


def load_graph(model: str | None, graph_file: str | None, *, batch_size: int, bytes_per_element: int,
               input_shape: str | None = None, torch: str | None = None, onnx: str | None = None,
               trainable="all", costs: str | None = None, optimizer: str = "none", weights: str = "resident",
               profile=None, ram=None, weight_tile=None, strips="auto"):
    """--model NAME, --graph FILE, --torch FILE.py:FACTORY or --onnx FILE, exactly one
    (poet_opt.model.load.load_training_graph); ``profile`` decides --weights auto; streamed layers
    with more weights than ``weight_tile`` (default: a quarter of the smallest ``ram``) are sliced."""
    from poet_opt.model.load import default_tile_bytes, load_training_graph
    from poet_opt.units import parse_size

    # weights that do not fit the storage are refused before the activations are tiled (seconds)
    device = {} if profile is None else {"device_ram_bytes": profile.memory.ram_bytes,
                                         "stack_reserve_bytes": profile.memory.stack_reserve_bytes,
                                         "before_tiling": lambda graph: check_weights_stored(graph, profile)}
    budgets = None if ram is None else [parse_size(r, field="--ram") for r in ram]
    if weight_tile is not None:
        tile = parse_size(weight_tile, field="--weight-tile")
        if tile < 1:
            raise PoetError("must be at least 1 B", field="--weight-tile")
    else:
        tile = default_tile_bytes(budgets)
    largest = None if budgets is None else max(budgets)
    return load_training_graph(model, graph_file, torch, onnx, batch_size=batch_size,
                               bytes_per_element=bytes_per_element, input_shape=input_shape, trainable=trainable,
                               costs=costs, optimizer=optimizer, weights=weights, tile_bytes=tile, ram_bytes=largest,
                               strips=strips, **device)


def WEIGHTS_OPTION(command):
    command = click.option(
        "--strips", default="auto", show_default=True, help="streamed zoo and --torch models: split activations along "
        "H into strips, or a transformer's tokens into row blocks (docs/streaming.md); auto: only when a node would "
        "not fit the device otherwise; off; or N (strips, or row blocks), which streams the weights under --weights "
        "auto")(command)
    command = click.option(
        "--weight-tile", default=None, help="streamed weights: split a layer whose weights exceed this (e.g. 48KiB) "
        "into slices of its output features; default a quarter of the RAM budget")(command)
    return click.option(
        "--weights", type=click.Choice(["auto", "resident", "streamed"]), default="auto", show_default=True,
        help="resident: weights and gradients in RAM all step; streamed: read from storage when needed and updated "
             "in place (docs/streaming.md); auto: streamed when resident ones do not fit the device")(command)


@main.command()
@click.option("--model", help="zoo model name (see `poet-opt models`)")
@click.option("--graph", "graph_file", type=click.Path(dir_okay=False), help="training graph, node-link JSON")
@click.option("--device", required=True, help="built-in device name (see `poet-opt devices`) or a YAML profile")
@click.option("--ram", required=True, help="RAM budget for what the plan holds (activations, gradients and, with "
              "streamed weights, the weights), e.g. 1.5MB, 256KiB")
@click.option("--runtime", default=None, help="runtime budget: a multiple of plain training (1.2x) or a time (2.5s); "
              "default: no limit")
@click.option("--mode", type=click.Choice(["joint", "remat", "paging", "none"]), default="joint", show_default=True)
@click.option("--solver", "backend", type=click.Choice(["highs", "cbc", "gurobi", "cpsat"]), default="highs", show_default=True,
              help="cpsat: OR-Tools CP-SAT on a retention-interval model (docs/cpsat.md), pip extra [cpsat]")
@click.option("--time-limit", default=None, metavar="SECONDS|none",
              help="seconds for the solver (default 60, as run and emulate); the best schedule found so far is kept; "
                   "none: wait for the proof")
@click.option("--order", type=click.Choice(["auto", "given"]), default="auto", show_default=True,
              help="execution order: auto also tries orders that hold less in RAM at once; given keeps the graph's")
@click.option("--gap", type=float, default=1e-3, show_default=True,
              help="stop once proven within this relative gap of the optimum")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--torch", "torch_spec", default=None, help="a PyTorch module: FILE.py:FACTORY or "
              "package.module:FACTORY (needs the torch extra; docs/importers.md)")
@click.option("--onnx", "onnx_file", type=click.Path(dir_okay=False), default=None,
              help="an ONNX model file (needs the onnx extra)")
@click.option("--input-shape", default=None, help="zoo models: input shape without the batch, e.g. 3x64x64 "
              "(C x H x W) or 256 (sequence length); --torch/--onnx: the whole input, batch first, e.g. 1,3,32,32")
@click.option("--trainable", default="all", show_default=True,
              help="layers to fine-tune: all, last:N (the last N layers with weights) or NAME,NAME,...")
@click.option("--optimizer", type=click.Choice(["none", "sgd", "adam"]), default="none", show_default=True,
              help="add the weight update (and Adam's state) to the graph")
@click.option("--costs", "costs_file", type=click.Path(dir_okay=False), default=None,
              help="measured per-layer time/energy, CSV or YAML, by node name or operator type")
@click.option("-o", "--out", type=click.Path(dir_okay=False), default=None, help="write the schedule JSON here")
@click.option("--allow-oversize", is_flag=True,
              help="keep a plan whose weights, gradients, working peak and stack reserve exceed the device's RAM")
@click.option("--min-lifetime-steps", type=click.IntRange(min=1), default=None,
              help="training steps the storage must survive: the least-energy plan that lasts them; the summary "
                   "says what that costs beside the plan without it (docs/wear.md)")
@WEIGHTS_OPTION
@click.option("--export", "export_file", type=click.Path(dir_okay=False), default=None,
              help="also write the schedule as a C header for firmware (see `poet-opt export`)")
@click.option("--prefix", default="POET_", show_default=True, help="--export: prefix of the header's C names")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
@click.option("--quiet", "-q", is_flag=True, help="no solver progress on stderr")
@_one_line_errors
def solve(model, graph_file, device, ram, runtime, mode, backend, time_limit, order, gap, batch_size, torch_spec, onnx_file,
          input_shape, trainable, optimizer, costs_file, out, allow_oversize, min_lifetime_steps, weights, weight_tile,
          strips, export_file, prefix, as_json, quiet):
    """Solve for the energy-optimal training schedule under RAM and runtime budgets."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.files import write_json_atomic, write_text_atomic
    from poet_opt.schedule.report import summary_dict, summary_text
    from poet_opt.solver.backends import print_progress
    from poet_opt.solver.driver import solve as solve_schedule

    profile = load_profile(device)
    check_ram_within_device(ram, profile)
    graph, name = load_graph(model, graph_file, batch_size=batch_size, input_shape=input_shape,
                             bytes_per_element=profile.memory.bytes_per_element, torch=torch_spec, onnx=onnx_file,
                             trainable=trainable, costs=costs_file, optimizer=optimizer, weights=weights, profile=profile,
                             ram=[ram], weight_tile=weight_tile, strips=strips)
    if not allow_oversize:
        check_weights_fit(graph, profile)
    _check_not_inputs([("--out", out), ("--export", export_file)], graph_file=graph_file, device=device,
                      torch_spec=torch_spec, onnx_file=onnx_file, costs_file=costs_file)
    if out is not None:
        _check_writable(out)
    if export_file is not None:
        _check_writable(export_file, field="--export")
        _check_prefix(prefix)
    solve_kwargs = dict(runtime=runtime, mode=mode, backend=backend, time_limit=parse_time_limit(time_limit), gap=gap,
                        order=order, model_name=name, progress=None if quiet else print_progress,
                        min_lifetime_steps=min_lifetime_steps)
    firmware = None
    if export_file is None:
        schedule = solve_schedule(graph, profile, ram=ram, **solve_kwargs)
    else:  # re-solves with a tighter budget if the static arena would not fit
        from poet_opt.firmware.fit import solve_for_export

        firmware = solve_for_export(graph, profile, ram=ram, **solve_kwargs)
        schedule = firmware.schedule
    # Everything that could fail comes before the write, so a failure leaves no file behind.
    if not allow_oversize and schedule.solver["status"] != "interrupted":
        check_fits_device(schedule, firmware)
    if as_json:
        summary = summary_dict(schedule)
        if out is not None:
            summary["out"] = str(out)
        text = json.dumps(summary, indent=1)
    else:
        text = summary_text(schedule) + ("" if out is None else f"\n  wrote    {out}")
    header = None
    if firmware is not None:
        from poet_opt.firmware.header import export_summary, render_header

        plan, flash = firmware.arena, firmware.flash
        header = render_header(schedule.to_dict(), plan, flash, prefix=prefix)
        if as_json:
            summary.update(_export_dict(plan, flash, export_file), arena_rounds=firmware.rounds)
            text = json.dumps(summary, indent=1)
        else:
            text += f"\n{export_summary(plan, flash)}{_rounds_text(firmware.rounds)}\n  wrote    {export_file}"
    if out is not None:
        write_json_atomic(schedule.to_dict(), out)
    if header is not None:
        write_text_atomic(header, export_file, field="--export")
    click.echo(text)
    if schedule.solver["status"] == "interrupted":  # the best plan found is out; the run still ended early
        command_ending()
        sys.exit(EXIT_INTERRUPTED)


def _check_prefix(prefix: str) -> None:
    """Before a long solve, not after it."""
    from poet_opt.firmware.header import check_prefix

    check_prefix(prefix)


def _rounds_text(rounds: list[dict]) -> str:
    from poet_opt.units import format_bytes

    return "".join(f"\n  re-solve the arena of the plan solved at {format_bytes(a['ram_bytes'])} needed "
                   f"{format_bytes(a['arena_bytes'])}; solved again at {format_bytes(b['ram_bytes'])}"
                   for a, b in zip(rounds, rounds[1:]))


def _export_dict(plan, flash, path) -> dict:
    return {"export": str(path), "arena_bytes": plan.arena_bytes, "live_peak_bytes": plan.live_peak_bytes,
            "arena_ratio": plan.ratio, "flash_bytes": flash.flash_bytes,
            "flash_bytes_written_per_step": flash.bytes_written_per_step,
            "flash_lifetime_steps": flash.lifetime_steps}


@main.command()
@click.argument("schedule_file", type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="the C header to write")
@click.option("--prefix", default="POET_", show_default=True, help="prefix of every C name in the header")
@click.option("--json", "as_json", is_flag=True, help="print the arena and flash figures as JSON")
@click.option("--allow-oversize", is_flag=True, help="export a plan that does not fit the device's RAM")
@_one_line_errors
def export(schedule_file, out, prefix, as_json, allow_oversize):
    """Export a schedule as a C99 header: static arena offsets, flash layout and the step table."""
    from poet_opt.files import write_text_atomic
    from poet_opt.firmware.header import export as export_header
    from poet_opt.firmware.header import export_summary
    from poet_opt.schedule.validator import ScheduleInvalid, load_and_validate

    _check_prefix(prefix)
    _check_not_inputs([("-o", out)], schedule_file=schedule_file)
    _check_writable(out)
    try:
        doc, _ = load_and_validate(schedule_file)
    except ScheduleInvalid as exc:  # nothing to export either way: bad input, exit 2
        raise PoetError(f"not a valid schedule, nothing exported: {exc.message}", source=schedule_file) from None
    header, plan, flash = export_header(doc, prefix=prefix, source=schedule_file)
    fit = device_fit(doc, plan.arena_bytes)  # firmware allocates the whole arena
    if fit is not None and not fit["fits"] and not allow_oversize:
        raise PoetError(f"the plan needs {fit['needed_bytes']:,} B with its arena, more than the device's "
                        f"{fit['device_ram_bytes']:,} B of RAM; nothing exported (--allow-oversize exports it anyway)",
                        source=schedule_file)
    write_text_atomic(header, out)
    if as_json:
        click.echo(json.dumps({"schedule": str(schedule_file), "steps": len(doc["steps"]),
                               "tensors": len(doc["graph"]["nodes"]), **_export_dict(plan, flash, out)}, indent=1))
        return
    click.echo(f"{schedule_file}: {len(doc['steps'])} steps, {len(doc['graph']['nodes'])} tensors\n"
               f"{export_summary(plan, flash)}\n  wrote    {out}")


def _check_not_inputs(outputs, *, device=(), torch_spec=None, **inputs) -> None:
    """An output that is an input would overwrite it (poet_opt.files.check_not_inputs). A device
    or --torch module counts when it names a file: `--device rpi4` is a built-in name."""
    from poet_opt.files import check_not_inputs

    named = {"graph_file": "--graph", "onnx_file": "--onnx", "costs_file": "--costs", "schedule_file": "SCHEDULE_FILE",
             "data": "--data", "eval_data": "--eval"}
    given = [(named[k], v) for k, v in inputs.items() if v is not None]
    given += [("--device", d) for d in ([device] if isinstance(device, str) else device) if Path(d).is_file()]
    if torch_spec and Path(torch_spec.rsplit(":", 1)[0]).is_file():
        given.append(("--torch", torch_spec.rsplit(":", 1)[0]))
    check_not_inputs(outputs, given)


def _check_writable(out: str, field: str = "--out") -> None:
    """Fail before a long solve, not after it, when --out cannot be written."""
    path = Path(out)
    if path.is_dir():
        raise PoetError("is a directory; give a file name", source=out, field=field)
    if path.exists() and not path.is_file():
        raise PoetError("exists and is not a regular file", source=out, field=field)
    parent = path.parent
    existing = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise PoetError(f"{existing} is a file, not a directory", source=out, field=field)
    # Permission bits do not tell for root or read-only mounts: try it, as the writer will.
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=existing)
    except OSError as exc:
        raise PoetError(f"cannot write in {existing}: {exc.strerror}", source=out, field=field) from None
    os.close(fd)
    os.unlink(probe)


@main.command()
@click.argument("schedule_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the replayed totals and the device fit as JSON")
@_one_line_errors
def validate(schedule_file, as_json):
    """Replay a schedule and check it: exit 0 if valid, 1 naming the first violation."""
    from poet_opt.schedule.validator import load_and_validate
    from poet_opt.units import format_bytes, format_joules, format_seconds

    doc, totals = load_and_validate(schedule_file)
    ram_budget = doc["budgets"]["ram_bytes"]
    fit = device_fit(doc, totals["peak_ram_bytes"])
    if as_json:
        click.echo(json.dumps({"schedule": str(schedule_file), "valid": True, "steps": len(doc["steps"]),
                               **{k: totals[k] for k in ("energy_j", "runtime_s", "peak_ram_bytes", "storage_bytes")},
                               "ram_budget_bytes": ram_budget, "device_fit": fit}, indent=1))
        return
    click.echo(f"{schedule_file}: valid: {len(doc['steps'])} steps, energy {format_joules(totals['energy_j'])}, "
               f"runtime {format_seconds(totals['runtime_s'])}, peak RAM {format_bytes(totals['peak_ram_bytes'])} "
               + ("(no RAM budget)" if ram_budget is None else f"of {format_bytes(ram_budget)}"))
    if fit is not None:
        verdict = (f"fits, {format_bytes(fit['device_ram_bytes'] - fit['needed_bytes'])} to spare" if fit["fits"]
                   else f"DOES NOT FIT, {format_bytes(fit['needed_bytes'] - fit['device_ram_bytes'])} over")
        click.echo(f"  device   {doc['device'].get('name', '?')}: weights, gradients, working peak and stack reserve "
                   f"need {format_bytes(fit['needed_bytes'])} of {format_bytes(fit['device_ram_bytes'])}: {verdict}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print the profiles' key figures as JSON")
@_one_line_errors
def devices(as_json):
    """List the built-in device profiles with their key figures."""
    from poet_opt.device.profiles import list_profiles
    from poet_opt.units import format_bytes

    if as_json:
        click.echo(json.dumps([p.summary_row() for p in list_profiles()], indent=1))
        return
    rows = [("name", "cpu", "RAM", "GFLOP/s", "pJ/FLOP", "storage", "read MB/s", "write MB/s")]
    for p in list_profiles():
        r = p.summary_row()
        rows.append((r["name"], r["cpu"], format_bytes(r["ram_bytes"], binary=True), f"{r['gflops']:.3g}",
                     f"{r['pj_per_flop']:.3g}", r["storage"], f"{r['read_mb_s']:.3g}", f"{r['write_mb_s']:.3g}"))
    click.echo(_table(rows))
    click.echo("\nA YAML file of your own works wherever a name does: --device path/to/board.yaml")


@main.command()
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the models' figures as JSON")
@_one_line_errors
def models(batch_size, as_json):
    """List the model zoo with node counts and plain-training memory."""
    from poet_opt.model.zoo import MODELS, build_model
    from poet_opt.units import format_bytes

    if as_json:
        graphs = {name: build_model(name, batch_size=batch_size) for name in MODELS}
        click.echo(json.dumps([{"name": name, "nodes": len(g), "param_bytes": g.param_bytes,
                                "plain_peak_bytes": g.plain_peak_bytes(), "description": MODELS[name]}
                               for name, g in graphs.items()], indent=1))
        return
    rows = [("name", "nodes", "params", "plain peak", "description")]
    for name, description in MODELS.items():
        g = build_model(name, batch_size=batch_size)
        rows.append((name, str(len(g)), format_bytes(g.param_bytes), format_bytes(g.plain_peak_bytes()), description))
    click.echo(_table(rows))
    click.echo("\nOr bring your own graph: --graph FILE.json (networkx node-link format, docs/graphs.md)")


def _table(rows) -> str:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


@main.command()
@click.option("--model", help="zoo model name (see `poet-opt models`)")
@click.option("--graph", "graph_file", type=click.Path(dir_okay=False), help="training graph, node-link JSON")
@click.option("--device", "devices", multiple=True, required=True,
              help="device name or YAML profile; repeat for several devices")
@click.option("--ram-from", default=None, help="smallest RAM budget of a range, e.g. 256KB")
@click.option("--ram-to", default=None, help="largest RAM budget of a range, e.g. 4MB")
@click.option("--points", type=int, default=None, help="budgets in the range, spaced geometrically (at least 2)")
@click.option("--ram", "ram_list", default=None, help="explicit budgets instead of a range: 256KB,512KB,1MB")
@click.option("--runtime", default=None, help="runtime budget for every point: 1.2x (of plain training) or 2.5s")
@click.option("--modes", default="joint", show_default=True, help="comma-separated: joint, remat, paging, none")
@click.option("--time-limit", default=None, metavar="SECONDS|none",
              help="seconds per point (default 60, as solve); none: wait for each point's proof")
@click.option("--order", type=click.Choice(["auto", "given"]), default="auto", show_default=True,
              help="execution order: auto also tries orders that hold less in RAM at once; given keeps the graph's")
@click.option("--gap", type=float, default=1e-3, show_default=True, help="relative gap at which a point stops")
@click.option("--jobs", type=int, default=None, help="points solved at once (default: one per CPU, or the Dask "
              "cluster's worker threads; 1: no pool)")
@click.option("--scheduler", default=None, help="run the points on a Dask cluster: tcp://HOST:PORT of its scheduler "
              "(needs the dask extra)")
@click.option("--warm/--no-warm", default=True, show_default=True,
              help="start each point from the schedule of the next smaller budget")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--torch", "torch_spec", default=None, help="a PyTorch module: FILE.py:FACTORY or package.module:FACTORY")
@click.option("--onnx", "onnx_file", type=click.Path(dir_okay=False), default=None, help="an ONNX model file")
@click.option("--input-shape", default=None, help="zoo models: input shape without the batch, e.g. 3x64x64; "
              "--torch/--onnx: the whole input, batch first, e.g. 1,3,32,32")
@click.option("--trainable", default="all", show_default=True, help="all, last:N or NAME,NAME,...")
@click.option("--optimizer", type=click.Choice(["none", "sgd", "adam"]), default="none", show_default=True)
@click.option("--costs", "costs_file", type=click.Path(dir_okay=False), default=None,
              help="measured per-layer time/energy, CSV or YAML")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(), help="directory for the CSVs and plots")
@click.option("--allow-oversize", is_flag=True, help="also solve budgets above a device's RAM")
@click.option("--json", "as_json", is_flag=True, help="print the rows and the files written as JSON")
@click.option("--min-lifetime-steps", type=click.IntRange(min=1), default=None,
              help="training steps the storage must survive, for every point (a wear budget)")
@WEIGHTS_OPTION
@click.option("--quiet", "-q", is_flag=True, help="no progress on stderr")
@_one_line_errors
def pareto(model, graph_file, devices, ram_from, ram_to, points, ram_list, runtime, modes, time_limit, order, gap, jobs,
           scheduler, warm, batch_size, torch_spec, onnx_file, input_shape, trainable, optimizer, costs_file, out_dir,
           allow_oversize, as_json, min_lifetime_steps, weights, weight_tile, strips, quiet):
    """Sweep RAM budgets and plot the energy-memory Pareto front (docs/pareto.md)."""
    from poet_opt import pareto as pf
    from poet_opt.device.profiles import load_profile
    from poet_opt.plots.front import plot_front
    from poet_opt.units import format_bytes, format_joules

    if ram_list is not None and any(v is not None for v in (ram_from, ram_to, points)):
        raise PoetError("give either --ram LIST or --ram-from/--ram-to/--points, not both", field="--ram")
    if ram_list is not None:
        rams = pf.parse_ram_list(ram_list)
    elif None in (ram_from, ram_to, points):
        raise PoetError("give --ram-from, --ram-to and --points together (or --ram LIST)", field="--ram-from")
    else:
        rams = pf.ram_range(ram_from, ram_to, points)
    mode_list = [m.strip() for m in modes.split(",")]
    for m in mode_list:
        if m not in ("joint", "remat", "paging", "none"):
            raise PoetError(f"unknown mode {m!r}; choose from joint, remat, paging, none", field="--modes")
    time_limit = parse_time_limit(time_limit)
    if not gap >= 0:
        raise PoetError(f"must be >= 0, got {gap}", field="--gap")
    if jobs is not None and jobs < 1:
        raise PoetError(f"must be at least 1, got {jobs}", field="--jobs")
    profiles = [load_profile(d) for d in devices]
    built_once = (graph_file or torch_spec or onnx_file or costs_file or optimizer != "none" or trainable != "all"
                  or weights != "auto")
    if built_once or weights == "auto":
        # one graph for every device, sized (and --weights auto decided) with the first device
        subject, _name = load_graph(model, graph_file, batch_size=batch_size, input_shape=input_shape,
                                    bytes_per_element=4 if graph_file else profiles[0].memory.bytes_per_element,
                                    torch=torch_spec, onnx=onnx_file, trainable=trainable, costs=costs_file,
                                    optimizer=optimizer, weights=weights, profile=profiles[0], ram=rams,
                                    weight_tile=weight_tile, strips=strips)
        built_once = built_once or subject.streams_weights
    if built_once:
        kwargs = {}
    else:  # resident weights from the zoo: each worker builds the model at its device's element size
        subject, kwargs = model, {"batch_size": batch_size, "input_shape": input_shape}
    out = Path(out_dir)
    _check_not_inputs([("-o", out), *(("-o", out / name) for name in
                                      ("pareto.csv", "pareto_front.csv", "pareto.png", "pareto.svg"))],
                      graph_file=graph_file, device=devices, torch_spec=torch_spec, onnx_file=onnx_file,
                      costs_file=costs_file)
    if out.exists() and not out.is_dir():
        raise PoetError("exists and is not a directory", source=out_dir, field="-o")
    _check_writable(str(out / "pareto.csv"), field="-o")

    # an unreachable scheduler is bad input: say so before any progress bar is drawn
    client = pf.dask_client(scheduler) if scheduler is not None else None
    bar = None
    if quiet:
        report = None
    elif sys.stderr.isatty():
        total = len(rams) * len(profiles) * len(mode_list)
        bar = click.progressbar(length=total, label="solving", show_eta=True, show_pos=True, file=sys.stderr,
                                item_show_func=lambda row: row and f"{row['device']} {row['mode']} "
                                f"{format_bytes(row['ram_bytes'])}: {row['status']}")
        bar.__enter__()

        def report(done, total, row):
            bar.update(1, current_item=row)
    else:
        def report(done, total, row):
            energy = "" if row["energy_j"] is None else f" {format_joules(row['energy_j'])}"
            click.echo(f"[{done}/{total}] {row['device']} {row['mode']} {format_bytes(row['ram_bytes'])}: "
                       f"{row['status']}{energy} ({row['solve_s']:.1f} s)", err=True)
    try:
        rows = pf.sweep(subject, devices, rams, runtime=runtime, modes=mode_list, time_limit=time_limit, gap=gap,
                        order=order,
                        jobs=jobs, progress=report, model_kwargs=kwargs, model_name=None if built_once else model,
                        warm=warm, scheduler=client, allow_oversize=allow_oversize,
                        min_lifetime_steps=min_lifetime_steps)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
        if client is not None:
            client.close()
    written = []
    if rows:
        out.mkdir(parents=True, exist_ok=True)
        pf.write_csv(rows, out / "pareto.csv")
        pf.write_csv(pf.non_dominated(rows), out / "pareto_front.csv")
        written = ["pareto.csv", "pareto_front.csv"] + [p.name for p in plot_front(rows, out / "pareto")]
    if rows.interrupted:  # the sweep takes SIGTERM (_Terminated) as it takes Ctrl-C
        how, code = ("terminated", EXIT_TERMINATED) if _TERMINATED.is_set() else ("interrupted", EXIT_INTERRUPTED)
        _fail(f"{how}; {len(rows)} finished points written to {out}" if rows else f"{how}; nothing was written", code)
    if as_json:
        click.echo(json.dumps({"rows": [dict(r) for r in rows], "written": [str(out / w) for w in written]},
                              indent=1, default=str))
        return
    table = [("device", "mode", "RAM budget", "status", "energy", "x plain", "peak RAM", "recomp", "page-in",
              "fits device")]
    for r in rows:
        solved = r["energy_j"] is not None
        table.append((r["device"], r["mode"], format_bytes(r["ram_bytes"]), r["status"],
                      format_joules(r["energy_j"]) if solved else "-",
                      f"{r['energy_j'] / r['plain_energy_j']:.3f}" if solved and r["plain_energy_j"] else "-",
                      format_bytes(r["peak_ram_bytes"]) if solved else "-",
                      str(r["recomputes"]) if solved else "-", str(r["page_ins"]) if solved else "-",
                      {1: "yes", 0: "NO"}.get(r.get("fits_device"), "-")))
    click.echo(_table(table))
    for (device, mode) in dict.fromkeys((r["device"], r["mode"]) for r in rows):
        mins = [r["min_feasible_ram_bytes"] for r in rows
                if (r["device"], r["mode"]) == (device, mode) and r["min_feasible_ram_bytes"]]
        if mins:
            click.echo(f"{device} ({mode}): smallest feasible budget {format_bytes(min(mins))}")
    for why in dict.fromkeys(f"{r['device']} ({r['mode']}): infeasible: {r['error']}" for r in rows
                             if r["status"] in pf.INFEASIBLE and r["error"]):
        click.echo(why)  # e.g. a runtime budget below plain training on this device
    click.echo(f"wrote {', '.join(str(out / w) for w in written)}")


@main.command()
@click.argument("schedule_file", type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
              help="image to write: .png, or .svg (a .png is written beside it)")
@click.option("--json", "as_json", is_flag=True, help="print the files written as JSON")
@_one_line_errors
def plot(schedule_file, out, as_json):
    """Plot one schedule: RAM over the steps, and the stage x node compute/keep matrix."""
    from poet_opt.plots.timeline import plot_timeline
    from poet_opt.schedule.validator import ScheduleInvalid, load_and_validate

    if Path(out).suffix.lower() not in (".png", ".svg"):
        raise PoetError("give a file name ending .png or .svg", source=out, field="-o")
    try:
        doc, _totals = load_and_validate(schedule_file)
    except ScheduleInvalid as exc:
        raise PoetError(f"not a valid schedule, nothing plotted: {exc.message}", source=schedule_file) from None
    beside = [("-o", Path(out).with_suffix(".png"))] if Path(out).suffix.lower() == ".svg" else []  # written too
    _check_not_inputs([("-o", out), *beside], schedule_file=schedule_file)
    _check_writable(out, field="-o")
    written = plot_timeline(doc, out)
    if as_json:
        click.echo(json.dumps({"schedule": str(schedule_file), "written": [str(w) for w in written]}, indent=1))
        return
    click.echo(f"wrote {', '.join(map(str, written))}")


# `emulate` (poet_opt/firmware/commands.py), `run` and `measure` (poet_opt/executor/commands.py): defined
# there, kept out of this module's length; `measure --device` runs the firmware's own, handed over here
from poet_opt.executor.commands import add_commands as _add_executor_commands  # noqa: E402
from poet_opt.firmware.commands import add_commands as _add_firmware_commands  # noqa: E402
from poet_opt.firmware.commands import measure_on_device as _measure_on_device  # noqa: E402

_add_firmware_commands(main, _one_line_errors, _check_writable, _check_not_inputs, WEIGHTS_OPTION)
_add_executor_commands(main, _one_line_errors, _check_writable, _check_not_inputs,
                       measure_on_device=_measure_on_device, weights_option=WEIGHTS_OPTION)

if __name__ == "__main__":
    main()
