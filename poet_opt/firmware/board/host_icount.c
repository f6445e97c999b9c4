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
} poet_block_slot;

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
    uint32_t count, sample;
    if (s->cache != NULL) {
        poet_block_slot *slot = &s->cache[(address >> 1) & (POET_CACHE_SLOTS - 1u)];
        if (slot->address == (uint32_t)address && slot->size == size) {
            count = slot->count;
            sample = slot->sample;
        } else {
            count = poet_count_block(uc, s, address, size);
            sample = poet_sample_here(s, address);
            slot->address = (uint32_t)address;
            slot->size = size;
            slot->count = count;
            slot->sample = sample;
        }
    } else {
        count = poet_count_block(uc, s, address, size);
        sample = poet_sample_here(s, address);
    }
    s->instructions += count;
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
