"""`poet-opt emulate`: solve, export, generate, cross-compile and train N steps on the emulated board.

Everything the command does is :func:`emulate_training`, a plain function a notebook can call.
"""

from __future__ import annotations

import bisect
import math
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np

from poet_opt.device.costs import storage_bus_seconds
from poet_opt.device.profiles import load_profile
from poet_opt.errors import PoetError
from poet_opt.files import check_not_inputs, write_files
from poet_opt.firmware import codegen
from poet_opt.firmware.fit import solve_for_export
from poet_opt.firmware.lowering import STACK_BYTES, Lowering
from poet_opt.firmware.targets import target_from_profile
from poet_opt.model.batch import check_labels, divergence, finite_or_none
from poet_opt.model.load import strips_value
from poet_opt.model.network import Network
from poet_opt.model.operators import parse_full_shape
from poet_opt.solver.backends import ctrl_c_ends_everything
from poet_opt.units import parse_size

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
BOARD_DIR = Path(__file__).resolve().parent / "board"
LOSS_BYTES = 4  # harness_losses: one float per step, kept in RAM for the host to read back
FLOAT32_MAX = float(np.finfo(np.float32).max)
EXAMPLE_STEPS_ON_A_DATA_SET = 16  # the board project's main.c, after emulate on a data set
# re-solves with a tighter arena when the firmware's statics beside it would not fit the device
MAX_DEVICE_FITS = 4
LIBRARY_STATE_BYTES = 16  # firmware/library.py: ready flag, input and label pointers, learning rate


