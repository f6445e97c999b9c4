"""Instructions and estimated cycles per multiply-accumulate of the fp32 kernels on the emulated
Cortex-M, per kernel and layer shape, against an earlier revision's kernels.

Each kernel runs inside a small harness (HARNESS below) on random data, once and twice; the
difference of the two runs is one call, so reset, start-up and the host's data cancel. Shapes are
mcu-vww's layers, ResNet-18 (CIFAR) strip convolutions as poet-opt's strips cut them (rows of a
stage plus their halo, padded along W only), and a transformer block's linear layers at d=256,
FFN 1024. "before" builds the same harness against the kernels of ``--before REV``
(``git show REV:poet_opt/firmware/kernels/...``); the kernels' C signatures are the same in both.
``backward_input_set`` (depthwise shapes, the one-row head) is a gradient buffer's first
contribution, dx = the data gradient: ``poet_conv2d_backward_input_set`` (``poet_linear_...``)
where the kernels have it, else what the generator emitted before it, ``poet_zero`` and the
accumulating kernel. The strip executor's depthwise windows (padding 0 along H) are measured
without ``backward_input``: the executor writes a window's data gradient into its scratch
(``poet_conv2d_backward_input_set``) and emits the accumulating kernel for no such shape.

    python benchmarks/kernels.py                         # M4F, before = main, the markdown table
    python benchmarks/kernels.py --cores cortex-m4f cortex-m7f --before main --only linear
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from poet_opt.firmware.build import build_firmware  # noqa: E402
from poet_opt.firmware.emulator import Emulator  # noqa: E402
from poet_opt.firmware.targets import Target  # noqa: E402
from poet_opt.firmware.toolchain import KERNEL_DIR  # noqa: E402

HARNESS = r"""
#include <stdint.h>
#include "poet_kernels.h"

volatile int32_t kernel_id, reps;
poet_conv2d_shape cs;            /* conv kernels */
uint32_t dims[3];                /* linear kernels: rows, in, out */
float pool[POOL_FLOATS];         /* random data from the host */

