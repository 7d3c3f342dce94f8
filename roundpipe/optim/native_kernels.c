/* roundpipe.optim's native one-pass updates (see native.py).
 *
 * Each function updates one contiguous range of a float32 parameter in place, reading its
 * gradient as stored (bfloat16 or float32) and its state as stored (float32 or bfloat16),
 * so every operand is read once and every result written once.  Plain C, no OpenMP: the
 * caller splits the work over threads (ctypes releases the GIL for the call).  Built with
 * -ffp-contract=off and without -ffast-math, so the vector loop and its scalar remainder
 * round alike and a result does not depend on where the ranges are cut.  The multiply-adds
 * torch's vectorised kernels fuse (lerp, addcmul, add with alpha) are explicit fmaf() calls
 * here, rounded once in the vector loop and the remainder alike: a moment that nearly
 * cancels then rounds as torch's does (SGD bit for bit; AdamW differs only where torch's
 * MKL sqrt is not correctly rounded).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_load(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN kept quiet: what torch's float -> bfloat16 conversion does. */
static inline bf16 bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t nan = (u >> 16) | 0x40u;
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

/* Loop-invariant choices are selects or separate functions, never branches in the loop, so
 * every variant vectorises whole.  maximize comes as a negated first gradient factor
 * (negation is exact). */

/* AdamW as torch.optim.AdamW computes it: decay the weight, lerp the first moment towards
 * the gradient (from the nearer end, as torch.lerp: m + w (g - m) for w < 0.5, else
 * g + (w - 1)(g - m)), update the second, divide by its bias-corrected square root plus
 * eps; AMS keeps the running maximum of the second moment. */
#define ADAMW(NAME, GT, GLOAD, ST, SLOAD, SSTORE, AMS)                                     \
    void NAME(float *restrict p, const GT *restrict g, ST *restrict m, ST *restrict v,      \
              ST *restrict vmax, int64_t n, float decay, float lerp_weight,                 \
              int lerp_from_grad, float beta2, float one_minus_beta2, float step_size,      \
              float bc2_sqrt, float eps, float scale0, float scale1) {                      \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float gi = GLOAD(g[i]) * scale0 * scale1;                                       \
            float pi = p[i] * decay;                                                        \
            float mi = SLOAD(m[i]);                                                         \
            float base = lerp_from_grad ? gi : mi;                                          \
            mi = fmaf(lerp_weight, gi - mi, base);                                          \
            float vi = fmaf(one_minus_beta2 * gi, gi, SLOAD(v[i]) * beta2);                 \
            m[i] = SSTORE(mi);                                                              \
            v[i] = SSTORE(vi);                                                              \
            float vd = vi;                                                                  \
            if (AMS) {                                                                      \
                float vm = SLOAD(vmax[i]);                                                  \
                vd = (vm > vi || vm != vm) ? vm : vi; /* NaN wins, as torch.maximum */     \
                vmax[i] = SSTORE(vd);                                                       \
            }                                                                               \
            p[i] = pi - step_size * mi / (sqrtf(vd) / bc2_sqrt + eps);                      \
        }                                                                                   \
    }

ADAMW(rp_adamw_g32_s32, float, f32_load, float, f32_load, f32_store, 0)
ADAMW(rp_adamw_g16_s32, bf16, bf16_load, float, f32_load, f32_store, 0)
ADAMW(rp_adamw_g32_s16, float, f32_load, bf16, bf16_load, bf16_store, 0)
ADAMW(rp_adamw_g16_s16, bf16, bf16_load, bf16, bf16_load, bf16_store, 0)
ADAMW(rp_adamw_ams_g32_s32, float, f32_load, float, f32_load, f32_store, 1)
ADAMW(rp_adamw_ams_g16_s32, bf16, bf16_load, float, f32_load, f32_store, 1)
ADAMW(rp_adamw_ams_g32_s16, float, f32_load, bf16, bf16_load, bf16_store, 1)
ADAMW(rp_adamw_ams_g16_s16, bf16, bf16_load, bf16, bf16_load, bf16_store, 1)

/* SGD as torch.optim.SGD computes it; with MOMENTUM the buffer starts as the (decayed)
 * gradient on the first step.  A zero weight decay adds nothing (as torch skips it). */
