"""Where a streamed plan's energy above plain training goes, beside the residency LP's, and what the
LP would be without each kind of return: which side of a gap (the plan or the bound) to work on.

    python benchmarks/residency_anatomy.py --plan r18.json     # ~4 min on 2 cores for ResNet-18
    poet-opt solve --model resnet18-cifar --device nrf52840 --ram 200KiB --time-limit 300 --out r18.json

The plan is a schedule JSON (`solve --out`); its model, device, RAM and options are read from it
(zoo models; streamed weights, strips and slices as `solve` cut them by default). Printed:

1. The plan's energy above plain training per kind of action (recomputation, page-in, page-out) and
   kind of tensor (weight slice, forward activation, gradient), beside the residency LP's optimum
   with recomputation inputs (solver/residency.py, solver/stream_bound.py) split the same way. The
   LP is a lower bound on every plan in this order; the split shows where the LP is cheaper.
2. Three LPs: the residency LP with recomputation inputs (a bound, as the solve proves it); the
   same with no activation recomputed (weights still read again) — the least energy of any plan of
   the *spill space*, which the heuristic starts and windows search, NOT a bound on plans that
   recompute; and with no ReLU or add recomputed, also NOT a bound: the LP's value without the
   returns that make it cheap. Each line says which it is.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from poet_opt.device.costs import node_costs  # noqa: E402
from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.model.load import default_tile_bytes, load_training_graph  # noqa: E402
from poet_opt.solver.backends import solve_milp  # noqa: E402
from poet_opt.solver.budgets import resolve_budgets  # noqa: E402
from poet_opt.solver.formulation import Milp  # noqa: E402
from poet_opt.solver.residency import ResidencyModel  # noqa: E402

ELEMENTWISE = ("relu", "add")


def tensor_kind(node) -> str:
    if node.op == "param":
        return "weight slice"
    return {"forward": "forward activation", "backward": "gradient"}.get(node.kind, node.kind)


def plan_split(graph, costs, doc: dict) -> collections.Counter:
    """The plan's joules above plain training by (action, tensor kind), from its steps."""
    nodes, seen, split = graph.nodes, set(), collections.Counter()
    joules = {"page_in": costs.page_in_j, "page_out": costs.page_out_j}
    for step in doc["steps"]:
        node, op = nodes[step["node"]], step["op"]
        if op == "compute":
            if node.id in seen:
                split[("recompute", tensor_kind(node))] += costs.compute_j[node.id]
            seen.add(node.id)
        elif op in ("page_in", "page_out"):
            split[(op.replace("_", "-"), tensor_kind(node))] += joules[op][node.id]
    return split


def lp_split(graph, model: ResidencyModel, x: np.ndarray) -> collections.Counter:
    c, split = model.milp.c, collections.Counter()
    gaps = model.gaps
    for label, cols, owners in (("recompute", model.R, gaps.tensor), ("page-in", model.P, gaps.tensor),
                                ("page-out", model.O, np.arange(len(model.O)))):
        for owner, joules in zip(owners.tolist(), (x[cols] * c[cols]).tolist()):
            split[(label, tensor_kind(graph.nodes[owner]))] += joules
    extra = model.milp.num_vars - model.block.base if model.block is not None else 0
    if extra:
        split[("inputs' returns", "(stream_bound block)")] += float(x[model.block.base:] @ c[model.block.base:])
    return split


def lp(model: ResidencyModel, forbid=None, time_limit=900.0):
    """The model's LP optimum, with the recomputations of the gaps in ``forbid`` (a mask) taken out."""
    m = model.relaxed()
    ub = m.ub.copy()
    if forbid is not None:
        ub[model.R[forbid]] = 0.0
    started = time.perf_counter()
    result = solve_milp(Milp(c=m.c, offset=m.offset, A=m.A, row_lb=m.row_lb, row_ub=m.row_ub, lb=m.lb, ub=ub,
                             integrality=m.integrality), time_limit=time_limit, gap=0.0, threads=2)
    return result, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="a schedule JSON written by `poet-opt solve --out`")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per LP")
    args = parser.parse_args()
    doc = json.loads(Path(args.plan).read_text())
    profile = load_profile(doc["device"]["name"])
    ram = doc["budgets"]["ram_bytes"]
    graph, _ = load_training_graph(doc["model"], None, None, None, batch_size=1, bytes_per_element=4,
                                   weights="auto", tile_bytes=default_tile_bytes([ram]), ram_bytes=ram,
                                   device_ram_bytes=profile.memory.ram_bytes,
                                   stack_reserve_bytes=profile.memory.stack_reserve_bytes)
    if [n["name"] for n in doc["graph"]["nodes"]] != [n.name for n in graph.nodes]:
        print("the plan's graph is not the one `solve` builds by default for its model (other options, "
              "or another execution order): give a plan solved with the defaults", file=sys.stderr)
        return 2
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, ram)
    floor = costs.plain_energy_j
    print(f"{doc['model']} on {profile.name} at {ram / 1024:g} KiB: {len(graph)} nodes, plain training "
          f"{floor:.4f} J, the plan {doc['totals']['energy_j']:.4f} J")

    model = ResidencyModel(graph, costs, budgets, doc["mode"], inputs=True)
    result, seconds = lp(model, time_limit=args.time_limit)
    if result.x is None:
        print(f"the residency LP did not finish in {args.time_limit:g} s ({result.status})", file=sys.stderr)
        return 1
    ours, its = plan_split(graph, costs, doc), lp_split(graph, model, result.x)
    print("\n| action | tensor | plan J | LP J | plan - LP J |\n|---|---|---:|---:|---:|")
    for key in sorted(set(ours) | set(its)):
        if abs(ours[key]) + abs(its[key]) > 1e-6:
            print(f"| {key[0]} | {key[1]} | {ours[key]:.4f} | {its[key]:.4f} | {ours[key] - its[key]:+.4f} |")
    print(f"| all | | {sum(ours.values()):.4f} | {sum(its.values()):.4f} | "
          f"{sum(ours.values()) - sum(its.values()):+.4f} |")

    owners = model.gaps.tensor
    activation = np.array([graph.nodes[i].op != "param" for i in owners.tolist()], dtype=bool)
    elementwise = np.array([graph.nodes[i].op in ELEMENTWISE for i in owners.tolist()], dtype=bool)
    print("\n| LP | value J | status | s | what it is |\n|---|---:|---|---:|---|")
    print(f"| residency, recomputation inputs | {result.objective:.4f} | {result.status} | {seconds:.0f} | "
          "a lower bound on every plan in this order (before the solve's safety margin) |")
    for label, mask, meaning in (
            ("no activation recomputed", activation,
             "a bound on the spill space's plans (paging, weights read again), NOT on plans that recompute"),
            (f"no {' or '.join(ELEMENTWISE)} recomputed", elementwise,
             "NOT a bound: the LP without the returns it prices cheapest")):
        other, seconds = lp(model, forbid=mask, time_limit=args.time_limit)
        value = "-" if other.objective is None else f"{other.objective:.4f}"
        print(f"| {label} | {value} | {other.status} | {seconds:.0f} | {meaning} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
