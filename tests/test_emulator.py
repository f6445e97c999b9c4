"""The emulated Cortex-M board (poet_opt.firmware.emulator): builds with the pip-installed zig, runs
on unicorn, maps memory as the real part, faults clearly, and checks storage semantics.

One C program (below) holds every case; the host picks one by writing `test_case` before the
run, which also exercises symbol writes. It is built once per target, so the whole module costs
a handful of links."""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("ziglang", "unicorn", "elftools")),
    reason="needs the emulate extra: pip install 'poet-opt[emulate]'")

from poet_opt.errors import PoetError
from poet_opt.firmware import build, toolchain
from poet_opt.firmware.build import build_firmware
from poet_opt.firmware.emulator import (
    Emulator,
    EmulatorFault,
    EmulatorTimeout,
    StackOverflow,
)
from poet_opt.firmware.storage_model import (
    STORAGE_E_ALIGN,
    STORAGE_E_NOT_ERASED,
    STORAGE_E_RANGE,
    STORAGE_OK,
)
from poet_opt.firmware.targets import (
    CORES,
    RAM_BASE,
    Target,
    core_for_cpu,
    target_from_profile,
)

PROGRAM = r"""
#include <stdint.h>
#include "poet_storage.h"

#define NV 64
volatile int32_t test_case;     /* chosen by the host before each run */
volatile int32_t arg;           /* a per-case argument */
float vin[NV];                  /* host-written inputs */
float wts[NV];
float fout[8];                  /* host-read results */
const volatile float table[4] = {1.5f, -2.0f, 0.25f, 8.0f};  /* in flash, read at run time */

/* Storage script: the host writes ops, the firmware runs them and records each return code. */
typedef struct { int32_t op, offset, length, fill; } storage_op;   /* op: 1 read 2 write 3 erase */
storage_op ops[16];
int32_t n_ops;
int32_t rc[16];
uint8_t io[1536];

extern uint32_t _estack[];

static float expf_poly(float x)
{
    /* exp(x) = 2^k * exp(r), |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial */
    float k = __builtin_floorf(x * 1.44269504f + 0.5f);
    float r = x - k * 0.693147181f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { float f; uint32_t u; } v;
    v.f = p;
    v.u += (uint32_t)(int32_t)k << 23;
    return v.f;
}

static int float_math(void)
{
    float dot = 0.0f, m = vin[0], s = 0.0f, sq = 0.0f;
    int i;
    for (i = 0; i < NV; ++i) {
        dot += vin[i] * wts[i];
        if (vin[i] > m) m = vin[i];
    }
    for (i = 0; i < NV; ++i) s += expf_poly(vin[i] - m);     /* softmax denominator */
    for (i = 0; i < NV; ++i) sq += vin[i] * vin[i];
    fout[0] = dot;
    fout[1] = s;
    fout[2] = expf_poly(vin[3]);
    fout[3] = __builtin_sqrtf(sq);
    fout[4] = dot / (1.0f + s);
    fout[5] = table[0] * table[1] + table[2] * table[3];
    return (int)(dot * 1000.0f) + (int)(s * 1000.0f);
}

__attribute__((noinline)) static int deep(int n)
{
    volatile uint8_t pad[64];   /* indexed by n, so the whole array lives in every frame */
    pad[n & 63] = (uint8_t)n;
    if (n <= 0) return pad[n & 63];
    return deep(n - 1) + pad[(n * 7) & 63];
}

static int run_storage(void)
{
    int32_t i, j;
    for (i = 0; i < n_ops && i < 16; ++i) {
        storage_op o = ops[i];
        if (o.op == 2) {
            for (j = 0; j < o.length && j < (int32_t)sizeof io; ++j) io[j] = (uint8_t)(o.fill + j);
            rc[i] = poet_storage_write((uint32_t)o.offset, io, (uint32_t)o.length);
        } else if (o.op == 1) {
            rc[i] = poet_storage_read((uint32_t)o.offset, io, (uint32_t)o.length);
        } else {
            rc[i] = poet_storage_erase((uint32_t)o.offset);
        }
    }
    return 0;
}

int main(void)
{
    switch (test_case) {
    case 0: return float_math();
    case 1: { volatile uint32_t *p = _estack + arg; *p = 1u; return 1; }  /* past RAM */
    case 2: return deep(arg);
    case 3: return run_storage();
    case 4: for (;;) { __asm__ volatile(""); }
    case 5: __asm__ volatile("udf #3"); return 5;
    case 6: { void (*f)(void) = (void (*)(void))(uintptr_t)(uint32_t)arg; f(); return 6; }
    default: return -1;
    }
}
"""

