"""Human-readable and JSON summaries of a schedule."""

from __future__ import annotations

import math
from typing import Optional

from poet_opt.device.media import packs_sectors, storage_logs, wear_levelled
from poet_opt.schedule.decisions import lifetime_steps
from poet_opt.schedule.document import Schedule
from poet_opt.units import format_bytes, format_joules, format_seconds


def summary_dict(s: Schedule) -> dict:
    t, plain, mem = s.totals, s.plain, s.memory()
    names = [n.name for n in s.graph.nodes]
    runtime_budget = s.budgets.runtime_s if math.isfinite(s.budgets.runtime_s) else None
    return {
        "model": s.model,
        "device": s.profile.name,
        "mode": s.mode,
        "budgets": {"ram_bytes": int(s.budgets.ram_bytes), "runtime_s": runtime_budget,
                    "min_lifetime_steps": s.budgets.min_lifetime_steps},
        # training steps until the storage wears out under this plan; null when nothing is written
        "lifetime_steps": s.lifetime_steps(),
        "totals": t,
        "plain": plain,
        "energy_vs_plain": _ratio(t["energy_j"], plain["energy_j"], None),
        "runtime_vs_plain": _ratio(t["runtime_s"], plain["runtime_s"], None),
        "memory": mem,
        "recomputed": [names[i] for i in s.recomputed_nodes()],
        "paged": [names[i] for i in s.paged_nodes()],
        "solver": s.solver,
        "lower_bound": _lower_bound(s),
    }


def _lower_bound(s: Schedule) -> dict:
    """How far the schedule can be from the best one: the solver's proven bound (its dual bound, at
    least the LP relaxation once the root is solved, and never below plain training) and the
    plain-training floor itself."""
    energy, bound = s.totals["energy_j"], s.solver.get("bound")
    floor = s.solver.get("plain_floor_j", s.plain["energy_j"])
    return {"energy_j": energy, "bound_j": bound, "gap": s.solver.get("gap"), "plain_floor_j": floor,
            "above_floor": _ratio(energy - floor, energy, None)}


