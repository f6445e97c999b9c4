/* Reference runtime for poet-opt training schedules: see poet_runtime.h and docs/c-runtime.md.
 * C99, <stdint.h> only (no libc calls, no malloc), so it builds for bare-metal targets as is. */
#include "poet_runtime.h"

#define NOT_RESIDENT 0xFFFFFFFFu

static int stop(poet_rt_error_t *error, int rc, uint32_t step, uint32_t node, int32_t code) {
    if (error) {
        error->step = step;
        error->node = node;
        error->code = code;
    }
    return rc;
}

/* [offset, offset + bytes) inside [0, limit), without overflowing. */
static int fits(uint32_t offset, uint32_t bytes, uint32_t limit) {
    return offset <= limit && bytes <= limit - offset;
}

/* The header comes from the exporter, but it is data the firmware links in and may get wrong (a
 * stale header, a corrupted flash image): every index and offset is checked before it is used. */
static int step_is_sound(const poet_rt_plan_t *plan, const poet_rt_callbacks_t *cb, const poet_rt_step_t *st) {
    uint32_t k;
    if (st->kind > POET_RT_FREE || st->node >= plan->num_tensors || st->bytes != plan->node_bytes[st->node])
        return 0;
    if (!fits(st->arena_offset, st->bytes, plan->arena_bytes))
        return 0;
    switch (st->kind) {
    case POET_RT_COMPUTE:
        if (!cb->kernels[st->node] || st->num_operands > POET_RT_MAX_OPERANDS ||
            !fits(st->first_operand, st->num_operands, plan->num_operands))
            return 0;
        for (k = st->first_operand; k < st->first_operand + st->num_operands; k++) {
            uint32_t dep = plan->operand_node(k);
            if (dep >= plan->num_tensors || !fits(plan->operands[k], plan->node_bytes[dep], plan->arena_bytes))
                return 0;
        }
        return 1;
    case POET_RT_PAGE_OUT:
    case POET_RT_PAGE_IN:
        return (st->kind == POET_RT_PAGE_OUT ? cb->write != 0 : cb->read != 0) &&
               fits(st->flash_offset, st->bytes, plan->flash_bytes);
    default:
        return 1;
    }
}

#ifdef POET_RUNTIME_DEBUG

static void fill(uint8_t *p, uint8_t value, uint32_t bytes) {
    uint32_t b;
    for (b = 0; b < bytes; b++)
        p[b] = value;
}

static void report(poet_rt_debug_t *debug, void *user, uint32_t what, uint32_t step, uint32_t node,
                   uint32_t offset, uint32_t bytes, uint32_t victim) {
    poet_rt_violation_t v;
    v.what = what;
    v.step = step;
    v.node = node;
    v.offset = offset;
    v.bytes = bytes;
    v.victim = victim;
    debug->violations++;
    if (debug->report)
        debug->report(user, &v);
}

/* The resident node whose tensor holds arena byte `offset`, or POET_RT_NO_NODE. */
static uint32_t owner_of(const poet_rt_plan_t *plan, const poet_rt_debug_t *debug, uint32_t offset) {
    uint32_t n;
    for (n = 0; n < plan->num_tensors; n++) {
        uint32_t at = debug->resident[n];
        if (at != NOT_RESIDENT && offset >= at && offset - at < plan->node_bytes[n])
            return n;
    }
    return POET_RT_NO_NODE;
}

static void debug_begin(const poet_rt_plan_t *plan, poet_rt_debug_t *debug, uint8_t *arena) {
    uint32_t n;
    fill(arena, POET_RT_POISON, plan->arena_bytes + POET_RT_GUARD_BYTES);
    fill(debug->shadow, POET_RT_POISON, plan->arena_bytes + POET_RT_GUARD_BYTES);
    for (n = 0; n < plan->num_tensors; n++)
        debug->resident[n] = NOT_RESIDENT;
    debug->violations = 0;
}

/* Residency rules, checked before the step's callback runs. */
static void debug_before(const poet_rt_plan_t *plan, poet_rt_debug_t *debug, void *user, uint32_t s,
                         const poet_rt_step_t *st) {
    uint32_t k, n;
    if (st->kind == POET_RT_COMPUTE || st->kind == POET_RT_PAGE_IN) {
        if (debug->resident[st->node] != NOT_RESIDENT)
            report(debug, user, POET_RT_V_ALREADY_LIVE, s, st->node, debug->resident[st->node],
                   st->bytes, st->node);
        for (n = 0; n < plan->num_tensors; n++) {
            uint32_t at = debug->resident[n];
            if (n != st->node && at != NOT_RESIDENT && plan->node_bytes[n] && st->bytes &&
                at < st->arena_offset + st->bytes && st->arena_offset < at + plan->node_bytes[n])
                report(debug, user, POET_RT_V_OVERLAP, s, st->node, st->arena_offset, st->bytes, n);
        }
    }
    if (st->kind == POET_RT_COMPUTE) {
        for (k = st->first_operand; k < st->first_operand + st->num_operands; k++) {
            uint32_t dep = plan->operand_node(k);
            if (debug->resident[dep] != plan->operands[k])
                report(debug, user, POET_RT_V_OPERAND_NOT_LIVE, s, st->node, plan->operands[k],
                       plan->node_bytes[dep], dep);
        }
    }
    if ((st->kind == POET_RT_PAGE_OUT || st->kind == POET_RT_FREE) && debug->resident[st->node] != st->arena_offset)
        report(debug, user, POET_RT_V_NOT_LIVE, s, st->node, st->arena_offset, st->bytes, st->node);
}

/* Compare arena and shadow over [from, to) except the interval the step may write: every run of
 * changed bytes there is a write outside a live tensor's interval. */