# The Target fields of the three built-in microcontroller profiles, cpu: text as in their YAML.
NRF = {"core": "Arm Cortex-M4F @ 64 MHz (single-precision FPU)", "ram_bytes": 256 << 10,
       "storage_kind": "sd-card", "storage_capacity_bytes": 8 << 30,
       "erase_block_bytes": 4 << 20, "name": "nrf52840-like"}
STM = {"core": "Arm Cortex-M7 (STM32F746NG) @ 216 MHz, single-precision FPU",
       "ram_bytes": 320 << 10, "storage_kind": "qspi-flash", "storage_capacity_bytes": 16 << 20,
       "erase_block_bytes": 64 << 10, "name": "stm32f746-like"}
MKR = {"core": "Arm Cortex-M0+ (SAMD21G18A) @ 48 MHz, no FPU", "ram_bytes": 32 << 10,
       "storage_kind": "sd-card", "storage_capacity_bytes": 8 << 30,
       "erase_block_bytes": 4 << 20, "name": "mkr1000-like"}
TARGETS = {"m4f": NRF, "m7f": STM, "m0plus": MKR}


@pytest.fixture(scope="module")
def firmware(tmp_path_factory):
    """Built once per target for the whole module."""
    src = tmp_path_factory.mktemp("emu_src") / "emu_test.c"
    src.write_text(PROGRAM)
    cache = {}

    def get(key):
        if key not in cache:
            target = Target(**TARGETS[key])
            cache[key] = build_firmware([src], target, tmp_path_factory.mktemp(f"emu_{key}"))
        return cache[key]

    return get


def run_case(fw, case, arg=0, **run_kwargs):
    emu = Emulator(fw)
    emu.write_symbol("test_case", np.int32(case))
    emu.write_symbol("arg", np.int32(arg))
    return emu, emu.run(**run_kwargs)


def numpy_float_math(vin, wts):
    f32 = np.float32
    dot = f32(0)
    for a, b in zip(vin, wts):
        dot = f32(dot + f32(a * b))
    m = vin.max()
    s = np.exp((vin - m).astype(np.float64)).sum()
    return {"dot": float(dot), "s": float(s), "e3": float(np.exp(np.float64(vin[3]))),
            "norm": float(np.sqrt((vin.astype(np.float64) ** 2).sum()))}


@pytest.mark.parametrize("key", ["m4f", "m7f", "m0plus"])
def test_float_math_matches_numpy_on_each_core(firmware, key):
    fw = firmware(key)
    rng = np.random.default_rng(3)
    vin = rng.uniform(-2, 2, 64).astype(np.float32)
    wts = rng.uniform(-1, 1, 64).astype(np.float32)
    emu = Emulator(fw)
    emu.write_symbol("test_case", np.int32(0))
    emu.write_symbol("vin", vin)
    emu.write_symbol("wts", wts)
    result = emu.run()
    out = emu.read_symbol("fout", np.float32)
    ref = numpy_float_math(vin, wts)
    assert out[0] == pytest.approx(ref["dot"], rel=1e-5, abs=1e-5)
    assert out[1] == pytest.approx(ref["s"], rel=1e-5)
    assert out[2] == pytest.approx(ref["e3"], rel=1e-5)
    assert out[3] == pytest.approx(ref["norm"], rel=1e-6)
    assert out[4] == pytest.approx(ref["dot"] / (1 + ref["s"]), rel=1e-5, abs=1e-5)
    assert out[5] == 1.5 * -2.0 + 0.25 * 8.0  # exact in float
    # the checksum main() returns is made of the same floats, so it matches them to the unit
    assert abs(result.exit_code - (int(out[0] * 1000) + int(out[1] * 1000))) <= 1
    assert abs(result.exit_code - (int(ref["dot"] * 1000) + int(ref["s"] * 1000))) <= 2
    assert result.instructions > 1000
    assert result.static_bytes == fw.static_bytes > 0
    assert 0 < result.stack_bytes < 1024
    assert result.ram_used_bytes == result.static_bytes + result.stack_bytes
    assert result.ram_bytes == TARGETS[key]["ram_bytes"]
    assert {".text", ".bss", ".isr_vector"} <= set(result.sections)


def test_cores_and_hard_float_code(firmware):
    """The M4F and M7F builds use the FPU; the M0+ build calls compiler_rt's soft-float."""
    assert firmware("m4f").target.core == "cortex-m4f"
    assert firmware("m7f").target.core == "cortex-m7f"
    assert firmware("m0plus").target.core == "cortex-m0plus"
    emu = Emulator(firmware("m0plus"))
    assert "__aeabi_fmul" in emu.image.symbols or "__mulsf3" in emu.image.symbols
    assert "__aeabi_fmul" not in Emulator(firmware("m4f")).image.symbols


