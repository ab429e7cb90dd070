/* The io_uring engine: a ring per direction, each owned by one worker thread.
 *
 * Python hands whole transfers (tm_request) to tm_engine_submit(), which puts a
 * read on the read lane and a write on the write lane. Each lane's worker cuts
 * its requests into block_size pieces, keeps up to queue_depth pieces in its
 * ring, reaps completions, requeues short transfers and EAGAIN, and marks a
 * request done when its last piece lands. Two rings, as fio's read job and
 * write job have: a read never waits for ring slots held by writes nor the
 * reverse, and a traced 300M SGD step (writes async in both) ran 4-6% faster
 * than with one ring serving reads first (docs/dev/benchmarks.md, #17).
 * Python only sleeps in tm_engine_wait() with the GIL released (cffi releases
 * it around every call), so the rings keep moving while Python computes.
 * Modelled on liburing's examples/io_uring-cp.c: keep the queue full, treat
 * short transfers as normal. */
#define _GNU_SOURCE
#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "tiermem_native.h"
#include "completion.h"

#define WAKE_TAG ((uint64_t)1) /* user_data of the eventfd read; pieces are
                                   pointers, never 1 */
#define LANES 2                /* lane i moves requests with op == i */

typedef struct piece {
    tm_request *req;
    char *buf;
    uint64_t off;
    uint32_t len;
    int busy;           /* handed out: in the ring or on the retry list */
    struct piece *next; /* free list / retry list */
} piece;

typedef struct lane {
    struct tm_engine *e;
    struct io_uring ring;
    int ring_ok;
    int buffers_registered;
    int wake_fd;
    uint64_t wake_val;
    pthread_t worker;
    int started;
    int failed; /* the ring's own error once it failed; under e->lock */
    tm_request *pending_head, *pending_tail; /* submitted, not yet seen; under e->lock */
    /* worker-only state */
    tm_request *active_head, *active_tail;
    piece *pieces, *free_pieces, *retry;
    unsigned pieces_in_ring;
} lane;

struct tm_engine {
    lane lanes[LANES];
    unsigned queue_depth; /* per lane */
    unsigned block_size;
    unsigned file_slots;
    int fixed_files_ok;
    pthread_mutex_t lock; /* guards the pending lists, stopping, done flags */
    pthread_cond_t cond;  /* broadcast when a request completes */
    int stopping;
    int inflight_requests; /* submitted and not done; under lock */
    unsigned *file_used;
    /* Set by the read worker before it looks at a write's landed prefix; the
     * write worker clears it and wakes the read worker after moving one on. */
    int read_waiting;
};

int tm_uring_probe(void)
{
    struct io_uring ring;
    int ret = io_uring_queue_init(2, &ring, 0);
    if (ret < 0)
        return ret;
    io_uring_queue_exit(&ring);
    return 0;
}

static void arm_wake(lane *l)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
    /* The ring has one slot beyond queue_depth reserved for this read. */
    io_uring_prep_read(sqe, l->wake_fd, &l->wake_val, sizeof l->wake_val, 0);
    io_uring_sqe_set_data64(sqe, WAKE_TAG);
}

static void finish_request(tm_engine *e, tm_request *r)
{
    pthread_mutex_lock(&e->lock);
    e->inflight_requests--;
    tm_mark_done(&e->cond, r);
    pthread_mutex_unlock(&e->lock);
}

