#include "poet_paging.h"

#include "poet_storage.h"

#if POET_STORAGE_WRITE_BLOCK_BYTES > 1
/* the tail of a tensor that ends inside a block; static, so it counts in the image's RAM */
static uint8_t poet_bounce[POET_STORAGE_WRITE_BLOCK_BYTES];
#endif

int poet_page_out(uint32_t offset, const float *src, uint32_t bytes)
{
    int rc;
#if POET_STORAGE_ERASE_REQUIRED
    uint32_t block = offset / POET_STORAGE_ERASE_BLOCK_BYTES;
    uint32_t end = (uint32_t)(((uint64_t)offset + bytes + POET_STORAGE_ERASE_BLOCK_BYTES - 1u) /
                              POET_STORAGE_ERASE_BLOCK_BYTES);
    for (; block < end; ++block) {
        rc = poet_storage_erase(block);
        if (rc != POET_STORAGE_OK) {
            return rc;
        }
    }
#endif
#if POET_STORAGE_WRITE_BLOCK_BYTES > 1
    {
        uint32_t whole = bytes / POET_STORAGE_WRITE_BLOCK_BYTES * POET_STORAGE_WRITE_BLOCK_BYTES;
        uint32_t k;
        const uint8_t *tail = (const uint8_t *)src + whole;
        if (whole) {
            rc = poet_storage_write(offset, src, whole);
            if (rc != POET_STORAGE_OK) {
                return rc;
            }
        }
        if (whole == bytes) {
            return POET_STORAGE_OK;
        }
        for (k = 0; k < POET_STORAGE_WRITE_BLOCK_BYTES; ++k) {
            poet_bounce[k] = k < bytes - whole ? tail[k] : 0u;
        }
        return poet_storage_write(offset + whole, poet_bounce, POET_STORAGE_WRITE_BLOCK_BYTES);
    }
#else
    rc = poet_storage_write(offset, src, bytes);
    return rc;
#endif
}

int poet_page_in(uint32_t offset, float *dst, uint32_t bytes)
{
    return poet_storage_read(offset, dst, bytes);
}
