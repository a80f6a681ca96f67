// Fused GRPO loss rows on Hopper (sm_90+): each row read from DRAM once, held on chip between the
// two passes. Compiled at first use by NVRTC (kernels/cuda_grpo.py), which prepends the #defines
// below; the same row semantics and outputs as `_grpo_rows_kernel` in triton_rows.py.
//
// Why: the Triton row kernel reads each row twice (pass 2 from L1/L2) with plain loads, one block
// ahead in registers, and streams well below peak DRAM bandwidth (profiles/kernel.md). Here, per
// CTA (one per SM, persistent):
//   * one producer thread streams rows in CHUNK-element bulk copies (cp.async.bulk, completing on an
//     mbarrier) into a FIFO ring of SLOTS chunks in shared memory: many bytes in flight, no registers;
//   * CONSUMER_WARPS warps fold each chunk into per-thread (max, sum 2^(z - max)) from the ring;
//   * of a row's K chunks, the first `held` (REG_CHUNKS) are copied into consumer registers, the last
//     R = min(K - held, SLOTS - PREFETCH) stay in the ring, and only the H in between are bulk-copied
//     again in pass 2 (from L2). At V=152064 bf16 with the defaults: 6 held, 11 resident, 2 read
//     twice, so DRAM moves the ideal bytes (measured with Nsight Compute: 4.50 GB read, 4.95 written);
//   * pass 2 writes d(logits) with 16-byte stores while the freed slots already stream the next row,
//     so each SM reads and writes at once, as a copy does;
//   * rows are handed out one at a time (atomicAdd) through a small queue, so CTAs end together.
// The ring is strictly FIFO (pass 2 takes the resident chunks, then the re-read ones), so a slot's
// n-th reuse waits for the n-th release of that slot and the pipeline cannot deadlock.
//
// Constraints (checked on the host): bf16 logits, rows and the gradient 16-byte aligned (V % 8 == 0,
// row strides % 8 == 0), weights >= 0. Rows with weight 0 read nothing and get a zero gradient.
//
// #define CHUNK 8192          elements per bulk copy (16 KB of bf16)
// #define SLOTS 14            ring slots (14 x 16 KB: an H200's 227 KB per block, with the barriers)
// #define PREFETCH 3          slots never held by resident chunks (the next row streams into them)
// #define CONSUMER_WARPS 16   a chunk's CHUNK / 8 vectors must split evenly over their threads
// #define REG_CHUNKS 6        chunks of each row held in consumer registers
// #define HINTS 1             L2 hints: chunks read twice evict_last, the rest evict_first

#ifndef REG_CHUNKS
#define REG_CHUNKS 6
#endif
#define NT (CONSUMER_WARPS * 32)                 // consumer threads
#define ROW_QUEUE 4                              // row ids in flight from the producer to the consumers
#define CHUNK_BYTES (CHUNK * 2)
#define CHUNK_VECS (CHUNK / 8)                   // 16-byte vectors of 8 bf16 per chunk
static_assert(CHUNK_VECS % NT == 0, "a full chunk must split evenly over the consumer threads");
#define NV (CHUNK_VECS / NT)                     // vectors per consumer thread in a full chunk

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {  // shared-window address of a generic pointer
    u32 a;
    asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    }
}

__device__ __forceinline__ u64 policy_evict_last() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
}

__device__ __forceinline__ u64 policy_evict_first() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}

// Global -> shared bulk copy of `bytes` (multiple of 16, both addresses 16-byte aligned), completing
// on `bar` (whose expected transaction count the caller raised by `bytes`).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
#if HINTS
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1], %2, [%3], %4;"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
#endif
}

