"""`poet-opt emulate`: solve, export, generate, cross-compile and train N steps on the emulated board.

Everything the command does is :func:`emulate_training`, a plain function a notebook can call.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from poet_opt.device.profiles import load_profile
from poet_opt.errors import PoetError
from poet_opt.files import check_not_inputs
from poet_opt.firmware import codegen
from poet_opt.firmware.fit import solve_for_export
from poet_opt.firmware.targets import target_from_profile
from poet_opt.model.batch import load_batch
from poet_opt.model.network import Network, lower_network
from poet_opt.model.operators import parse_full_shape

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
BOARD_DIR = Path(__file__).resolve().parent / "board"
STACK_BYTES = 4096  # the kernels keep a few words each; the emulator measures the real depth


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

    def summary(self) -> dict:
        return {"steps": len(self.losses), "loss": [float(v) for v in self.losses],
                "ram_device_bytes": self.ram_device_bytes, "ram_used_bytes": self.ram_used_bytes,
                "flash_bytes_written": self.flash_bytes_written,
                "flash_erases_max_block": self.flash_erases_max_block, "instructions": self.instructions}


def emulate_training(*, device, ram, steps: int, lr: float, data, model: Optional[str] = None,
                     torch_model=None, input_shape=None, trainable="all", out_dir=None,
                     time_limit: Optional[float] = 60.0, mode: str = "joint", progress=None) -> EmulatedTraining:
    """Train ``steps`` SGD steps on the batch in ``data`` in firmware generated from the schedule
    that ``poet-opt solve --export`` would give, on the emulated ``device``.

    ``model`` names a zoo model (its seeded PyTorch twin, poet_opt.firmware.torch_zoo), or
    ``torch_model`` is a module, factory or ``FILE.py:FACTORY`` with ``input_shape``. ``out_dir``
    keeps the generated sources and the linked ELF; ``mode`` is the solver's (joint, remat, paging)."""
    from poet_opt.firmware.torch_zoo import zoo_module

    def say(text: str) -> None:
        if progress is not None:
            progress(text)

    if (model is None) == (torch_model is None):
        raise PoetError("give a zoo model or a torch model, not both or neither", field="--model")
    if not isinstance(steps, int) or steps < 1:
        raise PoetError(f"expected a positive whole number of steps, got {steps!r}", field="--steps")
    if not (isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0):
        raise PoetError(f"expected a positive finite learning rate, got {lr!r}", field="--lr")
    profile = load_profile(device)
    target_from_profile(profile)  # a core the emulator lacks fails now, not after the solve
    if model is not None:  # a zoo model takes the batch's shape
        x, y = load_batch(data)
        module, shape = zoo_module(model), x.shape
    else:
        if input_shape is None:
            raise PoetError("--torch needs --input-shape", field="--input-shape")
        module, shape = torch_model, parse_full_shape(input_shape)
        x, y = load_batch(data, shape)  # the traced network takes exactly this shape
    say("tracing the model")
    network = lower_network(module, shape, trainable=trainable, name=model)
    classes = network.layers[network.output].elements // network.input_shape[0]
    if (y < 0).any() or (y >= classes).any():
        raise PoetError(f"labels must lie in [0, {classes}) for this model's {classes} outputs", field="--data")
    say("solving")
    plan = solve_for_export(network.graph, profile, ram=ram, time_limit=time_limit, mode=mode)
    if out_dir is not None:
        check_not_inputs([("-o", Path(out_dir))], [("--data", Path(data))])
    return run_schedule(network, plan, profile, steps=steps, lr=lr, x=x, y=y, out_dir=out_dir, progress=progress)