@dataclass
class EmulatedTraining:
    network: Network
    schedule: object  # the validated Schedule the firmware executes
    losses: list[float]
    weights: dict[str, np.ndarray]  # torch name -> trained value, PyTorch's shape
    ram_device_bytes: int
    ram_used_bytes: int
    static_bytes: int
    stack_bytes: int
    flash_bytes_written: int
    flash_erases_max_block: int
    flash_violations: list[str]
    instructions: int
    arena_bytes: int
    files: list[Path] = field(default_factory=list)
    weights_placement: str = "resident"  # or "streamed": weights on storage, read into the arena
    # activation strips: the window rows gathered from several strips, static RAM beside the arena
    scratch_bytes: int = 0
    flash_bytes_read: int = 0
    # what the flash plan says one step writes and how many steps the storage survives that
    # (None: nothing is written); the emulator's own count is flash_bytes_written over the run
    flash_bytes_written_per_step: int = 0
    flash_lifetime_steps: Optional[int] = None
    # storage node name (param:f for weights, else a paged tensor) -> bytes the run wrote to its region
    region_bytes_written: dict[str, int] = field(default_factory=dict)
    # erase events over the run: erases on raw flash, on a card each allocation unit a write touched
    flash_wear_events: int = 0
    cycles: int = 0  # the emulator's cycle estimate for the run (poet_opt/firmware/cycles.py)
    # the run's storage commands at the profile's latencies and rates: the emulated card answers at
    # once, a real one holds the step for this long (device/costs.py storage_bus_seconds)
    storage_bus_s: float = 0.0
    clock_hz: Optional[float] = None  # the profile's core clock, when it gives one
    # a profiling build (run_schedule(marks=True)): (schedule step, or len(steps) at the end of a
    # training step; estimated cycles when it began), every training step's in turn
    marks: list[tuple[int, int]] = field(default_factory=list)
    # a data set's run (firmware/dataset.py): batch size, epochs, each epoch's mean loss, accuracy
    dataset: Optional[dict] = None
    running: dict[str, np.ndarray] = field(default_factory=dict)  # the norms' running statistics, by torch name

    @property
    def instructions_per_step(self) -> float:
        return self.instructions / max(1, len(self.losses))

    @property
    def diverged(self):
        """TrainingDiverged saying why, when a loss or a trained weight is not finite; else None."""
        return divergence(self.losses, self.weights)

    def summary(self) -> dict:
        """The figures as JSON: a loss that is not finite is null, and ``diverged`` true is added."""
        out = {"steps": len(self.losses), "loss": [finite_or_none(v) for v in self.losses],
               "ram_device_bytes": self.ram_device_bytes, "ram_used_bytes": self.ram_used_bytes,
               "flash_bytes_written": self.flash_bytes_written,
               "flash_erases_max_block": self.flash_erases_max_block, "instructions": self.instructions}
        # beside the plan's prediction: the estimated cycles, and with the profile's clock, seconds
        steps, totals = max(1, len(self.losses)), self.schedule.totals
        # the cycle estimate covers start-up too (shared by the steps); the storage's bus time is the
        # commands the firmware issued, priced by the profile as the plan prices its transfers
        estimated = (self.cycles / self.clock_hz + self.storage_bus_s) / steps if self.clock_hz else None
        predicted = float(totals["runtime_s"])
        out.update(cycles=self.cycles, predicted_runtime_s_per_step=predicted,
                   predicted_energy_j_per_step=float(totals["energy_j"]), estimated_runtime_s_per_step=estimated,
                   storage_bus_s_per_step=self.storage_bus_s / steps,
                   estimated_over_predicted=estimated / predicted if estimated is not None and predicted else None,
                   costs=self.network.graph.meta.get("measured_costs"))
        if self.weights_placement == "streamed":  # (resident runs keep the summary they always had)
            out.update(weights="streamed", flash_bytes_read=self.flash_bytes_read,
                       flash_bytes_written_per_step=self.flash_bytes_written_per_step,
                       flash_lifetime_steps=self.flash_lifetime_steps)
            tiles = self.network.graph.meta.get("tiles") or {}
            if tiles:
                out["tiles"] = {layer: len(names) for layer, names in tiles.items()}
            strips, rows = self.network.graph.meta.get("strips"), self.network.graph.meta.get("rows")
            if strips is not None:
                out.update(strips=dict(strips.per_height), scratch_bytes=self.scratch_bytes)
            if rows is not None:
                out["rows"] = {"blocks": len(rows.blocks), "piece": rows.piece}
        if self.dataset is not None:
            from poet_opt.firmware.dataset import MAX_LISTED_LOSSES

            out.update(self.dataset)
            if len(self.losses) > MAX_LISTED_LOSSES:
                out["loss"] = None  # epoch_loss has the means
        if self.diverged:
            out["diverged"] = True
        return out

    def _loss_lines(self, summary: dict) -> list[str]:
        if self.dataset is None:
            return [f"  loss     {', '.join(f'{v:.6g}' for v in self.losses)}"]
        shown = ", ".join("null" if v is None else f"{v:.6g}" for v in summary["epoch_loss"])
        lines = [f"  data     {summary['epochs']:g} epoch(s) of {summary['batches_per_epoch']} batch(es) of "
                 f"{summary['batch_size']}, shuffled with seed {summary['seed']}",
                 f"  loss     {self.losses[0]:.6g} at the first step, {self.losses[-1]:.6g} at the last; each "
                 f"epoch's mean {shown}"]
        if "accuracy_before" in summary:
            lines.append(f"  accuracy {summary['accuracy_before']:.2%} before, {summary['accuracy_after']:.2%} after "
                         f"(the firmware's predict on {summary['eval_samples']} eval samples)")
        return lines

    def text(self, device: str, weights_out=None, out_dir=None) -> str:
        """What `poet-opt emulate` prints: ``weights_out`` and ``out_dir`` as written."""
        summary = self.summary()
        return "\n".join([
            f"{self.network.name} on the emulated {device}: {summary['steps']} SGD step(s), schedule "
            f"{self.schedule.solver['status']}",
            *self._loss_lines(summary),
            f"  RAM      {summary['ram_used_bytes'] / 1024:.1f} KiB used of {summary['ram_device_bytes'] / 1024:.0f} "
            f"KiB (arena {self.arena_bytes / 1024:.1f} KiB, stack {self.stack_bytes} B)",
            f"  storage  {summary['flash_bytes_written'] / 1024:.1f} KiB written, at most "
            f"{summary['flash_erases_max_block']} erase(s) of one block",
            f"  executed {summary['instructions']:,} instructions"
            + (f", about {summary['estimated_runtime_s_per_step'] * 1e3:,.2f} ms a step at the profile's clock "
               f"with {summary['storage_bus_s_per_step'] * 1e3:,.2f} ms of storage transfers (the plan predicts "
               f"{summary['predicted_runtime_s_per_step'] * 1e3:,.2f} ms)"
               if summary["estimated_runtime_s_per_step"] is not None else ""),
            *([f"  weights  streamed from storage: {summary['flash_bytes_read'] / 1024:.1f} KiB read in all, "
               f"{summary['flash_bytes_written_per_step'] / 1024:.1f} KiB written per step (plan), storage lasts "
               + (f"{summary['flash_lifetime_steps']:,} steps" if summary.get("flash_lifetime_steps") else "forever")]
              if summary.get("weights") == "streamed" else []),
            *(["  tiles    " + ", ".join(f"{layer} in {k}" for layer, k in summary["tiles"].items())]
              if summary.get("tiles") else []),
            *([f"  wrote    {weights_out}"] if weights_out else []),
            *([f"  kept     {out_dir}/ (the library, its header, the example main(), poet_train.elf, a CMake project)"]
              if out_dir else []),
        ])


