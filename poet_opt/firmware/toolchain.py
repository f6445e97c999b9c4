"""The one C toolchain of the firmware stage: zig cc, the flags for each Cortex-M core, and the
reference C kernels it compiles.

zig cc is clang with every target's headers and compiler-rt built in, installed from PyPI as the
`ziglang` package, so neither the host build nor a Cortex-M cross build needs a system compiler.
The kernels (here) and the emulated board's firmware (build.py) take their -target/-mcpu and
code generation flags from `cpu_flags`, so that both are compiled for a core the same way.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from poet_opt.errors import PoetError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

# The kernels and the board's sources promise to compile cleanly under these on every target.
WARNING_FLAGS = ("-Wall", "-Wextra", "-Werror", "-pedantic")
# Without -fno-math-errno the compiler keeps a libm sqrtf call next to vsqrt.f32, for errno.
NO_MATH_ERRNO = "-fno-math-errno"
# Bare metal: no libc, so the compiler must not turn loops into memset/memcpy calls
# (-ffreestanding), and no C++ unwinder, whose personality routines EHABI unwind tables would name.
# One section per function lets --gc-sections drop the code a network does not use. zig keeps frame
# pointers at -O2 unless told otherwise, which a board's GCC build does not; omitting them makes
# the emulator's instruction counts and stack depths those of a production build.
FREESTANDING_FLAGS = ("-ffreestanding", "-nostdlib", "-fno-unwind-tables", "-fno-asynchronous-unwind-tables",
                      "-ffunction-sections", "-fdata-sections", "-fomit-frame-pointer")

# -target and -mcpu for each core. eabihf is the hard-float calling convention, for a core with an
# FPU. zig's plain cortex_m4 and cortex_m7 models have no FPU; the feature suffix adds the one the
# core ships with: FPv4-SP-D16 on an M4F, FPv5-SP-D16 (single precision, STM32F74x/F75x) or
# FPv5-D16 (double precision too, STM32F76x/H7) on an M7. A core without one sends floats through
# compiler-rt's __aeabi_f* routines, which zig links into every image.
CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "cortex-m0plus": ("-target", "thumb-freestanding-eabi", "-mcpu=cortex_m0plus"),
    "cortex-m0": ("-target", "thumb-freestanding-eabi", "-mcpu=cortex_m0"),
    "cortex-m3": ("-target", "thumb-freestanding-eabi", "-mcpu=cortex_m3"),
    "cortex-m4": ("-target", "thumb-freestanding-eabi", "-mcpu=cortex_m4"),
    "cortex-m4f": ("-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m4+vfp4d16sp"),
    "cortex-m7": ("-target", "thumb-freestanding-eabi", "-mcpu=cortex_m7"),
    "cortex-m7f": ("-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m7+fp_armv8d16sp"),
    "cortex-m7fd": ("-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m7+fp_armv8d16"),
}


# The same cores for arm-none-eabi-gcc, which a board's own project builds with (board_project.py).
GCC_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "cortex-m0plus": ("-mcpu=cortex-m0plus", "-mthumb", "-mfloat-abi=soft"),
    "cortex-m0": ("-mcpu=cortex-m0", "-mthumb", "-mfloat-abi=soft"),
    "cortex-m3": ("-mcpu=cortex-m3", "-mthumb", "-mfloat-abi=soft"),
    "cortex-m4": ("-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=soft"),
    "cortex-m4f": ("-mcpu=cortex-m4", "-mthumb", "-mfpu=fpv4-sp-d16", "-mfloat-abi=hard"),
    "cortex-m7": ("-mcpu=cortex-m7", "-mthumb", "-mfloat-abi=soft"),
    "cortex-m7f": ("-mcpu=cortex-m7", "-mthumb", "-mfpu=fpv5-sp-d16", "-mfloat-abi=hard"),
    "cortex-m7fd": ("-mcpu=cortex-m7", "-mthumb", "-mfpu=fpv5-d16", "-mfloat-abi=hard"),
}


def zig_cc() -> list[str]:
    """The command that runs zig's C compiler from the current Python environment."""
    if importlib.util.find_spec("ziglang") is None:
        raise PoetError("the ziglang package is not installed; `pip install poet-opt[emulate]` provides it",
                        field="zig cc")
    return [sys.executable, "-m", "ziglang", "cc"]


