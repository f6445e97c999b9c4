"""The CMake project ``poet-opt emulate -o DIR`` writes beside the library: a board's starting
point that builds the generated library and an example ``main()`` for the profile's core.

The project's sources are the ones the emulator linked (the library, the kernels, the paging,
the linker script poet_train.ld), so the image it builds with the zig toolchain file and the
emulator's storage port is the image the emulator ran. A board swaps two files: the storage port
(``poet_storage_port.c``, a stub naming what its SD or flash driver must do) and, usually, the
start-up code for its vendor's. Two toolchain files: arm-none-eabi-gcc, what board projects use,
and zig cc from the ``ziglang`` pip package through a wrapper script, because CMake needs one
executable as its compiler and zig runs as ``python -m ziglang cc``.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.files import write_files
from poet_opt.firmware.c_text import float_literal
from poet_opt.firmware.targets import Target
from poet_opt.firmware.toolchain import CPU_FLAGS, GCC_CPU_FLAGS
from poet_opt.firmware.writer import KERNEL_FILES, PAGING_FILES, c_array

BOARD_DIR = Path(__file__).resolve().parent / "board"
PROJECT_FILES = ("CMakeLists.txt", "README.md", "main.c", "poet_storage_port.c", "startup.c",
                 "poet_storage_emu.c")
TOOLCHAIN_DIR = "cmake"
TOOLCHAIN_FILES = ("arm-none-eabi.cmake", "zig-cc.cmake", "zig-cc", "zig-ar")
ELF_NAME = "poet_board.elf"
# what the emulator reads back from the example's image (tests; a debugger on a board)
EXAMPLE_LOSSES = "example_losses"
EXAMPLE_LOGITS = "example_logits"
EXAMPLE_STATUS = "example_status"


# the user's once written: a rerun of `emulate -o` into the same directory keeps them, so that a
# storage driver filled in (or an application) survives regenerating the library
USER_FILES = ("main.c", "poet_storage_port.c")
MARK = "poet-opt"  # in the opening lines of every project file poet-opt writes over


def check_project_dir(out_dir) -> None:
    """Refuse, before anything is solved, a directory whose CMakeLists.txt, README.md or toolchain
    files poet-opt did not write: the project would replace them."""
    for path in project_paths(out_dir):
        if path.name in USER_FILES or not path.is_file():
            continue
        with open(path, "rb") as fh:
            head = fh.read(1000)
        packaged = BOARD_DIR / path.name  # startup.c, poet_storage_emu.c: copies, unmarked
        if MARK.encode() not in head and not (packaged.is_file() and packaged.read_bytes() == path.read_bytes()):
            raise PoetError(f"{path} was not written by poet-opt and the board project would replace it; give -o a "
                            "directory of its own", field="-o")


def project_paths(out_dir) -> list[Path]:
    """Every file the project adds to ``out_dir`` (checked against the command's inputs first)."""
    out = Path(out_dir)
    return [*(out / n for n in PROJECT_FILES), *(out / TOOLCHAIN_DIR / n for n in TOOLCHAIN_FILES)]


def example_main(prefix: str, *, steps: int, lr: float, x: np.ndarray, y: np.ndarray, heading: str) -> str:
    """main.c: ``steps`` train steps on the emulate batch at ``lr``, then predict and save, each
    result in a global a debugger (or the emulator) reads."""
    p, P = prefix, prefix.upper()
    rate = float_literal(lr, field="--lr")
    return "\n".join([
        heading.rstrip("\n"),
        "/* Example application: replace the built-in batch with your data (README.md, step 4). */",
        "#include <stdint.h>",
        f'#include "{p}train.h"',
        "",
        f"#define EXAMPLE_STEPS {int(steps)}u",
        "",
        # token ids (an integer x: the model's input goes into embeddings) are int32, as train.h takes them
        c_array("int32_t", "example_input", x.astype(np.int64), const=True) if x.dtype.kind in "iu" else
        c_array("float", "example_input", x.astype(np.float32), const=True),
        c_array("int32_t", "example_labels", y.astype(np.int64), const=True),
        "/* volatile: nothing in this program reads them; a debugger does */",
        f"__attribute__((used)) volatile float {EXAMPLE_LOSSES}[EXAMPLE_STEPS];",
        f"__attribute__((used)) float {EXAMPLE_LOGITS}[{P}LOGITS_FLOATS];",
        f"__attribute__((used)) volatile int32_t {EXAMPLE_STATUS};",
        "",
        "int main(void)",
        "{",
        "    uint32_t s;",
        "    float loss = 0.0f;",
        f"    {p}status rc = {p}init();",
        f"    for (s = 0u; rc == {P}OK && s < EXAMPLE_STEPS; ++s) {{",
        f"        rc = {p}train_step(example_input, example_labels, {rate}, &loss);",
        f"        {EXAMPLE_LOSSES}[s] = loss;",
        "    }",
        f"    if (rc == {P}OK) {{",
        f"        rc = {p}predict(example_input, {EXAMPLE_LOGITS});",
        "    }",
        "    /* kept on the storage device: after a reset, load_weights goes on from here */",
        f"    if (rc == {P}OK) {{",
        f"        rc = {p}save_weights();",
        "    }",
        f"    {EXAMPLE_STATUS} = (int32_t)rc;",
        "    return (int)rc;",
        "}",
        "",
    ])


STORAGE_STUB = """\
/*
 * poet_storage_port.c: the three functions of poet_storage.h for YOUR storage device.
 * A stub: every call fails with POET_STORAGE_E_IO until a driver fills it in (README.md, step 2).
 * poet_storage_emu.c is the emulator's port, a working reference.
 *
 * Geometry (CMakeLists.txt passes it with -D) for this project's device:
@GEOMETRY@ *
 * What a driver must do:
 *   - offsets are bytes from the start of the area the firmware may use; keep the application's
 *     own files elsewhere (a partition, or an offset added here);
 *   - return POET_STORAGE_OK (0) or a negative POET_STORAGE_E_* code; never block forever and
 *     never fault: the library passes the code to the caller of train_step and save_weights;
 *   - return only when the data is where it was asked to be: a DMA transfer has completed, a
 *     flash program or erase has finished (poll the busy bit), an SD write has left the card busy.
 */
#include "poet_storage.h"

/* Read `bytes` at `offset` into `dst`. SD card/eMMC: the card transfers whole 512-byte blocks
   (CMD17/CMD18), so a read that starts or ends inside a block goes through a one-block buffer;
   SPI/QSPI NOR flash: the READ command (0x03/0x0B) takes any offset and length. */
int poet_storage_read(uint32_t offset, void *dst, uint32_t bytes)
{
    (void)offset;
    (void)dst;
    (void)bytes;
    return POET_STORAGE_E_IO;
}

/* Program `bytes` from `src` at `offset`. NOR flash: page program (0x02) in pieces that do not
   cross a program page (often 256 B), after write enable (0x06); the library erased the block
   first. SD card/eMMC: whole aligned 512-byte blocks (CMD24/CMD25); the library sends only such. */
int poet_storage_write(uint32_t offset, const void *src, uint32_t bytes)
{
    (void)offset;
    (void)src;
    (void)bytes;
    return POET_STORAGE_E_IO;
}

/* Erase block number `block` (POET_STORAGE_ERASE_BLOCK_BYTES each) so that every byte reads
   POET_STORAGE_ERASED_BYTE. NOR flash: sector erase (0x20 for 4 KiB) after write enable. SD card:
   never called (POET_STORAGE_ERASE_REQUIRED is 0); returning POET_STORAGE_OK is enough. */
int poet_storage_erase(uint32_t block)
{
    (void)block;
    return POET_STORAGE_E_IO;
}
"""


def _cmake_list(values) -> str:
    return " ".join(values)


def cmakelists(prefix: str, target: Target, *, heading: str) -> str:
    sources = [f"{prefix}train.c", *KERNEL_FILES, *PAGING_FILES]
    geometry = "\n".join(f'set({key} "{value}" CACHE STRING "storage geometry (poet_storage.h)")'
                         for key, value in target.storage_defines().items())
    return "\n".join([
        heading.rstrip("\n"),
        "cmake_minimum_required(VERSION 3.20)",
        "project(poet_board C)",
        "",
        "# README.md, step 2: the storage device's geometry, and the file that drives it",
        geometry,
        'set(POET_STORAGE_PORT "poet_storage_port.c" CACHE STRING',
        '    "the storage port: poet_storage_port.c (yours) or poet_storage_emu.c (the emulator\'s)")',
        "",
        "# the generated library and the sources it needs, as the emulator compiled them",
        f"set(POET_LIBRARY_SOURCES {_cmake_list(sources)})",
        "",
        f"add_executable(poet_board main.c startup.c ${{POET_STORAGE_PORT}} ${{POET_LIBRARY_SOURCES}})",
        'set_target_properties(poet_board PROPERTIES SUFFIX ".elf")',
        "target_include_directories(poet_board PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})",
        "set(POET_GEOMETRY_DEFINES)",
        f"foreach(key {_cmake_list(target.storage_defines())})",
        '    list(APPEND POET_GEOMETRY_DEFINES "${key}=${${key}}")',
        "endforeach()",
        "target_compile_definitions(poet_board PRIVATE ${POET_GEOMETRY_DEFINES})",
        "# freestanding C99, no libc: the flags the emulator's build uses (the core's come from the toolchain file)",
        "target_compile_options(poet_board PRIVATE -std=c99 -Wall -Wextra -pedantic -O2 -g0 -fno-math-errno",
        "    -ffreestanding -fno-unwind-tables -fno-asynchronous-unwind-tables -ffunction-sections -fdata-sections",
        "    -fomit-frame-pointer)",
        "# README.md, step 3: poet_train.ld has the profile's flash at 0 and RAM at 0x20000000",
        "target_link_options(poet_board PRIVATE -nostdlib -Wl,--entry=Reset_Handler",
        "    -T${CMAKE_CURRENT_SOURCE_DIR}/poet_train.ld)",
        "set_target_properties(poet_board PROPERTIES LINK_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/poet_train.ld)",
        "",
    ])


def zig_toolchain(target: Target, *, heading: str) -> str:
    flags = " ".join(CPU_FLAGS[target.core])
    return "\n".join([
        heading.rstrip("\n"),
        "# zig cc (pip package ziglang) through cmake/zig-cc, which runs `python -m ziglang cc`",
        "set(CMAKE_SYSTEM_NAME Generic)",
        "set(CMAKE_SYSTEM_PROCESSOR arm)",
        'set(CMAKE_C_COMPILER "${CMAKE_CURRENT_LIST_DIR}/zig-cc")',
        'set(CMAKE_AR "${CMAKE_CURRENT_LIST_DIR}/zig-ar" CACHE FILEPATH "zig ar")',
        "# a bare-metal test program cannot link without this project's linker script",
        "set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)",
        f'set(CMAKE_C_FLAGS_INIT "{flags}")',
        "# compiler_rt: the soft-float and division helpers, memcpy and memset (no libc is linked)",
        'set(CMAKE_EXE_LINKER_FLAGS_INIT "--rtlib=compiler-rt")',
        "",
    ])


def gcc_toolchain(target: Target, *, heading: str) -> str:
    flags = " ".join(GCC_CPU_FLAGS[target.core])
    return "\n".join([
        heading.rstrip("\n"),
        "# arm-none-eabi-gcc (Arm GNU Toolchain) on the PATH, or give its directory in ARM_GCC_DIR",
        "set(CMAKE_SYSTEM_NAME Generic)",
        "set(CMAKE_SYSTEM_PROCESSOR arm)",
        'if(DEFINED ENV{ARM_GCC_DIR})',
        '    set(CMAKE_C_COMPILER "$ENV{ARM_GCC_DIR}/arm-none-eabi-gcc")',
        "else()",
        "    set(CMAKE_C_COMPILER arm-none-eabi-gcc)",
        "endif()",
        "set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)",
        f'set(CMAKE_C_FLAGS_INIT "{flags}")',
        "# libgcc: the soft-float and division helpers; newlib's libc: memcpy and memset only",
        'set(CMAKE_C_STANDARD_LIBRARIES "-Wl,--start-group -lc -lgcc -Wl,--end-group")',
        "",
    ])


def _wrapper(tool: str) -> str:
    # the Python that wrote the project has ziglang; POET_PYTHON names another one
    return (f'#!/bin/sh\n# written by {MARK}: runs zig {tool} from the pip package ziglang\n'
            f'if [ -n "$POET_PYTHON" ]; then exec "$POET_PYTHON" -m ziglang {tool} "$@"; fi\n'
            f'exec {shlex.quote(sys.executable)} -m ziglang {tool} "$@"\n')


def readme(prefix: str, target: Target, device: str, *, storage_images=()) -> str:
    geometry = "\n".join(f"   - `{k}` = `{v}`" for k, v in target.storage_defines().items())
    gcc = " ".join(GCC_CPU_FLAGS[target.core])
    lines = [
        f"# A board project for {device} ({target.core_spec.description})",
        "",
        f"Generated by `poet-opt emulate -o`: the training library (`{prefix}train.c`, `{prefix}train.h`), the "
        "kernels and paging it needs, and an example `main.c` that trains a few steps on a built-in batch, "
        "predicts and saves the trained weights. Regenerate rather than edit the generated files.",
        "",
        "What to fill in, in order:",
        "",
        "1. **The compiler.** `cmake/arm-none-eabi.cmake` uses `arm-none-eabi-gcc` (on the PATH, or "
        f"`ARM_GCC_DIR`) with `{gcc}`; `cmake/zig-cc.cmake` uses zig cc from the pip package `ziglang` "
        "(the Python that wrote this project, or `POET_PYTHON`).",
        "2. **The storage.** Implement the three functions of `poet_storage_port.c` for your SD card or "
        "flash: its comments say what each must do. The geometry, in `CMakeLists.txt` (cache variables, "
        "override with `-D`), is this profile's:",
        "",
        geometry,
        "",
        "   `-DPOET_STORAGE_PORT=poet_storage_emu.c` builds the emulator's port instead, for an image "
        "that runs on the emulated core. `poet-opt emulate -o` into this directory again regenerates "
        "everything else but keeps your `poet_storage_port.c` and `main.c`.",
        "3. **The memory map.** `poet_train.ld` places flash at 0x00000000 and RAM at 0x20000000 with the "
        "profile's sizes (right for an nRF52840; an STM32 maps its flash at 0x08000000). Keep "
        f"`KEEP(*(.{prefix}arena))` in a RAM region if you use your own script.",
        "4. **The start-up and the application.** `startup.c` is the emulator's: vector table, `.data` "
        "copy, `.bss` zeroing, FPU enable, then `main()`, ending in `bkpt`. Use your vendor's start-up "
        "(clocks, interrupts) instead when you have one. Replace `main.c`'s built-in batch with your "
        f"data and learning rate; `{prefix}load_weights()` after `{prefix}init()` resumes from saved weights.",
    ]
    if storage_images:
        where = {"poet_weights.bin": "at offset 0 (the streamed weights live there)",
                 "poet_program.bin": "at `POET_PROGRAM_OFFSET` (`poet_train.c`; the step's program of kernel calls)"}
        lines += ["5. **The storage's contents.** Before the first run, write "
                  + " and ".join(f"`{name}` {where[name]}" for name in storage_images) + "."]
    lines += [
        "",
        "Build (CMake and Ninja: `pip install cmake ninja`):",
        "",
        "```sh",
        "cmake -S . -B build -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/arm-none-eabi.cmake",
        "cmake --build build",
        "```",
        "",
        "With pip's zig instead (`pip install ziglang cmake ninja`, no system compiler): "
        "`-DCMAKE_TOOLCHAIN_FILE=cmake/zig-cc.cmake`.",
        "",
        f"The image is `build/{ELF_NAME}`.",
        "",
    ]
    return "\n".join(lines)


def write_board_project(out_dir, *, target: Target, device: str, prefix: str, doc: dict, steps: int, lr: float,
                        x: np.ndarray, y: np.ndarray, storage_images=(), inputs=()) -> list[Path]:
    """Write the CMake project into ``out_dir`` (beside the library ``_keep`` wrote there); a
    ``main.c`` or ``poet_storage_port.c`` already there is the user's and stays. ``storage_images``:
    the files of ``-o`` a board's storage is provisioned with (poet_weights.bin, poet_program.bin)."""
    from poet_opt.firmware.library import provenance

    def hash_heading(what: str) -> str:  # provenance as a CMake comment
        text = provenance(doc, what)
        body = [line.strip()[2:] if line.strip().startswith("* ") else "" for line in text.splitlines()[1:-1]]
        return "".join(f"# {line}\n" for line in body)

    geometry = "".join(f" *   {k} = {v}\n" for k, v in target.storage_defines().items())
    files = {
        "CMakeLists.txt": cmakelists(prefix, target, heading=hash_heading("CMakeLists.txt")).encode(),
        "README.md": readme(prefix, target, device, storage_images=storage_images).encode(),
        "main.c": example_main(prefix, steps=steps, lr=lr, x=x, y=y,
                               heading=provenance(doc, "main.c, an example application")).encode(),
        "poet_storage_port.c": STORAGE_STUB.replace("@GEOMETRY@", geometry).encode(),
        "startup.c": BOARD_DIR / "startup.c",
        "poet_storage_emu.c": BOARD_DIR / "poet_storage_emu.c",
    }
    tools = {
        "arm-none-eabi.cmake": gcc_toolchain(target, heading=hash_heading("arm-none-eabi.cmake")).encode(),
        "zig-cc.cmake": zig_toolchain(target, heading=hash_heading("zig-cc.cmake")).encode(),
        "zig-cc": _wrapper("cc").encode(),
        "zig-ar": _wrapper("ar").encode(),
    }
    files = {name: content for name, content in files.items()
             if name not in USER_FILES or not (Path(out_dir) / name).exists()}
    try:
        written = write_files(out_dir, files, field="-o", inputs=inputs)
        written += write_files(Path(out_dir) / TOOLCHAIN_DIR, tools, field="-o", inputs=inputs)
        for name in ("zig-cc", "zig-ar"):
            path = Path(out_dir) / TOOLCHAIN_DIR / name
            os.chmod(path, path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as exc:
        raise PoetError(f"cannot write here: {exc.strerror}", source=str(out_dir), field="-o") from None
    return written
