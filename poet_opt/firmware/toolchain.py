"""Where the reference C kernels live and how to compile them with zig cc.

zig cc is clang with every target's headers and compiler-rt built in, installed from PyPI as the
`ziglang` package, so neither the host build nor a Cortex-M cross build needs a system compiler.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from poet_opt.errors import PoetError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

# The kernels promise to compile cleanly under these on every target.
STRICT_FLAGS = ("-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic")
# Without -fno-math-errno the compiler keeps a libm sqrtf call next to vsqrt.f32, for errno.
OPTIMISE_FLAGS = ("-O2", "-fno-math-errno")
# Bare metal: no libc, so the compiler must not turn loops into memset/memcpy calls
# (-ffreestanding), and no C++ unwinder, whose personality routines EHABI unwind tables would name.
# One section per function lets --gc-sections drop the kernels a network does not use; zig keeps
# frame pointers at -O2 unless told otherwise, which a production build does not.
FREESTANDING_FLAGS = ("-ffreestanding", "-nostdlib", "-fno-unwind-tables", "-fno-asynchronous-unwind-tables",
                      "-ffunction-sections", "-fdata-sections", "-fomit-frame-pointer")

# zig's plain cortex_m4 and cortex_m7 models have no FPU; the feature suffix adds the single-precision
# one each core ships with (FPv4-SP-D16, FPv5-SP-D16). The M0+ has none: floats go through compiler-rt's
# __aeabi_f* routines, which zig links into every image.
CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "cortex-m4f": ("-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m4+vfp4d16sp"),
    "cortex-m7f": ("-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m7+fp_armv8d16sp"),
    "cortex-m0plus": ("-target", "thumb-freestanding-eabi", "-mcpu=cortex_m0plus"),
}


def zig_cc() -> list[str]:
    """The command that runs zig's C compiler from the current Python environment."""
    if importlib.util.find_spec("ziglang") is None:
        raise PoetError("the ziglang package is not installed; `pip install poet-opt[emulate]` provides it",
                        field="zig cc")
    return [sys.executable, "-m", "ziglang", "cc"]


def kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.c"))


def kernel_header() -> Path:
    return KERNEL_DIR / "poet_kernels.h"


def cpu_flags(cpu: str) -> list[str]:
    """Target and FPU flags for a core, plus the strict and freestanding flag sets."""
    if cpu not in CPU_FLAGS:
        raise PoetError(f"unknown core {cpu!r}; expected one of {', '.join(CPU_FLAGS)}", field="cpu")
    return [*CPU_FLAGS[cpu], *STRICT_FLAGS, *OPTIMISE_FLAGS, *FREESTANDING_FLAGS]


def _run(command: list[str]) -> None:
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        first_error = next((line for line in lines if "error" in line), lines[0] if lines else "no output")
        raise PoetError(f"zig cc failed: {first_error}", field="zig cc")


def compile_objects(cpu: str, out_dir: Path, *, extra_flags: tuple[str, ...] = ()) -> list[Path]:
    """Each kernel source compiled for `cpu` to an object file in out_dir, for a firmware link."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    objects = []
    for source in kernel_sources():
        obj = out_dir / f"{source.stem}.o"
        _run([*zig_cc(), *cpu_flags(cpu), *extra_flags, "-c", str(source), "-o", str(obj)])
        objects.append(obj)
    return objects


def compile_host_library(out_path: Path, *, extra_flags: tuple[str, ...] = ()) -> Path:
    """The kernels as a shared library for this machine, to load with ctypes (tests, host runs).

    Freestanding like the firmware build, so the library needs nothing from the host's libc and zig
    need not build its libc support first (20 s on a cold cache)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _run([*zig_cc(), "-shared", "-fPIC", "-ffreestanding", "-nostdlib", *STRICT_FLAGS, *OPTIMISE_FLAGS,
          *extra_flags, *map(str, kernel_sources()), "-o", str(out_path)])
    return out_path
