/* Declarations shared by the C sources and the cffi cdef (kept cdef-parsable:
 * no macros, no includes). */

typedef struct tm_engine tm_engine;

/* One transfer submitted from Python. The engine splits it into block_size
 * pieces; Python owns the struct and keeps it alive until `done` is set. */
typedef struct tm_request {
    int op;                 /* 0 = read, 1 = write */
    int fd;                 /* fixed-file slot when fixed_file, else a plain fd */
    int fixed_file;
    int buf_index;          /* registered-buffer index, or -1 */
    char *buf;
    uint64_t len;
    uint64_t offset;
    /* written by the engine, read by Python once done != 0 */
    int done;
    int error;              /* 0, or the negative errno of the first failed piece */
    uint64_t error_offset;
    uint64_t error_length;
    uint64_t bytes_done;
    uint32_t resubmits;     /* short transfers and EAGAINs requeued */
    uint64_t submit_ns;     /* CLOCK_MONOTONIC when submitted */
    uint64_t done_ns;       /* CLOCK_MONOTONIC when the last piece landed */
    /* A write whose memory this read reuses, or NULL: a piece of this request starts
     * only once every byte of `after` that it overlaps has been sent (after's landed
     * prefix covers it); if `after` fails, this request fails with -ECANCELED where it
     * got to. Set before submit; the caller keeps `after` alive until this is done. */
    struct tm_request *after;
    /* Bytes of the buffer's prefix whose pieces all landed (atomic). */
    uint64_t landed;
    /* engine-private */
    uint64_t next;          /* bytes handed to the ring so far */
    uint32_t inflight;      /* pieces in the ring */
    struct tm_request *link;
} tm_request;

int tm_uring_probe(void);
int tm_engine_create(unsigned queue_depth, unsigned block_size,
                     unsigned file_slots, tm_engine **out);
int tm_engine_register_buffers(tm_engine *e, void **addrs, size_t *lens, unsigned n);
int tm_engine_unregister_buffers(tm_engine *e);
int tm_engine_register_file(tm_engine *e, int fd);
int tm_engine_unregister_file(tm_engine *e, int slot);
int tm_engine_submit(tm_engine *e, tm_request *r);
int tm_engine_wait(tm_engine *e, tm_request *r, int timeout_ms);
int tm_engine_inflight(tm_engine *e);
void tm_engine_destroy(tm_engine *e);

typedef struct tm_pool tm_pool;
int tm_pool_create(unsigned nthreads, unsigned block_size, tm_pool **out);
int tm_pool_submit(tm_pool *p, tm_request *r);
int tm_pool_wait(tm_pool *p, tm_request *r, int timeout_ms);
void tm_pool_destroy(tm_pool *p);

/* Memory for I/O buffers. want_huge: 0 = 4 KiB pages, 1 = huge pages (the size
 * rounded up to 2 MiB), 2 = huge pages for the whole 2 MiB extents and 4 KiB pages
 * for the tail (the size rounded up to 4 KiB only). kind: 0 = plain pages,
 * 1 = transparent huge pages (madvise), 2 = hugetlb pages, 3 = transparent huge
 * pages over the whole extents, 4 KiB pages after them. */
void *tm_mem_alloc(size_t nbytes, int want_huge, int want_lock,
                   int *kind_out, int *locked_out, int *lock_errno_out);
void tm_mem_free(void *p, size_t nbytes);
size_t tm_mem_mapped_size(size_t nbytes, int kind);
long tm_mem_live_count(void);
size_t tm_mem_live_bytes(void);
long tm_mem_free_count(void);

/* The fused Adam/AdamW update (adam.c). isa: -1 = best available, 0 = scalar,
 * 1 = AVX2+FMA+F16C, 2 = AVX-512. dtypes: 0 = fp32, 1 = bf16, 2 = fp16 (grad:
 * any; out: 1 or 2, or out = NULL for none). step is the count after this
 * step's increment. state_mode: 0 = fp32 moments, 1 = bf16 moments rounded to
 * nearest even, 2 = bf16 moments rounded stochastically with the bits of stream
 * (seed, index0 + i) for element i. Returns 0, or -EINVAL. */
