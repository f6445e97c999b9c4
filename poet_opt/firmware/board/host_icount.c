/*
 * Instruction counter for the emulator, compiled for the HOST (not the target) as a shared
 * library by poet_opt/firmware/icount.py and registered with unicorn's C API as a
 * UC_HOOK_BLOCK callback.
 *
 * Why a C callback: a Python callback costs about a microsecond per call, and training firmware
 * executes hundreds of millions of instructions in tens of millions of basic blocks; counting in
 * Python would dominate the run. A per-instruction UC_HOOK_CODE callback, even in C, adds a
 * helper call to every instruction. A block hook is called once per executed basic block with
 * the block's address and size in bytes, which is enough: the number of Thumb instructions in a
 * block follows from its halfwords (a halfword whose top five bits are 0b11101, 0b11110 or
 * 0b11111 starts a 32-bit instruction, any other halfword is a 16-bit instruction). Counts are
 * cached per block address, so the decode runs once per translated block.
 *
 * The counter also enforces the instruction limit: once it is reached it calls uc_emu_stop, so
 * a runaway program stops without any per-instruction cost. And it watches the stack pointer at
 * the blocks a map marks (function entries; one uc_reg_read each), stopping the run when the
 * stack has grown into the static data below it.
 *
 * With a cost table (poet_opt/firmware/cycles.py: one entry per instruction class of
 * poet_icount_class, per core) it also estimates cycles, at the same price: each block's cost is
 * summed from its instructions' classes when the block is first decoded and cached beside its
 * count. A block that does not start where the previous one ended was reached by a taken branch
 * (or a call, a return, an exception); it adds the table's refill cost plus the flash wait states.
 *
 * No unicorn headers are needed: the two unicorn functions used are passed in as pointers by the
 * Python side, so this library links against nothing and builds with any C compiler.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define POET_EXPORT __declspec(dllexport)
#else
#define POET_EXPORT __attribute__((visibility("default")))
#endif

typedef int (*poet_uc_mem_read_fn)(void *uc, uint64_t address, void *bytes, uint64_t size);
typedef int (*poet_uc_emu_stop_fn)(void *uc);
typedef int (*poet_uc_reg_read_fn)(void *uc, int regid, void *value);

#define POET_CACHE_SLOTS 65536u

typedef struct {
    uint32_t address; /* block start address; 0xFFFFFFFF = empty slot */
    uint32_t size;    /* block size in bytes (a re-translated block may differ) */
    uint32_t count;   /* instructions in the block */
    uint32_t sample;  /* 1: read the stack pointer when this block starts */
    uint32_t cycles;  /* estimated cycles of the block, without the taken-branch cost */
} poet_block_slot;

/* Instruction classes of the cycle estimate; keep in step with CLASSES in cycles.py. */
enum {
    POET_C_ALU,        /* data processing, moves, compares, IT, NOP, barriers */
    POET_C_MUL,        /* 32-bit multiply and multiply-accumulate, long multiplies */
    POET_C_DIV,        /* SDIV, UDIV */
    POET_C_LOAD,       /* LDR/STR of one register (any width), the first of a run */
    POET_C_LOAD_NEXT,  /* the same right after another load or store: its address phase overlaps */
    POET_C_MULTI,      /* LDM/STM/PUSH/POP/LDRD/STRD/VLDM/VSTM/VPUSH/VPOP, per instruction */
    POET_C_MULTI_REG,  /* ... plus this per word transferred */
    POET_C_BRANCH,     /* B, B<c>, CBZ, BX, TBB (not taken, or the taken branch's own cycle) */
    POET_C_CALL,       /* BL, BLX */
    POET_C_FP_LOAD,    /* VLDR/VSTR, first of a run */
    POET_C_FP_LOAD_NEXT, /* VLDR/VSTR right after another load or store */
    POET_C_FP_ALU,     /* VADD, VSUB, VMUL, VNMUL, VABS, VNEG, VCMP, VCVT, VMOV, VSEL, VMAXNM */
    POET_C_FP_MAC,     /* VMLA, VMLS, VNMLA, VNMLS, VFMA, VFMS, VFNMA, VFNMS */
    POET_C_FP_DIV,     /* VDIV, VSQRT */
    POET_C_FP_XFER,    /* VMOV between core and FPU registers, VMRS, VMSR */
    POET_C_TAKEN,      /* a taken branch's pipeline refill (added once per non-sequential block) */
    POET_CLASSES
};