#define SGD(NAME, GT, GLOAD, ST, SLOAD, SSTORE, MOMENTUM)                                  \
    void NAME(float *restrict p, const GT *restrict g, ST *restrict buf, int64_t n,         \
              float lr, float weight_decay, float momentum, float one_minus_dampening,      \
              int nesterov, int first, float scale0, float scale1) {                        \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float d = GLOAD(g[i]) * scale0 * scale1;                                        \
            float decayed = fmaf(p[i], weight_decay, d);                                    \
            d = weight_decay != 0.0f ? decayed : d;                                         \
            if (MOMENTUM) {                                                                 \
                float b = fmaf(d, one_minus_dampening, SLOAD(buf[i]) * momentum);           \
                b = first ? d : b;                                                          \
                buf[i] = SSTORE(b);                                                         \
                d = nesterov ? fmaf(b, momentum, d) : b;                                    \
            }                                                                               \
            p[i] = fmaf(d, -lr, p[i]);                                                      \
        }                                                                                   \
    }

SGD(rp_sgd_g32_s32, float, f32_load, float, f32_load, f32_store, 1)
SGD(rp_sgd_g16_s32, bf16, bf16_load, float, f32_load, f32_store, 1)
SGD(rp_sgd_g32_s16, float, f32_load, bf16, bf16_load, bf16_store, 1)
SGD(rp_sgd_g16_s16, bf16, bf16_load, bf16, bf16_load, bf16_store, 1)
SGD(rp_sgd_plain_g32, float, f32_load, float, f32_load, f32_store, 0)
SGD(rp_sgd_plain_g16, bf16, bf16_load, float, f32_load, f32_store, 0)

/* Stochastic rounding (stochastic.py says why and how the bits are keyed).  The weight is
 * bfloat16; the update is computed in float32 with plain multiplies and adds (no fmaf), in
 * the order of stochastic.py's torch path, each operation rounded once, so both paths
 * give the same float32 value; it is then rounded to bfloat16 with 16 bits of a counter
 * hash of the element's index (lo: its lower 32 bits; the caller never crosses a 2^32
 * block) under the keys of its (seed, step, parameter, block, stream). */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

static inline uint32_t sr_hash(uint32_t lo, uint32_t ka, uint32_t kb) {
    return fmix32(fmix32(lo ^ ka) + kb);
}

/* Add 16 random bits below bfloat16's mantissa and truncate.  Every NaN becomes the one
 * quiet NaN 0x7fc0: which NaN an operation returns differs between this loop and torch's
 * (MKL's) operations, the weights must not. */
