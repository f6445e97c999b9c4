"""`poet-opt run`: solve a schedule for a torch module at a RAM budget and train N steps with it in PyTorch.

Everything the command does is :func:`run_training`, a plain function a notebook can call. The
conventions are `poet-opt emulate`'s: a batch file with ``x`` and ``y``, mean cross-entropy over
the batch, plain SGD at ``lr``, the same batch every step, the module's own initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from poet_opt.device.profiles import load_profile
from poet_opt.errors import PoetError
from poet_opt.executor.runner import ScheduleExecutor, StepStats, Storage
from poet_opt.model.batch import divergence, finite_or_none, load_batch
from poet_opt.model.network import Network, lower_network
from poet_opt.model.operators import parse_full_shape


@dataclass
class RunResult:
    network: Network
    schedule: object  # the Schedule the executor followed
    stats: list[StepStats]
    weights: dict[str, np.ndarray]  # torch name -> trained value (float32, PyTorch's shape)
    planned_bytes_written: int = 0
    planned_bytes_read: int = 0
    device: str = "cpu"
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
        out = {"steps": len(self.stats), "loss": [finite_or_none(s.loss) for s in self.stats],
                "peak_live_bytes": max(s.peak_live_bytes for s in self.stats),
                "planned_peak_bytes": int(self.schedule.totals["peak_ram_bytes"]),
                "storage_bytes_written": sum(s.storage_bytes_written for s in self.stats),
                "storage_bytes_read": sum(s.storage_bytes_read for s in self.stats),
                "planned_storage_bytes_written": self.planned_bytes_written * len(self.stats),
                "planned_storage_bytes_read": self.planned_bytes_read * len(self.stats),
                "step_s": [s.wall_s for s in self.stats],
                "planned_step_s": float(self.schedule.totals["runtime_s"]),
                "recomputes": int(self.schedule.totals["recomputes"]),
                "page_outs": int(self.schedule.totals["page_outs"]),
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


def run_training(*, torch_model, input_shape, device, ram, steps: int, lr: float, data, storage=None,
                 trainable="all", mode: str = "joint", time_limit: float | None = 60.0, torch_device=None,
                 progress=None) -> RunResult:
    """Solve the least-energy schedule of ``torch_model`` (a module, factory or ``FILE.py:FACTORY``)
    on ``device`` within ``ram``, then train ``steps`` SGD steps on the batch in ``data`` with it."""
    from poet_opt.solver.backends import ctrl_c_ends_everything
    from poet_opt.solver.driver import solve

    say = progress or (lambda text: None)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise PoetError(f"expected a positive whole number of steps, got {steps!r}", field="--steps")
    if not (isinstance(lr, (int, float)) and np.isfinite(lr) and lr > 0):
        raise PoetError(f"expected a positive finite learning rate, got {lr!r}", field="--lr")
    if not lr <= float(np.finfo(np.float32).max):  # a float, not a float32: 1e39 would overflow in the cast
        raise PoetError(f"{lr:g} is beyond float32, the weights' number type (at most "
                        f"{float(np.finfo(np.float32).max):.4g})", field="--lr")
    profile = load_profile(device)
    if input_shape is None:
        raise PoetError("--torch needs --input-shape (the whole input, batch first)", field="--input-shape")
    # a missing or malformed batch, or one of another shape, and a storage directory that cannot be
    # written fail before the trace and the solve
    x, y = load_batch(data, parse_full_shape(input_shape))  # the traced network takes exactly this shape
    if storage is not None:
        Storage(storage).close()
    say("tracing the model")
    network = prepare(torch_model, input_shape, trainable=trainable)
    from poet_opt.model.strips import refuse_needing_strips

    refuse_needing_strips(network.graph, profile.memory.ram_bytes, profile.memory.stack_reserve_bytes,
                          "the PyTorch executor", profile.name)
    say("solving")
    with ctrl_c_ends_everything():
        schedule = solve(network.graph, profile, ram=ram, mode=mode, time_limit=time_limit)
    stats = []
    with ScheduleExecutor(network, schedule, lr=lr, storage=storage, device=torch_device) as step:
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
    return RunResult(network, schedule, stats, weights, written, read, used)


def _trainable(network: Network, torch_name: str) -> bool:
    return any(layer.trainable and any(p.torch_name == torch_name for p in layer.params.values())
               for layer in network.layers.values())