def hard_float(cpu: str) -> bool:
    """Whether the core has an FPU (and is compiled for the hard-float calling convention)."""
    return _core_flags(cpu)[1].endswith("eabihf")


def cpu_flags(cpu: str, *, opt: str = "-O2", std: str = "c99",
              warnings: Sequence[str] = WARNING_FLAGS) -> list[str]:
    """Target and FPU flags for a core, the language standard, warning and optimisation flags, and
    the freestanding flag set."""
    return [*_core_flags(cpu), f"-std={std}", *warnings, opt, NO_MATH_ERRNO, *FREESTANDING_FLAGS]


def _core_flags(cpu: str) -> tuple[str, ...]:
    if cpu not in CPU_FLAGS:
        raise PoetError(f"unknown core {cpu!r}; expected one of {', '.join(CPU_FLAGS)}", field="cpu")
    return CPU_FLAGS[cpu]


def host_library_command(sources: Sequence[str | Path], out_path: str | Path, *,
                         extra_flags: Sequence[str] = ()) -> list[str]:
    """zig cc building freestanding C99 ``sources`` into a shared library for this machine, to load
    with ctypes. The sources need nothing from the host's libc; on Linux -nostdlib also spares zig
    building glibc stubs and compiler_rt for the host first (12-20 s on a cold cache instead of
    ~0.3 s). A Windows DLL takes no -fPIC."""
    platform_flags = [] if sys.platform == "win32" else ["-fPIC"]
    if sys.platform.startswith("linux"):
        platform_flags.append("-nostdlib")
    return [*zig_cc(), "-shared", *platform_flags, "-ffreestanding", "-std=c99", *WARNING_FLAGS, "-O2",
            NO_MATH_ERRNO, *extra_flags, *map(str, sources), "-o", str(out_path)]


@dataclass(frozen=True)
class ZigFailure:
    """The first command of a `run_zig` batch that failed."""

    command: list[str]
    output: str  # the compiler's stderr and stdout
    timed_out: bool = False


def run_zig(commands: Sequence[Sequence[str]], *, timeout_s: float | None = None) -> ZigFailure | None:
    """Run zig commands side by side (zig's cache makes a rebuild of unchanged outputs instant) and
    return the first one, in the given order, that failed or outlasted ``timeout_s``, or None. On a
    failure the others are stopped rather than left running."""
    procs: list[tuple[list[str], subprocess.Popen]] = []
    try:
        for command in commands:
            command = [str(c) for c in command]
            procs.append((command, subprocess.Popen(command, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, text=True)))
        for command, proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return ZigFailure(command, "", timed_out=True)
            if proc.returncode != 0:
                return ZigFailure(command, (stderr + stdout).strip())
        return None
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _run(commands: Sequence[Sequence[str]]) -> None:
    failure = run_zig(commands)
    if failure is not None:
        lines = failure.output.splitlines()
        first_error = next((line for line in lines if "error" in line), lines[0] if lines else "no output")
        raise PoetError(f"zig cc failed: {first_error}", field="zig cc")


def kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.c"))


def kernel_header() -> Path:
    return KERNEL_DIR / "poet_kernels.h"


def compile_objects(cpu: str, out_dir: Path, *, extra_flags: tuple[str, ...] = ()) -> list[Path]:
    """Each kernel source compiled for `cpu` to an object file in out_dir, for a firmware link."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    compile_ = [*zig_cc(), *cpu_flags(cpu), *extra_flags, "-c"]
    sources = kernel_sources()
    objects = [out_dir / f"{source.stem}.o" for source in sources]
    _run([[*compile_, str(source), "-o", str(obj)] for source, obj in zip(sources, objects)])
    return objects


def compile_host_library(out_path: Path, *, extra_flags: tuple[str, ...] = ()) -> Path:
    """The kernels as a shared library for this machine, to load with ctypes (tests, host runs).

    Freestanding like the firmware build, so the library needs nothing from the host's libc and zig
    need not build its libc support first (20 s on a cold cache)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _run([host_library_command(kernel_sources(), out_path, extra_flags=extra_flags)])
    return out_path