static inline bf16 bf16_store_sr(float f, uint32_t r16) {
    uint32_t u;
    memcpy(&u, &f, sizeof f);
    uint32_t rounded = (u + r16) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

static inline float f32_store_sr(float x, uint32_t r16) { (void)r16; return x; }

/* AdamW with a bfloat16 weight: the weight and the first moment take the low and high
 * halves of stream 0's hash, the second moment and its running maximum those of stream
 * 1 (used only where the state is bfloat16). */
#define ADAMW_SR(NAME, GT, GLOAD, ST, SLOAD, SSTORE, AMS)                                  \
    void NAME(bf16 *restrict p, const GT *restrict g, ST *restrict m, ST *restrict v,       \
              ST *restrict vmax, int64_t n, float decay, float beta1,                       \
              float one_minus_beta1, float beta2, float one_minus_beta2, float step_size,   \
              float bc2_sqrt, float eps, float scale0, float scale1, uint32_t lo,           \
              uint32_t ka0, uint32_t kb0, uint32_t ka1, uint32_t kb1) {                     \
        for (int64_t i = 0; i < n; i++) {                                                   \
            uint32_t idx = lo + (uint32_t)i;                                                \
            uint32_t h0 = sr_hash(idx, ka0, kb0);                                           \
            uint32_t h1 = sr_hash(idx, ka1, kb1);                                           \
            float gi = GLOAD(g[i]) * scale0 * scale1;                                       \
            float pi = bf16_load(p[i]) * decay;                                             \
            float mi = SLOAD(m[i]) * beta1 + gi * one_minus_beta1;                          \
            float vi = SLOAD(v[i]) * beta2 + gi * one_minus_beta2 * gi;                     \
            m[i] = SSTORE(mi, h0 >> 16);                                                    \
            v[i] = SSTORE(vi, h1 & 0xffffu);                                                \
            float vd = vi;                                                                  \
            if (AMS) {                                                                      \
                float vm = SLOAD(vmax[i]);                                                  \
                vd = (vm > vi || vm != vm) ? vm : vi;                                       \
                vmax[i] = SSTORE(vd, h1 >> 16);                                             \
            }                                                                               \
            float upd = step_size * mi / (sqrtf(vd) / bc2_sqrt + eps);                      \
            p[i] = bf16_store_sr(pi - upd, h0 & 0xffffu);                                   \
        }                                                                                   \
    }

ADAMW_SR(rp_adamw_sr_g32_s32, float, f32_load, float, f32_load, f32_store_sr, 0)
ADAMW_SR(rp_adamw_sr_g16_s32, bf16, bf16_load, float, f32_load, f32_store_sr, 0)
ADAMW_SR(rp_adamw_sr_g32_s16, float, f32_load, bf16, bf16_load, bf16_store_sr, 0)
ADAMW_SR(rp_adamw_sr_g16_s16, bf16, bf16_load, bf16, bf16_load, bf16_store_sr, 0)
ADAMW_SR(rp_adamw_sr_ams_g32_s32, float, f32_load, float, f32_load, f32_store_sr, 1)
ADAMW_SR(rp_adamw_sr_ams_g16_s32, bf16, bf16_load, float, f32_load, f32_store_sr, 1)
ADAMW_SR(rp_adamw_sr_ams_g32_s16, float, f32_load, bf16, bf16_load, bf16_store_sr, 1)
ADAMW_SR(rp_adamw_sr_ams_g16_s16, bf16, bf16_load, bf16, bf16_load, bf16_store_sr, 1)

/* SGD with a bfloat16 weight: the weight and the momentum buffer take the low and high
 * halves of stream 0's hash. */
#define SGD_SR(NAME, GT, GLOAD, ST, SLOAD, SSTORE, MOMENTUM)                               \
    void NAME(bf16 *restrict p, const GT *restrict g, ST *restrict buf, int64_t n,          \
              float lr, float weight_decay, float momentum, float one_minus_dampening,      \
              int nesterov, int first, float scale0, float scale1, uint32_t lo,             \
              uint32_t ka0, uint32_t kb0) {                                                 \
        for (int64_t i = 0; i < n; i++) {                                                   \
            uint32_t h0 = sr_hash(lo + (uint32_t)i, ka0, kb0);                              \
            float pi = bf16_load(p[i]);                                                     \
            float d = GLOAD(g[i]) * scale0 * scale1;                                        \
            float decayed = d + pi * weight_decay;                                          \
            d = weight_decay != 0.0f ? decayed : d;                                         \
            if (MOMENTUM) {                                                                 \
                float b = SLOAD(buf[i]) * momentum + d * one_minus_dampening;               \
                b = first ? d : b;                                                          \
                buf[i] = SSTORE(b, h0 >> 16);                                               \
                float ahead = d + b * momentum;                                             \
                d = nesterov ? ahead : b;                                                   \
            }                                                                               \
            p[i] = bf16_store_sr(pi - d * lr, h0 & 0xffffu);                                \
        }                                                                                   \
    }

SGD_SR(rp_sgd_sr_g32_s32, float, f32_load, float, f32_load, f32_store_sr, 1)
SGD_SR(rp_sgd_sr_g16_s32, bf16, bf16_load, float, f32_load, f32_store_sr, 1)
SGD_SR(rp_sgd_sr_g32_s16, float, f32_load, bf16, bf16_load, bf16_store_sr, 1)
SGD_SR(rp_sgd_sr_g16_s16, bf16, bf16_load, bf16, bf16_load, bf16_store_sr, 1)
SGD_SR(rp_sgd_sr_plain_g32, float, f32_load, float, f32_load, f32_store_sr, 0)
SGD_SR(rp_sgd_sr_plain_g16, bf16, bf16_load, float, f32_load, f32_store_sr, 0)

/* The rounding alone, for tests: x[i] (float32) rounded with the low half of the hash of
 * element lo + i under (ka, kb). */
void rp_round_sr(const float *restrict x, bf16 *restrict out, int64_t n, uint32_t lo,
                 uint32_t ka, uint32_t kb) {
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_store_sr(x[i], sr_hash(lo + (uint32_t)i, ka, kb) & 0xffffu);
}
