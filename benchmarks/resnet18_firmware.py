"""ResNet-18 (CIFAR) trained one SGD step by the generated firmware on the emulated nRF52840 at
200 KiB, from `--torch` and from `--model`, against one torch.optim.SGD step on the same module and
batch: the figures of benchmarks/FIRMWARE.md, "ResNet-18 on the nRF52840".

    python benchmarks/resnet18_firmware.py [--source torch|model|both] [--ram 200KiB]

Minutes to tens of minutes on a 2-core machine (the emulated step is tens of billions of
instructions); not a test. Prints one line per source and exits non-zero when the firmware's
weights differ from torch's by more than 1e-4 of the largest weight.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SPEC = "poet_opt.examples.torch_models:resnet18"
COMMON = ["--device", "nrf52840", "--steps", "1", "--lr", "0.01"]


def torch_step(source: str, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """One torch.optim.SGD step on the module the source's run builds: for --torch, the factory
    itself (the seeded twin only equals it because the factory seeds torch's generator)."""
    import torch

    from poet_opt.examples.torch_models import resnet18
    from poet_opt.model.zoo_twins import zoo_module

    module = resnet18() if source == "torch" else zoo_module("resnet18-cifar")
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("torch", "model", "both"), default="both")
    parser.add_argument("--ram", default="200KiB", help="the RAM budget (the issue's: 200KiB)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="poet-resnet18-"))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1, 3, 32, 32)).astype(np.float32), np.array([3])
    np.savez(work / "B.npz", x=x, y=y)
    failed = False
    sources = {"torch": ["--torch", SPEC, "--input-shape", "1,3,32,32"], "model": ["--model", "resnet18-cifar"]}
    for name in (("torch", "model") if args.source == "both" else (args.source,)):
        want = torch_step(name, x, y)
        largest = max(float(np.abs(w).max()) for w in want.values())
        out = work / name
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "poet_opt.cli", "emulate", *sources[name], *COMMON, "--ram", args.ram, "--data",
                               str(work / "B.npz"), "--weights-out", str(out / "W.npz"), "--json", "-o", str(out)],
                              capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            print(f"{name:6} exit {done.returncode}: {done.stderr.strip().splitlines()[-1]}")
            failed = True
            continue
        summary = json.loads(done.stdout)
        with np.load(out / "W.npz") as trained:
            worst = max(float(np.abs(trained[n] - w).max()) for n, w in want.items())
        program = (out / "poet_program.bin").stat().st_size if (out / "poet_program.bin").exists() else 0
        print(f"{name:6} exit 0 in {wall:,.0f} s: loss {summary['loss'][0]:.6f}, max |firmware - torch| "
              f"{worst / largest:.2e} of the largest weight, RAM {summary['ram_used_bytes']:,} B of "
              f"{summary['ram_device_bytes']:,} B, {summary['instructions'] / 1e9:,.2f} G instructions"
              + (f", {summary['cycles'] / 1e9:,.2f} G cycles est." if "cycles" in summary else "")
              + (f", predicted {summary['predicted_runtime_s_per_step']:,.0f} s a step"
                 if "predicted_runtime_s_per_step" in summary else "")
              + f", strips {summary.get('strips')}, {len(summary.get('tiles', {}))} layers in slices, "
              f"step program {program / 2**20:.2f} MiB on storage; storage read {summary['flash_bytes_read'] / 2**20:,.1f} MiB,"
              f" written {summary['flash_bytes_written'] / 2**20:,.1f} MiB")
        failed |= worst > 1e-4 * largest or summary["ram_used_bytes"] > 262144
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