def summary_text(s: Schedule) -> str:
    t, plain, mem, solver = s.totals, s.plain, s.memory(), s.solver
    names = [n.name for n in s.graph.nodes]
    lines = []
    lines.append(f"{s.model} on {s.profile.name} ({s.profile.cpu}), mode {s.mode}: "
                 f"{len(s.graph)} nodes, {len(s.steps)} steps")
    ratio = _ratio(t["energy_j"], plain["energy_j"])
    lines.append(f"  energy   {format_joules(t['energy_j'])} ({ratio:.3f}x plain training's "
                 f"{format_joules(plain['energy_j'])}): compute {format_joules(t['compute_j'])}, "
                 f"page-in {format_joules(t['page_in_j'])}, page-out {format_joules(t['page_out_j'])}")
    budget = s.budgets.runtime_s
    budget_text = "no limit" if not math.isfinite(budget) else f"budget {format_seconds(budget)}"
    lines.append(f"  runtime  {format_seconds(t['runtime_s'])} ({_ratio(t['runtime_s'], plain['runtime_s']):.3f}x plain), "
                 f"{budget_text}")
    lines.append(f"  RAM      peak {format_bytes(t['peak_ram_bytes'])} of budget {format_bytes(s.budgets.ram_bytes)} "
                 f"(plain training peaks at {format_bytes(plain['peak_ram_bytes'])})")
    state = mem.get("optimizer_state_bytes") or 0
    state_text = f" (with optimizer state {format_bytes(state)})" if state else ""
    reserve = mem.get("stack_reserve_bytes") or 0
    reserve_text = f" + stack reserve {format_bytes(reserve)}" if reserve else ""
    need = mem["total_bytes"] + reserve
    verdict = (f"fits, {format_bytes(mem['device_ram_bytes'] - need)} to spare" if mem["fits_device"]
               else f"DOES NOT FIT, {format_bytes(need - mem['device_ram_bytes'])} over; train fewer layers "
                    "(--trainable) or give a smaller --ram")
    if mem.get("weights") == "streamed":
        held = mem["resident_at_peak"]
        lines.append(f"  device   working peak (weights {format_bytes(held['weights'])}, optimizer state "
                     f"{format_bytes(held['optimizer_state'])}, activations {format_bytes(held['activations'])}, "
                     f"gradients {format_bytes(held['gradients'])} at the peak){reserve_text} = {format_bytes(need)} "
                     f"of the device's {format_bytes(mem['device_ram_bytes'])}: {verdict}")
        lines.append(f"  weights  streamed: {format_bytes(mem['streamed_param_bytes'])} of weights and optimizer state "
                     f"on {s.profile.storage.kind}, updated in place ({s.graph.meta.get('optimizer', 'sgd')}); per step "
                     f"{format_bytes(t['storage_read_bytes'])} read, {format_bytes(t['storage_written_bytes'])} written")
    else:
        lines.append(f"  device   weights {format_bytes(mem['param_bytes'])}{state_text} + weight gradients "
                     f"{format_bytes(mem['param_grad_bytes'])} + working peak{reserve_text} = {format_bytes(need)} "
                     f"of the device's {format_bytes(mem['device_ram_bytes'])}: {verdict}")
    lifetime = s.lifetime_steps()
    if lifetime is not None or s.budgets.min_lifetime_steps is not None:
        want = s.budgets.min_lifetime_steps
        levelled = "with" if wear_levelled(s.profile.storage) else "without"
        block = format_bytes(s.profile.storage.erase_block_bytes)
        packed = packs_sectors(s.profile.storage.kind, wear_levelled(s.profile.storage))
        cache = bool(s.profile.storage.write_cache)
        log = storage_logs(s.profile.storage)
        lines.append(f"  wear     {format_bytes(s.erased_bytes_per_step())} erased per step ("
                     + ("the sectors written, gathered by the write cache" if packed and cache
                        else f"the {block} allocation units the step's sequential log fills" if log
                        else f"every {block} allocation unit each write can touch, a worst case" if packed
                        else f"each written region in whole {block} erase blocks") + "): the "
                     f"{s.profile.storage.kind} lasts "
                     + ("forever (nothing written)" if lifetime is None else f"{lifetime:,} training steps")
                     + f" ({levelled} wear levelling, {s.profile.storage.endurance_cycles:,} cycles)"
                     + (f", at least {want:,} asked" if want else "")
                     + (_merged_lifetime(s) if packed and not cache and not log and lifetime is not None else ""))
        cost = _wear_cost(s.solver)
        if cost:
            lines.append(cost)
    if not mem.get("fits_storage", True):
        lines.append(f"  storage  DOES NOT FIT: {format_bytes(mem['stored_bytes'])} stored, the device has "
                     f"{format_bytes(mem['storage_capacity_bytes'])}")
    rec, paged = s.recomputed_nodes(), s.paged_nodes()
    lines.append(f"  remat    {_count(t['recomputes'], 'recomputation')} of {_count(len(rec), 'node')}"
                 f"{_names(names, rec)}")
    lines.append(f"  paging   {_count(t['page_outs'], 'page-out')}, {_count(t['page_ins'], 'page-in')} "
                 f"({format_bytes(t['storage_bytes'])} on {s.profile.storage.kind}){_names(names, paged)}")
    low = _lower_bound(s)
    gap_text = "-" if low["gap"] is None else f"{100 * low['gap']:.3g}%"
    bound_text = "-" if low["bound_j"] is None else format_joules(low["bound_j"])
    lines.append(f"  bound    energy {format_joules(low['energy_j'])}, bound {bound_text} (gap {gap_text}), "
                 f"plain-training floor {format_joules(low['plain_floor_j'])}")
    lines.append(f"  claim    {claim(s)}")
    lines.append(f"  solver   {solver['backend']} {solver['status']}, "
                 f"build {solver['build_s']:.2f} s, solve {solver['solve_s']:.2f} s "
                 + (f"({solver['variables']} variables, {solver['constraints']} constraints)"
                    if solver.get("variables") is not None else f"(full MILP {solver.get('full_milp')})"))
    return "\n".join(lines)


