/* Threads for the passes of adam_lowbit.c, rules.c and crc32c.c (defined in adam.c, beside
 * the pool and the OpenMP choice they share; not part of the cffi interface). */
#ifndef TM_PARALLEL_H
#define TM_PARALLEL_H
#include <stddef.h>
#include <stdint.h>

/* Run fn(pieces + k * stride) for k in [0, parts) and return when all are done: on
 * OpenMP's team where tm_adam_openmp() says so, else on threads started for this call
 * (nothing to forget after fork), the caller running piece 0 and any piece whose thread
 * could not start. stride 0: every thread runs the same piece (a task whose chunks the
 * threads take in turn). */
void tm_parallel_pieces(void *(*fn)(void *), void *pieces, size_t stride, int parts);

/* The chunk a thread takes of a pass over n elements on up to nthreads threads, in turn
 * with the others: as long as `most`, so that each thread streams long runs of each array,
 * yet four or more a thread, so that one slowed by other work on its core takes fewer; a
 * multiple of `piece` (what a hashing pass hashes at once), at least one piece. Why long
 * runs: adam.c, at TM_ADAM_STREAM_CHUNK. */
static inline int64_t tm_stream_chunk(int64_t n, int nthreads, int64_t piece, int64_t most)
{
    int64_t per = n / (4 * (int64_t)(nthreads > 1 ? nthreads : 1));
    per = (per + piece - 1) / piece * piece;
    return per < piece ? piece : per > most ? most : per;
}

#endif