static void queue_piece(lane *l, piece *p)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);
    tm_request *r = p->req;
    if (r->buf_index >= 0) {
        if (r->op == 0)
            io_uring_prep_read_fixed(sqe, r->fd, p->buf, p->len, p->off, r->buf_index);
        else
            io_uring_prep_write_fixed(sqe, r->fd, p->buf, p->len, p->off, r->buf_index);
    } else {
        if (r->op == 0)
            io_uring_prep_read(sqe, r->fd, p->buf, p->len, p->off);
        else
            io_uring_prep_write(sqe, r->fd, p->buf, p->len, p->off);
    }
    if (r->fixed_file)
        sqe->flags |= IOSQE_FIXED_FILE;
    /* Writes go straight to io-wq. Issued inline by this worker, an O_DIRECT
     * write is first tried non-blocking and, when it would block, punted to
     * io-wq anyway; going there at once let the step run ~10% faster in the
     * 300M SGD trace (docs/dev/benchmarks.md). Reads stay inline: the same
     * flag on them measured no better. */
    if (r->op == 1)
        sqe->flags |= IOSQE_ASYNC;
    io_uring_sqe_set_data(sqe, p);
    l->pieces_in_ring++;
}

/* r's write (r->after) failed: hand out no more of r, and fail it where it got
 * to once its pieces in the ring are back. */
static void cancel_rest(lane *l, tm_request *r)
{
    tm_cancel_rest(r);
    if (r->inflight == 0) {
        tm_unlink(&l->active_head, &l->active_tail, r);
        finish_request(l->e, r);
    }
}

/* A piece of r landed: its landed prefix ends at the lowest piece still out
 * (in the ring or to retry), or at what was handed out if none is. A failed
 * request's prefix stays where it was. A write's prefix is what a read that
 * follows it may overwrite; a read's is what Python may hash while the rest
 * lands. */
static void advance_landed(lane *l, tm_request *r)
{
    if (r->error != 0)
        return;
    uint64_t low = r->next;
    for (unsigned i = 0; i < l->e->queue_depth; i++) {
        piece *p = &l->pieces[i];
        if (p->busy && p->req == r && (uint64_t)(p->buf - r->buf) < low)
            low = (uint64_t)(p->buf - r->buf);
    }
    __atomic_store_n(&r->landed, low, __ATOMIC_SEQ_CST);
}

static int wake(lane *l);

/* A write moved on (or ended): the read worker, if it looked at a landed
 * prefix since it last woke, looks again. */
static void wake_reader(tm_engine *e)
{
    if (__atomic_exchange_n(&e->read_waiting, 0, __ATOMIC_SEQ_CST))
        (void)wake(&e->lanes[0]);
}

/* Hand out pieces until the ring holds queue_depth: retries first, then the
 * lane's requests in submission order (the pipeline submits the partition it
 * needs first, first). */
static void fill_ring(lane *l)
{
    unsigned depth = l->e->queue_depth, block = l->e->block_size;
    while (l->retry && l->pieces_in_ring < depth) {
        piece *p = l->retry;
        l->retry = p->next;
        queue_piece(l, p);
    }
    tm_request *r = l->active_head;
    while (r && l->pieces_in_ring < depth) {
        if (r->next >= r->len) {
            r = r->link;
            continue;
        }
        uint64_t end = r->len;
        if (r->after) {
            /* Before the landed prefix is read: a write moving on after that
             * sees the flag and wakes this worker (seq_cst on both sides). */
            __atomic_store_n(&l->e->read_waiting, 1, __ATOMIC_SEQ_CST);
            int64_t limit = tm_after_limit(r);
            if (limit < 0) {
                tm_request *nx = r->link;
                cancel_rest(l, r);
                r = nx;
                continue;
            }
            end = (uint64_t)limit;
            if (end <= r->next) { /* its memory is still being written: later ones go on */
                r = r->link;
                continue;
            }
        }
        piece *p = l->free_pieces;
        l->free_pieces = p->next;
        uint64_t left = end - r->next;
        p->busy = 1;
        p->req = r;
        p->len = left < block ? (uint32_t)left : block;
        p->off = r->offset + r->next;
        p->buf = r->buf + r->next;
        r->next += p->len;
        r->inflight++;
        queue_piece(l, p);
    }
}

