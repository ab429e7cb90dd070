/* Page-aligned, huge-page backed, pre-touched and page-locked I/O buffers.
 *
 * The virtio disk under this project splits an O_DIRECT request at every
 * physical discontinuity of its buffer, so buffers come from 2 MiB pages when
 * the kernel has them: hugetlb pages if some are reserved, otherwise
 * transparent huge pages asked for with MADV_HUGEPAGE on a 2 MiB-aligned range.
 * A buffer of odd size that must not grow to whole huge pages (want_huge 2, the
 * parameter tier's record buffers, counted byte for byte against the window)
 * starts on a 2 MiB boundary and asks for transparent huge pages as well: the
 * kernel backs its whole 2 MiB extents with them and the tail with 4 KiB pages.
 * Every page is touched here, once, so that no training step pays first-touch
 * faults. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tiermem_native.h"

#define HUGE_SZ ((size_t)2 << 20)
#define SMALL_SZ ((size_t)4096)

static long live_count, free_count;
static size_t live_bytes;

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t tm_mem_mapped_size(size_t nbytes, int kind)
{
    if (nbytes == 0)
        nbytes = 1;
    return round_up(nbytes, kind == 0 || kind == 3 ? SMALL_SZ : HUGE_SZ);
}

static void touch(char *p, size_t n)
{
    /* One write per 4 KiB page faults every page in; with THP each fault
     * fills a whole 2 MiB page, so this is cheap after the first. */
    for (size_t off = 0; off < n; off += SMALL_SZ)
        ((volatile char *)p)[off] = 0;
}

static void *map_thp(size_t size)
{
    /* Over-map by one huge page and trim so the range starts on a 2 MiB
     * boundary: THP only backs aligned 2 MiB extents. */
    size_t span = size + HUGE_SZ;
    char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uintptr_t aligned = round_up((uintptr_t)raw, HUGE_SZ);
    size_t head = aligned - (uintptr_t)raw;
    size_t tail = span - head - size;
    if (head)
        munmap(raw, head);
    if (tail)
        munmap((char *)aligned + size, tail);
    madvise((void *)aligned, size, MADV_HUGEPAGE);
    return (void *)aligned;
}

void *tm_mem_alloc(size_t nbytes, int want_huge, int want_lock,
                   int *kind_out, int *locked_out, int *lock_errno_out)
{
    void *p = NULL;
    int kind = 0;
    size_t size;

    if (want_huge == 2 && tm_mem_mapped_size(nbytes, 3) >= HUGE_SZ) {
        size = tm_mem_mapped_size(nbytes, 3);
        p = map_thp(size);
        kind = 3;
    } else if (want_huge == 1) {
        size = tm_mem_mapped_size(nbytes, 2);
        p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
        if (p != MAP_FAILED) {
            kind = 2;
        } else {
            p = map_thp(size);
            kind = 1;
        }
    } else {
        size = tm_mem_mapped_size(nbytes, 0);
        p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            p = NULL;
    }
    if (p == NULL)
        return NULL;
    touch(p, size);

    *locked_out = 0;
    *lock_errno_out = 0;
    if (want_lock) {
        if (mlock(p, size) == 0)
            *locked_out = 1;
        else
            *lock_errno_out = errno;
    }
    *kind_out = kind;
    __atomic_add_fetch(&live_count, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&live_bytes, size, __ATOMIC_RELAXED);
    return p;
}

void tm_mem_free(void *p, size_t mapped_size)
{
    /* munmap also drops any mlock on the range. */
    munmap(p, mapped_size);
    __atomic_sub_fetch(&live_count, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&live_bytes, mapped_size, __ATOMIC_RELAXED);
    __atomic_add_fetch(&free_count, 1, __ATOMIC_RELAXED);
}

long tm_mem_live_count(void) { return __atomic_load_n(&live_count, __ATOMIC_RELAXED); }
size_t tm_mem_live_bytes(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }
long tm_mem_free_count(void) { return __atomic_load_n(&free_count, __ATOMIC_RELAXED); }
