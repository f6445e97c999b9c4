"""`poet-opt measure --device MCU`: every node's cost from the firmware poet-opt generates for it.

The plan `emulate` would run (the same lowering, the same solve) is generated as a profiling build
(writer.StepWriter ``marks``): before each step of the schedule the firmware writes the step's
number to the emulator's trace register, which records the cycle estimate of that moment
(firmware/cycles.py). One training step runs on the emulated core. The cycles from one mark to the
next are that step's; a node's cost is the mean over its computes in the step (a recompute runs the
same kernel; a gradient's weight-gradient kernel runs at its first compute only, so the mean is
exact for the plan measured and a little off for a plan that recomputes gradients more often).

What is written (the file `solve --costs`, `emulate --costs` and `run --costs` read): seconds as
cycles over the profile's ``compute.clock_hz``, joules as those seconds at the profile's active
power. Not written, so that the profile's storage model keeps pricing them: the nodes that read
streamed weights from storage (``param:``), and paging. The emulator's storage answers at once, so
a transfer's bus time is in no cycle count: the estimate adds the commands the firmware issued at
the profile's storage latencies and rates (``storage_bus_s``); the paging steps' own cycles (the
driver's) are reported beside, not written. Nor is anything outside the schedule's
steps: zeroing the resident weights' gradients and their SGD update, start-up (``outside_cycles``).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

import numpy as np

from poet_opt.errors import PoetError


@dataclass(frozen=True)
class NodeCycles:
    name: str
    kind: str  # forward, loss, backward
    computes: int  # how often the measured plan computes it in one step
    cycles: int  # over all of them

    @property
    def cycles_per_compute(self) -> float:
        return self.cycles / self.computes


@dataclass
class FirmwareCosts:
    network: object
    schedule: object  # the plan that ran
    device: str
    clock_hz: float
    power_w: float
    nodes: list[NodeCycles]  # every node the file gives, in graph order
    step_cycles: int  # the whole training step: start-up, gradients zeroed, the schedule, SGD
    schedule_cycles: int  # the schedule's steps (from the first mark to the last)
    paging_cycles: int  # the page-out and page-in steps, and reading streamed weights (param:)
    instructions: int
    skipped: list[str] = field(default_factory=list)  # nodes left to the storage model
    # the step's storage commands at the profile's latencies and rates (the emulated card takes no time)
    storage_bus_s: float = 0.0
    plan: object = None  # the FirmwarePlan that ran (its .schedule is ``schedule``)

    @property
    def outside_cycles(self) -> int:
        return self.step_cycles - self.schedule_cycles

    def seconds(self, cycles: float) -> float:
        return cycles / self.clock_hz

    def csv(self) -> str:
        """The measured-costs file (model/measured_costs.py): one row per node, SI units."""
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        out.writerow(["name", "time_s", "energy_j"])
        for node in self.nodes:
            seconds = self.seconds(node.cycles_per_compute)
            out.writerow([node.name, repr(seconds), repr(seconds * self.power_w)])
        return buf.getvalue()

    def summary(self) -> dict:
        totals = self.schedule.totals
        node_cycles = sum(n.cycles for n in self.nodes)
        return {
            "device": self.device, "clock_hz": self.clock_hz, "power_w": self.power_w,
            "instructions": self.instructions, "step_cycles": self.step_cycles,
            "schedule_cycles": self.schedule_cycles, "node_cycles": node_cycles,
            "paging_cycles": self.paging_cycles, "outside_cycles": self.outside_cycles,
            "estimated_runtime_s_per_step": self.seconds(self.step_cycles) + self.storage_bus_s,
            "storage_bus_s_per_step": self.storage_bus_s,
            "predicted_runtime_s_per_step": float(totals["runtime_s"]),
            "predicted_energy_j_per_step": float(totals["energy_j"]),
            "recomputes": int(totals["recomputes"]), "page_outs": int(totals.get("page_outs", 0)),
            "left_to_storage_model": list(self.skipped),
            "nodes": [{"name": n.name, "kind": n.kind, "computes": n.computes,
                       "cycles_per_compute": n.cycles_per_compute,
                       "time_s": self.seconds(n.cycles_per_compute)} for n in self.nodes],
        }


def cycles_per_step(marks: list[tuple[int, int]], n_steps: int) -> dict[int, int]:
    """Schedule step -> its cycles, from one training step's marks (step numbers in increasing order,
    ``n_steps`` closing the last)."""
    numbers = [m for m, _ in marks]
    if not marks or numbers[-1] != n_steps or numbers != sorted(set(numbers)):
        raise PoetError(f"internal: the profiled step left marks {numbers[:8]}... not one pass over its "
                        f"{n_steps} steps")
    return {m: after - at for (m, at), (_, after) in zip(marks, marks[1:])}


def measure_firmware(module, shape, device, *, ram, name=None, trainable="all", time_limit=60.0, mode="joint",
                     weights="resident", tile_bytes=None, strips="auto", costs=None, progress=None,
                     seed: int = 0) -> FirmwareCosts:
    """Solve as `emulate` does, run one training step of the profiling build on the emulated core
    and attribute its cycles to the graph's nodes. ``costs``: the plan is solved with these (the
    nodes it computes are what is measured, whatever the costs)."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.firmware.targets import target_from_profile
    from poet_opt.firmware.trainer import run_schedule, solve_plan

    profile = load_profile(device)
    target_from_profile(profile)  # a core the emulator lacks fails now, not after the solve
    clock = getattr(profile.compute, "clock_hz", None)
    if not clock:
        raise PoetError(f"{profile.name} gives no compute.clock_hz: cycles cannot become seconds; add it to the "
                        "profile", field="--device")
    network, plan = solve_plan(module, shape, profile, ram=ram, name=name, trainable=trainable,
                               time_limit=time_limit, mode=mode, progress=progress, weights=weights,
                               tile_bytes=tile_bytes, strips=strips, costs=costs)
    # the kernels take as long whatever the values (no data-dependent loop counts): any batch will do
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(network.input_shape).astype(np.float32) if network.vocabulary is None else \
        rng.integers(0, network.vocabulary, network.input_shape).astype(np.int32)  # token ids: the table's rows
    y = np.zeros(network.input_shape[0], dtype=np.int64)
    result = run_schedule(network, plan, profile, steps=1, lr=0.01, x=x, y=y, progress=progress, marks=True)
    doc = plan.schedule.to_dict()
    steps, nodes = doc["steps"], plan.graph.nodes
    per_step = cycles_per_step(result.marks, len(steps))
    total: dict[int, int] = {}
    runs: dict[int, int] = {}
    paging = 0
    for s, cycles in per_step.items():
        step = steps[s]
        n = step["node"]
        if step["op"] in ("page_in", "page_out") or nodes[n].op == "param":
            paging += cycles
        elif step["op"] == "compute":
            total[n] = total.get(n, 0) + cycles
            runs[n] = runs.get(n, 0) + 1
    measured = [NodeCycles(node.name, node.kind, runs[n], total[n]) for n, node in enumerate(nodes) if n in runs]
    skipped = [node.name for n, node in enumerate(nodes) if n not in runs]
    return FirmwareCosts(network=network, schedule=plan.schedule, device=profile.name, clock_hz=float(clock),
                         power_w=float(profile.compute.power_w), nodes=measured, step_cycles=int(result.cycles),
                         schedule_cycles=int(result.marks[-1][1] - result.marks[0][1]), paging_cycles=paging,
                         instructions=int(result.instructions), skipped=skipped, plan=plan,
                         storage_bus_s=result.storage_bus_s)