def test_symbols_read_and_write(firmware):
    fw = firmware("m4f")
    emu = Emulator(fw)
    np.testing.assert_array_equal(emu.read_symbol("table", np.float32), [1.5, -2.0, 0.25, 8.0])
    emu.write_symbol("table", np.array([1, 1, 1, 1], np.float32))   # flash: patched into the image
    emu.write_symbol("test_case", struct.pack("<i", 0))
    emu.write_symbol("vin", np.zeros(64, np.float32))
    emu.write_symbol("wts", np.zeros(64, np.float32))
    # pending RAM writes are visible before the run
    assert emu.read_symbol("test_case", np.int32)[0] == 0
    emu.run()
    assert emu.read_symbol("fout", np.float32, count=6)[5] == 2.0
    assert emu.read_symbol("fout", np.float32, count=1, offset=4)[0] == pytest.approx(64.0, rel=1e-5)
    with pytest.raises(ValueError, match="is 16 bytes"):
        emu.write_symbol("table", np.zeros(5, np.float32))
    with pytest.raises(KeyError, match="no symbol 'nope'"):
        emu.read_symbol("nope")


def test_write_past_ram_end_faults_naming_the_address(firmware):
    fw = firmware("m4f")
    end = RAM_BASE + (256 << 10)
    with pytest.raises(EmulatorFault) as info:
        run_case(fw, 1, arg=4)
    err = info.value
    assert err.address == end + 16
    assert f"0x{end + 16:08x}" in str(err) and "past the end of RAM" in str(err)
    assert "pc 0x" in str(err) and "(main+0x" in str(err)


def test_recursion_overflowing_the_stack_faults(firmware):
    fw = firmware("m0plus")
    # watched (default): stops as soon as the stack pointer enters .bss, still inside RAM
    with pytest.raises(StackOverflow, match="into the static data") as info:
        run_case(fw, 2, arg=100_000)
    assert RAM_BASE <= info.value.address < RAM_BASE + fw.static_bytes
    assert "(deep+0x" in str(info.value)
    # unwatched: the stack runs through .bss and faults below the start of RAM
    emu = Emulator(fw, watch_stack=False, count_instructions=False)
    emu.write_symbol("test_case", np.int32(2))
    emu.write_symbol("arg", np.int32(100_000))
    with pytest.raises(StackOverflow, match="grew past the start of RAM") as info:
        emu.run()
    assert RAM_BASE - 64 <= info.value.address < RAM_BASE


def test_stack_depth_grows_with_recursion_depth(firmware):
    fw = firmware("m4f")
    depth = {n: run_case(fw, 2, arg=n)[1].stack_bytes for n in (10, 30, 50)}
    frame = (depth[50] - depth[10]) / 40
    assert frame >= 64 and frame == int(frame)           # a 64-byte pad per call, plus registers
    assert depth[30] - depth[10] == 20 * frame            # exactly linear


def test_instruction_limit_and_timeout_stop_a_runaway_program(firmware):
    fw = firmware("m4f")
    with pytest.raises(EmulatorTimeout, match="100,000 instructions"):
        run_case(fw, 4, max_instructions=100_000)
    with pytest.raises(EmulatorTimeout, match="within 0.2 s"):
        run_case(fw, 4, timeout_s=0.2)


def test_undefined_instruction_and_bad_jump_fault(firmware):
    fw = firmware("m4f")
    with pytest.raises(EmulatorFault, match=r"undefined instruction at pc 0x[0-9a-f]{8} \(main"):
        run_case(fw, 5)
    with pytest.raises(EmulatorFault, match="instruction fetch from 0x10000000") as info:
        run_case(fw, 6, arg=0x1000_0001)
    assert info.value.address == 0x1000_0000


def storage_run(fw, ops, emu=None):
    emu = emu or Emulator(fw)
    table = np.zeros((16, 4), np.int32)
    table[:len(ops)] = ops
    emu.write_symbol("test_case", np.int32(3))
    emu.write_symbol("ops", table)
    emu.write_symbol("n_ops", np.int32(len(ops)))
    result = emu.run()
    return emu, result, list(emu.read_symbol("rc", np.int32)[:len(ops)])


READ, WRITE, ERASE = 1, 2, 3


