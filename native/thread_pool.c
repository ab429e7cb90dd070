/* The threads backend: pread/pwrite of block_size pieces on pthreads, a pool
 * of them per direction.
 *
 * Used where io_uring is unavailable. Reads and writes each have their own
 * threads (nthreads each), as the io_uring engine has a ring per direction and
 * fio a job per direction: a read never waits for a thread that a write holds,
 * so an optimizer step's reads run beside its write-backs instead of behind
 * them. Each direction takes its pieces in submission order; short transfers
 * continue where they stopped and EAGAIN/EINTR are retried. No Python and no
 * GIL per piece. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "tiermem_native.h"
#include "completion.h"

#define DIRECTIONS 2 /* request op: 0 read, 1 write */

struct tm_pool;

typedef struct pool_worker_arg {
    struct tm_pool *pool;
    int op; /* the direction this thread moves */
    tm_request *cur; /* the request of the piece it moves, or NULL; under lock */
    uint64_t cur_off; /* that piece's offset in the request */
} pool_worker_arg;

struct tm_pool {
    unsigned nthreads; /* started, both directions together */
    unsigned per_direction;
    unsigned block_size;
    pthread_t *threads;
    pool_worker_arg *args;
    pthread_mutex_t lock;  /* guards the request list, request fields, stopping */
    pthread_cond_t work[DIRECTIONS]; /* signalled when pieces of that direction or a stop arrive */
    pthread_cond_t done;   /* broadcast when a request completes */
    tm_request *head, *tail;
    int stopping;
    int inflight_requests;
    int following; /* reads in the list that follow a write (tm_request.after) */
};

/* Under lock: r is done; wake its waiters. */
static void finish(tm_pool *p, tm_request *r)
{
    tm_unlink(&p->head, &p->tail, r);
    p->inflight_requests--;
    if (r->after)
        p->following--;
    tm_mark_done(&p->done, r);
}

/* Under lock: hand out the next piece of direction op, in submission order; a
 * read whose memory a write still has to send waits, and those after it go on. */
static tm_request *take_piece(tm_pool *p, int op, uint64_t *off, uint64_t *len)
{
    tm_request *nx;
    for (tm_request *r = p->head; r; r = nx) {
        nx = r->link;
        if (r->op != op || r->next >= r->len)
            continue;
        uint64_t end = r->len;
        if (r->after) {
            int64_t limit = tm_after_limit(r);
            if (limit < 0) { /* its write failed: none of the rest is issued */
                tm_cancel_rest(r);
                if (r->inflight == 0)
                    finish(p, r);
                continue;
            }
            end = (uint64_t)limit;
            if (end <= r->next)
                continue;
        }
        uint64_t left = end - r->next;
        *off = r->next;
        *len = left < p->block_size ? left : p->block_size;
        r->next += *len;
        r->inflight++;
        return r;
    }
    return NULL;
}

/* Under lock: whether a request of direction op still has pieces to hand out. */
static int pending(tm_pool *p, int op)
{
    for (tm_request *r = p->head; r; r = r->link)
        if (r->op == op && r->next < r->len)
            return 1;
    return 0;
}

static ssize_t transfer(tm_request *r, char *buf, size_t len, off_t pos, int stream)
{
    if (stream) /* pipes and sockets have no offset, as io_uring treats them */
        return r->op == 0 ? read(r->fd, buf, len) : write(r->fd, buf, len);
    return r->op == 0 ? pread(r->fd, buf, len, pos) : pwrite(r->fd, buf, len, pos);
}

/* Without lock: move one piece whole. 0, or a negative errno. */
static int move_piece(tm_request *r, uint64_t off, uint64_t len, uint32_t *resubmits)
{
    uint64_t done = 0;
    int stream = 0;
    while (done < len) {
        ssize_t n = transfer(r, r->buf + off + done, len - done,
                             (off_t)(r->offset + off + done), stream);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) {
                (*resubmits)++;
                continue;
            }
            if (errno == ESPIPE && !stream) {
                stream = 1;
                continue;
            }
            return -errno;
        }
        if (n == 0)
            return r->op == 0 ? -ENODATA : -EIO;
        done += (uint64_t)n;
        if (done < len)
            (*resubmits)++;
    }
    return 0;
}

