/* Completion bookkeeping shared by the io_uring engine and the thread pool:
 * timestamps and the condition-variable wait Python sleeps in. */
#ifndef TIERMEM_COMPLETION_H
#define TIERMEM_COMPLETION_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* Include after tiermem_native.h (which cannot carry an include guard: cffi parses it). */

static inline uint64_t tm_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Mark r done and wake its waiters; the caller holds `lock`. */
static inline void tm_mark_done(pthread_cond_t *cond, tm_request *r)
{
    r->done_ns = tm_now_ns();
    __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(cond);
}

/* Sleep until r is done (timeout_ms < 0: no limit). 0, or -ETIME. */
static inline int tm_wait_done(pthread_mutex_t *lock, pthread_cond_t *cond, tm_request *r,
                               int timeout_ms)
{
    int ret = 0;
    pthread_mutex_lock(lock);
    if (timeout_ms < 0) {
        while (!r->done)
            pthread_cond_wait(cond, lock);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += timeout_ms / 1000;
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        while (!r->done && ret == 0)
            ret = pthread_cond_timedwait(cond, lock, &ts);
        ret = r->done ? 0 : -ETIME;
    }
    pthread_mutex_unlock(lock);
    return ret;
}

/* Remove r from a singly linked list (head, tail), if it is there. */
static inline void tm_unlink(tm_request **head, tm_request **tail, tm_request *r)
{
    tm_request **pp = head, *prev = NULL;
    while (*pp && *pp != r) {
        prev = *pp;
        pp = &(*pp)->link;
    }
    if (!*pp)
        return;
    *pp = r->link;
    if (*tail == r)
        *tail = prev;
    r->link = NULL;
}

static inline void tm_reset_request(tm_request *r)
{
    r->done = 0;
    r->error = 0;
    r->bytes_done = 0;
    r->resubmits = 0;
    r->next = 0;
    r->inflight = 0;
    r->link = NULL;
    r->submit_ns = tm_now_ns();
    r->done_ns = 0;
    r->landed = 0;
}

/* Read r's write (r->after) failed: hand out none of the rest of r, which fails with
 * -ECANCELED from where it got to (the caller finishes it once its pieces are back). */
static inline void tm_cancel_rest(tm_request *r)
{
    if (r->error == 0) {
        r->error = -ECANCELED;
        r->error_offset = r->offset + r->next;
        r->error_length = r->len - r->next;
    }
    r->next = r->len;
}

/* How far read r may go now, given the write r->after whose memory it reuses:
 * the end (in r's buffer) of what it may take, from r->next on, or -1 when the
 * write failed (r is then cancelled). The write's unsent memory is
 * [after.buf + landed, after.buf + after.len): r may not touch it. The limit is
 * kept a multiple of 4096 bytes from r->next (O_DIRECT) unless it is r's end. */
static inline int64_t tm_after_limit(const tm_request *r)
{
    const tm_request *w = r->after;
    if (__atomic_load_n(&w->done, __ATOMIC_ACQUIRE))
        return w->error ? -1 : (int64_t)r->len;
    uintptr_t a = (uintptr_t)r->buf + r->next;
    uintptr_t unsent = (uintptr_t)w->buf + __atomic_load_n(&w->landed, __ATOMIC_SEQ_CST);
    uintptr_t wend = (uintptr_t)w->buf + w->len;
    if (a >= wend || (uintptr_t)r->buf + r->len <= unsent)
        return (int64_t)r->len;
    if (a >= unsent)
        return (int64_t)r->next;
    uint64_t room = (uint64_t)(unsent - a) & ~(uint64_t)4095;
    return (int64_t)(r->next + room);
}

#endif
