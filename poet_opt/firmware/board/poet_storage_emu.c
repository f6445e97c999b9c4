/*
 * Storage port for the emulated board: poet_storage.h implemented on the emulator's storage
 * controller.
 *
 * The controller is a small DMA engine with memory-mapped registers in the peripheral region
 * (POET_EMU_STORAGE_BASE, outside RAM). The port writes the operation, the storage offset, the
 * RAM/flash address and the length, then writes GO; the controller performs the whole transfer
 * before the write completes and leaves the result in STATUS. The emulator checks every
 * operation there, at controller level, against the semantics of the device kind (flash:
 * program only clears bits, erase per block; SD/eMMC: whole aligned 512-byte blocks) and
 * counts bytes and erases. So the port passes each request through unchanged: a request the
 * device would refuse must reach the controller to be recorded as a violation.
 *
 * A real board replaces this file with its own driver and keeps poet_storage.h. The one piece
 * of real-driver logic kept here is the read path of a block device, which can only transfer
 * whole blocks: a read that starts or ends inside a block goes through a one-block bounce
 * buffer, as an SD driver must do (and costs the 512 bytes of RAM it costs there).
 */
#include "poet_storage.h"

#ifndef POET_EMU_STORAGE_BASE
#define POET_EMU_STORAGE_BASE 0x40000000u
#endif

/* Register map of the emulated controller (byte offsets); keep in step with emulator.py. */
#define POET_EMU_REG(off) (*(volatile uint32_t *)(POET_EMU_STORAGE_BASE + (off)))
#define POET_EMU_OP POET_EMU_REG(0x00u)     /* 1 read, 2 write (program), 3 erase */
#define POET_EMU_OFFSET POET_EMU_REG(0x04u) /* byte offset in storage */
#define POET_EMU_ADDR POET_EMU_REG(0x08u)   /* RAM/flash address of the data */
#define POET_EMU_LEN POET_EMU_REG(0x0Cu)    /* bytes to transfer */
#define POET_EMU_BLOCK POET_EMU_REG(0x10u)  /* erase block number */
#define POET_EMU_GO POET_EMU_REG(0x14u)     /* write 1: perform the operation */
#define POET_EMU_STATUS POET_EMU_REG(0x18u) /* result of the last operation (int32) */

#define POET_EMU_OP_READ 1u
#define POET_EMU_OP_WRITE 2u
#define POET_EMU_OP_ERASE 3u

static int poet_emu_transfer(uint32_t op, uint32_t offset, uint32_t address, uint32_t bytes)
{
    POET_EMU_OP = op;
    POET_EMU_OFFSET = offset;
    POET_EMU_ADDR = address;
    POET_EMU_LEN = bytes;
    POET_EMU_GO = 1u;
    return (int)(int32_t)POET_EMU_STATUS;
}

#if POET_STORAGE_WRITE_BLOCK_BYTES > 1
/* Block device: reads move whole blocks, so a partial first or last block is read into this
   buffer and the wanted part copied out. Word-aligned for the controller's DMA. */
static uint32_t poet_emu_bounce[POET_STORAGE_WRITE_BLOCK_BYTES / 4u];

int poet_storage_read(uint32_t offset, void *dst, uint32_t bytes)
{
    const uint32_t blk = POET_STORAGE_WRITE_BLOCK_BYTES;
    uint8_t *out = (uint8_t *)dst;
    int rc;
    while (bytes > 0u) {
        uint32_t within = offset % blk;
        uint32_t chunk;
        if (within == 0u && bytes >= blk) {
            /* Aligned run of whole blocks: straight into the destination. */
            chunk = bytes - bytes % blk;
            rc = poet_emu_transfer(POET_EMU_OP_READ, offset, (uint32_t)(uintptr_t)out, chunk);
        } else {
            uint32_t i;
            const uint8_t *b = (const uint8_t *)poet_emu_bounce;
            chunk = blk - within;
            if (chunk > bytes) {
                chunk = bytes;
            }
            rc = poet_emu_transfer(POET_EMU_OP_READ, offset - within,
                                   (uint32_t)(uintptr_t)poet_emu_bounce, blk);
            if (rc == POET_STORAGE_OK) {
                for (i = 0u; i < chunk; ++i) {
                    out[i] = b[within + i];
                }
            }
        }
        if (rc != POET_STORAGE_OK) {
            return rc;
        }
        out += chunk;
        offset += chunk;
        bytes -= chunk;
    }
    return POET_STORAGE_OK;
}
#else
int poet_storage_read(uint32_t offset, void *dst, uint32_t bytes)
{
    return poet_emu_transfer(POET_EMU_OP_READ, offset, (uint32_t)(uintptr_t)dst, bytes);
}
#endif

int poet_storage_write(uint32_t offset, const void *src, uint32_t bytes)
{
    return poet_emu_transfer(POET_EMU_OP_WRITE, offset, (uint32_t)(uintptr_t)src, bytes);
}

int poet_storage_erase(uint32_t block)
{
    POET_EMU_OP = POET_EMU_OP_ERASE;
    POET_EMU_BLOCK = block;
    POET_EMU_GO = 1u;
    return (int)(int32_t)POET_EMU_STATUS;
}
