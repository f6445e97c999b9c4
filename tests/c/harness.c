/* One training step of a poet-opt schedule on the host, for tests/test_c_execution.py.
 *
 *   harness DIR MODE [ARG]
 *
 * reads DIR/params.bin (the weights, fp32) and DIR/input.bin (the batch, fp32, then the targets,
 * int32), runs the plan in plan.h through the reference runtime with the kernels of net.c, writes
 * DIR/grads.bin (every weight and bias gradient, fp32, in the order of params.bin) and prints what
 * happened. Flash is a byte array with erase-block semantics. MODE injects one fault, to prove the
 * runtime's checks fire: ok, overflow NODE DELTA (a byte DELTA past the output), clobber-input NODE, fail-kernel NODE, bad-operand K,
 * fail-read, force-debug (a debug struct handed to a release build). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "poet_runtime.h"
#include "net.h"

POET_RT_DEFINE_PLAN(plan, POET_);

static uint8_t flash[POET_FLASH_BYTES + 1u];
static uint8_t flash_written[POET_FLASH_BYTES + 1u];
static uint8_t arena_buffer[POET_ARENA_BYTES + POET_RT_GUARD_BYTES + POET_ARENA_ALIGNMENT];
static uint32_t operands_copy[POET_NUM_OPERANDS + 1u];
static unsigned long bytes_written, page_ins, page_outs;
static int fail_read;

static int flash_write(void *user, uint32_t offset, const uint8_t *src, uint32_t bytes) {
    uint32_t start = offset, end = offset + bytes;
    (void)user;
    if (offset % POET_REGION_ALIGNMENT_BYTES || end > POET_FLASH_BYTES) return -2;
#if POET_REGION_ALIGNMENT_BYTES == POET_ERASE_BLOCK_BYTES
    /* raw flash: erase the blocks the region spans (NOR/NAND reads erased bytes as 0xFF), then
       program; the region is whole blocks of its own */
    end = (end + POET_ERASE_BLOCK_BYTES - 1u) / POET_ERASE_BLOCK_BYTES * POET_ERASE_BLOCK_BYTES;
    if (end > POET_FLASH_BYTES) end = POET_FLASH_BYTES;
    memset(flash + start, 0xFF, end - start);
    memset(flash_written + start, 0, end - start);
#else
    (void)start; /* a card packed in sectors: no erase, the write overwrites exactly its bytes */
#endif
    memcpy(flash + offset, src, bytes);
    memset(flash_written + offset, 1, bytes);
    bytes_written += bytes;
    page_outs++;
    return 0;
}

static int flash_read(void *user, uint32_t offset, uint8_t *dst, uint32_t bytes) {
    uint32_t b;
    (void)user;
    if (fail_read) return -7;
    if (offset + bytes > POET_FLASH_BYTES) return -3;
    for (b = offset; b < offset + bytes; b++)
        if (!flash_written[b]) return -4; /* paging in what was never paged out */
    memcpy(dst, flash + offset, bytes);
    page_ins++;
    return 0;
}

static void on_violation(void *user, const poet_rt_violation_t *v) {
    (void)user;
    printf("violation what=%u step=%u node=%u offset=%u bytes=%u victim=%u\n", (unsigned)v->what,
           (unsigned)v->step, (unsigned)v->node, (unsigned)v->offset, (unsigned)v->bytes, (unsigned)v->victim);
}

static int load(const char *dir, const char *name, void *dst, size_t bytes) {
    char path[4096];
    FILE *f;
    size_t got;
    sprintf(path, "%.4000s/%s", dir, name);
    f = fopen(path, "rb");
    if (!f) return 0;
    got = fread(dst, 1, bytes, f);
    fclose(f);
    return got == bytes;
}

int main(int argc, char **argv) {
    static poet_rt_kernel_fn kernels[POET_NUM_TENSORS];
    poet_rt_callbacks_t callbacks;
    poet_rt_plan_t run_plan = plan;
    poet_rt_error_t error;
    poet_rt_debug_t *debug = NULL;
    const char *dir, *mode;
    uint8_t *arena;
    uint32_t n, arg = 0, arg2 = 0;
    char path[4096];
    FILE *out;
    int rc;
#ifdef POET_RUNTIME_DEBUG
    static uint8_t shadow[POET_ARENA_BYTES + POET_RT_GUARD_BYTES];
    static uint32_t resident[POET_NUM_TENSORS];
    static poet_rt_debug_t debug_state;
    debug_state.shadow = shadow;
    debug_state.resident = resident;
    debug_state.report = on_violation;
    debug = &debug_state;
#else
    static uint8_t dummy_shadow[1];
    static uint32_t dummy_resident[1];
    static poet_rt_debug_t debug_state;
    debug_state.shadow = dummy_shadow;
    debug_state.resident = dummy_resident;
    (void)on_violation;
#endif

    if (argc < 3) return 64;
    dir = argv[1];
    mode = argv[2];
    if (argc > 3) arg = (uint32_t)strtoul(argv[3], NULL, 10);
    if (argc > 4) arg2 = (uint32_t)strtoul(argv[4], NULL, 10);
    if (!load(dir, "params.bin", net_params, sizeof net_params) ||
        !load(dir, "input.bin", net_input, sizeof net_input) ||
        !load(dir, "target.bin", net_target, sizeof net_target))
        return 65;

    for (n = 0; n < POET_NUM_TENSORS; n++) kernels[n] = net_kernel;
    callbacks.kernels = kernels;
    callbacks.read = flash_read;
    callbacks.write = flash_write;
    callbacks.user = NULL;

    if (!strcmp(mode, "overflow")) net_fault(arg, NET_FAULT_OVERFLOW, arg2);
    else if (!strcmp(mode, "clobber-input")) net_fault(arg, NET_FAULT_CLOBBER_INPUT, 0);
    else if (!strcmp(mode, "fail-kernel")) net_fault(arg, NET_FAULT_FAIL, 0);
    else if (!strcmp(mode, "fail-read")) fail_read = 1;
    else if (!strcmp(mode, "force-debug")) debug = &debug_state;
    else if (!strcmp(mode, "bad-operand")) {
        /* point operand ARG at the previous operand's tensor, which is some other node's */
        memcpy(operands_copy, POET_OPERANDS, sizeof POET_OPERANDS);
        operands_copy[arg] = POET_OPERANDS[arg ? arg - 1u : 1u];
        run_plan.operands = operands_copy;
    } else if (strcmp(mode, "ok")) return 66;

    arena = arena_buffer + (POET_ARENA_ALIGNMENT - (uintptr_t)arena_buffer % POET_ARENA_ALIGNMENT) % POET_ARENA_ALIGNMENT;
    rc = poet_rt_run(&run_plan, &callbacks, arena, debug, &error);

    printf("rc=%d step=%u node=%u code=%d violations=%u\n", rc, (unsigned)error.step, (unsigned)error.node,
           (int)error.code, debug ? (unsigned)debug->violations : 0u);
    printf("loss=%.9g\n", (double)net_loss_total());
    printf("flash bytes_written=%lu page_ins=%lu page_outs=%lu\n", bytes_written, page_ins, page_outs);
    printf("computes");
    for (n = 0; n < POET_NUM_TENSORS; n++) printf(" %lu", net_computes[n]);
    printf("\n");

    sprintf(path, "%.4000s/grads.bin", dir);
    out = fopen(path, "wb");
    if (!out || fwrite(net_grads, 1, sizeof net_grads, out) != sizeof net_grads) return 67;
    fclose(out);
    return 0;
}
