/*
 * Bare-metal start-up for the emulated Cortex-M target (poet_opt/firmware/emulator.py).
 *
 * It does what the start-up file of a real part does, and nothing that only an emulator needs,
 * so that a program which runs here runs on the board too:
 *
 *   - the vector table at address 0 holds the initial stack pointer (the top of RAM, see
 *     link.ld.in) and the reset handler; the core loads both from there at reset;
 *   - the reset handler copies .data from its load image in flash to RAM and zeroes .bss,
 *     because C promises initialised and zeroed statics and nothing else provides them;
 *   - on a hard-float build it grants access to the FPU (CPACR, coprocessors 10 and 11),
 *     because a Cortex-M4F/M7F comes out of reset with the FPU disabled and the first
 *     floating-point instruction would otherwise take a UsageFault;
 *   - it calls main() and then executes `bkpt #0` with main's return value in r0. On a board
 *     with a debugger attached that halts the core; the emulator stops there and reports r0
 *     as the result code.
 *
 * Every exception other than reset lands in fault_handler, which executes `bkpt #1` with the
 * active exception number (IPSR) in r0 and the stacked exception frame's address in r1, so a
 * fault stops the run with a clear report instead of spinning in a loop.
 */
#include <stdint.h>

/* Defined by the linker script (link.ld.in). Declared as arrays of words so that the copy
   loops below step one 32-bit word at a time; the script aligns each bound to 4 bytes. */
extern uint32_t _sidata[]; /* load address of .data in flash */
extern uint32_t _sdata[];  /* .data in RAM */
extern uint32_t _edata[];
extern uint32_t _sbss[];   /* .bss in RAM */
extern uint32_t _ebss[];
extern uint32_t _estack[]; /* one past the top of RAM: the initial stack pointer */

int main(void);

void Reset_Handler(void);
void fault_handler(void);

/* Address of the Coprocessor Access Control Register in the System Control Block. */
#define POET_SCB_CPACR (*(volatile uint32_t *)0xE000ED88u)

void Reset_Handler(void)
{
    uint32_t *src = _sidata;
    uint32_t *dst = _sdata;
    while (dst < _edata) {
        *dst++ = *src++;
    }
    for (dst = _sbss; dst < _ebss; ) {
        *dst++ = 0u;
    }
#if defined(__ARM_FP)
    /* CP10 and CP11 full access (bits 20-23); the barriers make sure the next instruction
       sees the FPU enabled, as the Arm architecture requires after writing CPACR. */
    POET_SCB_CPACR |= (0xFu << 20);
    __asm__ volatile("dsb\n\tisb" ::: "memory");
#endif
    {
        register int result __asm__("r0") = main();
        for (;;) {
            __asm__ volatile("bkpt #0" : : "r"(result));
        }
    }
}

/* Naked, so that r1 holds the exception frame exactly as the core stacked it (r0-r3, r12, lr,
   pc, xPSR): a debugger, or the emulator, reads the faulting pc at [r1 + 24]. */
__attribute__((naked)) void fault_handler(void)
{
    __asm__ volatile(
        "mrs r0, ipsr\n\t"
        "mov r1, sp\n\t"
        "1: bkpt #1\n\t"
        "b 1b");
}

/* One vector-table entry: the first holds a stack address, the others handlers. A union keeps
   the table free of casts between object and function pointers, which ISO C does not allow. */
typedef union {
    void (*handler)(void);
    const void *stack_top;
} poet_vector_t;

/* The 16 system vectors of ARMv6-M/ARMv7-M. No peripheral interrupts are used, so the table
   stops there; the reserved slots stay zero as the architecture asks. */
__attribute__((section(".isr_vector"), used))
const poet_vector_t poet_vectors[16] = {
    {.stack_top = _estack},     /*  0 initial MSP */
    {.handler = Reset_Handler}, /*  1 reset */
    {.handler = fault_handler}, /*  2 NMI */
    {.handler = fault_handler}, /*  3 HardFault */
    {.handler = fault_handler}, /*  4 MemManage (ARMv7-M) */
    {.handler = fault_handler}, /*  5 BusFault (ARMv7-M) */
    {.handler = fault_handler}, /*  6 UsageFault (ARMv7-M) */
    {.stack_top = 0},           /*  7 reserved */
    {.stack_top = 0},           /*  8 reserved */
    {.stack_top = 0},           /*  9 reserved */
    {.stack_top = 0},           /* 10 reserved */
    {.handler = fault_handler}, /* 11 SVCall */
    {.handler = fault_handler}, /* 12 DebugMonitor (ARMv7-M) */
    {.stack_top = 0},           /* 13 reserved */
    {.handler = fault_handler}, /* 14 PendSV */
    {.handler = fault_handler}, /* 15 SysTick */
};