static void complete_piece(lane *l, piece *p, int res)
{
    tm_request *r = p->req;
    l->pieces_in_ring--;
    if (res == -EAGAIN || res == -EINTR) {
        r->resubmits++;
        p->next = l->retry;
        l->retry = p;
        return;
    }
    if (res > 0 && (uint32_t)res < p->len) {
        /* Short transfer: requeue the rest of this piece. */
        r->bytes_done += res;
        r->resubmits++;
        p->buf += res;
        p->off += res;
        p->len -= res;
        p->next = l->retry;
        l->retry = p;
        return;
    }
    if (res < 0 || (res == 0 && p->len > 0)) {
        if (r->error == 0) {
            /* A read returning 0 bytes is end of file; a write returning 0
             * made no progress and never will. */
            r->error = res < 0 ? res : (r->op == 0 ? -ENODATA : -EIO);
            r->error_offset = p->off;
            r->error_length = p->len;
        }
        r->next = r->len; /* stop handing out pieces of a failed request */
    } else {
        r->bytes_done += res;
    }
    r->inflight--;
    p->busy = 0;
    p->next = l->free_pieces;
    l->free_pieces = p;
    int is_write = r->op == 1;
    advance_landed(l, r); /* before finish_request: Python may free r after it */
    if (r->inflight == 0 && r->next >= r->len) {
        tm_unlink(&l->active_head, &l->active_tail, r);
        finish_request(l->e, r);
    }
    if (is_write)
        wake_reader(l->e); /* after: a read cancelled by a failed write sees it done */
}

/* Fail a list of requests with the ring's error, from where each got to (a
 * request not yet started, next == 0, fails whole). */
static void fail_requests(tm_engine *e, tm_request *r, int err)
{
    while (r) {
        tm_request *nx = r->link;
        if (r->error == 0) {
            r->error = err;
            r->error_offset = r->offset + r->next;
            r->error_length = r->len - r->next;
        }
        r->link = NULL;
        finish_request(e, r);
        r = nx;
    }
}

static void *worker_main(void *arg)
{
    lane *l = arg;
    tm_engine *e = l->e;
    arm_wake(l);
    for (;;) {
        pthread_mutex_lock(&e->lock);
        tm_request *got = l->pending_head;
        l->pending_head = l->pending_tail = NULL;
        int stopping = e->stopping;
        pthread_mutex_unlock(&e->lock);
        while (got) {
            tm_request *nx = got->link;
            got->link = NULL;
            if (got->len == 0) {
                finish_request(e, got);
            } else {
                if (l->active_tail)
                    l->active_tail->link = got;
                else
                    l->active_head = got;
                l->active_tail = got;
            }
            got = nx;
        }
        fill_ring(l);
        if (stopping && l->pieces_in_ring == 0 && !l->active_head)
            break;
        int ret = io_uring_submit_and_wait(&l->ring, 1);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
            /* The ring itself failed: fail everything outstanding rather
             * than leave a waiter asleep forever. No worker will ever drain
             * this lane again, so later submissions are refused and those
             * that came in meanwhile fail with the rest. */
            pthread_mutex_lock(&e->lock);
            l->failed = ret;
            tm_request *late = l->pending_head;
            l->pending_head = l->pending_tail = NULL;
            pthread_mutex_unlock(&e->lock);
            fail_requests(e, l->active_head, ret);
            fail_requests(e, late, ret);
            wake_reader(e); /* reads that follow these writes are cancelled */
            l->active_head = l->active_tail = NULL;
            break;
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&l->ring, head, cqe) {
            seen++;
            if (cqe->user_data == WAKE_TAG) {
                arm_wake(l);
                continue;
            }
            complete_piece(l, (piece *)(uintptr_t)cqe->user_data, cqe->res);
        }
        io_uring_cq_advance(&l->ring, seen);
    }
    return NULL;
}