static void find_stray_writes(const poet_rt_plan_t *plan, poet_rt_debug_t *debug, void *user, uint32_t s,
                              const poet_rt_step_t *st, const uint8_t *arena, uint32_t from, uint32_t to,
                              uint32_t allowed_lo, uint32_t allowed_hi, uint32_t what) {
    uint32_t b = from;
    while (b < to) {
        uint32_t start;
        if ((b >= allowed_lo && b < allowed_hi) || arena[b] == debug->shadow[b]) {
            b++;
            continue;
        }
        start = b;
        while (b < to && !(b >= allowed_lo && b < allowed_hi) && arena[b] != debug->shadow[b])
            b++;
        report(debug, user, what, s, st->node, start, b - start,
               what == POET_RT_V_GUARD ? POET_RT_NO_NODE : owner_of(plan, debug, start));
    }
}

/* After the callback: nothing but the step's own output may have changed; then record the step. */
static void debug_after(const poet_rt_plan_t *plan, poet_rt_debug_t *debug, void *user, uint32_t s,
                        const poet_rt_step_t *st, uint8_t *arena) {
    uint32_t lo = 0, hi = 0, b;
    if (st->kind == POET_RT_COMPUTE || st->kind == POET_RT_PAGE_IN) {
        lo = st->arena_offset;
        hi = st->arena_offset + st->bytes;
    }
    find_stray_writes(plan, debug, user, s, st, arena, 0, plan->arena_bytes, lo, hi, POET_RT_V_STRAY_WRITE);
    find_stray_writes(plan, debug, user, s, st, arena, plan->arena_bytes, plan->arena_bytes + POET_RT_GUARD_BYTES,
                      0, 0, POET_RT_V_GUARD);
    for (b = lo; b < hi; b++)
        debug->shadow[b] = arena[b];
    if (st->kind == POET_RT_COMPUTE || st->kind == POET_RT_PAGE_IN) {
        debug->resident[st->node] = st->arena_offset;
    } else if (st->kind == POET_RT_FREE) {
        /* Poison what was freed, so that a later read of it yields NaNs, not the old values. */
        debug->resident[st->node] = NOT_RESIDENT;
        fill(arena + st->arena_offset, POET_RT_POISON, st->bytes);
        fill(debug->shadow + st->arena_offset, POET_RT_POISON, st->bytes);
    }
}

#endif /* POET_RUNTIME_DEBUG */

int poet_rt_run(const poet_rt_plan_t *plan, const poet_rt_callbacks_t *callbacks, uint8_t *arena,
                poet_rt_debug_t *debug, poet_rt_error_t *error) {
    const uint8_t *inputs[POET_RT_MAX_OPERANDS];
    poet_rt_step_t st;
    uint32_t s, k;
    int rc;

    if (!plan || !callbacks || !callbacks->kernels || !plan->step || !plan->operand_node)
        return stop(error, POET_RT_ERR_PLAN, 0, POET_RT_NO_NODE, 0);
    stop(error, POET_RT_OK, plan->num_steps, POET_RT_NO_NODE, 0);
    if (!arena || plan->arena_alignment == 0 || (uintptr_t)arena % plan->arena_alignment != 0)
        return stop(error, POET_RT_ERR_ARENA, 0, POET_RT_NO_NODE, 0);
#ifdef POET_RUNTIME_DEBUG
    if (debug) {
        if (!debug->shadow || !debug->resident)
            return stop(error, POET_RT_ERR_ARENA, 0, POET_RT_NO_NODE, 0);
        debug_begin(plan, debug, arena);
    }
#else
    if (debug)
        return stop(error, POET_RT_ERR_NO_DEBUG, 0, POET_RT_NO_NODE, 0);
#endif

    for (s = 0; s < plan->num_steps; s++) {
        plan->step(s, &st);
        if (!step_is_sound(plan, callbacks, &st))
            return stop(error, POET_RT_ERR_PLAN, s, st.node < plan->num_tensors ? st.node : POET_RT_NO_NODE, 0);
#ifdef POET_RUNTIME_DEBUG
        if (debug) {
            uint32_t before = debug->violations;
            debug_before(plan, debug, callbacks->user, s, &st);
            if (debug->violations != before)
                return stop(error, POET_RT_ERR_VIOLATION, s, st.node, 0);
        }
#endif
        rc = 0;
        switch (st.kind) {
        case POET_RT_COMPUTE:
            for (k = 0; k < st.num_operands; k++)
                inputs[k] = arena + plan->operands[st.first_operand + k];
            rc = callbacks->kernels[st.node](callbacks->user, st.node, inputs, st.num_operands,
                                             arena + st.arena_offset, st.bytes);
            if (rc)
                return stop(error, POET_RT_ERR_KERNEL, s, st.node, rc);
            break;
        case POET_RT_PAGE_OUT:
            rc = callbacks->write(callbacks->user, st.flash_offset, arena + st.arena_offset, st.bytes);
            if (rc)
                return stop(error, POET_RT_ERR_WRITE, s, st.node, rc);
            break;
        case POET_RT_PAGE_IN:
            rc = callbacks->read(callbacks->user, st.flash_offset, arena + st.arena_offset, st.bytes);
            if (rc)
                return stop(error, POET_RT_ERR_READ, s, st.node, rc);
            break;
        default: /* POET_RT_FREE: the bytes are simply reused by a later step */
            break;
        }
#ifdef POET_RUNTIME_DEBUG
        if (debug) {
            uint32_t before = debug->violations;
            debug_after(plan, debug, callbacks->user, s, &st, arena);
            if (debug->violations != before)
                return stop(error, POET_RT_ERR_VIOLATION, s, st.node, 0);
        }
#endif
    }
    return POET_RT_OK;
}
