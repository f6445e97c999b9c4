"""The click command `poet-opt emulate`, and what `poet-opt measure --device` does, added to the
command group by poet_opt/cli.py (which keeps under the 700 lines a module may have).

cli.py hands over its group and its helpers (one-line errors, output checks, the weights options),
so that nothing here imports the command line's module. `measure` itself is defined with `run` in
poet_opt/executor/commands.py; with --device it calls :func:`measure_on_device`, which cli.py hands
it, since the executor stage may not import this one.
"""

from __future__ import annotations

import json

import click

from poet_opt.errors import PoetError
from poet_opt.model.zoo_twins import FIRMWARE_TRAINED, check_trains
from poet_opt.solver.time_budget import parse_time_limit


def add_commands(main, one_line_errors, check_writable, check_not_inputs, weights_option) -> None:
    """Add `emulate` to the click group ``main``."""
    _one_line_errors, _check_writable, _check_not_inputs, WEIGHTS_OPTION = (
        one_line_errors, check_writable, check_not_inputs, weights_option)

    @main.command()
    @click.option("--model", help=f"zoo model name with a firmware build ({', '.join(FIRMWARE_TRAINED)})")
    @click.option("--torch", "torch_spec", default=None, help="a PyTorch module: FILE.py:FACTORY or package.module:FACTORY")
    @click.option("--input-shape", default=None, help="--torch: the whole input, batch first, e.g. 2,3,32,32")
    @click.option("--device", required=True, help="built-in device name (see `poet-opt devices`) or a YAML profile")
    @click.option("--ram", required=True, help="RAM budget, as for `poet-opt solve`")
    @click.option("--steps", type=int, default=None, help="training steps to run on the emulated board (or --epochs)")
    @click.option("--epochs", type=int, default=None, help="passes over the --data set (or --steps)")
    @click.option("--batch-size", type=int, default=None,
                  help="samples per step (default: --input-shape's batch; with --model, all of --data)")
    @click.option("--seed", type=int, default=0, show_default=True, help="the shuffle of a data set's samples")
    @click.option("--eval", "eval_data", default=None, type=click.Path(dir_okay=False),
                  help="DATA.npz (x, y): accuracy before and after training, from the firmware's predict")
    @click.option("--lr", type=float, required=True, help="SGD learning rate")
    @click.option("--data", required=True, type=click.Path(dir_okay=False),
                  help="BATCH.npz or a data set: x (float32, samples first) and y (integer class labels)")
    @click.option("--trainable", default="all", show_default=True, help="all, last:N or NAME,NAME,...")
    @click.option("--weights-out", default=None, type=click.Path(dir_okay=False),
                  help="write every trainable parameter and the norms' running statistics after the steps here "
                       "(.npz, PyTorch's state_dict names and shapes)")
    @click.option("--mode", type=click.Choice(["joint", "remat", "paging", "none"]), default="joint", show_default=True,
                  help="as for `poet-opt solve`: what the plan may trade memory with (none: plain training)")
    @click.option("--costs", "costs_file", type=click.Path(dir_okay=False), default=None,
                  help="per-node time/energy the plan is solved with, as for `poet-opt solve --costs` (`poet-opt measure "
                       "--device` writes them from this firmware)")
    @click.option("--time-limit", default=None, metavar="SECONDS|none",
                  help="seconds for the solver (default 60, as solve and run; emulate then goes on to build and "
                       "train with the best plan found); none: wait for the proof")
    @click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
    @click.option("-o", "--out", "out_dir", default=None, type=click.Path(file_okay=False),
                  help="keep the generated library (PREFIXtrain.c, .h), its example main() and the image here")
    @click.option("--prefix", default="poet_", show_default=True,
                  help="prefix of every name the generated library exports (PREFIXtrain_step, PREFIXtrain.h)")
    @WEIGHTS_OPTION
    @click.option("--quiet", "-q", is_flag=True, help="no progress on stderr")
    @_one_line_errors
    def emulate(model, torch_spec, input_shape, device, ram, steps, epochs, batch_size, seed, eval_data, lr, data,
                trainable, weights_out, mode, costs_file, time_limit, as_json, out_dir, prefix, weights, weight_tile, strips,
                quiet):
        """Solve, export, generate C, cross-compile and train N steps or epochs on an emulated Cortex-M.

        Exits 4 when training diverges: the result printed (NaN as null), no --weights-out written."""
        import sys

        import numpy as np

        from poet_opt.files import write_atomic
        from poet_opt.firmware.trainer import emulate_training, output_files

        if (model is None) == (torch_spec is None):
            raise click.UsageError("give --model NAME or --torch FILE.py:FACTORY (with --input-shape)")
        if model is not None:
            check_trains(model, firmware=True)
        if weights_out is not None:
            _check_writable(weights_out, field="--weights-out")
        kept = [("-o", path) for path in output_files(out_dir, prefix)] if out_dir is not None else []
        _check_not_inputs([*kept, ("--weights-out", weights_out)], device=device, torch_spec=torch_spec, data=data,
                          costs_file=costs_file, eval_data=eval_data)
        say = None if quiet else (lambda text: click.echo(f"poet-opt: {text}", err=True))
        result = emulate_training(model=model, torch_model=torch_spec, input_shape=input_shape, device=device, ram=ram,
                                  steps=steps, lr=lr, data=data, trainable=trainable, out_dir=out_dir,
                                  time_limit=parse_time_limit(time_limit), mode=mode, progress=say, weights=weights,
                                  tile_bytes=weight_tile, strips=strips, costs=costs_file, prefix=prefix,
                                  epochs=epochs, batch_size=batch_size, seed=seed, eval_data=eval_data,
                                  bar=sys.stderr.isatty() and not as_json and not quiet)
        if weights_out is not None and not result.diverged:  # NaN weights are no one's trained model
            write_atomic(weights_out, lambda fh: np.savez(fh, **result.weights, **result.running), field="--weights-out", binary=True)
        click.echo(json.dumps(result.summary(), indent=1, allow_nan=False) if as_json
                   else result.text(device, None if result.diverged else weights_out, out_dir))
        if result.diverged:
            raise result.diverged


