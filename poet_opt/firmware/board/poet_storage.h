/*
 * poet_storage.h: the storage interface the generated training firmware pages through.
 *
 * Three functions, implemented by a board port. The emulator's port (poet_storage_emu.c) drives
 * an emulated storage controller that checks every operation against the semantics of the
 * device kind; a real board replaces that one file with a driver for its SPI/QSPI flash, its
 * internal flash or its SD card, and keeps this header.
 *
 * Offsets are byte offsets from the start of the storage device. All functions return
 * POET_STORAGE_OK (0) or a negative POET_STORAGE_E_* code, and never fault: what to do about a
 * failed page-out is the caller's decision.
 *
 * Semantics a caller must respect (the emulator enforces them; real devices need them):
 *   - flash kinds (POET_STORAGE_ERASE_REQUIRED == 1): poet_storage_write can only clear bits
 *     (1 -> 0). Writing data that needs a 0 bit to become 1 fails with
 *     POET_STORAGE_E_NOT_ERASED and changes nothing; erase the containing erase block first,
 *     which sets it to POET_STORAGE_ERASED_BYTE (0xFF). Each erase wears the block.
 *   - block devices (SD card, eMMC; POET_STORAGE_ERASE_REQUIRED == 0): writes must cover whole
 *     POET_STORAGE_WRITE_BLOCK_BYTES (512-byte) blocks, aligned; anything else fails with
 *     POET_STORAGE_E_ALIGN. No erase is needed before a write. Reads may start and end
 *     anywhere (the port reads whole blocks and copies the part asked for). Erase is allowed
 *     (the SD erase command) but never needed; it sets the allocation unit to
 *     POET_STORAGE_ERASED_BYTE.
 */
#ifndef POET_STORAGE_H
#define POET_STORAGE_H

#include <stdint.h>

/* Geometry of the storage device. The emulator's build passes these with -D from the device
   profile; a board port defines them for its part (e.g. in its build flags). They have no
   defaults on purpose: a wrong erase-block size silently breaks the page-out layout. */
#ifndef POET_STORAGE_CAPACITY_BYTES
#error "define POET_STORAGE_CAPACITY_BYTES (bytes addressable through this interface, at most 2^32)"
#endif
#ifndef POET_STORAGE_ERASE_BLOCK_BYTES
#error "define POET_STORAGE_ERASE_BLOCK_BYTES (flash: erase sector; SD/eMMC: allocation unit)"
#endif
#ifndef POET_STORAGE_WRITE_BLOCK_BYTES
#error "define POET_STORAGE_WRITE_BLOCK_BYTES (1 for NOR flash, 512 for SD/eMMC)"
#endif
#ifndef POET_STORAGE_ERASE_REQUIRED
#error "define POET_STORAGE_ERASE_REQUIRED (1: flash, erase before programming; 0: block device)"
#endif

/* Value of every byte of an erased flash block. */
#ifndef POET_STORAGE_ERASED_BYTE
#define POET_STORAGE_ERASED_BYTE 0xFFu
#endif

#define POET_STORAGE_OK 0
#define POET_STORAGE_E_RANGE (-1)      /* offset/length/block outside the device */
#define POET_STORAGE_E_ALIGN (-2)      /* block device: write not whole aligned blocks */
#define POET_STORAGE_E_NOT_ERASED (-3) /* flash: write would turn a 0 bit into 1 */
#define POET_STORAGE_E_IO (-4)         /* the device or its controller failed */

/* Copy `bytes` bytes from storage at `offset` to RAM at `dst`. */
int poet_storage_read(uint32_t offset, void *dst, uint32_t bytes);

/* Program `bytes` bytes from `src` (RAM or flash) to storage at `offset`. */
int poet_storage_write(uint32_t offset, const void *src, uint32_t bytes);

/* Erase erase-block number `block` (bytes block * POET_STORAGE_ERASE_BLOCK_BYTES onwards). */
int poet_storage_erase(uint32_t block);

#endif /* POET_STORAGE_H */