__device__ __forceinline__ float ex2(float x) {  // 2^x, one MUFU op; ex2(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void unpack8(const uint4 v, float* x) {  // 8 bf16 -> fp32 (exact)
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {  // round to nearest even, as .to(bf16)
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void consumer_sync() {  // the consumer warps only (the producer never joins)
    asm volatile("bar.sync 1, %0;" :: "r"(NT) : "memory");
}

__device__ __forceinline__ float bf16_at(const uint4* chunk, int col) {  // element `col` of a chunk, as fp32
    return __uint_as_float(((u32)reinterpret_cast<const unsigned short*>(chunk)[col]) << 16);
}

// Fold N vectors of 8 bf16 into a thread's running (m, s), s = sum 2^(x * scale - m). m starts finite
// (-3e38), so a vector of -inf adds ex2(-inf) = 0 instead of NaN. One max and at most one rescale
// per call, and the N independent loads and exponentials give the scheduler something to overlap.
template <int N>
__device__ __forceinline__ void fold_vectors(const uint4 (&v)[N], float scale, float& m, float& s) {
    float x[N][8];
#pragma unroll
    for (int j = 0; j < N; ++j) unpack8(v[j], x[j]);
    float mj[N];
#pragma unroll
    for (int j = 0; j < N; ++j)
        mj[j] = fmaxf(fmaxf(fmaxf(x[j][0], x[j][1]), fmaxf(x[j][2], x[j][3])),
                      fmaxf(fmaxf(x[j][4], x[j][5]), fmaxf(x[j][6], x[j][7])));
    float mx = mj[0];
#pragma unroll
    for (int j = 1; j < N; ++j) mx = fmaxf(mx, mj[j]);
    mx *= scale;
    if (mx > m) {
        s *= ex2(m - mx);
        m = mx;
    }
    float acc[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = ex2(fmaf(x[j][i], scale, -m));
        acc[j] = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
    }
#pragma unroll
    for (int j = 1; j < N; ++j) acc[0] += acc[j];
    s += acc[0];
}

// d(logits) of one 16-byte vector (columns 8v .. 8v+7 of a chunk): neg_coef * 2^(z - lse2), and
// g_tgt at the target's column. Returns the packed bf16 vector.
__device__ __forceinline__ uint4 grad_vec(const uint4 packed, int v, int tgt_col, float scale, float lse2,
                                          float neg_coef, float g_tgt) {
    float x[8];
    unpack8(packed, x);
    float d[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) d[i] = neg_coef * ex2(fmaf(x[i], scale, -lse2));
    if ((unsigned)(tgt_col - v * 8) < 8u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) if (v * 8 + i == tgt_col) d[i] = g_tgt;
    }
    return make_uint4(pack_bf16x2(d[0], d[1]), pack_bf16x2(d[2], d[3]), pack_bf16x2(d[4], d[5]),
                      pack_bf16x2(d[6], d[7]));
}

extern "C" __global__ void __launch_bounds__(NT + 32, 1) grpo_rows_bulk(
    const unsigned short* __restrict__ logits,  // [N, V] bf16 bits, row stride stride_logits
    unsigned short* grad,                       // [N, V] bf16 bits; may alias logits (in place)
    const long long* __restrict__ targets,      // [N] int64
    const float* __restrict__ weights,          // [N] mask * normalization, >= 0
    const float* __restrict__ behaviour,        // [N]
    const float* __restrict__ advantages,       // [N]
    const float* __restrict__ ref,              // [N] (read only when has_kl)
    const float* __restrict__ dlogp,            // [N] dL/dlogp per row (read only when has_dlogp)
    float* __restrict__ row_out,                // [N, 6]: w*loss, ratio, kl, is_clipped, active, logp
    int* __restrict__ counters,                 // [2] zero at launch, zero again at exit: next row, finished CTAs
    int num_rows, int vocab, int stride_logits, int stride_grad,
    double log2e_over_t_d, double inv_t_d, double eps_low_d, double eps_high_d, double beta_d, int has_kl,
    int has_dlogp) {  // the gradient's coefficient is w * dlogp[row] / T (an objective computed outside)
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;                                   // [SLOTS][CHUNK_BYTES]
    u64* full = reinterpret_cast<u64*>(smem + SLOTS * CHUNK_BYTES);  // [SLOTS] producer -> consumers
    u64* empty = full + SLOTS;                                    // [SLOTS] consumers -> producer
    float* red = reinterpret_cast<float*>(empty + SLOTS);         // [2][2][CONSUMER_WARPS] (m, s) per warp
    float* tgt_z = red + 4 * CONSUMER_WARPS;                      // [2] target's z, per row parity
    u64* rq_full = reinterpret_cast<u64*>(tgt_z + 2);             // [ROW_QUEUE] row queue, producer -> consumers
    u64* rq_empty = rq_full + ROW_QUEUE;                          // [ROW_QUEUE]
    int* rq = reinterpret_cast<int*>(rq_empty + ROW_QUEUE);       // [ROW_QUEUE] row ids

    const float scale = (float)log2e_over_t_d;  // z = x * log2(e) / T: base 2, one ex2 per exponential
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // A row's K chunks: [0, held) stay in consumer registers, [held, held + H) are read twice (their
    // slots freed in pass 1, bulk-copied again in pass 2, from L2), [K - R, K) stay in the ring.
    const int num_chunks = (vocab + CHUNK - 1) / CHUNK;                                     // K
    const int full_chunks = vocab / CHUNK;
    const int held = min(REG_CHUNKS, full_chunks);
    const int resident = min(num_chunks - held, SLOTS - PREFETCH);                          // R
    const int reread = num_chunks - held - resident;                                         // H

    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; ++i) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], CONSUMER_WARPS);
        }
        for (int i = 0; i < ROW_QUEUE; ++i) {
            mbar_init(&rq_full[i], 1);
            mbar_init(&rq_empty[i], CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == CONSUMER_WARPS) {  // ---- producer: one thread issues every bulk copy, in ring order
        if (lane != 0) return;
        const u64 keep = policy_evict_last(), stream = policy_evict_first();
        u32 idx = 0;  // ring index of the next copy
        // Rows are handed out one at a time (atomicAdd): a static split leaves CTAs with different
        // numbers of unmasked rows, and the kernel ends with the slowest. Each row id goes through a
        // small queue to the consumers; a row id >= num_rows tells them to stop.
        for (u32 qi = 0;; ++qi) {
            const int row = atomicAdd(&counters[0], 1);
            const u32 qs = qi % ROW_QUEUE;
            if (qi >= ROW_QUEUE) mbar_wait(&rq_empty[qs], ((qi / ROW_QUEUE) - 1) & 1);
            rq[qs] = row;
            mbar_arrive(&rq_full[qs]);  // release: the consumers' acquire sees rq[qs]
            if (row >= num_rows) {
                // The last CTA to get here re-zeroes the counters for the next launch (stream order;
                // every other CTA has taken its last row id already).
                if (atomicAdd(&counters[1], 1) == (int)gridDim.x - 1) {
                    atomicExch(&counters[0], 0);
                    atomicExch(&counters[1], 0);
                }
                break;
            }
            if (!(weights[row] > 0.0f)) continue;
            const unsigned short* x_row = logits + (long long)row * stride_logits;
            for (int k = 0; k < num_chunks + reread; ++k, ++idx) {  // pass 1: 0..K-1; pass 2: the re-read ones
                const int c = k < num_chunks ? k : held + (k - num_chunks);
                const u32 slot = idx % SLOTS;
                if (idx >= SLOTS) mbar_wait(&empty[slot], ((idx / SLOTS) - 1) & 1);
                const int len = min(CHUNK, vocab - c * CHUNK);
                mbar_arrive_expect_tx(&full[slot], (u32)len * 2);
                // Chunks read twice: keep them in L2 until pass 2. Nothing else is read again.
                const bool again = k < num_chunks && c >= held && c < held + reread;
                bulk_load(ring + slot * CHUNK_BYTES, x_row + (long long)c * CHUNK, (u32)len * 2, &full[slot],
                          again ? keep : stream);
            }
        }
        return;
    }

    // ---- consumers: NT threads, thread t takes vectors t, t + NT, ... of each chunk
    const int t = threadIdx.x;
    uint4 regs[REG_CHUNKS > 0 ? REG_CHUNKS : 1][NV];  // the held chunks (compile-time indexed)
    u32 idx = 0;  // ring index of this row's chunk 0
    int parity = 0;
    for (u32 qi = 0;; ++qi) {
        const u32 qs = qi % ROW_QUEUE;
        mbar_wait(&rq_full[qs], (qi / ROW_QUEUE) & 1);
        const int row = rq[qs];
        __syncwarp();
        if (lane == 0) mbar_arrive(&rq_empty[qs]);
        if (row >= num_rows) break;
        const float w = weights[row];
        unsigned short* g_row = grad + (long long)row * stride_grad;
        float* out = row_out + (long long)row * 6;
        if (!(w > 0.0f)) {  // masked row: zero gradient, nothing read
            const uint4 zero = make_uint4(0, 0, 0, 0);
            for (int v = t; v < vocab / 8; v += NT) reinterpret_cast<uint4*>(g_row)[v] = zero;
            if (t < 6) out[t] = 0.0f;
            continue;
        }
        const int tgt = (int)targets[row];

        // Pass 1: per-thread running (m, s) with s = sum 2^(z - m) (fold_vectors).
        float m = -3.0e38f, s = 0.0f;
        // Held chunks first (compile-time h, so regs[h] stays in registers), then the rest of the row.
#pragma unroll
        for (int h = 0; h < REG_CHUNKS; ++h) {
            if (h < held) {
                const u32 slot = (idx + h) % SLOTS;
                mbar_wait(&full[slot], ((idx + h) / SLOTS) & 1);
                const uint4* chunk = reinterpret_cast<const uint4*>(ring + slot * CHUNK_BYTES);
#pragma unroll
                for (int j = 0; j < NV; ++j) regs[h][j] = chunk[t + j * NT];
                fold_vectors(regs[h], scale, m, s);
                if (t == 0 && (unsigned)(tgt - h * CHUNK) < (unsigned)CHUNK)  // before any in-place write
                    tgt_z[parity] = bf16_at(chunk, tgt - h * CHUNK) * scale;
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[slot]);
            }
        }
        for (int k = held; k < num_chunks; ++k) {
            const u32 slot = (idx + k) % SLOTS;
            mbar_wait(&full[slot], ((idx + k) / SLOTS) & 1);
            const uint4* chunk = reinterpret_cast<const uint4*>(ring + slot * CHUNK_BYTES);
            if (k < full_chunks) {
                uint4 v[NV];
#pragma unroll
                for (int j = 0; j < NV; ++j) v[j] = chunk[t + j * NT];
                fold_vectors(v, scale, m, s);
            } else {  // the partial last chunk
                for (int i = t; i < (vocab - k * CHUNK) / 8; i += NT) {
                    uint4 v[1] = {chunk[i]};
                    fold_vectors(v, scale, m, s);
                }
            }
            if (t == 0 && (unsigned)(tgt - k * CHUNK) < (unsigned)CHUNK)
                tgt_z[parity] = bf16_at(chunk, tgt - k * CHUNK) * scale;
            if (k < num_chunks - resident) {  // read again in pass 2: release the slot now
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[slot]);
            }
        }

        // Row logsumexp (base 2): combine (m, s) across the warp, then across consumer warps.
