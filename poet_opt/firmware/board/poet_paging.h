/* poet_paging: a generated training step's page-out and page-in, over the three storage functions
 * of poet_storage.h (a board port supplies those).
 *
 * A page-out first erases the erase blocks it will program on flash (a program can only clear
 * bits), and writes whole 512-byte blocks on an SD card or eMMC (the last, partial one through a
 * bounce buffer padded with zeros), so the same generated step is correct on either kind. Each
 * paged tensor owns its own erase-block-aligned region (the export's flash plan), so an erase never
 * touches another tensor's bytes.
 */
#ifndef POET_PAGING_H
#define POET_PAGING_H

#include <stdint.h>

/* 0 or a negative POET_STORAGE_E_* code */
int poet_page_out(uint32_t offset, const float *src, uint32_t bytes);
int poet_page_in(uint32_t offset, float *dst, uint32_t bytes);

#endif /* POET_PAGING_H */
