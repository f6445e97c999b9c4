"""The time limit and the memory of a solve at 10^5-10^6 nodes (issue 28, defect 8; run by hand).

A node-link graph of N nodes and no edges (the issue's reproducer), solved on rpi4 with a RAM
budget it fits plainly, once per time limit, each in a process of its own: the graph file's size,
the load time, solve()'s wall time against limit x 1.05 + 2 s, what it returned (a status, or the
refusal naming --time-limit), and the process's peak resident memory. Prints one Markdown table.

    .venv/bin/python benchmarks/huge_graph.py                       # 10^6 nodes, limits 10 and 600 s
    .venv/bin/python benchmarks/huge_graph.py --nodes 100000 --limits 3,10,30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_ONE = r"""
import json, resource, sys, time
began = time.perf_counter()
from poet_opt.device.profiles import load_profile
from poet_opt.errors import PoetError
from poet_opt.model.node_link import load_node_link
from poet_opt.solver.driver import solve
graph = load_node_link(sys.argv[1])
loaded = time.perf_counter()
row = {"load_s": loaded - began, "load_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
try:
    schedule = solve(graph, load_profile("rpi4"), ram="2GB", time_limit=float(sys.argv[2]))
    row["result"] = schedule.solver["status"]
except PoetError as exc:
    row["result"] = exc.one_line()
row["solve_s"] = time.perf_counter() - loaded
row["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(row))
"""


def flat_graph(n: int, path: Path) -> None:
    with open(path, "w") as fh:
        fh.write('{"nodes": [')
        fh.write(",".join(f'{{"id": {i}, "name": "n{i}", "backward": false, "cost_cpu": 0.001, "cost_ram": 1024}}'
                          for i in range(n)))
        fh.write('], "links": []}')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--limits", default="10,600", help="seconds, comma-separated")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"flat{args.nodes}.json"
        flat_graph(args.nodes, path)
        size = path.stat().st_size
        print(f"{args.nodes:,} nodes, no edges: {size / 2**20:.0f} MiB of node-link JSON\n")
        print("| limit s | load s | solve s | within limit x 1.05 + 2 s | result | peak RSS MiB (after load) |")
        print("|---|---|---|---|---|---|")
        for limit in (float(v) for v in args.limits.split(",")):
            run = subprocess.run([sys.executable, "-c", _ONE, str(path), str(limit)], capture_output=True, text=True)
            if run.returncode != 0:
                print(f"| {limit:g} | failed: {run.stderr.strip().splitlines()[-1]} |")
                continue
            row = json.loads(run.stdout.strip().splitlines()[-1])
            within = "yes" if row["solve_s"] <= 1.05 * limit + 2 else "NO"
            print(f"| {limit:g} | {row['load_s']:.1f} | {row['solve_s']:.1f} | {within} | {row['result']} | "
                  f"{row['rss_mib']:.0f} ({row['load_rss_mib']:.0f}) |", flush=True)


if __name__ == "__main__":
    main()