int tm_adam_isa_supported(int isa);
int tm_adam_set_isa(int isa);
int tm_adam_get_isa(void);
/* Software prefetch in adam.c's passes: -1 = the CPU's default
 * (on for Intel, off for AMD: measured, see adam.c), 0 = off, 1 = on. It never changes
 * a result. set returns 1, or 0 for a bad value; get returns 0 or 1. */
int tm_adam_set_prefetch(int mode);
int tm_adam_get_prefetch(void);
/* 1 when a call from this thread runs adam.c's pass on OpenMP's threads (built with
 * it, called from the main thread, not in a child forked after the library was
 * loaded), 0 when on its own pthread pool. */
int tm_adam_openmp(void);
/* 0: the pool for every call (to compare, or where OpenMP misbehaves); 1: as above. */
void tm_adam_set_openmp(int allowed);
int tm_adam_step(float *p, void *exp_avg, void *exp_avg_sq, void *max_exp_avg_sq,
                 const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 double step, int amsgrad, int maximize, int decoupled, int state_mode,
                 uint64_t seed, uint64_t index0, int nthreads);

/* tm_adam_step, also returning in crcs[0..3] the CRC32C of the bytes it wrote to
 * p, exp_avg, exp_avg_sq, max_exp_avg_sq (those whose bit 1, 2, 4, 8 is set in
 * crc_mask; the others are left alone). Each chunk is hashed right after it
 * was updated, on the thread that updated it. The last tail_len elements (0: none)
 * take the arithmetic of torch's fused CPU kernel's scalar loop, which it runs over
 * the last numel % 8 elements of each tensor it steps (numeric.h, torch_tail). */
int tm_adam_step_crc(float *p, void *exp_avg, void *exp_avg_sq, void *max_exp_avg_sq,
                     const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     double step, int amsgrad, int maximize, int decoupled, int state_mode,
                     uint64_t seed, uint64_t index0, int nthreads, int crc_mask,
                     uint32_t *crcs, int64_t tail_len);

/* One run of tm_adam_step_runs: what tm_adam_step takes per call (fp32 moments). */
typedef struct tm_adam_run {
    float *p;
    void *exp_avg, *exp_avg_sq, *max_exp_avg_sq;
    const void *grad;
    void *out;
    int64_t n;
    double step;
    int grad_dtype, out_dtype;
    int64_t tail_len;  /* as tm_adam_step_crc's: the last elements in torch's scalar loop */
} tm_adam_run;

/* tm_adam_step (state_mode 0: fp32 moments, no CRCs) on each of nruns runs, in one
 * pass whose threads take chunks across the runs (no join between runs): the same
 * bits as one call per run. Returns 0, -EINVAL (a bad run; nothing was updated) or
 * -ENOMEM. */
int tm_adam_step_runs(const tm_adam_run *runs, int nruns, double lr, double beta1,
                      double beta2, double eps, double weight_decay, int amsgrad,
                      int maximize, int decoupled, int nthreads);

/* Adam/AdamW with 8-bit blockwise moments (adam_lowbit.c): exp_avg and exp_avg_sq
 * one byte per element, one fp32 scale per 256 elements (a call's blocks start at
 * its element 0), dequantised, updated in fp32 and quantised again in one pass.
 * master_mode: 0 = p is fp32 (out: optional bf16/fp16 copy, out_dtype 1 or 2),
 * 1 = kahan (p: the bf16 weights, comp: a bf16 compensation term), 2 = none (p:
 * the bf16 weights, rounded back stochastically). stochastic: the moments' codes
 * rounded with the bits of stream (seed, index0 + i), else to nearest even.
 * crc_mask bits 1, 2, 4, 8, 16, 32: CRC32C of p, exp_avg, exp_avg_scale,
 * exp_avg_sq, exp_avg_sq_scale, comp after the update into crcs[0..5]. Returns
 * 0, -EINVAL, -ENOMEM, or -ERANGE when index0 .. index0 + n crosses a multiple
 * of 2^32. moment_dtype: 0 = those int8 codes; 1 = fp32, 2 = bf16 moments (dense: no
 * scales, both scale pointers NULL; bf16 ones stored with the same rounding and bits
 * as the codes), with the same weight formats. weight_dtype: 0 (fp32) with master_mode
 * 0; 1 (bf16) or 2 (fp16) weights and term with kahan / none. max_exp_avg_sq:
 * amsgrad's running max in the dense moments' format, or NULL (int8: always NULL). */
