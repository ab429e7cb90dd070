/* Threads for the passes of adam_lowbit.c, rules.c and crc32c.c (defined in adam.c, beside
 * the pool and the OpenMP choice they share; not part of the cffi interface). */
#ifndef TM_PARALLEL_H
#define TM_PARALLEL_H
#include <stddef.h>

/* Run fn(pieces + k * stride) for k in [0, parts) and return when all are done: on
 * OpenMP's team where tm_adam_openmp() says so, else on threads started for this call
 * (nothing to forget after fork), the caller running piece 0 and any piece whose thread
 * could not start. stride 0: every thread runs the same piece (a task whose chunks the
 * threads take in turn). */
void tm_parallel_pieces(void *(*fn)(void *), void *pieces, size_t stride, int parts);

#endif
