"""One plan's SD card wear under both card models (docs/wear.md): each write command rewriting
every allocation unit it touches (`sequential_writes: false`, the wear model before 2026-11-26),
and the step's writes appended as one sequential log (`sequential_writes: true`, the nRF52840's
profile now). Reads schedule files written by `poet-opt solve --out`:

    python benchmarks/wear_log.py /tmp/r18.json /tmp/bert.json    # seconds

The headline plans (long: minutes each, run one at a time):

    poet-opt solve --model resnet18-cifar --device nrf52840 --ram 200KiB --time-limit 60 --min-lifetime-steps 100000 --out /tmp/r18.json
    poet-opt solve --model bert-base --device nrf52840 --ram 200KiB --time-limit 600 --min-lifetime-steps 10000 --out /tmp/bert.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from poet_opt.device.media import erased_bytes, step_erased_bytes  # noqa: E402
from poet_opt.units import format_bytes  # noqa: E402


def wear(doc: dict) -> dict:
    device, nodes = doc["device"], doc["graph"]["nodes"]
    block = device["erase_block_bytes"]
    written = [s["node"] for s in doc["steps"] if s["op"] == "page_out"]
    written += [p for s in doc["steps"] if s["op"] == "compute" for p in nodes[s["node"]].get("updates", ())]
    sizes = [nodes[n]["bytes"] for n in written]
    per_command = int(erased_bytes(sizes, device["storage_kind"], True, block).sum())
    logged = step_erased_bytes(float(erased_bytes(sizes, device["storage_kind"], True, block, sequential=True).sum()),
                               block, True)
    absorbed = device["endurance_cycles"] * device["storage_capacity_bytes"]
    return {"writes": len(written), "written": sum(sizes), "per_command": per_command, "logged": logged,
            "lifetime_per_command": absorbed // per_command, "lifetime_logged": absorbed // logged,
            "energy_j": doc["totals"]["energy_j"], "wear_budget": doc["solver"].get("wear_budget")}


def main(paths: list[str]) -> None:
    print(f"{'schedule':28} {'writes':>7} {'written':>10} {'worn, per command':>18} {'lifetime':>9} "
          f"{'worn, log':>10} {'lifetime':>9} {'energy J':>9}  wear budget")
    for path in paths:
        w = wear(json.loads(Path(path).read_text()))
        budget = w["wear_budget"] or {}
        note = (f"{budget['min_lifetime_steps']:,} steps, cost {budget['cost_j']:.4g} J"
                f"{' (binds)' if budget.get('binds') else ''}" if budget else "-")
        print(f"{Path(path).name:28} {w['writes']:>7,} {format_bytes(w['written']):>10} "
              f"{format_bytes(w['per_command']):>18} {w['lifetime_per_command']:>9,} "
              f"{format_bytes(w['logged']):>10} {w['lifetime_logged']:>9,} {w['energy_j']:>9.4g}  {note}")


if __name__ == "__main__":
    main(sys.argv[1:])