int tm_adam_lowbit_step(void *p, int master_mode, int weight_dtype, uint16_t *comp,
                        int moment_dtype,
                        void *exp_avg, float *exp_avg_scale, void *exp_avg_sq,
                        float *exp_avg_sq_scale, void *max_exp_avg_sq,
                        const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                        double lr, double beta1, double beta2, double eps,
                        double weight_decay, double step, int maximize, int decoupled,
                        int stochastic, uint64_t seed, uint64_t index0, int nthreads,
                        int crc_mask, uint32_t *crcs);

/* CRC32C (crc32c.c): standard CRC-32C values; crc = 0 starts one, a previous
 * value continues it. _sw is the portable table path; _hw the SSE4.2 one where
 * tm_crc32c_hw_supported() (elsewhere it answers with the portable path).
 * tm_crc32c picks the fastest the CPU has: AVX-512 VPCLMULQDQ folding for
 * buffers of 1 KiB and more where tm_crc32c_fold_supported(); else, where
 * tm_crc32c_clmul_supported(), whichever of SSE4.2 and the 128-bit PCLMULQDQ
 * fold (_clmul, buffers of 256 bytes and more) measured faster at start-up;
 * else SSE4.2. tm_crc32c_path() says which: 0 table, 1 SSE4.2, 2 PCLMULQDQ,
 * 3 AVX-512. _threads splits buf over up to nthreads threads and combines.
 * The GIL is released by cffi around each call. */
uint32_t tm_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t tm_crc32c_sw(uint32_t crc, const void *buf, size_t len);
uint32_t tm_crc32c_hw(uint32_t crc, const void *buf, size_t len);
int tm_crc32c_hw_supported(void);
int tm_crc32c_fold_supported(void);
uint32_t tm_crc32c_clmul(uint32_t crc, const void *buf, size_t len);
int tm_crc32c_clmul_supported(void);
int tm_crc32c_path(void);
uint32_t tm_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
uint32_t tm_crc32c_threads(const void *buf, size_t len, int nthreads);

/* SGD and Adagrad on fp32 runs (rules.c), the arithmetic of torch's fused CPU
 * kernels' vector body. momentum_buffer is NULL exactly when momentum == 0;
 * first: the buffer starts as this step's gradient. step is Adagrad's count
 * after this step's increment. crc_mask bit 1: crcs[0] = CRC32C of the state
 * after the update, bit 2: crcs[1] = that of p; hashed chunk by chunk in the
 * same pass. Returns 0, or -EINVAL. */
int tm_sgd_step(float *p, float *momentum_buffer, const float *grad, int64_t n, double lr,
                double momentum, double dampening, double weight_decay, int nesterov,
                int maximize, int first, int nthreads, int crc_mask, uint32_t *crcs);
/* Force a path (0 scalar, 1 AVX2+FMA, 2 AVX-512; -1 the best): 0 if unsupported. */
int tm_rules_set_isa(int isa);
int tm_adagrad_step(float *p, float *state_sum, const float *grad, int64_t n, double lr,
                    double lr_decay, double weight_decay, double eps, double step,
                    int maximize, int nthreads, int crc_mask, uint32_t *crcs);

/* A low-precision model's fp32 masters take the elements of its weights (w_dtype: 1 =
 * bf16, 2 = fp16) that are not their masters rounded to nearest even (edits.c). Returns
 * how many it took, or -EINVAL. */
int64_t tm_take_edits(float *master, const uint16_t *weights, int64_t n, int w_dtype,
                      int nthreads);
