"""The click commands `poet-opt run` and `poet-opt measure`, added to the command group by poet_opt/cli.py.

They live here rather than in cli.py (which keeps under the 700 lines a module may have): cli.py
hands over its group and its helpers (one-line errors and exit codes, output checks), so that this
module needs nothing from the command line's module and no import runs in a circle.
"""

from __future__ import annotations

import json
import sys

import click

from poet_opt.errors import PoetError
from poet_opt.model.zoo_twins import TRAINED, check_trains
from poet_opt.solver.time_budget import parse_time_limit


def add_commands(main, one_line_errors, check_writable, check_not_inputs, measure_on_device,
                 weights_option) -> None:
    """Add `run` and `measure` to the click group ``main``. ``measure_on_device``: what `measure
    --device` runs (poet_opt/firmware/commands.py, a stage this one may not import)."""
    _check_writable, _check_not_inputs, _one_line_errors = check_writable, check_not_inputs, one_line_errors

    @main.command()
    @click.option("--torch", "torch_spec", default=None, help="a PyTorch module: FILE.py:FACTORY or package.module:FACTORY")
    @click.option("--model", help=f"instead of --torch: a zoo model's PyTorch twin ({', '.join(TRAINED)})")
    @click.option("--input-shape", default=None, help="the whole input, batch first, e.g. 8,3,32,32 (with --torch; "
                  "with --model, --data's x)")
    @click.option("--schedule", "schedule_file", default=None, type=click.Path(dir_okay=False),
                  help="the plan to follow step for step, as `poet-opt solve --out` wrote it; it must be for this "
                       "module, input shape and --trainable, and for --device, --ram, --runtime and --mode where given")
    # the options `run` shares with `solve` have solve's defaults, so that without --schedule `run`
    # follows the plan `solve` writes for the same arguments (tests/test_cli.py compares them)
    @click.option("--device", help="built-in device name (see `poet-opt devices`) or a YAML profile; "
                  "required without --schedule")
    @click.option("--ram", help="RAM budget for activations and gradients, as for `poet-opt solve`; "
                  "required without --schedule")
    @click.option("--runtime", default=None, help="runtime budget: a multiple of plain training (1.2x) or a time "
                  "(2.5s); default: no limit")
    @click.option("--mode", type=click.Choice(["joint", "remat", "paging", "none"]), default="joint", show_default=True)
    @click.option("--time-limit", default=None, metavar="SECONDS|none",
                  help="seconds for the solver (default 60, as solve and emulate); the best schedule found so far is "
                       "kept; none: wait for the proof")
    @click.option("--trainable", default="all", show_default=True,
                  help="layers to fine-tune: all, last:N (the last N layers with weights) or NAME,NAME,...")
    @click.option("--costs", "costs_file", type=click.Path(dir_okay=False), default=None,
                  help="measured per-layer time/energy (what `poet-opt measure` writes), as for `poet-opt solve`")
    @click.option("--weights", type=click.Choice(["auto", "resident", "streamed"]), default="auto", show_default=True,
                  help="as for `poet-opt solve`: streamed weights live on --storage and pass through RAM as the plan "
                       "says; auto: streamed when resident weights do not fit the device (with --schedule: the plan's)")
    @click.option("--weight-tile", default=None, help="as for `poet-opt solve`: streamed weights, slice a layer whose "
                  "weights exceed this; default: a quarter of --ram")
    @click.option("--strips", default="auto", show_default=True, help="as for `poet-opt solve`: streamed weights, "
                  "split activations along H into strips, or a transformer's tokens into row blocks; auto: only when "
                  "a node would not fit the device otherwise; off; or N, which streams the weights under --weights auto")
    @click.option("--steps", type=int, required=True, help="training steps to run")
    @click.option("--lr", type=float, required=True, help="SGD learning rate")
    @click.option("--data", required=True, type=click.Path(dir_okay=False),
                  help="BATCH.npz: x (float32, the input's shape; integer token ids when the model starts with an "
                       "embedding) and y (int64 class labels)")
    @click.option("--storage", default=None, type=click.Path(file_okay=False),
                  help="directory paged tensors go to (the SD card or SSD); default: a temporary directory, removed "
                       "afterwards")
    @click.option("--weights-out", default=None, type=click.Path(dir_okay=False),
                  help="write the trained parameters and the norms' running statistics here (.npz, PyTorch's "
                       "state_dict names and shapes)")
    @click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
    @click.pass_context
    @_one_line_errors
    def run(ctx, torch_spec, model, input_shape, schedule_file, device, ram, runtime, mode, time_limit, trainable, costs_file,
            weights, weight_tile, strips, steps, lr, data, storage, weights_out, as_json):
        """Train N steps of a torch module in PyTorch with a schedule: --schedule's, or one solved here.

        Exits 4 when training diverges: the result is printed (a loss that is not finite as null in
        --json, which adds "diverged": true) and --weights-out is not written."""
        import numpy as np

        from poet_opt.executor.train import run_training
        from poet_opt.files import check_not_inputs, write_atomic

        if (model is None) == (torch_spec is None):
            raise PoetError("give --torch FILE.py:FACTORY or --model NAME, one of the two", field="--torch")
        if model is not None:
            check_trains(model)
        if weights_out is not None:
            _check_writable(weights_out, field="--weights-out")
        _check_not_inputs([("--weights-out", weights_out)], device=device or (), torch_spec=torch_spec, data=data,
                          costs_file=costs_file)
        check_not_inputs([("--weights-out", weights_out)], [("--schedule", schedule_file)] if schedule_file else [])
        if model is not None:
            from poet_opt.model.batch import load_batch
            from poet_opt.model.zoo_twins import zoo_module

            if input_shape is not None:
                raise PoetError("--model takes its input's shape from --data's x", field="--input-shape")
            batch = load_batch(data, token_ids=True)  # a bad file is refused here as it would be by --torch
            input_shape, torch_spec = ",".join(map(str, batch[0].shape)), zoo_module(model)
        # with a plan, --mode is checked against it only when given: its default is for solving
        given_mode = ctx.get_parameter_source("mode") is not click.core.ParameterSource.DEFAULT
        # progress only to a terminal: a script reading stderr sees one line, the error, if any
        say = None if as_json or not sys.stderr.isatty() else (lambda text: click.echo(f"poet-opt: {text}", err=True))
        result = run_training(torch_model=torch_spec, input_shape=input_shape, device=device, ram=ram, steps=steps,
                              lr=lr, data=data if model is None else batch, storage=storage, schedule=schedule_file, costs=costs_file,
                              runtime=runtime, mode=mode if given_mode or schedule_file is None else None,
                              # with --schedule there is no solve: a limit given is refused, not defaulted
                              time_limit=time_limit if schedule_file else parse_time_limit(time_limit),
                              trainable=trainable, progress=say, weights=weights,
                              weight_tile=weight_tile, strips=strips)
        diverged = result.diverged
        if weights_out is not None and not diverged:  # NaN weights are no one's trained model
            write_atomic(weights_out, lambda fh: np.savez(fh, **result.weights, **result.running), field="--weights-out",
                         binary=True)
        summary = result.summary()
        if as_json:
            click.echo(json.dumps(summary, indent=1, allow_nan=False))
            if diverged:
                raise diverged
            return
        steps_s = summary["step_s"]
        plan = result.schedule
        where = plan["device"]["name"]
        source = f"the plan in {schedule_file}" if schedule_file else f"the {where} schedule solved here"
        click.echo("\n".join([
            f"{result.network.name} with {source} ({plan['solver']['status']}, {summary['recomputes']} "
            f"recompute(s), {summary['page_outs']} page-out(s) per step) on {summary['torch_device']}: "
            f"{summary['steps']} SGD step(s)",
            f"  loss     {', '.join(f'{v:.6g}' for v in result.losses)}",
            f"  peak     {summary['peak_live_bytes'] / 1024:,.1f} KiB of live tensors (plan "
            f"{summary['planned_peak_bytes'] / 1024:,.1f} KiB)",
            f"  storage  {summary['storage_bytes_written'] / 1024:,.1f} KiB written, "
            f"{summary['storage_bytes_read'] / 1024:,.1f} KiB read",
            f"  time     {sum(steps_s) / len(steps_s):.4f} s per step (first {steps_s[0]:.4f} s; the plan predicts "
            f"{summary['planned_step_s']:.4f} s on {where})",
            *([f"  wrote    {weights_out}"] if weights_out and not diverged else []),
        ]))
        if diverged:
            raise diverged


    @main.command()
    @click.option("--torch", "torch_spec", default=None, help="a PyTorch module: FILE.py:FACTORY or package.module:FACTORY")
    @click.option("--model", default=None, help="with --device: a zoo model with a firmware build (as for `poet-opt "
                  "emulate`)")
    @click.option("--input-shape", required=True, help="the whole input, batch first, e.g. 8,3,32,32")
    @click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
                  help="the measured-costs file to write (.csv), for `poet-opt solve --costs`")
    @click.option("--device", default=None, help="a microcontroller profile (a core `poet-opt emulate` runs): measure "
                  "each node's generated kernels on the emulated core, not PyTorch on this machine")
    @click.option("--ram", default=None, help="with --device: the RAM budget of the plan that runs, as for `emulate`")
    @click.option("--trainable", default="all", show_default=True, help="with --device: all, last:N or NAME,NAME,...")
    @click.option("--mode", type=click.Choice(["joint", "remat", "paging", "none"]), default="joint", show_default=True,
                  help="with --device: what the plan that runs may trade memory with, as for `emulate`")
    @click.option("--costs", "costs_file", type=click.Path(dir_okay=False), default=None,
                  help="with --device: solve the plan that runs with these costs, as for `poet-opt solve --costs`")
    @click.option("--time-limit", default=None, metavar="SECONDS|none",
                  help="with --device: seconds for the solver (default 60, as solve); none: wait for the proof")
    @weights_option
    @click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="untimed runs per node")
    @click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="timed runs per node")
    @click.option("--watts", type=float, default=None,
                  help="average power while training, to write energy_j = time x watts (default: time only)")
    @click.option("--json", "as_json", is_flag=True, help="print every node's median and spread as JSON")
    @click.pass_context
    @_one_line_errors
    def measure(ctx, torch_spec, model, input_shape, out, device, ram, trainable, mode, costs_file, time_limit, weights,
                weight_tile, strips, warmup, repeat, watts, as_json):
        """Time every node's forward and backward on this machine, or with --device on the emulated
        microcontroller; write a --costs file."""
        from poet_opt.executor.measure import costs_csv, measure_costs
        from poet_opt.executor.train import prepare
        from poet_opt.files import write_text_atomic

        if not out.lower().endswith(".csv"):
            raise PoetError("give a .csv file name", source=out, field="--out")
        _check_writable(out, field="--out")
        _check_not_inputs([("--out", out)], device=device or (), torch_spec=torch_spec, costs_file=costs_file)
        given = {name for name in ctx.params if name not in ("torch_spec", "input_shape", "out", "device", "as_json")
                 and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
        on_host = {"warmup", "repeat", "watts"}
        if device is not None:
            for name in sorted(given & on_host):  # the emulator's cycles are exact, its power the profile's
                raise PoetError(f"applies to timing on this machine, not to --device {device}", field=f"--{name}")
            if ram is None:
                raise PoetError(f"--device {device} runs a plan: give its RAM budget", field="--ram")
            say = None if as_json or not sys.stderr.isatty() else (lambda text: click.echo(f"poet-opt: {text}", err=True))
            click.echo(measure_on_device(device=device, ram=ram, out=out, model=model, torch_spec=torch_spec,
                                         input_shape=input_shape, trainable=trainable, mode=mode,
                                         time_limit=parse_time_limit(time_limit),
                                         costs_file=costs_file, weights=weights, weight_tile=weight_tile,
                                         strips=strips, as_json=as_json, say=say))
            return
        for name in sorted(given - on_host):
            field = "--costs" if name == "costs_file" else "--" + name.replace("_", "-")
            raise PoetError("applies with --device (the emulated microcontroller) only", field=field)
        if torch_spec is None:
            raise PoetError("give --torch FILE.py:FACTORY (or --device with --model or --torch)", field="--torch")
        costs_csv([], watts)  # a bad --watts fails before the timing, not after it
        network = prepare(torch_spec, input_shape)
        nodes = network.graph.nodes
        if as_json:
            timings = measure_costs(network, warmup=warmup, repeat=repeat)
        else:
            with click.progressbar(length=len(nodes), label="poet-opt: timing nodes", file=sys.stderr,
                                   show_pos=True, item_show_func=lambda name: name,
                                   hidden=not sys.stderr.isatty()) as bar:
                timings = measure_costs(network, warmup=warmup, repeat=repeat,
                                        on_node=lambda name: bar.update(1, name))
        write_text_atomic(costs_csv(timings, watts), out, field="--out")
        if as_json:
            click.echo(json.dumps({"out": out, "watts": watts, "nodes": [
                {"name": t.name, "kind": t.kind, "median_s": t.median_s, "spread_s": t.spread_s, "runs": len(t.times_s)}
                for t in timings]}, indent=1))
            return
        total = sum(t.median_s for t in timings)
        by_kind = {k: sum(t.median_s for t in timings if t.kind == k) for k in ("forward", "loss", "backward")}
        noisy = max(timings, key=lambda t: t.spread_s / t.median_s if t.median_s else 0.0)
        click.echo("\n".join([
            f"{network.name}: {len(timings)} nodes timed ({warmup} warm-up, {repeat} timed runs each)",
            f"  one step  {total:.4f} s (forward {by_kind['forward']:.4f} s, loss {by_kind['loss']:.4f} s, "
            f"backward {by_kind['backward']:.4f} s)" + (f", {total * watts:.4g} J at {watts:g} W" if watts else ""),
            f"  spread    the widest: {noisy.name}, interquartile range {noisy.spread_s * 1e3:.3f} ms around a "
            f"median of {noisy.median_s * 1e3:.3f} ms",
            f"  wrote     {out}",
        ]))
