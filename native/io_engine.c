/* The io_uring engine: one ring per engine, owned by one worker thread.
 *
 * Python hands whole transfers (tm_request) to tm_engine_submit(); the worker
 * cuts them into block_size pieces, keeps up to queue_depth pieces in the ring,
 * reaps completions, requeues short transfers and EAGAIN, and marks a request
 * done when its last piece lands. Python only sleeps in tm_engine_wait() with
 * the GIL released (cffi releases it around every call), so the ring keeps
 * moving while Python computes. Modelled on liburing's examples/io_uring-cp.c:
 * keep the queue full, treat short transfers as normal. */
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

typedef struct piece {
    tm_request *req;
    char *buf;
    uint64_t off;
    uint32_t len;
    struct piece *next; /* free list / retry list */
} piece;

struct tm_engine {
    struct io_uring ring;
    unsigned queue_depth;
    unsigned block_size;
    unsigned file_slots;
    int fixed_files_ok;
    int buffers_registered;
    int wake_fd;
    uint64_t wake_val;
    pthread_t worker;
    pthread_mutex_t lock; /* guards pending list, stopping, done flags */
    pthread_cond_t cond;  /* broadcast when a request completes */
    tm_request *pending_head, *pending_tail; /* submitted, not yet seen */
    int stopping;
    int inflight_requests; /* submitted and not done; under lock */
    /* worker-only state */
    tm_request *active_head, *active_tail;
    piece *pieces, *free_pieces, *retry;
    unsigned pieces_in_ring;
    unsigned *file_used;
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

static void arm_wake(tm_engine *e)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&e->ring);
    /* The ring has one slot beyond queue_depth reserved for this read. */
    io_uring_prep_read(sqe, e->wake_fd, &e->wake_val, sizeof e->wake_val, 0);
    io_uring_sqe_set_data64(sqe, WAKE_TAG);
}

static void finish_request(tm_engine *e, tm_request *r)
{
    pthread_mutex_lock(&e->lock);
    e->inflight_requests--;
    tm_mark_done(&e->cond, r);
    pthread_mutex_unlock(&e->lock);
}

static void queue_piece(tm_engine *e, piece *p)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&e->ring);
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
    io_uring_sqe_set_data(sqe, p);
    e->pieces_in_ring++;
}

static void fill_op(tm_engine *e, int op);

/* Hand out pieces until the ring holds queue_depth: retries first, then reads,
 * then writes, each in submission order. Reads go first because a read is what
 * the next computation waits for, while a write only has to finish before its
 * buffer is reused; FIFO order would park the next partition's read behind
 * the write-backs of the ones before it. */
static void fill_ring(tm_engine *e)
{
    while (e->retry && e->pieces_in_ring < e->queue_depth) {
        piece *p = e->retry;
        e->retry = p->next;
        queue_piece(e, p);
    }
    for (int op = 0; op < 2; op++)
        fill_op(e, op);
}

static void fill_op(tm_engine *e, int op)
{
    tm_request *r = e->active_head;
    while (r && e->pieces_in_ring < e->queue_depth) {
        if (r->op != op || r->next >= r->len) {
            r = r->link;
            continue;
        }
        piece *p = e->free_pieces;
        e->free_pieces = p->next;
        uint64_t left = r->len - r->next;
        p->req = r;
        p->len = left < e->block_size ? (uint32_t)left : e->block_size;
        p->off = r->offset + r->next;
        p->buf = r->buf + r->next;
        r->next += p->len;
        r->inflight++;
        queue_piece(e, p);
    }
}

