"""bert-base fine-tuned on an nRF52840 with its (seq, d) tensors tiled by rows (docs/streaming.md,
"Row tiling"): the figures of that section.

    python benchmarks/rows.py          # about 3 minutes on 2 cores

It runs, each in a child process so that its peak memory (RSS) is its own:

1. `poet-opt solve --model bert-base --device nrf52840 --ram 200KiB --time-limit 60`, which plans
   on the stock board and its 8 GB card (paged tensors packed in 512-byte sectors, device/media.py);
2. the same on `benchmarks/profiles/nrf52840-64gb.yaml` (the board with a 64 GB card): the same
   plan, eight times the lifetime;
3. `--device stm32f746`, refused at once: its 16 MiB QSPI flash cannot hold the weights;
4. `--model transformer-block` (one encoder block) on the stock nrf52840, which plans.

and prints the plan's figures: nodes, energy and runtime against plain training, bytes read and
written per step, lifetime, solve time and peak RSS.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POET = str(Path(sys.executable).with_name("poet-opt"))


def run(*args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """The command's result, wall-clock seconds and the peak RSS (GiB) of the child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    began = time.perf_counter()
    done = subprocess.run([POET, *args], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return done, wall, max(peak, before) / 2 ** 20


def report(label: str, args: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        done, wall, rss = run(*args, "--json", "--out", str(out))
        if done.returncode:
            sys.exit(done.stderr)
        summary = json.loads(done.stdout)
        doc = json.loads(out.read_text())
    totals, plain, memory = summary["totals"], summary["plain"], summary["memory"]
    nodes = doc["graph"]["nodes"]
    print(f"{label}: solved in {wall:.1f} s wall clock, peak RSS {rss:.2f} GiB (of the largest child so far)")
    blocks = len({n["name"].split("@r")[1].split("@")[0] for n in nodes if n["name"].startswith("input@r")})
    print(f"  nodes {len(nodes):,}, steps {len(doc['steps']):,}, {blocks} row block(s)")
    print(f"  energy {totals['energy_j']:.2f} J, plain {plain['energy_j']:.2f} J "
          f"({totals['energy_j'] / plain['energy_j']:.2f}x)")
    print(f"  runtime {totals['runtime_s']:.0f} s, plain {plain['runtime_s']:.0f} s "
          f"({totals['runtime_s'] / plain['runtime_s']:.3f}x)")
    print(f"  read {totals['storage_read_bytes'] / 2 ** 20:.0f} MiB, written "
          f"{totals['storage_written_bytes'] / 2 ** 20:.1f} MiB per step; "
          f"lifetime {summary.get('lifetime_steps')} steps (worst-case wear), "
          f"{memory['stored_bytes'] / 2 ** 20:,.0f} MiB stored of {memory['storage_capacity_bytes'] / 2 ** 30:.2f} GiB")
    print(f"  memory: total {memory['total_bytes']:,} B, fits device {memory['fits_device']}, peak "
          f"{totals['peak_ram_bytes']:,} B, plain peak {plain['peak_ram_bytes']:,} B")
    print(f"  page-outs {sum(s['op'] == 'page_out' for s in doc['steps']):,}, recomputations "
          f"{sum(1 for s in doc['steps'] if s['op'] == 'compute') - len(nodes):,}; "
          f"status {summary['solver']['status']}")


def main() -> None:
    common = ["solve", "--model", "bert-base", "--ram", "200KiB", "--time-limit", "60", "-q"]
    report("bert-base, nrf52840 (its 8 GB card)", [*common, "--device", "nrf52840"])
    done, wall, _ = run(*common[:-1], "--device", "stm32f746", "-q")
    print(f"stm32f746: exit {done.returncode} after {wall:.1f} s\n  {done.stderr.strip()}")
    report("bert-base, nrf52840 with a 64 GB card", [*common, "--device", "benchmarks/profiles/nrf52840-64gb.yaml"])
    report("transformer-block, nrf52840", ["solve", "--model", "transformer-block", "--ram", "200KiB", "--time-limit",
                                           "60", "-q", "--device", "nrf52840"])


if __name__ == "__main__":
    main()