#pragma unroll
        for (int o = 16; o > 0; o /= 2) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            const float mm = fmaxf(m, m2);
            s = s * ex2(m - mm) + s2 * ex2(m2 - mm);
            m = mm;
        }
        float* red_m = red + parity * 2 * CONSUMER_WARPS;  // double-buffered by row parity: row i + 2
        float* red_s = red_m + CONSUMER_WARPS;              // writes only after row i + 1's barrier
        if (lane == 0) {
            red_m[warp] = m;
            red_s[warp] = s;
        }
        consumer_sync();
        float mm = red_m[0];
#pragma unroll
        for (int i = 1; i < CONSUMER_WARPS; ++i) mm = fmaxf(mm, red_m[i]);
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < CONSUMER_WARPS; ++i) ss += red_s[i] * ex2(red_m[i] - mm);
        const float lse2 = mm + log2f(ss);
        const float z_tgt = tgt_z[parity];
        parity ^= 1;

        // Per-token GRPO terms, as reference.objective_terms with its defaults (every thread; thread 0 stores them).
        const float LN2 = 0.6931471805599453f;
        const float logp = (z_tgt - lse2) * LN2;
        const float adv = advantages[row];
        const float ratio = expf(logp - behaviour[row]);
        const float eps_low = (float)eps_low_d, eps_high = (float)eps_high_d;
        const float clipped = fminf(fmaxf(ratio, 1.0f - eps_low), 1.0f + eps_high);
        float loss = -fminf(ratio * adv, clipped * adv);
        const bool is_clipped = (adv > 0.0f && ratio > 1.0f + eps_high) || (adv < 0.0f && ratio < 1.0f - eps_low);
        float dloss_dlogp = is_clipped ? 0.0f : -ratio * adv;
        float kl = 0.0f;
        if (has_kl) {
            const float delta = ref[row] - logp;
            const float exp_delta = expf(delta);
            kl = exp_delta - delta - 1.0f;
            loss += (float)beta_d * kl;
            dloss_dlogp += (float)beta_d * (1.0f - exp_delta);
        }
        if (has_dlogp) dloss_dlogp = dlogp[row];
        if (t == 0) {
            out[0] = w * loss;
            out[1] = ratio;
            out[2] = kl;
            out[3] = is_clipped ? 1.0f : 0.0f;
            out[4] = 1.0f;
            out[5] = logp;
        }

        // Pass 2: d x_v = coef * (onehot_v - 2^(z_v - lse2)), coef = w * dloss/dlogp / T. The ring's
        // resident chunks first (already waited for; each freed slot lets the producer start the next
        // row), then the re-read ones as they come back, then the held ones from registers.
        const float coef = w * dloss_dlogp * (float)inv_t_d, neg_coef = -coef;
        const float g_tgt = coef * (1.0f - ex2(z_tgt - lse2));
        for (int j = 0; j < resident + reread; ++j) {
            const int k = j < resident ? num_chunks - resident + j : held + (j - resident);  // chunk of the row
            const u32 ring_idx = j < resident ? idx + k : idx + num_chunks + (j - resident);
            const u32 slot = ring_idx % SLOTS;
            if (j >= resident) mbar_wait(&full[slot], (ring_idx / SLOTS) & 1);
            const uint4* chunk = reinterpret_cast<const uint4*>(ring + slot * CHUNK_BYTES);
            uint4* g_chunk = reinterpret_cast<uint4*>(g_row + (long long)k * CHUNK);
            const int nvec = min(CHUNK, vocab - k * CHUNK) / 8;
            const int tgt_col = tgt - k * CHUNK;  // the target's column within this chunk (if any)
            if (k < full_chunks) {
                uint4 v[NV];
#pragma unroll
                for (int jj = 0; jj < NV; ++jj) v[jj] = chunk[t + jj * NT];
#pragma unroll
                for (int jj = 0; jj < NV; ++jj)
                    g_chunk[t + jj * NT] = grad_vec(v[jj], t + jj * NT, tgt_col, scale, lse2, neg_coef, g_tgt);
            } else {
                for (int i = t; i < nvec; i += NT) g_chunk[i] = grad_vec(chunk[i], i, tgt_col, scale, lse2, neg_coef, g_tgt);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);
        }
#pragma unroll
        for (int h = 0; h < REG_CHUNKS; ++h) {
            if (h < held) {
                uint4* g_chunk = reinterpret_cast<uint4*>(g_row + (long long)h * CHUNK);
                const int tgt_col = tgt - h * CHUNK;
#pragma unroll
                for (int j = 0; j < CHUNK_VECS / NT; ++j) {
                    const int v = t + j * NT;
                    g_chunk[v] = grad_vec(regs[h][j], v, tgt_col, scale, lse2, neg_coef, g_tgt);
                }
            }
        }
        idx += num_chunks + reread;
    }
}
