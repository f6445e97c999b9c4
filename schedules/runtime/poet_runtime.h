/* Reference runtime for poet-opt training schedules (docs/c-runtime.md).
 *
 * One call, poet_rt_run(), walks the step table of a header written by `poet-opt export` once: one
 * training step. The firmware supplies three things: a kernel per node (the forward, loss and
 * backward operators, with their weights and weight gradients outside the arena), a flash read and
 * a flash write callback, and the arena itself (POET_ARENA_BYTES bytes aligned to
 * POET_ARENA_ALIGNMENT). The runtime allocates nothing and needs nothing beyond <stdint.h>.
 *
 * The header's tables have the smallest integer widths that fit, and their names carry the prefix
 * chosen at export, so the runtime reads them through a small descriptor, poet_rt_plan_t, that
 * POET_RT_DEFINE_PLAN() fills from any header:
 *
 *     #include "mlp_plan.h"          the exported header (prefix POET_)
 *     #include "poet_runtime.h"
 *     POET_RT_DEFINE_PLAN(mlp_plan, POET_)
 *     ...
 *     int rc = poet_rt_run(&mlp_plan, &callbacks, arena, 0, &error);
 *
 * Debug builds: compile poet_runtime.c with -DPOET_RUNTIME_DEBUG and pass a poet_rt_debug_t. The
 * runtime then tracks which tensor is resident where, poisons free arena bytes, and after every
 * callback compares the whole arena (plus POET_RT_GUARD_BYTES of guard after it) with a shadow
 * copy: any byte a callback changed outside the one interval the step may write is reported.
 */
#ifndef POET_RUNTIME_H
#define POET_RUNTIME_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Step kinds, equal to the enum in every exported header (POET_RT_DEFINE_PLAN checks). */
#define POET_RT_COMPUTE 0u
#define POET_RT_PAGE_OUT 1u
#define POET_RT_PAGE_IN 2u
#define POET_RT_FREE 3u

/* Most inputs one compute step may have: the size of the pointer array handed to kernels. An
 * exported plan with more (its POET_MAX_OPERANDS) fails to compile in POET_RT_DEFINE_PLAN. */
#ifndef POET_RT_MAX_OPERANDS
#define POET_RT_MAX_OPERANDS 32u
#endif

/* Guard bytes a debug build checks after the arena: the arena buffer is then
 * POET_ARENA_BYTES + POET_RT_GUARD_BYTES long. */
#define POET_RT_GUARD_BYTES 64u

/* Return codes of poet_rt_run. */
enum {
    POET_RT_OK = 0,
    POET_RT_ERR_KERNEL = 1,     /* a kernel returned non-zero (its value is in error->code) */
    POET_RT_ERR_READ = 2,       /* the flash read callback returned non-zero */
    POET_RT_ERR_WRITE = 3,      /* the flash write callback returned non-zero */
    POET_RT_ERR_PLAN = 4,       /* a step the plan cannot mean: offsets outside arena or flash, an
                                 * unknown kind, a node without a kernel, too many operands */
    POET_RT_ERR_ARENA = 5,      /* arena pointer null or not aligned to the plan's alignment */
    POET_RT_ERR_VIOLATION = 6,  /* debug build: an access outside a live tensor (see poet_rt_debug_t) */
    POET_RT_ERR_NO_DEBUG = 7    /* a poet_rt_debug_t was passed to a runtime built without
                                 * POET_RUNTIME_DEBUG: refuse rather than run unchecked */
};

/* One step, widened to 32 bits whatever the header's field widths. */
typedef struct {
    uint32_t kind;
    uint32_t node;
    uint32_t arena_offset;
    uint32_t flash_offset;
    uint32_t bytes;
    uint32_t first_operand;
    uint32_t num_operands;
} poet_rt_step_t;

/* An exported plan, as the runtime reads it. Fill it with POET_RT_DEFINE_PLAN. */
typedef struct {
    uint32_t num_steps;
    uint32_t num_tensors;
    uint32_t num_operands;
    uint32_t arena_bytes;
    uint32_t arena_alignment;
    uint32_t flash_bytes;
    const uint32_t *operands;   /* PREFIX_OPERANDS: arena offsets of compute inputs */
    const uint32_t *node_bytes; /* PREFIX_NODE_BYTES */
    void (*step)(uint32_t index, poet_rt_step_t *out);  /* reads PREFIX_STEPS[index] */
    uint32_t (*operand_node)(uint32_t index);           /* reads PREFIX_OPERAND_NODES[index] */
} poet_rt_plan_t;

/* Kernel for one node: read inputs[0 .. num_inputs) (the node's deps, in the order of the graph's
 * deps, i.e. PREFIX_OPERAND_NODES), write all `bytes` of `output`, touch no other arena byte.
 * Inputs never alias the output. A kernel may be recomputed (called again for the same node in the
 * same training step), so anything it writes outside the arena, such as a weight gradient, must be
 * assigned, not accumulated. Return 0, or non-zero to abort the training step. */
typedef int (*poet_rt_kernel_fn)(void *user, uint32_t node, const uint8_t *const *inputs, uint32_t num_inputs,
                                 uint8_t *output, uint32_t bytes);
/* Flash: copy `bytes` at `flash_offset` of the plan's flash partition to `dst`; return 0 on success. */
typedef int (*poet_rt_read_fn)(void *user, uint32_t flash_offset, uint8_t *dst, uint32_t bytes);
/* Flash: store `bytes` from `src` at `flash_offset` (erase-block aligned; the region spans whole erase
 * blocks of the plan, so erasing them first destroys nothing else); return 0 on success. */