def test_flash_program_after_erase_and_violation_without(firmware):
    fw = firmware("m7f")
    block = 64 << 10
    ops = [(WRITE, 0, 256, 7),            # a new part is erased: programming works
           (WRITE, 0, 256, 7),            # same data again: no bit goes 0 -> 1, allowed
           (WRITE, 0, 256, 8),            # different data over programmed cells: violation
           (ERASE, 0, 0, 0),
           (WRITE, 0, 256, 8),            # after the erase it programs
           (ERASE, 3, 0, 0),
           (WRITE, 3 * block + 10, 100, 1),
           (READ, 0, 256, 0),
           (ERASE, 256, 0, 0)]            # 16 MiB / 64 KiB = 256 blocks: out of range
    emu, result, rc = storage_run(fw, ops)
    assert rc == [STORAGE_OK, STORAGE_OK, STORAGE_E_NOT_ERASED, STORAGE_OK, STORAGE_OK,
                  STORAGE_OK, STORAGE_OK, STORAGE_OK, STORAGE_E_RANGE]
    st = result.storage
    assert st.erase_counts == {0: 1, 3: 1} and st.erase_max_per_block == 1 and st.erases_total == 2
    assert st.bytes_written == 256 * 3 + 100 and st.bytes_read == 256
    assert [v.op for v in st.violations] == ["write", "erase"]
    assert "0 bit into 1" in st.violations[0].message and st.violations[0].pc is not None
    expected = bytes((8 + j) & 0xFF for j in range(256))
    assert emu.storage.dump(0, 256) == expected
    assert bytes(emu.read_symbol("io")[:256]) == expected
    assert emu.storage.dump(3 * block, 10) == b"\xff" * 10     # erased, untouched bytes

    # storage persists across runs (and across a power cycle), wear accumulates per block
    emu, result, rc = storage_run(fw, [(ERASE, 0, 0, 0), (ERASE, 0, 0, 0)], emu=emu)
    assert rc == [0, 0] and result.storage.erase_counts == {0: 2}
    assert emu.storage.stats().erase_counts == {0: 3, 3: 1}
    assert emu.storage.stats().erase_max_per_block == 3


def test_flash_preloaded_from_the_host_is_read_by_the_firmware(firmware):
    fw = firmware("m7f")
    emu = Emulator(fw)
    weights = np.arange(64, dtype=np.float32) / 8
    emu.storage.load(1 << 20, weights)
    _, result, rc = storage_run(fw, [(READ, 1 << 20, 256, 0)], emu=emu)
    assert rc == [0]
    np.testing.assert_array_equal(emu.read_symbol("io", np.float32, count=64), weights)
    assert result.storage.bytes_read == 256 and result.storage.erases_total == 0


def test_sd_card_whole_blocks_only(firmware):
    fw = firmware("m4f")
    au = 4 << 20
    ops = [(WRITE, 512 * 3, 512, 5),      # one aligned block
           (WRITE, 100, 512, 5),          # unaligned: refused
           (WRITE, 1024, 100, 5),         # partial block: refused
           (WRITE, au - 512, 1024, 9),    # spans two allocation units: wears both
           (WRITE, 0, 512, 1),            # no erase needed to rewrite
           (READ, 512 * 3 + 7, 300, 0)]   # unaligned read: the port reads whole blocks
    emu, result, rc = storage_run(fw, ops)
    assert rc == [STORAGE_OK, STORAGE_E_ALIGN, STORAGE_E_ALIGN, STORAGE_OK, STORAGE_OK, STORAGE_OK]
    st = result.storage
    assert [v.op for v in st.violations] == ["write", "write"]
    assert all("512-byte blocks" in v.message for v in st.violations)
    assert st.bytes_written == 512 + 1024 + 512
    assert st.bytes_read == 512                        # one whole block for the 300 bytes
    assert st.erase_counts == {0: 3, 1: 1}             # wear events per allocation unit
    assert bytes(emu.read_symbol("io")[:300]) == bytes((5 + 7 + j) & 0xFF for j in range(300))


def test_core_names_from_the_profiles():
    assert core_for_cpu(NRF["core"]) == "cortex-m4f"
    assert core_for_cpu(STM["core"]) == "cortex-m7f"
    assert core_for_cpu(MKR["core"]) == "cortex-m0plus"
    assert core_for_cpu("cortex-m7fd") == "cortex-m7fd"
    try:
        from poet_opt.device.profiles import load_profile
    except ImportError:  # before the move into subpackages
        from poet_opt.profiles import load_profile
    expected = {"nrf52840": ("cortex-m4f", 256 << 10, "sd-card"),
                "stm32f746": ("cortex-m7f", 320 << 10, "qspi-flash"),
                "mkr1000": ("cortex-m0plus", 32 << 10, "sd-card")}
    for name, (core, ram, kind) in expected.items():
        t = target_from_profile(load_profile(name))
        assert (t.core, t.ram_bytes, t.storage_kind) == (core, ram, kind)
    with pytest.raises(PoetError) as info:
        target_from_profile(load_profile("rpi4"))
    assert info.value.field == "--device" and "Cortex-A72" in str(info.value)