/* Shared with Python (ctypes.Structure in icount.py; keep the layout in step). */
typedef struct {
    uint64_t instructions; /* instructions executed so far */
    uint64_t blocks;       /* basic blocks executed so far */
    uint64_t limit;        /* stop once instructions >= limit; 0 = no limit */
    uint32_t limit_hit;    /* set when the limit stopped the run */
    uint32_t read_errors;  /* blocks whose code could not be read (counted as 0 instructions) */
    const uint8_t *code;   /* host copy of flash, where the code lives */
    uint64_t code_base;    /* guest address of code[0] */
    uint64_t code_size;
    poet_uc_mem_read_fn mem_read; /* uc_mem_read, for code outside flash (e.g. RAM) */
    poet_uc_emu_stop_fn emu_stop; /* uc_emu_stop */
    poet_block_slot *cache;       /* POET_CACHE_SLOTS slots, or NULL */
    poet_uc_reg_read_fn reg_read; /* uc_reg_read, or NULL: do not watch the stack pointer */
    int32_t sp_regid;             /* UC_ARM_REG_SP */
    uint32_t min_sp;              /* lowest stack pointer seen at a sampled block start */
    uint32_t sp_limit;            /* stop when the stack pointer goes below this (end of statics) */
    uint32_t sp_fault;            /* set when it did */
    uint32_t sp_fault_pc;         /* the block where it was seen */
    uint32_t unused;
    const uint8_t *sp_sample_map; /* bit per code halfword: sample sp at blocks starting there;
                                     NULL: at every block */
    uint64_t cycles;              /* estimated cycles so far (0 without a cost table) */
    const uint32_t *costs;        /* POET_CLASSES cycle costs, or NULL: no estimate */
    uint32_t taken_cost;          /* cycles a taken branch adds: refill + flash wait states */
    uint32_t next_address;        /* where the previous block ended */
} poet_icount_state;

static uint32_t poet_count_thumb(const uint8_t *p, uint32_t size)
{
    uint32_t n = 0, i = 0;
    while (i + 1u < size) {
        uint32_t top5 = (uint32_t)p[i + 1u] >> 3; /* little-endian halfword, bits 15..11 */
        i += (top5 >= 0x1Du) ? 4u : 2u;
        ++n;
    }
    return n;
}

static uint32_t poet_popcount(uint32_t v)
{
    uint32_t n = 0;
    while (v) {
        v &= v - 1u;
        ++n;
    }
    return n;
}

/* The class of one Thumb instruction (h1: first halfword, h2: second of a 32-bit one) and the
 * words it transfers (*words, for the MULTI classes), from the ARMv7-M encoding tables (ARM DDI
 * 0403, A5.2 and A5.3; the FP ones A6.4). Loads and stores are one class: the cores' tables give
 * them the same cost. */