static void complete_piece(tm_engine *e, piece *p, int res)
{
    tm_request *r = p->req;
    e->pieces_in_ring--;
    if (res == -EAGAIN || res == -EINTR) {
        r->resubmits++;
        p->next = e->retry;
        e->retry = p;
        return;
    }
    if (res > 0 && (uint32_t)res < p->len) {
        /* Short transfer: requeue the rest of this piece. */
        r->bytes_done += res;
        r->resubmits++;
        p->buf += res;
        p->off += res;
        p->len -= res;
        p->next = e->retry;
        e->retry = p;
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
    p->next = e->free_pieces;
    e->free_pieces = p;
    if (r->inflight == 0 && r->next >= r->len) {
        tm_unlink(&e->active_head, &e->active_tail, r);
        finish_request(e, r);
    }
}

static void *worker_main(void *arg)
{
    tm_engine *e = arg;
    arm_wake(e);
    for (;;) {
        pthread_mutex_lock(&e->lock);
        tm_request *got = e->pending_head;
        e->pending_head = e->pending_tail = NULL;
        int stopping = e->stopping;
        pthread_mutex_unlock(&e->lock);
        while (got) {
            tm_request *nx = got->link;
            got->link = NULL;
            if (got->len == 0) {
                finish_request(e, got);
            } else {
                if (e->active_tail)
                    e->active_tail->link = got;
                else
                    e->active_head = got;
                e->active_tail = got;
            }
            got = nx;
        }
        fill_ring(e);
        if (stopping && e->pieces_in_ring == 0 && !e->active_head)
            break;
        int ret = io_uring_submit_and_wait(&e->ring, 1);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
            /* The ring itself failed: fail everything outstanding rather
             * than leave a waiter asleep forever. */
            for (tm_request *r = e->active_head; r;) {
                tm_request *nx = r->link;
                if (r->error == 0) {
                    r->error = ret;
                    r->error_offset = r->offset + r->next;
                    r->error_length = r->len - r->next;
                }
                r->link = NULL;
                finish_request(e, r);
                r = nx;
            }
            e->active_head = e->active_tail = NULL;
            break;
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&e->ring, head, cqe) {
            seen++;
            if (cqe->user_data == WAKE_TAG) {
                arm_wake(e);
                continue;
            }
            complete_piece(e, (piece *)(uintptr_t)cqe->user_data, cqe->res);
        }
        io_uring_cq_advance(&e->ring, seen);
    }
    return NULL;
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
    struct io_uring_params params;
    memset(&params, 0, sizeof params);
    /* COOP_TASKRUN: completions are only needed when the worker enters the
     * kernel to wait, so skip the interrupting task-work IPIs. */
    params.flags = IORING_SETUP_COOP_TASKRUN;
    int ret = io_uring_queue_init_params(queue_depth + 1, &e->ring, &params);
    if (ret == -EINVAL) {
        memset(&params, 0, sizeof params);
        ret = io_uring_queue_init_params(queue_depth + 1, &e->ring, &params);
    }
    if (ret < 0) {
        free(e);
        return ret;
    }
    e->pieces = calloc(queue_depth, sizeof(piece));
    e->file_used = calloc(file_slots ? file_slots : 1, sizeof(unsigned));
    e->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (!e->pieces || !e->file_used || e->wake_fd < 0) {
        ret = e->wake_fd < 0 ? -errno : -ENOMEM;
        goto fail;
    }
    for (unsigned i = 0; i < queue_depth; i++) {
        e->pieces[i].next = e->free_pieces;
        e->free_pieces = &e->pieces[i];
    }
    if (file_slots && io_uring_register_files_sparse(&e->ring, file_slots) == 0) {
        e->fixed_files_ok = 1;
        e->file_slots = file_slots;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->cond, NULL);
    ret = -pthread_create(&e->worker, NULL, worker_main, e);
    if (ret < 0) {
        pthread_mutex_destroy(&e->lock);
        pthread_cond_destroy(&e->cond);
        goto fail;
    }
    *out = e;
    return 0;
fail:
    if (e->wake_fd >= 0)
        close(e->wake_fd);
    free(e->pieces);
    free(e->file_used);
    io_uring_queue_exit(&e->ring);
    free(e);
    return ret;
}

int tm_engine_register_buffers(tm_engine *e, void **addrs, size_t *lens, unsigned n)
{
    struct iovec *iov = calloc(n ? n : 1, sizeof *iov);
    if (!iov)
        return -ENOMEM;
    for (unsigned i = 0; i < n; i++) {
        iov[i].iov_base = addrs[i];
        iov[i].iov_len = lens[i];
    }
    if (e->buffers_registered) {
        io_uring_unregister_buffers(&e->ring);
        e->buffers_registered = 0;
    }
    int ret = io_uring_register_buffers(&e->ring, iov, n);
    free(iov);
    if (ret == 0)
        e->buffers_registered = 1;
    return ret;
}

int tm_engine_unregister_buffers(tm_engine *e)
{
    if (!e->buffers_registered)
        return 0;
    e->buffers_registered = 0;
    return io_uring_unregister_buffers(&e->ring);
}

int tm_engine_register_file(tm_engine *e, int fd)
{
    if (!e->fixed_files_ok)
        return -ENOTSUP;
    for (unsigned i = 0; i < e->file_slots; i++) {
        if (e->file_used[i])
            continue;
        int ret = io_uring_register_files_update(&e->ring, i, &fd, 1);
        if (ret < 0)
            return ret;
        e->file_used[i] = 1;
        return (int)i;
    }
    return -ENFILE;
}

int tm_engine_unregister_file(tm_engine *e, int slot)
{
    if (slot < 0 || (unsigned)slot >= e->file_slots || !e->file_used[slot])
        return -EBADF;
    int minus_one = -1;
    int ret = io_uring_register_files_update(&e->ring, slot, &minus_one, 1);
    e->file_used[slot] = 0;
    return ret < 0 ? ret : 0;
}

int tm_engine_submit(tm_engine *e, tm_request *r)
{
    tm_reset_request(r);
    pthread_mutex_lock(&e->lock);
    if (e->stopping) {
        pthread_mutex_unlock(&e->lock);
        return -ESHUTDOWN;
    }
    int was_empty = e->pending_head == NULL;
    if (e->pending_tail)
        e->pending_tail->link = r;
    else
        e->pending_head = r;
    e->pending_tail = r;
    e->inflight_requests++;
    pthread_mutex_unlock(&e->lock);
    if (was_empty) {
        /* Wake the worker out of io_uring_enter; later submissions before it
         * drains the list ride on the same wake-up. */
        uint64_t one = 1;
        if (write(e->wake_fd, &one, sizeof one) < 0)
            return -errno;
    }
    return 0;
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
    /* The worker drains every submitted request before it exits, so no
     * buffer is still being written by the kernel once this returns. */
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    pthread_mutex_unlock(&e->lock);
    uint64_t one = 1;
    (void)!write(e->wake_fd, &one, sizeof one);
    pthread_join(e->worker, NULL);
    io_uring_queue_exit(&e->ring); /* cancels the pending eventfd read */
    close(e->wake_fd);
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->cond);
    free(e->pieces);
    free(e->file_used);
    free(e);
}