def emulate_training(*, device, ram, steps: Optional[int], lr: float, data, model: Optional[str] = None,
                     torch_model=None, input_shape=None, trainable="all", out_dir=None,
                     time_limit: Optional[float] = 60.0, mode: str = "joint", progress=None,
                     weights: str = "resident", tile_bytes=None, strips="auto", costs=None,
                     prefix: str = "poet_", epochs: Optional[int] = None, batch_size: Optional[int] = None,
                     seed: int = 0, eval_data=None, bar: bool = False) -> EmulatedTraining:
    """Train ``steps`` SGD steps on the batch in ``data`` in firmware generated from the schedule
    that ``poet-opt solve --export`` would give, on the emulated ``device``.

    ``model`` names a zoo model (its seeded PyTorch twin, poet_opt.model.zoo_twins), or
    ``torch_model`` is a module, factory or ``FILE.py:FACTORY`` with ``input_shape``. ``out_dir``
    keeps the generated sources and the linked ELF; ``mode`` is the solver's (joint, remat, paging).
    ``weights="streamed"`` keeps the weights on the device's storage (pre-loaded there, as a board
    would be provisioned) and streams them through the arena as the schedule says, so a model
    whose weights exceed the RAM trains; the trained weights are read back from the storage.
    ``weights="auto"`` streams them when the RAM budget, the trained weights and their gradients
    and the stack would not fit the device's RAM together. ``tile_bytes`` (a size, with streamed
    weights): split a convolution or linear layer whose weights exceed it into tiles over its output
    features (model/tiling.py), each read, updated and written back on its own; None: no tiles.
    ``strips``: "auto" splits a CNN's activations along H into strips (model/strips.py, with
    streamed weights) when some node would not fit the device's RAM whole, the fewest that bring
    every node within ``ram``; N: N strips at every height; "off": never. ``costs``: measured
    per-node costs the plan is solved with, as for `poet-opt solve --costs` (`poet-opt measure`
    writes them from this firmware). ``prefix`` starts every name the generated library exports
    (``<prefix>train_step``, ``<prefix>train.h``).

    ``data`` may hold more samples than one batch: a data set, cut into batches of ``batch_size``
    (default: ``input_shape``'s batch; a zoo model's, all of ``data``) and trained ``steps`` steps or
    ``epochs`` epochs (one of the two), shuffled by ``seed``; ``eval_data``: a data set whose accuracy
    the firmware's predict gives before and after training; ``bar``: a progress bar on stderr
    (firmware/dataset.py)."""
    from poet_opt.firmware.dataset import Feeder, check_inputs, check_set, load_set
    from poet_opt.model.torch_import import resolve_module
    from poet_opt.model.zoo_twins import check_trains, zoo_module

    if (model is None) == (torch_model is None):
        raise PoetError("give a zoo model or a torch model, not both or neither", field="--model")
    if model is not None:
        check_trains(model, firmware=True)
    if (steps is None) == (epochs is None):
        raise PoetError("give the training's length as --steps N or --epochs N, one of the two", field="--epochs")
    for value, option in ((steps, "--steps"), (epochs, "--epochs"), (batch_size, "--batch-size")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PoetError(f"expected a positive whole number, got {value!r}", field=option)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise PoetError(f"expected a whole number 0 or more, got {seed!r}", field="--seed")
    if not (isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0):
        raise PoetError(f"expected a positive finite learning rate, got {lr!r}", field="--lr")
    if not lr <= FLOAT32_MAX:
        raise PoetError(f"{lr:g} is beyond float32, the firmware's number type (at most {FLOAT32_MAX:.4g})",
                        field="--lr")
    # every file this reads, so that -o writes none of them (before the solve, not after it)
    inputs = _input_files(data, device, torch_model, eval_data)
    from poet_opt.firmware.library import check_library_prefix

    check_library_prefix(prefix)
    if out_dir is not None:
        from poet_opt.firmware.board_project import check_project_dir

        check_not_inputs([("-o", path) for path in output_files(out_dir, prefix)], inputs)
        check_project_dir(out_dir)
    profile = load_profile(device)
    target = target_from_profile(profile)  # a core the emulator lacks fails now, not after the solve
    x, y = load_set(data, "--data")
    if model is not None:  # a zoo model takes the data's sample shape, and by default all of it as one batch
        module, shape = zoo_module(model), (batch_size or x.shape[0], *x.shape[1:])
    else:
        if input_shape is None:
            raise PoetError("--torch needs --input-shape", field="--input-shape")
        (module, model), shape = resolve_module(torch_model), parse_full_shape(input_shape)  # one module
        shape = (batch_size or shape[0], *shape[1:])
    batch = shape[0]
    if tuple(x.shape[1:]) != tuple(shape[1:]) or x.shape[0] < batch:
        check_set(x, y, shape[1:], None, batch, "--data")  # says which, before the solve
    if x.shape[0] % batch:
        raise PoetError(f"--data holds {x.shape[0]} samples, not a whole number of batches of {batch}; give a "
                        "--batch-size that divides it, or trim the data set",
                        field="--batch-size" if batch_size else "--data")
    per_epoch = x.shape[0] // batch
    steps = steps if steps is not None else epochs * per_epoch
    eval_x, eval_y = load_set(eval_data, "--eval") if eval_data is not None else (None, None)
    x, eval_x = check_inputs(module, shape, [(x, "--data"), (eval_x, "--eval")])  # features or token ids
    on_data_set = per_epoch > 1 or eval_x is not None  # else the single-batch harness, as before
    most = (target.ram_bytes - STACK_BYTES) // LOSS_BYTES
    if steps > most and not on_data_set:  # before any C is generated
        raise PoetError(f"the firmware keeps each step's loss in RAM ({LOSS_BYTES} B a step): {steps:,} steps need "
                        f"{LOSS_BYTES * steps:,} B and {profile.name} has {target.ram_bytes:,} B; at most "
                        f"{most:,} steps, fewer beside the model", field="--steps")

    def check_data(network) -> None:  # once the model's outputs are known, before the solve
        classes = network.layers[network.output].elements // network.input_shape[0]
        if on_data_set:  # a data set's check names the first label out of range, and its file
            check_set(x, y, shape[1:], classes, batch, "--data")
            if eval_x is not None:
                check_set(eval_x, eval_y, shape[1:], classes, batch, "--eval")
        check_labels(y, classes)  # one batch: the one rule `run` applies too

    network, plan = solve_plan(module, shape, profile, ram=ram, name=model, trainable=trainable,
                               time_limit=time_limit, mode=mode, progress=progress, weights=weights,
                               tile_bytes=tile_bytes, strips=strips, costs=costs, steps=steps,
                               data_set=on_data_set, check=check_data)
    feed = None
    if on_data_set:
        feed = Feeder(x, y, batch, steps, seed, eval_x, eval_y, bar=bar)
    x, y = x[:batch], y[:batch].astype(np.int64)  # check_data, before the solve, checked every label
    return run_schedule(network, plan, profile, steps=steps, lr=lr, x=x, y=y, out_dir=out_dir, progress=progress,
                        inputs=inputs, prefix=prefix, feed=feed)


def solve_plan(module, shape, profile, *, ram, name=None, trainable="all", time_limit: Optional[float] = 60.0,
               mode: str = "joint", progress=None, weights: str = "resident", tile_bytes=None, strips="auto",
               costs=None, steps: int = 1, data_set: bool = False, check=None):
    """(the network as lowered, the FirmwarePlan that ``poet-opt solve --export`` gives it): what
    `emulate` and `measure --device` run, its arena solved again, smaller, where the firmware's
    other statics (for ``steps`` steps' losses) and its stack leave too little of the device beside it. ``costs``: a measured-costs file or MeasuredCosts
    (``solve --costs``), put on the graph before the solve. ``data_set``: the harness keeps one
    batch, its logits and one loss (firmware/dataset.py) instead of every step's loss. ``check``: called
    with the network as lowered, before the solve (the data's labels against its outputs: bad input
    is refused in seconds, not after a solve of up to the time limit)."""
    from poet_opt.model.measured_costs import MeasuredCosts, load_costs

    def say(text: str) -> None:
        if progress is not None:
            progress(text)

    strips = strips_value(strips)
    table = costs if costs is None or isinstance(costs, MeasuredCosts) else load_costs(costs)
    model = name
    say("tracing the model")
    ram_bytes = parse_size(ram, field="--ram")
    striped = Lowering(module, shape, profile, ram_bytes, name=model, trainable=trainable, weights=weights,
                       tile_bytes=tile_bytes, strips=strips, table=table)
    network = striped(ram_bytes)
    if check is not None:
        check(network)
    say("solving")
    # strips fit to the budget may leave a node too large for the tighter budget an arena's
    # fragmentation calls for: auto strips are then fit to that budget
    refit = strips == "auto" and (network.graph.meta.get("strips") or network.graph.meta.get("rows"))
    graph_for = (lambda budget: striped(budget).graph) if refit else None
    with ctrl_c_ends_everything():
        plan = solve_for_export(network.graph, profile, ram=ram, time_limit=time_limit, mode=mode, graph_for=graph_for)
        network = striped.network_of(plan.graph) if refit else network
        # --ram bounds the arena; the firmware's other statics and its stack come on top of it, and
        # with them the arena of ResNet-18 at 200 KiB left no room on the nRF52840's 256 KiB: the
        # arena is then solved again within the RAM they leave
        target = target_from_profile(profile)
        batch = np.zeros(network.input_shape, np.float32), np.zeros(network.input_shape[0], np.int64)
        for _ in range(MAX_DEVICE_FITS):
            generated = codegen.generate(network, plan.schedule.to_dict(), plan.arena, plan.flash, steps=steps,
                                         lr=0.1, x=batch[0], y=batch[1])
            # a data set's harness: a batch, its labels, its logits, the loss and the command, a word each
            words = (int(np.prod(network.input_shape)) + network.input_shape[0] + network.layers[network.output].elements
                     + 2) if data_set else steps
            beside = static_beside_arena(generated.source, words, target) + STACK_BYTES
            room = target.ram_bytes - beside
            if plan.arena.arena_bytes <= room:
                break
            needed = plan.arena.arena_bytes + beside - LOSS_BYTES * words
            if not data_set and needed + LOSS_BYTES * 64 <= target.ram_bytes:  # the losses are what does not fit
                raise _too_many_steps(steps, needed, target, profile)
            budget = room - room % max(4, plan.arena.alignment)
            say(f"solving again for an arena of {budget:,} B: the firmware's other statics and its stack take "
                f"{beside:,} B of {profile.name}'s {target.ram_bytes:,} B")
            graph = network.graph
            if refit and graph.min_working_set_bytes() > budget:
                graph = striped(budget).graph
            try:
                plan = solve_for_export(graph, profile, ram=budget, time_limit=time_limit, mode=mode,
                                        graph_for=graph_for)
            except PoetError as exc:
                raise PoetError(f"{_no_room(ram_bytes, beside, target, profile)}, and no plan fits it: {exc.message}",
                                field="--ram") from None
            network = striped.network_of(plan.graph) if refit else network
        else:
            raise PoetError(_no_room(ram_bytes, beside, target, profile), field="--ram")
    return network, plan


def _too_many_steps(steps: int, needed: int, target, profile) -> PoetError:
    return PoetError(f"the firmware keeps each step's loss in RAM ({LOSS_BYTES} B a step): {steps:,} steps need "
                     f"{LOSS_BYTES * steps / 1024:,.1f} KiB beside the {needed / 1024:,.1f} KiB or more the plan, the "
                     f"weights and the stack take, and {profile.name} has {target.ram_bytes / 1024:,.0f} KiB; at most "
                     f"about {(target.ram_bytes - needed) // LOSS_BYTES:,} steps fit", field="--steps")


def _no_room(ram_bytes: int, beside: int, target, profile) -> str:
    return (f"the arena cannot have all of --ram ({ram_bytes:,} B): the firmware's other statics and its stack "
            f"({beside:,} B) leave {max(0, target.ram_bytes - beside):,} B of {profile.name}'s {target.ram_bytes:,} B")


# statics a generated step declares in RAM, one or more a line: "static float poet_scratch[6560];",
# "__attribute__((used)) float poet_running_mean_3[64] = {", "static float poet_mean_2[8], poet_invstd_2[8];"
_RAM_DECLARATION = re.compile(r"^(?:static |__attribute__\(\(used\)\) )*(float|int32_t|uint32_t|uint8_t) "
                              r"(poet_\w+\[\w+\](?:, poet_\w+\[\w+\])*)(?:;| = \{)$", re.M)
_DECLARATOR = re.compile(r"(poet_\w+)\[(\w+)\]")


def static_beside_arena(source: str, steps: int, target) -> int:
    """The bytes of RAM a generated step's firmware takes beside its arena and stack: what the step
    declares (the strips' scratch, the norms' statistics, resident weights and their gradients, the
    losses) and, when it pages, the board's two write-block buffers (poet_paging.c's tail of a
    block, poet_storage_emu.c's bounce buffer), each rounded up to a word as the linker places them;
    and the library's own state (its ready flag, the caller's batch pointers and learning rate) and
    the harness's losses, one float a step. The buffers count whenever the library can page (its
    save_weights does): emulate's harness never saves and the linker drops them there, but a board's
    application may, so the figure errs by at most those two blocks, on the safe side."""
    total = 2 * -(-target.write_block_bytes // 4) * 4 if "poet_page_" in source else 0
    total += LIBRARY_STATE_BYTES + LOSS_BYTES * steps
    for ctype, declarators in _RAM_DECLARATION.findall(source):
        for name, count in _DECLARATOR.findall(declarators):
            if name != "poet_arena":
                n = steps if count == "POET_TRAIN_STEPS" else int(count)
                total += -(-n * (1 if ctype == "uint8_t" else 4) // 4) * 4
    return total


def _input_files(data, device, torch_model, eval_data=None) -> list[tuple[str, Path]]:
    """The files emulate reads, by option: a device or torch module given by name is no file."""
    given = [("--data", data), ("--device", device), ("--eval", eval_data)]
    if isinstance(torch_model, str):
        given.append(("--torch", torch_model.rsplit(":", 1)[0]))
    return [(option, Path(path)) for option, path in given if isinstance(path, (str, Path)) and Path(path).is_file()]


def run_schedule(network: Network, plan, profile, *, steps: int, lr: float, x: np.ndarray, y: np.ndarray,
                 out_dir=None, progress=None, program: bool | str = "auto", inputs=(),
                 marks: bool = False, prefix: str = "poet_", feed=None) -> EmulatedTraining:
    """Generate, build and run the training step of a schedule of ``network.graph``: ``plan`` is
    a FirmwarePlan, or a Schedule (a baseline's, say) whose arena is laid out here. A tiled network
    (``lower_network(..., tile_bytes=...)``) carries its tiles, so nothing more is needed here.
    ``out_dir`` gets ``output_files``, none of which may be one of ``inputs`` ((option, path) pairs).
    ``marks``: a profiling build, each schedule step marked with its cycle estimate (``.marks``).
    ``feed``: a dataset.Feeder, whose harness hands the firmware its batches in one run."""
    from poet_opt.firmware import arena
    from poet_opt.firmware.fit import FirmwarePlan

    if not isinstance(plan, FirmwarePlan):
        doc = plan.to_dict()
        plan = FirmwarePlan(plan, arena.plan_arena(doc), arena.plan_flash(doc))
    target = target_from_profile(profile)
    generated = codegen.generate(network, plan.schedule.to_dict(), plan.arena, plan.flash, steps=steps, lr=float(lr),
                                 x=x, y=y, program=program, marks=marks, prefix=prefix,
                                 storage_defines=target.storage_defines())
    if feed is not None:
        from poet_opt.firmware.c_text import float_literal
        from poet_opt.firmware.dataset import harness
        from poet_opt.firmware.library import HARNESS_FILE, provenance

        heading = provenance(plan.schedule.to_dict(), f"{HARNESS_FILE}, the example main() the emulator runs on a "
                                                      "data set")
        generated = replace(generated, harness=heading + harness(prefix, float_literal(float(lr), field="--lr"),
                                                                 network.vocabulary))
    say = progress or (lambda text: None)
    # built in a scratch directory and copied to out_dir only once training ran: a failure leaves
    # nothing half-written there
    work = Path(tempfile.mkdtemp(prefix="poet-emulate-"))
    try:
        result = _build_and_run(network, plan, generated, target, profile, work, say, feed)
        if out_dir is not None and generated.param_layers:
            # what a board's storage is provisioned with (dd it to the card, or program it to flash)
            image = weights_image(generated.param_layers, plan.flash, target.erased_byte)
            (work / "poet_weights.bin").write_bytes(image.tobytes())
        if out_dir is not None and generated.program_offset is not None:
            # provisioned at its offset (the header of poet_train.c names it) beside the weights
            (work / "poet_program.bin").write_bytes(generated.program)
        if out_dir is not None:
            from poet_opt.firmware.board_project import write_board_project

            result.files = _keep(work, Path(out_dir), inputs, prefix)
            # the example main.c trains on its one built-in batch and keeps every loss in RAM: a data
            # set's thousands of steps would not fit there, and would show nothing more
            shown = steps if feed is None else min(steps, EXAMPLE_STEPS_ON_A_DATA_SET)
            result.files += write_board_project(out_dir, target=target, device=profile.name, prefix=prefix,
                                                doc=plan.schedule.to_dict(), steps=shown, lr=float(lr), x=x, y=y,
                                                storage_images=[p.name for p in result.files if p.suffix == ".bin"],
                                                inputs=inputs)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


# what -o DIR receives: the generated library and the example main() the emulator ran, its image and
# linker script, the storage image of streamed weights, and everything a board project needs
# besides its own poet_storage.c
def generated_files(prefix: str = "poet_") -> tuple[str, ...]:
    from poet_opt.firmware.library import HARNESS_FILE

    return (f"{prefix}train.c", f"{prefix}train.h", HARNESS_FILE, "poet_train.elf", "poet_train.ld",
            "poet_weights.bin", "poet_program.bin")


def _library_files() -> list[Path]:
    return [*(KERNEL_DIR / n for n in (*codegen.KERNEL_FILES, "poet_kernels.h")),
            *(BOARD_DIR / n for n in (*codegen.PAGING_FILES, "poet_paging.h", "poet_storage.h"))]


def output_files(out_dir, prefix: str = "poet_") -> list[Path]:
    """Every file ``emulate -o out_dir`` may write (a prefix that is no C name is refused first)."""
    from poet_opt.firmware.library import check_library_prefix

    from poet_opt.firmware.board_project import project_paths

    check_library_prefix(prefix)
    return [*(Path(out_dir) / name for name in (*generated_files(prefix), *(p.name for p in _library_files()))),
            *project_paths(out_dir)]


def _keep(work: Path, out_dir: Path, inputs, prefix: str) -> list[Path]:
    made = {p.name for p in work.iterdir() if p.suffix in (".c", ".h", ".elf", ".ld", ".bin")}
    generated = generated_files(prefix)
    # -o was checked against the inputs for exactly these names, before the solve
    assert made <= set(generated), f"internal: {sorted(made - set(generated))} are not in generated_files"
    files = {name: work / name for name in generated if name in made}
    files.update({path.name: path for path in _library_files()})
    try:
        return write_files(out_dir, files, field="-o", inputs=inputs)
    except OSError as exc:
        raise PoetError(f"cannot write here: {exc.strerror}", source=str(out_dir), field="-o") from None


def weights_image(param_layers: dict, flash, erased_byte: int) -> np.ndarray:
    """The storage's first bytes before the first step: each streamed layer's parameters at its
    region, erased bytes between them."""
    end = max(flash.offsets[n] + flash.region_bytes[n] for n in param_layers)
    image = np.full(end, erased_byte, dtype=np.uint8)
    for node, layer in param_layers.items():
        packed = codegen.packed_params(layer).view(np.uint8)
        image[flash.offsets[node]:flash.offsets[node] + packed.size] = packed
    return image


def layer_bytes(layer) -> int:
    return 4 * sum(p.value.size for p in layer.params.values())


def _build_and_run(network, plan, generated, target, profile, work: Path, say, feed=None) -> EmulatedTraining:
    from poet_opt.firmware.build import FirmwareBuildError, build_firmware
    from poet_opt.firmware.emulator import Emulator, EmulatorError
    from poet_opt.firmware.strip_codegen import scratch_bytes

    from poet_opt.firmware.library import HARNESS_FILE, HARNESS_LOSSES, provenance, running_statistics

    work.mkdir(parents=True, exist_ok=True)
    source, harness = work / f"{generated.prefix}train.c", work / HARNESS_FILE
    source.write_text(generated.source)
    (work / f"{generated.prefix}train.h").write_text(generated.header)
    harness.write_text(generated.harness)
    sources = [source, harness, *(KERNEL_DIR / name for name in codegen.KERNEL_FILES),
               *(BOARD_DIR / name for name in codegen.PAGING_FILES)]
    say("cross-compiling")
    try:
        firmware = build_firmware(sources, target, work, name="poet_train", include_dirs=[KERNEL_DIR, BOARD_DIR],
                                  defines=target.storage_defines(), min_stack_bytes=STACK_BYTES,
                                  arena_sections=[f".{generated.prefix}arena"],
                                  linker_heading=provenance(plan.schedule.to_dict(), "poet_train.ld, the linker script "
                                                            "the emulator linked poet_train.elf with"))
    except FirmwareBuildError as exc:
        if "does not fit in the device's RAM" in str(exc):
            # each with its gradient; streamed weights are in the arena
            weights = 0 if generated.param_layers else sum(8 * p.value.size for p in network.trainable_parameters)
            scratch = scratch_bytes(generated.source)
            halo = f", the strips' scratch {scratch / 1024:,.1f} KiB" if scratch else ""
            needed = plan.arena.arena_bytes + weights + scratch + STACK_BYTES
            losses = LOSS_BYTES * generated.steps
            if feed is None and needed + losses > target.ram_bytes and needed + LOSS_BYTES * 64 <= target.ram_bytes:
                raise _too_many_steps(generated.steps, needed, target, profile) from None
            raise PoetError(f"the firmware needs {needed / 1024:,.1f} KiB of RAM or more (arena "
                            f"{plan.arena.arena_bytes / 1024:,.1f} KiB, trainable weights and their gradients "
                            f"{weights / 1024:,.1f} KiB{halo}, a {STACK_BYTES // 1024} KiB stack, norm statistics) "
                            f"and {profile.name} has {target.ram_bytes / 1024:,.0f} KiB; give a smaller --ram or "
                            "train fewer layers (--trainable)", field="--ram") from None
        if "does not fit in flash" in str(exc):
            raise PoetError(f"the firmware image exceeds {profile.name}'s flash", field="--device") from None
        raise
    say(f"training {generated.steps} step(s)" + (f" ({feed.epochs} epoch(s) of {feed.per_epoch} batch(es))"
                                                 if feed is not None else "") + f" on the emulated {profile.name}")
    emulator = Emulator(firmware)
    try:
        for node, layer in generated.param_layers.items():  # the board's storage, provisioned
            emulator.storage.load(plan.flash.offsets[node], codegen.packed_params(layer))
        if generated.program_offset is not None:  # and the step program beside the weights
            emulator.storage.load(generated.program_offset, np.frombuffer(generated.program, np.uint8))
        if feed is not None:
            feed.attach(emulator)
        result = emulator.run()
        marks = list(emulator.marks)
        losses = list(feed.losses) if feed is not None else emulator.read_symbol(HARNESS_LOSSES, np.float32).tolist()
        # torch name -> (parameter, its trained value): one pair per tile of a tiled layer
        trained: dict[str, list] = {}
        for node, layer in generated.param_layers.items():
            if not layer.trainable:
                continue
            stored = np.frombuffer(emulator.storage.dump(plan.flash.offsets[node], int(layer_bytes(layer))), np.float32)
            for p in layer.params.values():
                trained.setdefault(p.torch_name, []).append((p, stored[:p.value.size]))
                stored = stored[p.value.size:]
        for p in [] if generated.param_layers else network.trainable_parameters:
            value = emulator.read_symbol(generated.param_symbols[p.torch_name], np.float32)[:p.value.size]
            trained.setdefault(p.torch_name, []).append((p, value))
        running = running_statistics(emulator, network)
    except EmulatorError as exc:
        raise PoetError(f"the firmware failed on the emulated {profile.name}: {str(exc).splitlines()[0]}") from None
    finally:
        emulator.close()
        if feed is not None:
            feed.close()
    if result.exit_code == -20 and feed is not None:  # the library's E_UNSUPPORTED
        raise PoetError("the firmware's predict cannot run this plan's forward part (too long for straight-line C); "
                        "train without --eval", field="--eval")
    if result.exit_code != 0:
        raise PoetError(f"the firmware stopped with storage error {result.exit_code} (poet_storage.h)")
    weights = network.assemble(trained)
    storage = result.storage
    flash = plan.flash
    nodes = plan.schedule.to_dict()["graph"]["nodes"]
    regions = {str(nodes[node]["name"]): 0 for node in flash.offsets}
    starts = sorted((offset, node) for node, offset in flash.offsets.items())
    for at, nbytes in storage.written_at.items():  # each write command lies within one region
        k = bisect.bisect_right(starts, (at, math.inf)) - 1
        if k >= 0 and at < starts[k][0] + flash.region_bytes[starts[k][1]]:
            regions[str(nodes[starts[k][1]]["name"])] += int(nbytes)
    return EmulatedTraining(
        network=network, schedule=plan.schedule, losses=losses, weights=weights,
        ram_device_bytes=int(target.ram_bytes), ram_used_bytes=int(result.ram_used_bytes),
        static_bytes=int(result.static_bytes), stack_bytes=int(result.stack_bytes),
        flash_bytes_written=int(storage.bytes_written), flash_erases_max_block=int(storage.erase_max_per_block),
        flash_violations=[str(v) for v in storage.violations], instructions=int(result.instructions or 0),
        arena_bytes=int(plan.arena.arena_bytes),
        weights_placement="streamed" if generated.param_layers else "resident",
        scratch_bytes=scratch_bytes(generated.source),
        flash_bytes_read=int(storage.bytes_read), flash_bytes_written_per_step=int(flash.bytes_written_per_step),
        flash_lifetime_steps=flash.lifetime_steps, region_bytes_written=regions,
        flash_wear_events=int(storage.erases_total), cycles=int(result.cycles or 0),
        storage_bus_s=storage_bus_seconds(profile.storage, read_ops=storage.read_ops, bytes_read=storage.bytes_read,
                                          write_ops=storage.write_ops, bytes_written=storage.bytes_written),
        clock_hz=getattr(profile.compute, "clock_hz", None), marks=marks,
        dataset=feed.summary() if feed is not None else None, running=running)