static int lane_init(tm_engine *e, lane *l)
{
    l->e = e;
    struct io_uring_params params;
    memset(&params, 0, sizeof params);
    /* COOP_TASKRUN: completions are only needed when the worker enters the
     * kernel to wait, so skip the interrupting task-work IPIs. */
    params.flags = IORING_SETUP_COOP_TASKRUN;
    int ret = io_uring_queue_init_params(e->queue_depth + 1, &l->ring, &params);
    if (ret == -EINVAL) {
        memset(&params, 0, sizeof params);
        ret = io_uring_queue_init_params(e->queue_depth + 1, &l->ring, &params);
    }
    if (ret < 0)
        return ret;
    l->ring_ok = 1;
    l->pieces = calloc(e->queue_depth, sizeof(piece));
    l->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (!l->pieces || l->wake_fd < 0)
        return l->wake_fd < 0 ? -errno : -ENOMEM;
    for (unsigned i = 0; i < e->queue_depth; i++) {
        l->pieces[i].next = l->free_pieces;
        l->free_pieces = &l->pieces[i];
    }
    return 0;
}

static void lane_free(lane *l)
{
    if (l->ring_ok)
        io_uring_queue_exit(&l->ring); /* cancels the pending eventfd read */
    if (l->wake_fd >= 0)
        close(l->wake_fd);
    free(l->pieces);
}

/* Wake the lane's worker out of io_uring_enter. */
static int wake(lane *l)
{
    uint64_t one = 1;
    return write(l->wake_fd, &one, sizeof one) < 0 ? -errno : 0;
}

/* Stop and join the workers started so far; each drains its requests first. */
static void stop_workers(tm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    pthread_mutex_unlock(&e->lock);
    for (int i = 0; i < LANES; i++)
        if (e->lanes[i].started)
            (void)wake(&e->lanes[i]);
    for (int i = 0; i < LANES; i++)
        if (e->lanes[i].started)
            pthread_join(e->lanes[i].worker, NULL);
}

static void engine_free(tm_engine *e)
{
    for (int i = 0; i < LANES; i++)
        lane_free(&e->lanes[i]);
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->cond);
    free(e->file_used);
    free(e);
}

int tm_engine_create(unsigned queue_depth, unsigned block_size,
                     unsigned file_slots, tm_engine **out)
{
    if (queue_depth == 0 || block_size == 0)
        return -EINVAL;
    tm_engine *e = calloc(1, sizeof *e);
    if (!e)
        return -ENOMEM;
    e->queue_depth = queue_depth;
    e->block_size = block_size;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->cond, NULL);
    for (int i = 0; i < LANES; i++)
        e->lanes[i].wake_fd = -1; /* engine_free closes only what lane_init opened */
    int ret = 0;
    for (int i = 0; i < LANES && ret == 0; i++)
        ret = lane_init(e, &e->lanes[i]);
    e->file_used = calloc(file_slots ? file_slots : 1, sizeof(unsigned));
    if (ret == 0 && !e->file_used)
        ret = -ENOMEM;
    if (ret < 0) {
        engine_free(e);
        return ret;
    }
    /* Fixed files only where both rings take them: a slot means one file on both. */
    if (file_slots && io_uring_register_files_sparse(&e->lanes[0].ring, file_slots) == 0) {
        if (io_uring_register_files_sparse(&e->lanes[1].ring, file_slots) == 0) {
            e->fixed_files_ok = 1;
            e->file_slots = file_slots;
        } else {
            io_uring_unregister_files(&e->lanes[0].ring);
        }
    }
    for (int i = 0; i < LANES; i++) {
        ret = -pthread_create(&e->lanes[i].worker, NULL, worker_main, &e->lanes[i]);
        if (ret < 0) {
            stop_workers(e);
            engine_free(e);
            return ret;
        }
        e->lanes[i].started = 1;
    }
    *out = e;
    return 0;
}

static int register_buffers_on(lane *l, struct iovec *iov, unsigned n)
{
    if (l->buffers_registered) {
        io_uring_unregister_buffers(&l->ring);
        l->buffers_registered = 0;
    }
    int ret = io_uring_register_buffers(&l->ring, iov, n);
    if (ret == 0)
        l->buffers_registered = 1;
    return ret;
}

