"""The emulator's instruction counter: board/host_icount.c compiled for this machine with zig cc
on first use and loaded with ctypes, then registered with unicorn's C API as a block hook (see
the C file for why a C callback, and what it also watches)."""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import platform
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from poet_opt.firmware.build import BOARD_DIR, EmulatorError, run_zig_build
from poet_opt.firmware.toolchain import host_library_command


class _IcountState(ctypes.Structure):
    # Mirrors poet_icount_state in board/host_icount.c.
    _fields_ = [
        ("instructions", ctypes.c_uint64),
        ("blocks", ctypes.c_uint64),
        ("limit", ctypes.c_uint64),
        ("limit_hit", ctypes.c_uint32),
        ("read_errors", ctypes.c_uint32),
        ("code", ctypes.c_void_p),
        ("code_base", ctypes.c_uint64),
        ("code_size", ctypes.c_uint64),
        ("mem_read", ctypes.c_void_p),
        ("emu_stop", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("reg_read", ctypes.c_void_p),
        ("sp_regid", ctypes.c_int32),
        ("min_sp", ctypes.c_uint32),
        ("sp_limit", ctypes.c_uint32),
        ("sp_fault", ctypes.c_uint32),
        ("sp_fault_pc", ctypes.c_uint32),
        ("unused", ctypes.c_uint32),
        ("sp_sample_map", ctypes.c_void_p),
        ("cycles", ctypes.c_uint64),
        ("costs", ctypes.c_void_p),
        ("taken_cost", ctypes.c_uint32),
        ("next_address", ctypes.c_uint32),
    ]


_icount_lock = threading.Lock()
_icount_lib_handle: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    env = os.environ.get("POET_OPT_CACHE_DIR")
    if env:
        return Path(env)
    if sys.platform == "win32":
        root = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    elif sys.platform == "darwin":
        root = Path.home() / "Library" / "Caches"
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "poet-opt"


def icount_library() -> ctypes.CDLL:
    """The host instruction counter, built on first use into the user cache directory
    (``$POET_OPT_CACHE_DIR`` or e.g. ~/.cache/poet-opt) and keyed by its source's hash, so that an
    upgrade rebuilds it and concurrent processes never load a half-written file."""
    global _icount_lib_handle
    with _icount_lock:
        if _icount_lib_handle is not None:
            return _icount_lib_handle
        src = BOARD_DIR / "host_icount.c"
        digest = hashlib.sha256(src.read_bytes() + f"|{sys.platform}|{platform.machine()}".encode())
        suffix = {"win32": ".dll", "darwin": ".dylib"}.get(sys.platform, ".so")
        lib = _cache_dir() / f"poet_icount-{digest.hexdigest()[:16]}{suffix}"
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp{suffix}")
            run_zig_build([host_library_command([src], tmp)], "building the host instruction counter", 300.0)
            os.replace(tmp, lib)
        _icount_lib_handle = ctypes.CDLL(str(lib))
        if _icount_lib_handle.poet_icount_state_bytes() != ctypes.sizeof(_IcountState):
            raise EmulatorError("host_icount.c and icount.py disagree on the counter's layout")
        return _icount_lib_handle


def install(uc, code: np.ndarray, code_base: int, *, sp_limit: int | None = None,
            function_entries: Iterable[int] = (), costs: Sequence[int] | None = None,
            taken_cost: int = 0) -> tuple:
    """Count the instructions ``uc`` executes from ``code`` (the host array mapped at ``code_base``)
    with a C block hook. With ``sp_limit``, also read the stack pointer at each of the
    ``function_entries`` and stop the run as soon as it is below ``sp_limit``. Returns what the
    hook uses, to keep alive as long as ``uc`` runs; its first item is the counter's state
    (``instructions``, ``limit``, ``limit_hit``, ``min_sp``, ``sp_fault``, ``sp_fault_pc``). With
    ``costs`` (cycles per instruction class, cycles.py) and ``taken_cost``, ``cycles`` estimates
    the cycles too."""
    from unicorn import UC_HOOK_BLOCK, UcError

    lib = icount_library()
    uclib = _uclib()
    state = _IcountState()
    state.code = code.ctypes.data
    state.code_base = code_base
    state.code_size = code.size
    state.mem_read = ctypes.cast(uclib.uc_mem_read, ctypes.c_void_p).value
    state.emu_stop = ctypes.cast(uclib.uc_emu_stop, ctypes.c_void_p).value
    cache = ctypes.create_string_buffer(b"\xff" * lib.poet_icount_cache_bytes())
    state.cache = ctypes.cast(cache, ctypes.c_void_p).value
    state.min_sp = 0xFFFF_FFFF
    sample_map = None
    if sp_limit is not None:
        from unicorn.arm_const import UC_ARM_REG_SP

        state.reg_read = ctypes.cast(uclib.uc_reg_read, ctypes.c_void_p).value
        state.sp_regid = UC_ARM_REG_SP
        state.sp_limit = sp_limit
        # Read sp only where a function starts: there it holds every caller's frame, so
        # the deepest call chain and a stack that has entered .bss are both seen, for about
        # nothing (reading it at every block costs 6-15% of the emulation speed).
        entries = np.zeros(code.size // 2, dtype=bool)
        for address in function_entries:
            if code_base <= address < code_base + code.size:
                entries[(address - code_base) // 2] = True
        sample_map = np.packbits(entries, bitorder="little")
        state.sp_sample_map = sample_map.ctypes.data
    cost_table = None
    if costs is not None:
        cost_table = np.ascontiguousarray(costs, dtype=np.uint32)
        state.costs = cost_table.ctypes.data
        state.taken_cost = int(taken_cost)
    handle = ctypes.c_size_t()
    fn = ctypes.cast(lib.poet_icount_block_hook, ctypes.c_void_p)
    # Registered through the C API: the Python binding would wrap a Python callable.
    status = uclib.uc_hook_add(uc._uch, ctypes.byref(handle), UC_HOOK_BLOCK, fn,
                               ctypes.cast(ctypes.pointer(state), ctypes.c_void_p),
                               ctypes.c_uint64(1), ctypes.c_uint64(0))
    if status != 0:
        raise UcError(status)
    return state, cache, handle, sample_map, cost_table


def _uclib():
    from unicorn import Uc

    return importlib.import_module(Uc.__module__).uclib