def claim(s: Schedule) -> str:
    """What was proven about this schedule, in words, for which execution order and under which
    model of the device: the sentence a user may quote."""
    solver = s.solver
    status, gap = solver.get("status"), solver.get("gap")
    model = f"under {s.profile.name}'s cost model"
    order = solver.get("execution_order", "given")
    tried = solver.get("orders_tried", 1)
    where = f"in the {order} execution order" + (f" (best of {tried} orders tried)" if tried > 1 else "")
    gap_text = "-" if gap is None else f"{100 * gap:.3g}%"
    if status == "optimal":
        return (f"optimal {model}: it needs only plain training's energy, which no valid step sequence in any "
                "order can go below")
    if status == "optimal_for_order":
        return (f"optimal {where} {model}; another execution order, or steps outside the stage model "
                f"(docs/formulation.md), might use less, by at most {100 * (solver.get('gap_any_order') or 0):.3g}%")
    if status == "gap_limit":
        any_order = solver.get("gap_any_order")
        if any_order is not None and gap is not None and any_order <= gap * (1 + 1e-9):
            # the bound is plain training's energy, which no step sequence in any order goes below
            return f"within {gap_text} of the least energy in any execution order {model}"
        return f"within {gap_text} of the least energy {where} {model}"
    reason = {"time_limit": "the time limit ran out", "interrupted": "interrupted",
              "stopped": "the solver stopped at its tolerances"}.get(status, status)
    if status in ("time_limit", "stopped") and str(solver.get("full_milp", "")).startswith("skipped"):
        # the limit did not run out on a search: the graph is too large for the full MILP in it
        within = "in memory" if status == "stopped" else "and solve within the time limit"
        reason = f"the best heuristic schedule: the full MILP is too large to build {within}"
    return f"not proven optimal ({reason}); within {gap_text} of the least energy {where} {model}"


def _wear_cost(solver: dict) -> Optional[str]:
    """The summary's line on what the wear budget cost (solver/wear_budget.py), or None without one."""
    wear = solver.get("wear_budget")
    if not wear:
        return None
    steps = f"{wear['min_lifetime_steps']:,} steps"
    if wear.get("most_worn_bytes") is not None:
        return (f"  wear cost none: the budget of {steps} cannot bind (paging every tensor once a step would "
                f"wear {format_bytes(wear['most_worn_bytes'])}, and still last that long); one solve")
    if not wear["binds"]:
        lasts = wear.get("lifetime_without")
        return ("  wear cost none: the plan without the budget already lasts "
                + ("forever" if lasts is None else f"{lasts:,} steps") + f", at least {steps}; "
                "one solve, in half the time limit (the other half was kept for a budgeted solve)")
    without = wear["energy_without_j"]
    share = wear["cost_j"] / without if without else math.nan
    return (f"  wear cost {format_joules(wear['cost_j'])} ({100 * share:+.3g}%) for {steps}: the plan without the "
            f"budget uses {format_joules(without)} and lasts {wear['lifetime_without']:,} steps; two solves "
            "sharing the time limit")


def _merged_lifetime(s: Schedule) -> str:
    """The other end of the range: a card whose controller gathers a step's writes into whole
    allocation units wears only the bytes written."""
    storage, written = s.profile.storage, s.totals.get("storage_written_bytes")
    if not written:
        return ""
    best = lifetime_steps(storage, -(-int(written) // storage.erase_block_bytes) * storage.erase_block_bytes)
    return f"; {best:,} if the card gathers the {format_bytes(written)} a step writes into whole units"


def _names(names: list[str], ids: list[int], limit: int = 8) -> str:
    if not ids:
        return ""
    shown = ", ".join(names[i] for i in ids[:limit])
    more = f", +{len(ids) - limit} more" if len(ids) > limit else ""
    return f": {shown}{more}"


def _ratio(value: float, reference: float, empty=float("nan")):
    """value / reference; a graph whose nodes all cost nothing has no meaningful ratio."""
    return value / reference if reference else empty


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