int main(void)
{
    const uint32_t rows = dims[0], in = dims[1], out = dims[2];
    const uint32_t nx = kernel_id < 10 ? cs.n * cs.c_in * cs.h_in * cs.w_in : rows * in;
    const uint32_t nw = kernel_id < 10 ? cs.c_out * (cs.c_in / cs.groups) * cs.k_h * cs.k_w : out * in;
    const uint32_t nb = kernel_id < 10 ? cs.c_out : out;
    const uint32_t ny = kernel_id < 10 ? cs.n * cs.c_out * cs.h_out * cs.w_out : rows * out;
    float *x = pool, *w = x + nx, *b = w + nw, *y = b + nb, *g = y + ny, *gb = g + (nx > nw ? nx : nw);
    int32_t r;
    for (r = 0; r < reps; ++r)
        switch (kernel_id) {
        /* the zoo's convolutions have no bias (batch norm follows), its linear layers do */
        case 0: poet_conv2d_forward(y, x, w, NULL, &cs); break;
        case 1: poet_conv2d_backward_input(g, y, w, &cs); break;
        case 2: poet_conv2d_backward_params(g, NULL, y, x, &cs); break;
        case 3: poet_conv2d_backward_params_sgd(w, NULL, y, x, &cs, 1e-3f); break;
        /* a gradient buffer's first contribution: dx = the data gradient. Kernels without
         * poet_conv2d_backward_input_set (before it) take what the generator emitted then. */
#ifdef POET_CONV2D_BACKWARD_INPUT_SET
        case 4: poet_conv2d_backward_input_set(g, y, w, &cs); break;
#else
        case 4: poet_zero(g, nx); poet_conv2d_backward_input(g, y, w, &cs); break;
#endif
        case 10: poet_linear_forward(y, x, w, b, rows, in, out); break;
        case 11: poet_linear_backward_input(g, y, w, rows, in, out); break;
        case 12: poet_linear_backward_params(g, gb, y, x, rows, in, out); break;
        case 13: poet_linear_backward_params_sgd(w, b, y, x, rows, in, out, 1e-3f); break;
#ifdef POET_LINEAR_BACKWARD_INPUT_SET
        case 14: poet_linear_backward_input_set(g, y, w, rows, in, out); break;
#else
        case 14: poet_zero(g, nx); poet_linear_backward_input(g, y, w, rows, in, out); break;
#endif
        default: return 1;
        }
    return 0;
}
"""

KERNELS = {"forward": 0, "backward_input": 1, "backward_input_set": 4, "backward_params": 2, "backward_params_sgd": 3}
KERNEL_FILES = ("poet_kernels.h", "poet_kernels_basic.c", "poet_kernels_conv.c", "poet_kernels_norm.c",
                "poet_kernels_strips.c", "poet_math.c")
POOL_FLOATS = 1_400_000


@dataclass(frozen=True)
class Conv:
    name: str
    n: int
    c_in: int
    h: int
    w: int
    c_out: int
    k: int
    stride: int
    pad_h: int
    pad_w: int
    groups: int = 1

    def out(self, size: int, pad: int) -> int:
        return (size + 2 * pad - self.k) // self.stride + 1

    def fields(self) -> list[int]:
        ho, wo = self.out(self.h, self.pad_h), self.out(self.w, self.pad_w)
        return [self.n, self.c_in, self.h, self.w, self.c_out, ho, wo, self.k, self.k, self.stride, self.stride,
                self.pad_h, self.pad_w, self.groups]

    def depthwise(self) -> bool:
        return self.groups == self.c_in == self.c_out

    def macs(self) -> int:
        f = self.fields()
        return f[0] * f[4] * f[5] * f[6] * (self.c_in // self.groups) * self.k * self.k


@dataclass(frozen=True)
class Linear:
    name: str
    rows: int
    d_in: int
    d_out: int

    def macs(self) -> int:
        return self.rows * self.d_in * self.d_out


# mcu-vww (poet_opt/model/zoo.py, 1x96x96, batch 1): the stem, the pointwise and depthwise layers
# of the first and middle blocks, the last depthwise (a 3x3 plane), and the head; the depthwise
# layers' strip windows.
# ResNet-18-CIFAR strips: a stage's 3x3 conv over a strip of rows with their one-row halo on each
# side (pad along H is 0 inside a strip, 1 along W), and the 1x1 stride-2 downsample.
# Transformer block at d=256, FFN 1024, 32 tokens (a row tile of the sequence).
SHAPES: list[Conv | Linear] = [
    Conv("vww conv0 1->4 3x3/2 96x96", 1, 1, 96, 96, 4, 3, 2, 1, 1),
    Conv("vww ds1.dw 4 3x3/2 48x48", 1, 4, 48, 48, 4, 3, 2, 1, 1, groups=4),
    Conv("vww ds1.pw 4->8 1x1 24x24", 1, 4, 24, 24, 8, 1, 1, 0, 0),
    Conv("vww ds3.pw 16->32 1x1 6x6", 1, 16, 6, 6, 32, 1, 1, 0, 0),
    Conv("vww ds4.dw 32 3x3 6x6", 1, 32, 6, 6, 32, 3, 1, 1, 1, groups=32),
    Conv("vww ds6.pw 64->64 1x1 3x3", 1, 64, 3, 3, 64, 1, 1, 0, 0),
    Linear("vww fc 64->2", 1, 64, 2),
    # mcu-vww's depthwise layers as the strip executor runs them: a window of output rows with
    # their input rows (halo included, padding 0 along H, 1 along W), as chunk_rows cuts them
    Conv("vww ds1.dw 4 3x3/2 strip 4x24", 1, 4, 9, 48, 4, 3, 2, 0, 1, groups=4),
    Conv("vww ds2.dw 8 3x3/2 strip 4x12", 1, 8, 9, 24, 8, 3, 2, 0, 1, groups=8),
    Conv("vww ds4.dw 32 3x3 strip 3x6", 1, 32, 5, 6, 32, 3, 1, 0, 1, groups=32),
    Conv("r18 layer1 64->64 3x3 strip 8x32", 1, 64, 10, 32, 64, 3, 1, 0, 1),
    Conv("r18 layer2 128->128 3x3 strip 4x16", 1, 128, 6, 16, 128, 3, 1, 0, 1),
    Conv("r18 layer3.ds 128->256 1x1/2 16x16", 1, 128, 16, 16, 256, 1, 2, 0, 0),
    Linear("xfmr qkv/out 256->256 x32", 32, 256, 256),
    Linear("xfmr ffn.fc1 256->1024 x32", 32, 256, 1024),
    Linear("xfmr ffn.fc2 1024->256 x32", 32, 1024, 256),
]


def kernel_dir_at(rev: str, dest: Path) -> Path:
    """The kernels of git revision ``rev``, written to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in KERNEL_FILES:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:poet_opt/firmware/kernels/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (dest / name).write_text(text)
    return dest