static uint32_t poet_classify(uint32_t h1, uint32_t h2, int wide, uint32_t *words)
{
    *words = 0;
    if (!wide) {
        if ((h1 >> 12) == 0xDu) /* B<c>; 0xDE UDF, 0xDF SVC */
            return ((h1 >> 8) & 0xFu) >= 0xEu ? POET_C_ALU : POET_C_BRANCH;
        if ((h1 >> 11) == 0x1Cu || (h1 & 0xFF00u) == 0x4700u || (h1 & 0xF500u) == 0xB100u)
            return POET_C_BRANCH; /* B, BX/BLX, CBZ/CBNZ */
        if ((h1 & 0xFE00u) == 0xB400u || (h1 & 0xFE00u) == 0xBC00u) { /* PUSH, POP */
            *words = poet_popcount(h1 & 0x1FFu);
            return POET_C_MULTI;
        }
        if ((h1 >> 12) == 0xCu) { /* LDM, STM */
            *words = poet_popcount(h1 & 0xFFu);
            return POET_C_MULTI;
        }
        if ((h1 >> 12) == 0x5u || (h1 >> 13) == 0x3u || (h1 >> 12) == 0x8u || (h1 >> 12) == 0x9u ||
            (h1 >> 11) == 0x9u)
            return POET_C_LOAD; /* register offset, immediate, halfword, SP-relative, literal */
        if ((h1 & 0xFFC0u) == 0x4340u)
            return POET_C_MUL;
        return POET_C_ALU;
    }
    switch ((h1 >> 11) & 3u) {
    case 1u:
        if ((h1 & 0xFE40u) == 0xE800u) { /* LDM/STM (.W), PUSH.W, POP.W */
            *words = poet_popcount(h2);
            return POET_C_MULTI;
        }
        if ((h1 & 0xFE40u) == 0xE840u) { /* LDRD/STRD, exclusives, TBB/TBH */
            if ((h1 & 0xFFF0u) == 0xE8D0u && (h2 & 0xFFE0u) == 0xF000u)
                return POET_C_BRANCH;
            *words = (h1 & 0x0120u) ? 2u : 1u; /* P or W set: LDRD/STRD; else an exclusive */
            return POET_C_MULTI;
        }
        if ((h1 & 0xEE00u) == 0xEA00u)
            return POET_C_ALU; /* data processing, shifted register */
        if ((h2 & 0x0E00u) != 0x0A00u)
            return POET_C_ALU; /* a coprocessor other than the FPU's 10/11 */
        if ((h1 & 0xFE00u) == 0xEC00u) { /* extension loads and stores, 0xEC00-0xEDFF */
            const uint32_t op = (h1 >> 4) & 0x1Fu; /* P U D W L */
            if ((op & 0x1Au) == 0x00u) /* P=0 U=0 W=0: VMOV of two core registers */
                return POET_C_FP_XFER;
            if ((op & 0x12u) == 0x10u) /* P=1 W=0: VLDR, VSTR */
                return POET_C_FP_LOAD;
            *words = h2 & 0xFFu; /* imm8 counts words, two per double register */
            return POET_C_MULTI;
        }
        if ((h1 & 0xFF00u) == 0xEE00u) {
            const uint32_t opc1 = (h1 >> 4) & 0xBu; /* bits 7, 5, 4 */
            if (h2 & 0x10u)
                return POET_C_FP_XFER; /* VMOV core <-> single, VMRS, VMSR */
            switch (opc1) {
            case 0x0u: case 0x1u: case 0x9u: case 0xAu:
                return POET_C_FP_MAC;
            case 0x8u:
                return POET_C_FP_DIV;
            case 0xBu:
                if ((h1 & 0xFu) == 0x1u && (h2 & 0xC0u) == 0xC0u)
                    return POET_C_FP_DIV; /* VSQRT */
                return POET_C_FP_ALU;
            default:
                return POET_C_FP_ALU;
            }
        }
        return POET_C_FP_ALU; /* 0xFC00-0xFFFF: the FPv5 additions (VSEL, VMAXNM, VRINT...) */
    case 2u:
        return (h2 & 0x8000u) ? ((h2 & 0x4000u) ? POET_C_CALL : POET_C_BRANCH) : POET_C_ALU;
    default: /* 3 */
        if ((h1 & 0xFE00u) == 0xF800u)
            return POET_C_LOAD;
        if ((h1 & 0xFF80u) == 0xFB00u)
            return POET_C_MUL;
        if ((h1 & 0xFFF0u) == 0xFB90u || (h1 & 0xFFF0u) == 0xFBB0u)
            return POET_C_DIV;
        if ((h1 & 0xFF80u) == 0xFB80u)
            return POET_C_MUL; /* long multiplies */
        if ((h1 & 0xFC00u) == 0xFC00u)
            return POET_C_FP_ALU;
        return POET_C_ALU;
    }
}

/* Estimated cycles of the instructions in p[0, size), without any taken branch */
static uint32_t poet_cost_thumb(const poet_icount_state *s, const uint8_t *p, uint32_t size)
{
    const uint32_t *c = s->costs;
    uint32_t i = 0, total = 0, after_memory = 0;
    while (i + 1u < size) {
        const uint32_t h1 = (uint32_t)p[i] | ((uint32_t)p[i + 1u] << 8);
        const int wide = (h1 >> 11) >= 0x1Du;
        uint32_t h2 = 0, words, cls;
        if (wide && i + 3u < size)
            h2 = (uint32_t)p[i + 2u] | ((uint32_t)p[i + 3u] << 8);
        cls = poet_classify(h1, h2, wide, &words);
        if (cls == POET_C_LOAD && after_memory)
            cls = POET_C_LOAD_NEXT;
        else if (cls == POET_C_FP_LOAD && after_memory)
            cls = POET_C_FP_LOAD_NEXT;
        total += c[cls] + (cls == POET_C_MULTI ? words * c[POET_C_MULTI_REG] : 0u);
        after_memory = cls == POET_C_LOAD || cls == POET_C_LOAD_NEXT || cls == POET_C_FP_LOAD ||
                       cls == POET_C_FP_LOAD_NEXT;
        i += wide ? 4u : 2u;
    }
    return total;
}

static uint32_t poet_cost_block(void *uc, poet_icount_state *s, uint64_t address, uint32_t size)
{
    uint8_t buf[512];
    if (s->costs == NULL)
        return 0u;
    if (address >= s->code_base && address - s->code_base + size <= s->code_size)
        return poet_cost_thumb(s, s->code + (address - s->code_base), size);
    if (size > sizeof buf || s->mem_read(uc, address, buf, size) != 0)
        return 0u; /* code outside flash (none in the generated firmware): not estimated */
    return poet_cost_thumb(s, buf, size);
}