def measure_on_device(*, device, ram, out, model=None, torch_spec=None, input_shape, trainable="all",
                      time_limit=60.0, mode="joint", costs_file=None, weights="auto", weight_tile=None,
                      strips="auto", as_json=False, say=None) -> str:
    """`poet-opt measure --device MCU`: one training step of the plan `emulate` would run, on the
    emulated core, every node's cycles written to ``out`` as seconds and joules
    (firmware/step_costs.py). Returns what the command prints."""
    from poet_opt.files import write_text_atomic
    from poet_opt.firmware.step_costs import measure_firmware
    from poet_opt.model.zoo_twins import zoo_module
    from poet_opt.model.operators import parse_full_shape

    if (model is None) == (torch_spec is None):
        raise PoetError("give --model NAME or --torch FILE.py:FACTORY, with --input-shape", field="--model")
    module = zoo_module(model) if model is not None else torch_spec
    shape = parse_full_shape(input_shape)
    found = measure_firmware(module, shape, device, ram=ram, name=model, trainable=trainable, time_limit=time_limit,
                             mode=mode, weights=weights, tile_bytes=weight_tile, strips=strips, costs=costs_file,
                             progress=say)
    write_text_atomic(found.csv(), out, field="--out")
    summary = found.summary()
    if as_json:
        return json.dumps({"out": out, **summary}, indent=1, allow_nan=False)
    est, pred = summary["estimated_runtime_s_per_step"], summary["predicted_runtime_s_per_step"]
    node_s = found.seconds(summary["node_cycles"])
    plan = found.schedule
    return "\n".join([
        f"{found.network.name} on the emulated {found.device}: one training step of the {plan.solver['status']} plan "
        f"({summary['recomputes']} recompute(s), {summary['page_outs']} page-out(s)), {len(found.nodes)} nodes "
        f"measured",
        f"  cycles   {summary['step_cycles']:,} estimated ({summary['instructions']:,} instructions): "
        f"{(est - summary['storage_bus_s_per_step']) * 1e3:,.2f} ms at {found.clock_hz / 1e6:g} MHz, and "
        f"{summary['storage_bus_s_per_step'] * 1e3:,.2f} ms of storage transfers at the profile's rates",
        f"  nodes    {summary['node_cycles']:,} cycles, {node_s * 1e3:,.2f} ms; paging {summary['paging_cycles']:,} "
        f"cycles and {summary['outside_cycles']:,} outside the plan's steps (start-up, SGD) are not written",
        f"  profile  the plan predicted {pred * 1e3:,.2f} ms from the profile's costs: estimate/prediction "
        f"{est / pred:.2f}" if pred else "  profile  the plan predicted no runtime",
        f"  wrote    {out}",
    ])