def build(kernel_dir: Path, core: str, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    harness = out / "bench_harness.c"
    harness.write_text(HARNESS)
    target = Target(core, ram_bytes=8 << 20)
    sources = [harness, *sorted(kernel_dir.glob("*.c"))]
    return build_firmware(sources, target, out, name="bench", include_dirs=[kernel_dir],
                          defines={"POOL_FLOATS": POOL_FLOATS}, cflags=["-fno-math-errno"])


def measure(fw, shape: Conv | Linear, kernel: str, rng) -> tuple[int, int | None, float]:
    """(instructions, estimated cycles or None, emulated instructions per second) of one call."""
    emu = Emulator(fw, watch_stack=False)
    pool = (rng.standard_normal(POOL_FLOATS) * 0.1).astype(np.float32)
    results = []
    for reps in (1, 2):
        emu.write_symbol("pool", pool)
        emu.write_symbol("reps", np.int32(reps))
        if isinstance(shape, Conv):
            emu.write_symbol("kernel_id", np.int32(KERNELS[kernel]))
            emu.write_symbol("cs", np.array(shape.fields(), dtype=np.uint32))
        else:
            emu.write_symbol("kernel_id", np.int32(10 + KERNELS[kernel]))
            emu.write_symbol("dims", np.array([shape.rows, shape.d_in, shape.d_out], dtype=np.uint32))
        results.append(emu.run(max_instructions=4 * 10**9))
    emu.close()
    assert all(r.exit_code == 0 for r in results)
    instructions = results[1].instructions - results[0].instructions
    cycles = None
    if getattr(results[1], "cycles", None) is not None:
        cycles = results[1].cycles - results[0].cycles
    rate = results[1].instructions / max(results[1].wall_time_s, 1e-9)
    return instructions, cycles, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", nargs="+", default=["cortex-m4f"])
    ap.add_argument("--before", default="main", help="git revision of the 'before' kernels ('' to skip)")
    ap.add_argument("--only", default="", help="substring of the shape names to run")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS))
    args = ap.parse_args()
    start = time.perf_counter()
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        builds = {}
        for core in args.cores:
            builds[("after", core)] = build(KERNEL_DIR, core, tmp / f"after-{core}")
            if args.before:
                before_dir = kernel_dir_at(args.before, tmp / "before-src")
                builds[("before", core)] = build(before_dir, core, tmp / f"before-{core}")
        print("| core | shape | kernel | MAC | instr/MAC before | instr/MAC after | cycles/MAC before "
              "| cycles/MAC after |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for core in args.cores:
            for shape in SHAPES:
                if args.only not in shape.name:
                    continue
                for kernel in args.kernels:
                    if kernel == "backward_input_set" and not (shape.depthwise() if isinstance(shape, Conv)
                                                               else shape.rows == 1 and shape.d_out <= 4):
                        continue  # a depthwise layer's, a head's own; the others zero dx and add (dx +=)
                    if kernel == "backward_input" and isinstance(shape, Conv) and shape.depthwise() \
                            and shape.pad_h == 0:
                        continue  # a depthwise window's data gradient is always written (strip_codegen)
                    row = {}
                    for when in ("before", "after"):
                        if (when, core) not in builds:
                            continue
                        rng = np.random.default_rng(0)
                        instr, cycles, rate = measure(builds[(when, core)], shape, kernel, rng)
                        rates.append(rate)
                        row[when] = (instr / shape.macs(), None if cycles is None else cycles / shape.macs())

                    def cell(when: str, i: int) -> str:
                        v = row.get(when, (None, None))[i]
                        return "-" if v is None else f"{v:.2f}"

                    print(f"| {core} | {shape.name} | {kernel} | {shape.macs():,} | {cell('before', 0)} | "
                          f"{cell('after', 0)} | {cell('before', 1)} | {cell('after', 1)} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; emulator throughput: median "
          f"{np.median(rates) / 1e6:.0f} M emulated instructions/s of wall time "
          f"(min {min(rates) / 1e6:.0f}, max {max(rates) / 1e6:.0f})")


if __name__ == "__main__":
    main()
