"""Streamed weights (docs/streaming.md): our plans against the naive one, and what freezing layers saves.

    python benchmarks/streaming.py              # ours vs naive, the table of benchmarks/STREAMING.md (~7 min on 2 cores)
    python benchmarks/streaming.py trainable    # the --trainable last:N table of docs/streaming.md (~4 min)
    python benchmarks/streaming.py trainable --write docs/streaming.md   # ... and put it in the document
    python benchmarks/streaming.py traffic      # ResNet-18 in strips: where the bytes read go, per stage (~1 min)

The naive plan is what a hand-written streaming trainer does: plain training (compute every node
once, keep each activation and gradient until its last reader), except that a layer's weights are
read from storage right before each node that needs them and dropped right after, and written back
by the update. It is a `Decisions` in the formulation's own stage semantics (docs/formulation.md),
replayed by `build_steps` and checked by the independent validator, so both plans are priced by
the same cost model and the same rules.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from poet_opt.device.costs import node_costs  # noqa: E402
from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.model.graph import TrainingGraph  # noqa: E402
from poet_opt.model.load import load_training_graph  # noqa: E402
from poet_opt.model.zoo import build_model  # noqa: E402
from poet_opt.schedule import validator  # noqa: E402
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, totals_of  # noqa: E402
from poet_opt.schedule.document import Schedule  # noqa: E402
from poet_opt.schedule.fit import check_weights_fit  # noqa: E402
from poet_opt.solver.driver import plain_summary, solve  # noqa: E402
from poet_opt.units import format_bytes, parse_size  # noqa: E402

# ---------------------------------------------------------------------------------------- the naive plan


def naive_decisions(graph: TrainingGraph) -> Decisions:
    """Plain training's keeps for everything but the weights; each ``param`` node (a layer's weights,
    or optimizer state) is read at its own stage and kept only until its first reader, then read
    again (a "recompute" of a param node is a storage read) in the stage of every later reader."""
    last, users = graph.last_use(), graph.users()
    keep, reread = set(), set()
    for i, node in enumerate(graph.nodes):
        if node.op == "param":
            first, *later = sorted(users[i])
            # the zoo puts a layer's weights right before the layer, so this keep is one stage long
            keep.update((t, i) for t in range(i + 1, first + 1))
            reread.update((t, i) for t in later)
        else:
            keep.update((t, i) for t in range(i + 1, last[i] + 1))
    return Decisions(frozenset(reread), frozenset(), frozenset(), frozenset(keep))


def naive_schedule(graph: TrainingGraph, device, *, model: str | None = None) -> Schedule:
    """The naive plan as a schedule, validated; its RAM budget is its own peak (it has no other)."""
    profile = load_profile(device) if isinstance(device, str) else device
    costs = node_costs(graph, profile)
    decisions = naive_decisions(graph)
    steps = build_steps(graph, decisions)
    totals = totals_of(graph, costs, steps)
    storage = float(profile.storage.capacity_bytes)
    budgets = Budgets(ram_bytes=totals["peak_ram_bytes"], runtime_s=float("inf"), storage_bytes=storage)
    schedule = Schedule(model=model or graph.name, mode="naive", graph=graph, profile=profile, costs=costs,
                        budgets=budgets, decisions=decisions, steps=steps, totals=totals,
                        plain=plain_summary(graph, costs), solver={"backend": "naive", "status": "naive"})
    validator.validate(schedule.to_dict())  # raises ScheduleInvalid on any broken rule or total
    return schedule


def streamed_graph(model: str, ram, *, trainable="all", input_shape=None, tile=None, device=None) -> TrainingGraph:
    """The graph `poet-opt solve --weights streamed` builds: layers over a quarter of --ram sliced,
    and, given the device, activations in strips where a node would not fit it otherwise
    (--strips auto)."""
    tile_bytes = parse_size(tile) if tile is not None else max(1, parse_size(ram) // 4)
    if device is None:
        return build_model(model, weights="streamed", trainable=trainable, input_shape=input_shape,
                           tile_bytes=tile_bytes)
    profile = load_profile(device) if isinstance(device, str) else device
    graph, _ = load_training_graph(model, batch_size=1, input_shape=input_shape, trainable=trainable, weights="streamed",
                                   tile_bytes=tile_bytes, device_ram_bytes=profile.memory.ram_bytes,
                                   stack_reserve_bytes=profile.memory.stack_reserve_bytes, ram_bytes=parse_size(ram))
    return graph


# ----------------------------------------------------------------------------- ours vs naive (STREAMING.md)

# model, input shape (None: the zoo's), device, --ram, --weight-tile (None: a quarter of --ram), why
CASES = [
    ("resnet18-cifar", None, "nrf52840", "200KiB", None, "the issue's target: activations in strips"),
    ("resnet18-cifar", "3x13x13", "nrf52840", "248KiB", None, "the largest input that fits, at the default tile"),
    ("mcu-vww", None, "nrf52840", "252KiB", None, "the device's RAM less the stack reserve"),
    ("mcu-vww", None, "nrf52840", "200KiB", None, "below what the naive plan needs"),
    ("mcu-vww", None, "stm32f746", "300KiB", None, "QSPI NOR flash: the naive plan fits"),
    ("mcu-vww", None, "stm32f746", "200KiB", None, "below what the naive plan needs"),
    ("mlp", None, "nrf52840", "200KiB", None, "1.28 MiB of weights through 200 KiB"),
]


def compare(model, input_shape, device, ram, tile=None, *, time_limit=300.0, gap=1e-3) -> dict:
    """One row: our plan at ``ram`` and the naive plan on the same graph, or why there is none."""
    profile = load_profile(device)
    row = {"model": model, "input_shape": input_shape, "device": device, "ram": ram, "tile": tile}
    graph = streamed_graph(model, ram, input_shape=input_shape, tile=tile, device=profile)
    row["nodes"] = len(graph)
    try:
        check_weights_fit(graph, profile)  # the CLI's refusal, before any solve
    except PoetError as exc:
        row["refused"] = exc.one_line()
        return row
    naive = naive_schedule(graph, profile, model=model)
    began = time.perf_counter()
    ours = solve(graph, profile, ram=ram, time_limit=time_limit, gap=gap, model_name=model)
    row["solve_s"] = time.perf_counter() - began
    validator.validate(ours.to_dict())
    for name, s in (("ours", ours), ("naive", naive)):
        t = s.totals
        row[name] = {"energy_j": t["energy_j"], "runtime_s": t["runtime_s"], "peak_ram_bytes": t["peak_ram_bytes"],
                     "read_bytes": t["storage_read_bytes"], "written_bytes": t["storage_written_bytes"],
                     "status": s.solver["status"], "gap": s.solver.get("gap"), "lifetime_steps": s.lifetime_steps()}
    row["plain"] = dict(ours.plain)
    naive_ram = naive.totals["peak_ram_bytes"]
    row["naive_fits_budget"] = naive_ram <= parse_size(ram)
    row["naive_fits_device"] = naive_ram + profile.memory.stack_reserve_bytes <= profile.memory.ram_bytes
    if row["naive_fits_device"] and naive_ram != parse_size(ram):
        # the same RAM as the naive plan: what planning alone saves, memory held equal
        same = solve(graph, profile, ram=naive_ram, time_limit=time_limit, gap=gap, model_name=model)
        validator.validate(same.to_dict())
        row["ours_at_naive_ram"] = {"energy_j": same.totals["energy_j"], "runtime_s": same.totals["runtime_s"],
                                    "status": same.solver["status"]}
    return row


def _mj(j: float) -> str:
    return f"{1e3 * j:,.0f}" if j >= 1 else f"{1e3 * j:.4g}"


def compare_table(rows: list[dict]) -> str:
    head = ("| model | device | --ram | ours mJ | naive mJ | ours/naive | ours s | naive s | ours/naive "
            "| read ours / naive | written | lifetime (steps) | naive's RAM | ours at naive's RAM: mJ, /naive "
            "| ours: status |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|")
    out = [head]
    for r in rows:
        what = r["model"] + (f" {r['input_shape']}" if r["input_shape"] else "")
        if r.get("tile"):
            what += f", tile {r['tile']}"
        if "refused" in r:
            out.append(f"| {what} | {r['device']} | {r['ram']} | refused | - | - | - | - | - | - | - | - | - | - "
                       f"| `{r['refused']}` |")
            continue
        o, n = r["ours"], r["naive"]
        naive_ram = format_bytes(n["peak_ram_bytes"]) + (
            "" if r["naive_fits_budget"] else " (over --ram)" if r["naive_fits_device"] else " (over the device)")
        gap = "" if o["gap"] is None else f" (gap {100 * o['gap']:.2g}%)"
        same = r.get("ours_at_naive_ram")
        if same:
            same_text = f"{_mj(same['energy_j'])}, {same['energy_j'] / n['energy_j']:.3f}"
        else:
            same_text = "as left" if r["naive_fits_device"] else "-"
        out.append(
            f"| {what} | {r['device']} | {r['ram']} | {_mj(o['energy_j'])} | {_mj(n['energy_j'])} "
            f"| {o['energy_j'] / n['energy_j']:.3f} | {o['runtime_s']:.3f} | {n['runtime_s']:.3f} "
            f"| {o['runtime_s'] / n['runtime_s']:.3f} | {format_bytes(o['read_bytes'])} / "
            f"{format_bytes(n['read_bytes'])} | {format_bytes(o['written_bytes'])} | {o['lifetime_steps']:,} "
            f"| {naive_ram} | {same_text} | {o['status']}{gap} |")
    return "\n".join(out)


# ------------------------------------------------------- ResNet-18 in strips: where the bytes go (traffic)


def traffic(graph: TrainingGraph, profile, ram) -> tuple[dict, dict]:
    """The spill plan of ``graph`` (the start that stands on graphs of thousands of nodes, where the
    full MILP is skipped), its totals, and what it moves, in bytes per network stage (``layerN``,
    or the stem and head) and kind: each weight's first read, weights read again (for a forward or
    a backward node), the input strips read, and activations and gradients paged in and out."""
    from collections import Counter, defaultdict

    from poet_opt.solver.driver import resolve_budgets
    from poet_opt.solver.heuristics import spill_plan

    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, parse_size(ram))
    steps = build_steps(graph, spill_plan(graph, costs, budgets))
    records = graph.meta["strips"].nodes

    def stage(node) -> str:
        record = records.get(node.name)
        layer = (record.tensor if record is not None else None) or node.name
        return layer.split(".")[0] if layer.startswith("layer") else "stem, head"

    moved: dict[str, Counter] = defaultdict(Counter)
    computed: set[int] = set()
    pending: list[dict] = []
    for step in steps + [{"op": "end", "node": None}]:
        pending.append(step)
        if step["op"] == "compute" and step["node"] in computed:
            continue
        if step["op"] not in ("compute", "end"):
            continue
        reader = None if step["node"] is None else graph.nodes[step["node"]]
        computed.add(step["node"])
        for s in pending:  # what the stage moves before the node it first computes
            node = graph.nodes[s["node"]] if s["node"] is not None else None
            if s["op"] == "compute" and node.op == "input":
                moved[stage(node)]["input read"] += node.bytes
            elif s["op"] == "compute" and node.op == "param":
                kind = "weights, first read" if s is step else f"weights read again ({reader.kind})"
                moved[stage(node)][kind] += node.bytes
            elif s["op"] in ("page_in", "page_out"):
                moved[stage(node)][f"{'paged in' if s['op'] == 'page_in' else 'paged out'} ({node.kind})"] += node.bytes
        pending = []
    return totals_of(graph, costs, steps), moved


def traffic_table(moved: dict) -> str:
    kinds = ["weights, first read", "weights read again (forward)", "weights read again (backward)",
             "paged in (forward)", "paged in (backward)", "paged out (forward)", "paged out (backward)", "input read"]
    out = ["| stage | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for name in sorted(moved) + ["all"]:
        row = {k: sum(m[k] for m in moved.values()) for k in kinds} if name == "all" else moved[name]
        out.append(f"| {name} | " + " | ".join(f"{row[k] / 2 ** 20:.2f}" for k in kinds) + " |")
    return "\n".join(out)


def traffic_report(ram="200KiB", device="nrf52840") -> str:
    """ResNet-18 in strips: the greedy low-memory order against the slice-block order the loader
    gives (model/strip_order.py), MiB moved per step by stage and kind."""
    from poet_opt.model.strips import low_memory

    profile = load_profile(device)
    blocks = streamed_graph("resnet18-cifar", ram, device=profile)
    counts = {int(h): k for h, k in blocks.meta["strips"].per_height.items()}
    greedy = low_memory(build_model("resnet18-cifar", weights="streamed", tile_bytes=parse_size(ram) // 4,
                                    strips=counts))
    out = []
    for label, graph in (("greedy low-memory order", greedy), ("slice-block order", blocks)):
        totals, moved = traffic(graph, profile, ram)
        out.append(f"**{label}**: {totals['energy_j']:.2f} J, {totals['runtime_s']:.0f} s, "
                   f"{format_bytes(totals['storage_read_bytes'])} read,\n"
                   f"{format_bytes(totals['storage_written_bytes'])} written, {totals['page_outs']:,} page-outs "
                   f"(MiB per step)\n\n{traffic_table(moved)}")
    return "\n\n".join(out)


# ------------------------------------------------------------------------ --trainable last:N (docs table)

TRAINABLE = ("all", "last:4", "last:2", "last:1")
# the MLP has four weighted layers, so last:4 is all: last:3 instead
TRAINABLE_CASES = [("mlp", "nrf52840", "200KiB", ("all", "last:3", "last:2", "last:1")),
                   ("mcu-vww", "nrf52840", "200KiB", TRAINABLE), ("mcu-vww", "stm32f746", "200KiB", TRAINABLE)]


def trainable_rows(model, device, ram, specs=TRAINABLE, *, input_shape=None, time_limit=120.0, gap=1e-3) -> list[dict]:
    """Our plan for each ``--trainable`` spec on the same device and budget."""
    profile = load_profile(device)
    rows = []
    for spec in specs:
        graph = streamed_graph(model, ram, trainable=spec, input_shape=input_shape)
        s = solve(graph, profile, ram=ram, time_limit=time_limit, gap=gap, model_name=model)
        validator.validate(s.to_dict())
        trained = {graph.nodes[p].name for n in graph.nodes for p in n.updates}
        frozen_params = [n for n in graph.nodes if n.op == "param" and n.name not in trained]
        rows.append({"model": model, "device": device, "ram": ram, "trainable": spec,
                     "energy_j": s.totals["energy_j"], "runtime_s": s.totals["runtime_s"],
                     "read_bytes": s.totals["storage_read_bytes"], "written_bytes": s.totals["storage_written_bytes"],
                     "erased_bytes": s.erased_bytes_per_step(), "lifetime_steps": s.lifetime_steps(),
                     "trained_param_bytes": sum(n.bytes for n in graph.nodes if n.name in trained),
                     "frozen_param_bytes": sum(n.bytes for n in frozen_params),
                     # bytes written by nodes that update frozen weights: none, by construction, shown
                     "frozen_written_bytes": sum(n.writes_bytes for n in graph.nodes
                                                 if any(graph.nodes[p].name not in trained for p in n.updates)),
                     "status": s.solver["status"], "gap": s.solver.get("gap")})
    return rows


def trainable_table(rows: list[dict]) -> str:
    out = ["| model, device, --ram | --trainable | energy mJ | runtime s | written / step | frozen weights "
           "| written to frozen | erased / step | lifetime (steps) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        life = "forever" if r["lifetime_steps"] is None else f"{r['lifetime_steps']:,}"
        out.append(f"| {r['model']}, {r['device']}, {r['ram']} | {r['trainable']} | {_mj(r['energy_j'])} "
                   f"| {r['runtime_s']:.3f} | {format_bytes(r['written_bytes'])} | {format_bytes(r['frozen_param_bytes'])} "
                   f"| {format_bytes(r['frozen_written_bytes'])} | {format_bytes(r['erased_bytes'])} | {life} |")
    return "\n".join(out)


BEGIN, END = "<!-- trainable-table: python benchmarks/streaming.py trainable --write docs/streaming.md -->", \
    "<!-- /trainable-table -->"


def write_between_markers(path: Path, table: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to fill")
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["naive", "trainable", "traffic"], default="naive")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per solve")
    parser.add_argument("--write", type=Path, default=None, help="trainable: replace the table in this document")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    if args.what == "traffic":
        print(traffic_report())
    elif args.what == "trainable":
        rows = []
        for model, device, ram, specs in TRAINABLE_CASES:
            rows += trainable_rows(model, device, ram, specs, time_limit=args.time_limit or 120.0)
            print(f"  {model} on {device}: done at {time.perf_counter() - began:.0f} s", file=sys.stderr)
        table = trainable_table(rows)
        print(table)
        if args.write:
            write_between_markers(args.write, table)
    else:
        rows = []
        for model, shape, device, ram, tile, _why in CASES:
            rows.append(compare(model, shape, device, ram, tile, time_limit=args.time_limit or 300.0))
            print(f"  {model} on {device} at {ram}: done at {time.perf_counter() - began:.0f} s", file=sys.stderr)
        print(compare_table(rows))
    print(f"\n{time.perf_counter() - began:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