static uint32_t poet_count_block(void *uc, poet_icount_state *s, uint64_t address, uint32_t size)
{
    if (address >= s->code_base && address - s->code_base + size <= s->code_size) {
        return poet_count_thumb(s->code + (address - s->code_base), size);
    }
    {
        uint8_t buf[256];
        uint32_t n = 0, done = 0;
        /* Chunks must not split a 32-bit instruction: decode each chunk only up to the last
           complete instruction and continue from there. */
        while (done + 1u < size) {
            uint32_t want = size - done, i = 0;
            if (want > sizeof buf) {
                want = sizeof buf;
            }
            if (s->mem_read(uc, address + done, buf, want) != 0) {
                s->read_errors++;
                return n;
            }
            while (i + 1u < want) {
                uint32_t step = (((uint32_t)buf[i + 1u] >> 3) >= 0x1Du) ? 4u : 2u;
                if (i + step > want && done + want < size) {
                    break; /* instruction straddles the chunk: re-read it with the next one */
                }
                i += step;
                ++n;
            }
            done += i;
        }
        return n;
    }
}

static uint32_t poet_sample_here(const poet_icount_state *s, uint64_t address)
{
    uint64_t half;
    if (s->reg_read == NULL) {
        return 0u;
    }
    if (s->sp_sample_map == NULL) {
        return 1u;
    }
    if (address < s->code_base || address - s->code_base >= s->code_size) {
        return 1u; /* code outside flash: no map, sample */
    }
    half = (address - s->code_base) >> 1;
    return (uint32_t)(s->sp_sample_map[half >> 3] >> (half & 7u)) & 1u;
}

POET_EXPORT void poet_icount_block_hook(void *uc, uint64_t address, uint32_t size, void *user)
{
    poet_icount_state *s = (poet_icount_state *)user;
    uint32_t count, sample, cycles;
    if (s->cache != NULL) {
        poet_block_slot *slot = &s->cache[(address >> 1) & (POET_CACHE_SLOTS - 1u)];
        if (slot->address == (uint32_t)address && slot->size == size) {
            count = slot->count;
            sample = slot->sample;
            cycles = slot->cycles;
        } else {
            count = poet_count_block(uc, s, address, size);
            sample = poet_sample_here(s, address);
            cycles = poet_cost_block(uc, s, address, size);
            slot->address = (uint32_t)address;
            slot->size = size;
            slot->count = count;
            slot->sample = sample;
            slot->cycles = cycles;
        }
    } else {
        count = poet_count_block(uc, s, address, size);
        sample = poet_sample_here(s, address);
        cycles = poet_cost_block(uc, s, address, size);
    }
    s->instructions += count;
    if (s->costs != NULL) {
        /* not the fall-through of the previous block: a branch was taken to get here */
        s->cycles += cycles + ((uint32_t)address != s->next_address ? s->taken_cost : 0u);
        s->next_address = (uint32_t)(address + size);
    }
    s->blocks++;
    if (sample) {
        /* The stack pointer at a marked block start: the stack's depth where paint cannot see
           it (a frame reserved but not written) and, below the end of static data, a stack that
           has run into .bss/.data without leaving RAM, which no memory fault would catch. */
        uint64_t sp = 0;
        s->reg_read(uc, s->sp_regid, &sp);
        if ((uint32_t)sp < s->min_sp) {
            s->min_sp = (uint32_t)sp;
            if (s->min_sp < s->sp_limit && !s->sp_fault) {
                s->sp_fault = 1u;
                s->sp_fault_pc = (uint32_t)address;
                s->emu_stop(uc);
            }
        }
    }
    if (s->limit != 0u && s->instructions >= s->limit && !s->limit_hit) {
        s->limit_hit = 1u;
        s->emu_stop(uc);
    }
}

/* Per-instruction variant (UC_HOOK_CODE), kept to cross-check the block counter and to measure
   what per-instruction hooks cost; the emulator uses the block hook. */
POET_EXPORT void poet_icount_code_hook(void *uc, uint64_t address, uint32_t size, void *user)
{
    poet_icount_state *s = (poet_icount_state *)user;
    (void)address;
    (void)size;
    s->instructions++;
    if (s->limit != 0u && s->instructions >= s->limit && !s->limit_hit) {
        s->limit_hit = 1u;
        s->emu_stop(uc);
    }
}

POET_EXPORT size_t poet_icount_cache_bytes(void)
{
    return POET_CACHE_SLOTS * sizeof(poet_block_slot);
}

POET_EXPORT size_t poet_icount_state_bytes(void)
{
    return sizeof(poet_icount_state);
}