def test_every_core_is_compiled_with_the_kernels_flags():
    """One table says how zig compiles for a core (toolchain.CPU_FLAGS): the emulator runs exactly
    the cores the kernels are compiled for, and a core has an FPU where its flags give it one."""
    assert set(CORES) == set(toolchain.CPU_FLAGS)
    hard_float = {name for name, core in CORES.items() if core.hard_float}
    assert hard_float == {"cortex-m4f", "cortex-m7f", "cortex-m7fd"}
    m7f = toolchain.cpu_flags("cortex-m7f", warnings=())
    assert build.common_cflags(Target("cortex-m7f", 64 << 10))[:len(m7f)] == m7f


def test_unknown_core_is_a_poet_error():
    with pytest.raises(PoetError, match="no model of the CPU 'RISC-V E31'") as info:
        Target("RISC-V E31", 64 << 10)
    assert info.value.field == "--device"
    assert "\n" not in str(info.value)
    with pytest.raises(PoetError, match="multiple of 4 KiB"):
        Target("cortex-m4f", 1000)
    with pytest.raises(PoetError, match="storage kind 'nvme'"):
        Target("cortex-m4f", 64 << 10, storage_kind="nvme")


# ---- cycle estimate (poet_opt/firmware/cycles.py, board/host_icount.c) ----

CYCLE_LOOP = r"""
#include <stdint.h>
volatile int32_t iterations;
float operands[2] = {1.5f, 2.0f};
int main(void)
{
    int32_t n = iterations;
    /* one basic block per iteration, its classes known: FP load, FP load next to it, 4 FP
       multiply-accumulates, a divide, an ALU op and the branch back (taken but for the last) */
    __asm__ volatile("1:\n"
                     "vldr s0, [%1]\n"
                     "vldr s1, [%1, #4]\n"
                     "vmla.f32 s2, s0, s1\n"
                     "vmla.f32 s2, s0, s1\n"
                     "vmla.f32 s2, s0, s1\n"
                     "vmla.f32 s2, s0, s1\n"
                     "sdiv r3, %0, %0\n"
                     "subs %0, %0, #1\n"
                     "bne 1b\n"
                     : "+r"(n) : "r"(operands) : "s0", "s1", "s2", "r3", "cc", "memory");
    return 0;
}
"""


@pytest.mark.parametrize("core,wait_states,expected", [
    # M4 (TRM tables 3-1, 7-1): VLDR 2, pipelined VLDR 1, VMLA 3 each, SDIV 7, SUBS 1, BNE 1, refill 2
    ("cortex-m4f", 0, 2 + 1 + 4 * 3 + 7 + 1 + 1 + 2),
    ("cortex-m4f", 3, 2 + 1 + 4 * 3 + 7 + 1 + 1 + 2 + 3),  # the fetch after the branch waits for flash
    # M7 estimate: 1 per instruction, SDIV 7, refill 1
    ("cortex-m7f", 0, 1 + 1 + 4 * 1 + 7 + 1 + 1 + 1),
])
def test_cycle_estimate_costs_each_class_and_each_taken_branch(tmp_path, core, wait_states, expected):
    """One more iteration of a loop whose instructions are known costs exactly the table's sum for
    them plus one taken branch, with the profile's flash wait states on the fetch after it."""
    src = tmp_path / "cycles.c"
    src.write_text(CYCLE_LOOP)
    fw = build_firmware([src], Target(core, 64 * 1024, flash_wait_states=wait_states), tmp_path / "build")
    emu = Emulator(fw)
    runs = []
    for n in (1, 2, 5):
        emu.write_symbol("iterations", np.int32(n))
        runs.append(emu.run())
    emu.close()
    assert runs[1].instructions - runs[0].instructions == 9
    assert runs[1].cycles - runs[0].cycles == expected
    assert runs[2].cycles - runs[1].cycles == 3 * expected


def test_cycle_estimate_of_soft_float_code_is_plausible(firmware):
    """Every core gets an estimate, at least a cycle per instruction on these tables, and a
    Cortex-M0+ without an FPU spends far more cycles than the M4F on the same float code."""
    results = {key: run_case(firmware(key), 0)[1] for key in ("m0plus", "m4f")}
    for result in results.values():
        assert result.cycles is not None and result.cycles >= result.instructions
    assert results["m0plus"].cycles > 2 * results["m4f"].cycles