static void *pool_worker(void *arg)
{
    pool_worker_arg *a = arg;
    tm_pool *p = a->pool;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        uint64_t off = 0, len = 0;  /* read only where take_piece returns a piece */
        tm_request *r = take_piece(p, a->op, &off, &len);
        a->cur = r;
        a->cur_off = off;
        if (!r) {
            /* Nothing left of this direction: with a stop, the other direction's
             * threads finish theirs. A read waiting for a write is not nothing. */
            if (p->stopping && !pending(p, a->op))
                break;
            pthread_cond_wait(&p->work[a->op], &p->lock);
            continue;
        }
        pthread_mutex_unlock(&p->lock);
        uint32_t resubmits = 0;
        int res = move_piece(r, off, len, &resubmits);
        pthread_mutex_lock(&p->lock);
        r->resubmits += resubmits;
        r->inflight--;
        if (res < 0) {
            if (r->error == 0) {
                r->error = res;
                r->error_offset = r->offset + off;
                r->error_length = len;
            }
            r->next = r->len; /* stop handing out pieces of a failed request */
        } else {
            r->bytes_done += len;
        }
        a->cur = NULL;
        if (r->error == 0) {
            /* Its landed prefix ends at the lowest piece still moving. */
            uint64_t low = r->next;
            for (unsigned i = 0; i < p->nthreads; i++)
                if (p->args[i].cur == r && p->args[i].cur_off < low)
                    low = p->args[i].cur_off;
            __atomic_store_n(&r->landed, low, __ATOMIC_SEQ_CST);
        }
        int moved_write = r->op == 1;
        if (r->inflight == 0 && r->next >= r->len)
            finish(p, r);
        if (moved_write && p->following)
            pthread_cond_broadcast(&p->work[0]); /* reads that follow it look again */
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

int tm_pool_create(unsigned nthreads, unsigned block_size, tm_pool **out)
{
    if (nthreads == 0 || block_size == 0)
        return -EINVAL;
    tm_pool *p = calloc(1, sizeof *p);
    if (!p)
        return -ENOMEM;
    unsigned total = nthreads * DIRECTIONS;
    p->threads = calloc(total, sizeof(pthread_t));
    p->args = calloc(total, sizeof(pool_worker_arg));
    if (!p->threads || !p->args) {
        free(p->threads);
        free(p->args);
        free(p);
        return -ENOMEM;
    }
    p->per_direction = nthreads;
    p->block_size = block_size;
    pthread_mutex_init(&p->lock, NULL);
    for (int op = 0; op < DIRECTIONS; op++)
        pthread_cond_init(&p->work[op], NULL);
    pthread_cond_init(&p->done, NULL);
    for (unsigned i = 0; i < total; i++) {
        p->args[i].pool = p;
        p->args[i].op = (int)(i % DIRECTIONS);
        int ret = pthread_create(&p->threads[i], NULL, pool_worker, &p->args[i]);
        if (ret) {
            p->nthreads = i;
            tm_pool_destroy(p);
            return -ret;
        }
    }
    p->nthreads = total;
    *out = p;
    return 0;
}

int tm_pool_submit(tm_pool *p, tm_request *r)
{
    tm_reset_request(r);
    pthread_mutex_lock(&p->lock);
    if (p->stopping) {
        pthread_mutex_unlock(&p->lock);
        return -ESHUTDOWN;
    }
    if (r->len == 0) {
        tm_mark_done(&p->done, r);
        pthread_mutex_unlock(&p->lock);
        return 0;
    }
    if (p->tail)
        p->tail->link = r;
    else
        p->head = r;
    p->tail = r;
    p->inflight_requests++;
    if (r->after)
        p->following++;
    /* One waiter of the request's direction per piece, at most all of them. */
    uint64_t pieces = (r->len + p->block_size - 1) / p->block_size;
    if (pieces >= p->per_direction)
        pthread_cond_broadcast(&p->work[r->op]);
    else
        for (uint64_t i = 0; i < pieces; i++)
            pthread_cond_signal(&p->work[r->op]);
    pthread_mutex_unlock(&p->lock);
    return 0;
}

int tm_pool_wait(tm_pool *p, tm_request *r, int timeout_ms)
{
    return tm_wait_done(&p->lock, &p->done, r, timeout_ms);
}

void tm_pool_destroy(tm_pool *p)
{
    /* Workers finish every queued piece of their direction before they see
     * the stop. */
    pthread_mutex_lock(&p->lock);
    p->stopping = 1;
    for (int op = 0; op < DIRECTIONS; op++)
        pthread_cond_broadcast(&p->work[op]);
    pthread_mutex_unlock(&p->lock);
    for (unsigned i = 0; i < p->nthreads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->lock);
    for (int op = 0; op < DIRECTIONS; op++)
        pthread_cond_destroy(&p->work[op]);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p->args);
    free(p);
}
