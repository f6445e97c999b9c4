"""The `poet-opt` command: a thin layer over plain functions that a notebook can call directly.

Bad input of any kind ends as one line on stderr and exit code 2 (validation failures: 1);
nothing is written unless the schedule validated. Exit codes: 0 success, 1 a schedule that breaks
a rule (`validate`), 2 bad input or no schedule within the budgets, 3 an internal error (a bug:
one line too; set POET_OPT_DEBUG=1 for the traceback), 130 interrupted.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import click

from . import __version__
from .errors import PoetError

EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int) -> None:
    click.echo(f"poet-opt: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PoetError as exc:
            _fail(f"error: {exc.one_line()}", exc.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written", EXIT_INTERRUPTED)
        except OSError as exc:  # the machine, not the input: a full disk, a vanished directory
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"error: {where}{exc.strerror or exc}", 2)
        except Exception as exc:
            if os.environ.get("POET_OPT_DEBUG"):
                traceback.print_exc()
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            _fail(f"internal error: {type(exc).__name__}: {exc} (at {Path(frame.filename).name}:{frame.lineno}); "
                  "please report it with the command line; POET_OPT_DEBUG=1 shows the traceback", EXIT_INTERNAL)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="poet-opt")
def main():
    """Energy-optimal rematerialization + paging schedules for training on edge devices."""


def load_graph(model: str | None, graph_file: str | None, *, batch_size: int, bytes_per_element: int,
               input_shape: str | None = None):
    """--model NAME or --graph FILE, exactly one."""
    if bool(model) == bool(graph_file):
        raise PoetError("give exactly one of --model NAME or --graph FILE", field="--model/--graph")
    if graph_file:
        from .importers import load_node_link

        return load_node_link(graph_file), Path(graph_file).stem
    from .zoo import build_model

    graph = build_model(model, batch_size=batch_size, input_shape=input_shape, bytes_per_element=bytes_per_element)
    return graph, model


@main.command()
@click.option("--model", help="zoo model name (see `poet-opt models`)")
@click.option("--graph", "graph_file", type=click.Path(dir_okay=False), help="training graph, node-link JSON")
@click.option("--device", required=True, help="built-in device name (see `poet-opt devices`) or a YAML profile")
@click.option("--ram", required=True, help="RAM budget for activations and gradients, e.g. 1.5MB, 256KiB")
@click.option("--runtime", default=None, help="runtime budget: a multiple of plain training (1.2x) or a time (2.5s); "
              "default: no limit")
@click.option("--mode", type=click.Choice(["joint", "remat", "paging", "none"]), default="joint", show_default=True)
@click.option("--solver", "backend", type=click.Choice(["highs", "cbc", "gurobi"]), default="highs", show_default=True)
@click.option("--time-limit", type=float, default=None, help="seconds; the best schedule found so far is kept")
@click.option("--gap", type=float, default=1e-3, show_default=True,
              help="stop once proven within this relative gap of the optimum")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--input-shape", default=None, help="zoo models: input shape without the batch, e.g. 3x64x64 "
              "(C x H x W) or 256 (sequence length)")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="write the schedule JSON here")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
@click.option("--quiet", "-q", is_flag=True, help="no solver progress on stderr")
@_one_line_errors
def solve(model, graph_file, device, ram, runtime, mode, backend, time_limit, gap, batch_size, input_shape, out,
          as_json, quiet):
    """Solve for the energy-optimal training schedule under RAM and runtime budgets."""
    from .profiles import load_profile
    from .report import summary_dict, summary_text
    from .schedule import write_json_atomic
    from .solve import solve as solve_schedule
    from .solvers import print_progress

    profile = load_profile(device)
    graph, name = load_graph(model, graph_file, batch_size=batch_size, input_shape=input_shape,
                             bytes_per_element=profile.memory.bytes_per_element)
    if out is not None:
        _check_writable(out)
    schedule = solve_schedule(graph, profile, ram=ram, runtime=runtime, mode=mode, backend=backend,
                              time_limit=time_limit, gap=gap, model_name=name,
                              progress=None if quiet else print_progress)
    # Everything that could fail comes before the write, so a failure leaves no file behind.
    if as_json:
        summary = summary_dict(schedule)
        if out is not None:
            summary["out"] = str(out)
        text = json.dumps(summary, indent=1)
    else:
        text = summary_text(schedule) + ("" if out is None else f"\n  wrote    {out}")
    if out is not None:
        write_json_atomic(schedule.to_dict(), out)
    click.echo(text)


def _check_writable(out: str) -> None:
    """Fail before a long solve, not after it, when --out cannot be written."""
    path = Path(out)
    if path.is_dir():
        raise PoetError("is a directory; give a file name", source=out, field="--out")
    if path.exists() and not path.is_file():
        raise PoetError("exists and is not a regular file", source=out, field="--out")
    parent = path.parent
    existing = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise PoetError(f"{existing} is a file, not a directory", source=out, field="--out")
    # Permission bits do not tell for root or read-only mounts: try it, as the writer will.
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=existing)
    except OSError as exc:
        raise PoetError(f"cannot write in {existing}: {exc.strerror}", source=out, field="--out") from None
    os.close(fd)
    os.unlink(probe)


@main.command()
@click.argument("schedule_file", type=click.Path(dir_okay=False))
@_one_line_errors
def validate(schedule_file):
    """Replay a schedule and check it: exit 0 if valid, 1 naming the first violation."""
    from .units import format_bytes, format_joules, format_seconds
    from .validator import load_and_validate

    doc, totals = load_and_validate(schedule_file)
    ram_budget = doc["budgets"]["ram_bytes"]
    click.echo(f"{schedule_file}: valid: {len(doc['steps'])} steps, energy {format_joules(totals['energy_j'])}, "
               f"runtime {format_seconds(totals['runtime_s'])}, peak RAM {format_bytes(totals['peak_ram_bytes'])} "
               + ("(no RAM budget)" if ram_budget is None else f"of {format_bytes(ram_budget)}"))


@main.command()
@_one_line_errors
def devices():
    """List the built-in device profiles with their key figures."""
    from .profiles import list_profiles
    from .units import format_bytes

    rows = [("name", "cpu", "RAM", "GFLOP/s", "pJ/FLOP", "storage", "read MB/s", "write MB/s")]
    for p in list_profiles():
        r = p.summary_row()
        rows.append((r["name"], r["cpu"], format_bytes(r["ram_bytes"], binary=True), f"{r['gflops']:.3g}",
                     f"{r['pj_per_flop']:.3g}", r["storage"], f"{r['read_mb_s']:.3g}", f"{r['write_mb_s']:.3g}"))
    click.echo(_table(rows))
    click.echo("\nA YAML file of your own works wherever a name does: --device path/to/board.yaml")


@main.command()
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@_one_line_errors
def models(batch_size):
    """List the model zoo with node counts and plain-training memory."""
    from .units import format_bytes
    from .zoo import MODELS, build_model

    rows = [("name", "nodes", "params", "plain peak", "description")]
    for name, description in MODELS.items():
        g = build_model(name, batch_size=batch_size)
        rows.append((name, str(len(g)), format_bytes(g.param_bytes), format_bytes(g.plain_peak_bytes()), description))
    click.echo(_table(rows))
    click.echo("\nOr bring your own graph: --graph FILE.json (networkx node-link format, docs/graphs.md)")


def _table(rows) -> str:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    main()