def run_schedule(network: Network, plan, profile, *, steps: int, lr: float, x: np.ndarray, y: np.ndarray,
                 out_dir=None, progress=None) -> EmulatedTraining:
    """Generate, build and run the training step of a schedule of ``network.graph``: ``plan`` is
    a FirmwarePlan, or a Schedule (a baseline's, say) whose arena is laid out here."""
    from poet_opt.firmware import arena
    from poet_opt.firmware.fit import FirmwarePlan

    if not isinstance(plan, FirmwarePlan):
        doc = plan.to_dict()
        plan = FirmwarePlan(plan, arena.plan_arena(doc), arena.plan_flash(doc))
    target = target_from_profile(profile)
    generated = codegen.generate(network, plan.schedule.to_dict(), plan.arena, plan.flash, steps=steps, lr=float(lr),
                                 x=x, y=y)
    say = progress or (lambda text: None)
    # built in a scratch directory and copied to out_dir only once training ran: a failure leaves
    # nothing half-written there
    work = Path(tempfile.mkdtemp(prefix="poet-emulate-"))
    try:
        result = _build_and_run(network, plan, generated, target, profile, work, say)
        if out_dir is not None:
            result.files = _keep(work, Path(out_dir))
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keep(work: Path, out_dir: Path) -> list[Path]:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        for path in sorted(work.iterdir()):
            if path.suffix in (".c", ".elf", ".ld"):
                shutil.copy2(path, out_dir / path.name)
                kept.append(out_dir / path.name)
        # everything a board project needs besides its own poet_storage.c
        for folder, name in [*((KERNEL_DIR, n) for n in (*codegen.KERNEL_FILES, "poet_kernels.h")),
                             *((BOARD_DIR, n) for n in (*codegen.PAGING_FILES, "poet_paging.h", "poet_storage.h"))]:
            shutil.copy2(folder / name, out_dir / name)
            kept.append(out_dir / name)
        return kept
    except OSError as exc:
        raise PoetError(f"cannot write here: {exc.strerror}", source=str(out_dir), field="-o") from None


def _build_and_run(network, plan, generated, target, profile, work: Path, say) -> EmulatedTraining:
    from poet_opt.firmware.build import FirmwareBuildError, build_firmware
    from poet_opt.firmware.emulator import Emulator, EmulatorError

    work.mkdir(parents=True, exist_ok=True)
    source = work / "poet_train.c"
    source.write_text(generated.source)
    sources = [source, *(KERNEL_DIR / name for name in codegen.KERNEL_FILES),
               *(BOARD_DIR / name for name in codegen.PAGING_FILES)]
    say("cross-compiling")
    try:
        firmware = build_firmware(sources, target, work, name="poet_train", include_dirs=[KERNEL_DIR, BOARD_DIR],
                                  defines=target.storage_defines(), min_stack_bytes=STACK_BYTES)
    except FirmwareBuildError as exc:
        if "does not fit in the device's RAM" in str(exc):
            weights = sum(8 * p.value.size for p in network.trainable_parameters)  # each with its gradient
            raise PoetError(f"the firmware needs {(plan.arena.arena_bytes + weights + STACK_BYTES) / 1024:,.1f} KiB of "
                            f"RAM or more (arena {plan.arena.arena_bytes / 1024:,.1f} KiB, trainable weights and their "
                            f"gradients {weights / 1024:,.1f} KiB, a {STACK_BYTES // 1024} KiB stack, norm statistics) "
                            f"and {profile.name} has {target.ram_bytes / 1024:,.0f} KiB; give a smaller --ram or "
                            "train fewer layers (--trainable)", field="--ram") from None
        if "does not fit in flash" in str(exc):
            raise PoetError(f"the firmware image exceeds {profile.name}'s flash", field="--device") from None
        raise
    say(f"training {generated.steps} step(s) on the emulated {profile.name}")
    emulator = Emulator(firmware)
    try:
        result = emulator.run()
        losses = emulator.read_symbol("poet_losses", np.float32).tolist()
        trained = {p.torch_name: emulator.read_symbol(generated.param_symbols[p.torch_name], np.float32)[:p.value.size]
                   for p in network.trainable_parameters}
    except EmulatorError as exc:
        raise PoetError(f"the firmware failed on the emulated {profile.name}: {str(exc).splitlines()[0]}") from None
    finally:
        emulator.close()
    if result.exit_code != 0:
        raise PoetError(f"the firmware stopped with storage error {result.exit_code} (poet_storage.h)")
    weights = {p.torch_name: trained[p.torch_name].reshape(p.value.shape).copy() for p in network.trainable_parameters}
    storage = result.storage
    return EmulatedTraining(
        network=network, schedule=plan.schedule, losses=losses, weights=weights,
        ram_device_bytes=int(target.ram_bytes), ram_used_bytes=int(result.ram_used_bytes),
        static_bytes=int(result.static_bytes), stack_bytes=int(result.stack_bytes),
        flash_bytes_written=int(storage.bytes_written), flash_erases_max_block=int(storage.erase_max_per_block),
        flash_violations=[str(v) for v in storage.violations], instructions=int(result.instructions or 0),
        arena_bytes=int(plan.arena.arena_bytes))