int tm_engine_unregister_buffers(tm_engine *e)
{
    int ret = 0;
    for (int i = 0; i < LANES; i++) {
        lane *l = &e->lanes[i];
        if (!l->buffers_registered)
            continue;
        l->buffers_registered = 0;
        int r = io_uring_unregister_buffers(&l->ring);
        if (ret == 0)
            ret = r;
    }
    return ret;
}

/* Both rings get the same table, so a request's buf_index means one buffer on
 * either; if one ring refuses, neither keeps it. */
int tm_engine_register_buffers(tm_engine *e, void **addrs, size_t *lens, unsigned n)
{
    struct iovec *iov = calloc(n ? n : 1, sizeof *iov);
    if (!iov)
        return -ENOMEM;
    for (unsigned i = 0; i < n; i++) {
        iov[i].iov_base = addrs[i];
        iov[i].iov_len = lens[i];
    }
    int ret = 0;
    for (int i = 0; i < LANES && ret == 0; i++)
        ret = register_buffers_on(&e->lanes[i], iov, n);
    free(iov);
    if (ret < 0)
        tm_engine_unregister_buffers(e);
    return ret;
}

int tm_engine_register_file(tm_engine *e, int fd)
{
    if (!e->fixed_files_ok)
        return -ENOTSUP;
    for (unsigned i = 0; i < e->file_slots; i++) {
        if (e->file_used[i])
            continue;
        int ret = io_uring_register_files_update(&e->lanes[0].ring, i, &fd, 1);
        if (ret < 0)
            return ret;
        ret = io_uring_register_files_update(&e->lanes[1].ring, i, &fd, 1);
        if (ret < 0) {
            int minus_one = -1;
            io_uring_register_files_update(&e->lanes[0].ring, i, &minus_one, 1);
            return ret;
        }
        e->file_used[i] = 1;
        return (int)i;
    }
    return -ENFILE;
}

int tm_engine_unregister_file(tm_engine *e, int slot)
{
    if (slot < 0 || (unsigned)slot >= e->file_slots || !e->file_used[slot])
        return -EBADF;
    int minus_one = -1, ret = 0;
    for (int i = 0; i < LANES; i++) {
        int r = io_uring_register_files_update(&e->lanes[i].ring, slot, &minus_one, 1);
        if (r < 0 && ret == 0)
            ret = r;
    }
    e->file_used[slot] = 0;
    return ret;
}

int tm_engine_submit(tm_engine *e, tm_request *r)
{
    if (r->op < 0 || r->op >= LANES)
        return -EINVAL;
    lane *l = &e->lanes[r->op];
    tm_reset_request(r);
    pthread_mutex_lock(&e->lock);
    if (e->stopping || l->failed) {
        int ret = e->stopping ? -ESHUTDOWN : l->failed;
        pthread_mutex_unlock(&e->lock);
        return ret;
    }
    int was_empty = l->pending_head == NULL;
    if (l->pending_tail)
        l->pending_tail->link = r;
    else
        l->pending_head = r;
    l->pending_tail = r;
    e->inflight_requests++;
    pthread_mutex_unlock(&e->lock);
    /* Later submissions before the worker drains the list ride on the same
     * wake-up. */
    return was_empty ? wake(l) : 0;
}

int tm_engine_wait(tm_engine *e, tm_request *r, int timeout_ms)
{
    return tm_wait_done(&e->lock, &e->cond, r, timeout_ms);
}

int tm_engine_inflight(tm_engine *e)
{
    pthread_mutex_lock(&e->lock);
    int n = e->inflight_requests;
    pthread_mutex_unlock(&e->lock);
    return n;
}

void tm_engine_destroy(tm_engine *e)
{
    /* Each worker drains every submitted request before it exits, so no
     * buffer is still being written by the kernel once this returns. */
    stop_workers(e);
    engine_free(e);
}