typedef int (*poet_rt_write_fn)(void *user, uint32_t flash_offset, const uint8_t *src, uint32_t bytes);

typedef struct {
    const poet_rt_kernel_fn *kernels; /* plan->num_tensors entries, indexed by node id */
    poet_rt_read_fn read;             /* may be null when the plan pages nothing */
    poet_rt_write_fn write;           /* likewise */
    void *user;                       /* passed to every callback */
} poet_rt_callbacks_t;

/* Where a run stopped. */
typedef struct {
    uint32_t step;  /* index of the failing step; num_steps when the run completed */
    uint32_t node;  /* its node */
    int32_t code;   /* the callback's non-zero return value, for POET_RT_ERR_KERNEL/READ/WRITE */
} poet_rt_error_t;

/* What a debug build reports. */
enum {
    POET_RT_V_OPERAND_NOT_LIVE = 1, /* a compute input is not resident where the table points */
    POET_RT_V_NOT_LIVE = 2,         /* a page-out or free of a tensor not resident at its offset */
    POET_RT_V_ALREADY_LIVE = 3,     /* a compute or page-in of a tensor that is already resident */
    POET_RT_V_OVERLAP = 4,          /* a compute or page-in into bytes a live tensor holds */
    POET_RT_V_STRAY_WRITE = 5,      /* a callback changed arena bytes outside the step's output */
    POET_RT_V_GUARD = 6             /* a callback changed the guard bytes after the arena */
};

#define POET_RT_NO_NODE 0xFFFFFFFFu

typedef struct {
    uint32_t what;    /* POET_RT_V_* */
    uint32_t step;    /* the step during which it happened */
    uint32_t node;    /* the step's node */
    uint32_t offset;  /* first arena byte concerned (>= arena_bytes: in the guard) */
    uint32_t bytes;   /* how many bytes from offset (a contiguous run, for stray writes) */
    uint32_t victim;  /* stray write / overlap: the live node owning those bytes, or POET_RT_NO_NODE
                       * (free bytes or guard); operand not live: the operand's node */
} poet_rt_violation_t;

typedef void (*poet_rt_report_fn)(void *user, const poet_rt_violation_t *violation);

/* Debug state the firmware allocates (no malloc): a shadow of arena + guard and one word per node. */
typedef struct {
    uint8_t *shadow;          /* arena_bytes + POET_RT_GUARD_BYTES bytes */
    uint32_t *resident;       /* num_tensors words: arena offset of each resident node */
    poet_rt_report_fn report; /* called once per violation; may be null */
    uint32_t violations;      /* set by poet_rt_run: how many were reported */
} poet_rt_debug_t;

/* Byte the debug build fills free arena and guard bytes with: 0xFF makes every float NaN, so a
 * kernel that reads a stale or unwritten tensor produces NaNs instead of plausible numbers. */
#define POET_RT_POISON 0xFFu

/* Run one training step. `arena` holds plan->arena_bytes bytes (plus POET_RT_GUARD_BYTES when
 * `debug` is given). `debug` is null in production. `error` may be null. Returns POET_RT_OK or the
 * first failure; a debug build stops at the first step with a violation. */
int poet_rt_run(const poet_rt_plan_t *plan, const poet_rt_callbacks_t *callbacks, uint8_t *arena,
                poet_rt_debug_t *debug, poet_rt_error_t *error);

/* A poet_rt_plan_t named NAME for the header whose prefix is P (written without quotes, e.g.
 * POET_). Include the header first. Fails to compile when the plan has more operands per step than
 * POET_RT_MAX_OPERANDS or its step kinds differ from the runtime's. */
#define POET_RT_DEFINE_PLAN(NAME, P)                                                              \
    typedef char NAME##_operands_fit[((P##MAX_OPERANDS) <= POET_RT_MAX_OPERANDS) ? 1 : -1];       \
    typedef char NAME##_kinds_match[((P##COMPUTE) == POET_RT_COMPUTE && (P##PAGE_OUT) == POET_RT_PAGE_OUT \
                                     && (P##PAGE_IN) == POET_RT_PAGE_IN && (P##FREE) == POET_RT_FREE) ? 1 : -1]; \
    static void NAME##_step(uint32_t index, poet_rt_step_t *out) {                                \
        const P##step_t *s = &P##STEPS[index];                                                    \
        out->kind = s->kind;                                                                      \
        out->node = s->node;                                                                      \
        out->arena_offset = s->arena_offset;                                                      \
        out->flash_offset = s->flash_offset;                                                      \
        out->bytes = s->bytes;                                                                    \
        out->first_operand = s->first_operand;                                                    \
        out->num_operands = s->num_operands;                                                      \
    }                                                                                             \
    static uint32_t NAME##_operand_node(uint32_t index) { return P##OPERAND_NODES[index]; }       \
    static const poet_rt_plan_t NAME P##UNUSED = {                                                \
        P##NUM_STEPS, P##NUM_TENSORS, P##NUM_OPERANDS, P##ARENA_BYTES, P##ARENA_ALIGNMENT,        \
        P##FLASH_BYTES, P##OPERANDS, P##NODE_BYTES, NAME##_step, NAME##_operand_node              \
    }

#ifdef __cplusplus
}
#endif

#endif /* POET_RUNTIME_H */
