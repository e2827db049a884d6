// tf_dp's native Gaussian sampler: the lazy float32 Box-Muller transform of
// tf_dp/dp_query/noise.py, fused into one TensorFlow CPU kernel.
//
// It reads the same Philox-4x32-10 words as the TensorFlow-ops sampler (the high words of u1 and
// the angle words from two counter planes, the k-th pair with a high word below 2^24 reading
// word k of a third plane for its low word) and computes, per pair i of the h = num_pairs pairs,
//   z[i]     = r cos(theta),   z[h + i] = r sin(theta),
//   r        = sqrt(log(u1) * scale)             (scale = -2 stddev^2),
//   u1       = min((hi + (lo + 1/2) 2^-32) 2^-32, 1 - 2^-24)   (float32, as the TF ops round it),
//   theta    = (2k + 1) pi 2^-23,  k = angle >> 9.
// In one pass over memory instead of about fifteen, vectorised, and sharded over TensorFlow's
// intra-op threads. The transcendentals are this file's own (no libm), so the values are the
// same on every CPU and compiler that honours IEEE float32 without contraction (built with
// -ffp-contract=off):
//   - log(m 2^e), m in [sqrt(1/2), sqrt(2)): e ln2 + 2 atanh(s), s = (m - 1) / (m + 1), |s| <=
//     0.1716, by the atanh series to s^15 (truncation below 1e-13 relative); ln2 split in two.
//   - cos and sin of theta without a floating-point range reduction: the angle word gives the
//     quadrant (top 2 bits of k) and the octant (the next bit) exactly, and the reduced angle
//     a = (2j + 1) pi 2^-23 lies in (0, pi/4); sin a and cos a by their Taylor series to a^11
//     and a^12 (truncation below 2e-9 relative). No output is ever an exact zero: the reduced
//     angle is at least pi 2^-23, so |sin a| >= 3.7e-7, and r >= 3.5e-4.
// The tests compare every value with a float64 computation from the same words and check the
// words against TensorFlow's StatelessRandomUniformFullIntV2 bit for bit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#ifdef TF_DP_XLA_CUSTOM_CALL
#include "xla/service/custom_call_target_registry.h"
#endif

namespace tf_dp {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

// Philox-4x32-10 on the counter words (x0, x1, x2, x3) under key (k0, k1), in place.
static inline void Philox10(uint32_t& x0, uint32_t& x1, uint32_t& x2, uint32_t& x3, uint32_t k0,
                            uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * x0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * x2;
    const uint32_t y0 = static_cast<uint32_t>(p1 >> 32) ^ x1 ^ k0;
    const uint32_t y1 = static_cast<uint32_t>(p1);
    const uint32_t y2 = static_cast<uint32_t>(p0 >> 32) ^ x3 ^ k1;
    const uint32_t y3 = static_cast<uint32_t>(p0);
    x0 = y0; x1 = y1; x2 = y2; x3 = y3;
    k0 += kW0; k1 += kW1;
  }
}

// The 4 words of block `block` of the plane at 128-bit counter (c_lo, c_hi) (the counter plus
// `block`, carried into the high word), written to out[0..3].
static inline void PhiloxBlock(uint64_t c_lo, uint64_t c_hi, uint64_t block, uint32_t k0,
                               uint32_t k1, uint32_t* out) {
  const uint64_t lo = c_lo + block;
  const uint64_t hi = c_hi + (lo < c_lo ? 1 : 0);
  uint32_t x0 = static_cast<uint32_t>(lo), x1 = static_cast<uint32_t>(lo >> 32);
  uint32_t x2 = static_cast<uint32_t>(hi), x3 = static_cast<uint32_t>(hi >> 32);
  Philox10(x0, x1, x2, x3, k0, k1);
  out[0] = x0; out[1] = x1; out[2] = x2; out[3] = x3;
}

// Words [start, stop) of the plane at counter (c_lo, c_hi): word w is element w % 4 of block w / 4.
static void PhiloxWords(uint64_t c_lo, uint64_t c_hi, uint32_t k0, uint32_t k1, int64_t start,
                        int64_t stop, uint32_t* out) {
  int64_t w = start;
  uint32_t block[4];
  if (w % 4 != 0 && w < stop) {  // leading partial block
    PhiloxBlock(c_lo, c_hi, static_cast<uint64_t>(w / 4), k0, k1, block);
    for (; w % 4 != 0 && w < stop; ++w) out[w - start] = block[w % 4];
  }
  const int64_t full_end = stop - stop % 4;
  const int64_t b0 = w / 4, b1 = full_end > w ? full_end / 4 : b0;
  uint32_t* dst = out + (w - start);
  // The loop GCC vectorises: blocks are independent.
  for (int64_t b = b0; b < b1; ++b) {
    PhiloxBlock(c_lo, c_hi, static_cast<uint64_t>(b), k0, k1, dst + 4 * (b - b0));
  }
  w = b1 > b0 ? 4 * b1 : w;
  if (w < stop) {  // trailing partial block
    PhiloxBlock(c_lo, c_hi, static_cast<uint64_t>(w / 4), k0, k1, block);
    for (; w < stop; ++w) out[w - start] = block[w % 4];
  }
}

static inline float AsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t AsUint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// ln 2 = kLn2Hi + kLn2Lo, kLn2Hi with 9 significant bits (e kLn2Hi is exact for |e| < 2^15).
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;

// log(u) for a positive normal float32 u < 1.
static inline float Log(float u) {
  const uint32_t bits = AsUint(u);
  int32_t e = static_cast<int32_t>(bits >> 23) - 127;
  float m = AsFloat((bits & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  // 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ... + s^14/15)
  float p = 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  const float t = 2.0f * s;
  const float ef = static_cast<float>(e);
  return (ef * kLn2Lo + t * s2 * p) + t + ef * kLn2Hi;
}

// Pairs per shard unit of the kernels.
constexpr int64_t kBlock = 8192;

constexpr float kAngleStep = 3.74507028e-7f;  // pi 2^-23 (float32)

// z[i] = r cos theta, z[h + i] = r sin theta for pairs [start, stop) from the words hi, lo (read
// for the pairs with hi < 2^24 only) and angle.
// With kAdd, z[i] = x[i] + r cos theta and z[h + i] = x[h + i] + r sin theta (one float32
// addition, rounded as TensorFlow's AddV2 rounds it; x may be z).
template <bool kAdd>
static void TransformInto(const uint32_t* hi, const uint32_t* lo, const uint32_t* angle,
                          float scale, int64_t start, int64_t stop, int64_t h, const float* x,
                          float* z) {
  for (int64_t i = start; i < stop; ++i) {
    // u1 as the TF ops compute it: float(hi) 2^-32, or for hi < 2^24 (exact in float32)
    // (hi + (float(lo) + 0.5) 2^-32) 2^-32 in float32 arithmetic.
    // Both roundings are computed and one is selected (no branch: the loop is vectorised).
    const uint32_t w = hi[i];
    const float wf = static_cast<float>(w);
    const float low = (static_cast<float>(lo[i]) + 0.5f) * 2.3283064365386963e-10f;
    const float u_small = (wf + low) * 2.3283064365386963e-10f;
    const float u_big = wf * 2.3283064365386963e-10f;
    float u1 = w < (1u << 24) ? u_small : u_big;
    u1 = u1 < 0.99999994f ? u1 : 0.99999994f;  // 1 - 2^-24
    const float r = std::sqrt(Log(u1) * scale);
    // theta = (2k + 1) pi 2^-23 = q pi/2 + phi, phi = (2j + 1) pi 2^-23 in (0, pi/2)
    const uint32_t k = angle[i] >> 9;  // 23 bits
    const uint32_t q = k >> 21;        // quadrant
    const uint32_t j = k & 0x1FFFFFu;  // 21 bits
    const bool upper = j >= (1u << 20);  // phi > pi/4: phi = pi/2 - a
    const uint32_t jj = upper ? (0x1FFFFFu - j) : j;  // (2jj + 1) pi 2^-23 in (0, pi/4)
    const float a = static_cast<float>(2u * jj + 1u) * kAngleStep;
    const float a2 = a * a;
    float sp = -1.0f / 39916800.0f;  // sin a = a (1 - a^2/3! + ... - a^10/11!)
    sp = sp * a2 + 1.0f / 362880.0f;
    sp = sp * a2 - 1.0f / 5040.0f;
    sp = sp * a2 + 1.0f / 120.0f;
    sp = sp * a2 - 1.0f / 6.0f;
    const float sa = a + a * a2 * sp;
    float cp = 1.0f / 479001600.0f;  // cos a = 1 - a^2/2 + ... + a^12/12!
    cp = cp * a2 - 1.0f / 3628800.0f;
    cp = cp * a2 + 1.0f / 40320.0f;
    cp = cp * a2 - 1.0f / 720.0f;
    cp = cp * a2 + 1.0f / 24.0f;
    const float ca = (a2 * a2 * cp - 0.5f * a2) + 1.0f;
    // Selections and sign flips on the bits (branch-free, so the loop is vectorised):
    // phi > pi/4 swaps cos and sin; quadrant q rotates (c, s) by q quarter turns:
    // q = 1: (-s, c), q = 2: (-c, -s), q = 3: (s, -c).
    const uint32_t sa_b = AsUint(sa), ca_b = AsUint(ca);
    const uint32_t swap = 0u - ((upper ? 1u : 0u) ^ (q & 1u));  // all ones: swap
    const uint32_t c_b = ((sa_b & swap) | (ca_b & ~swap)) ^ (((q + 1u) & 2u) << 30);
    const uint32_t s_b = ((ca_b & swap) | (sa_b & ~swap)) ^ ((q & 2u) << 30);
    const float c = AsFloat(c_b), s = AsFloat(s_b);
    if (kAdd) {
      z[i] = x[i] + r * c;
      z[h + i] = x[h + i] + r * s;
    } else {
      z[i] = r * c;
      z[h + i] = r * s;
    }
  }
}

static void Transform(const uint32_t* hi, const uint32_t* lo, const uint32_t* angle, float scale,
                      int64_t start, int64_t stop, int64_t h, float* z) {
  TransformInto<false>(hi, lo, angle, scale, start, stop, h, nullptr, z);
}

// lo[i] = the next of `low` for each pair i < count with hi[i] < 2^24 (about 1 in 256), else 0.
static void PlaceLowWords(const uint32_t* hi, int64_t count, const uint32_t* low, uint32_t* lo) {
  std::memset(lo, 0, sizeof(uint32_t) * count);
  for (int64_t i = 0; i < count; ++i) {
    if (hi[i] < (1u << 24)) lo[i] = *low++;
  }
}

class GaussianNoiseOp : public OpKernel {
 public:
  explicit GaussianNoiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& key_t = ctx->input(0);
    const Tensor& counter_t = ctx->input(1);
    const Tensor& planes_t = ctx->input(2);
    const Tensor& pairs_t = ctx->input(3);
    const Tensor& scale_t = ctx->input(4);
    OP_REQUIRES(ctx, key_t.NumElements() == 1,
                tensorflow::errors::InvalidArgument("key must have 1 element"));
    OP_REQUIRES(ctx, counter_t.NumElements() == 2,
                tensorflow::errors::InvalidArgument("counter must have 2 elements"));
    OP_REQUIRES(ctx, planes_t.NumElements() == 3,
                tensorflow::errors::InvalidArgument("planes must have 3 elements"));
    const int64_t h = pairs_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, h >= 0 && h <= (int64_t{1} << 40),
                tensorflow::errors::InvalidArgument("num_pairs must be in [0, 2^40], got ", h));
    const uint64_t key = key_t.flat<uint64_t>()(0);
    const uint64_t c_lo = counter_t.flat<uint64_t>()(0), c_hi = counter_t.flat<uint64_t>()(1);
    const auto planes = planes_t.flat<uint64_t>();
    const float scale = scale_t.scalar<float>()();
    const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);

    Tensor* z_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2 * h}), &z_t));
    if (h == 0) return;
    float* z = z_t->flat<float>().data();
    // Scratch: the high words of every pair (the angle words are drawn where they are used).
    Tensor words_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT32, TensorShape({h}), &words_t));
    uint32_t* hi = words_t.flat<uint32_t>().data();
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t block = kBlock;
    const int64_t units = (h + block - 1) / block;
    // Pass 1: the high words (Philox), and per unit the count of hi < 2^24.
    std::vector<int64_t> counts(units + 1, 0);
    pool->ParallelFor(units, 10 * block * 10, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t s = u * block, e = std::min(h, s + block);
        PhiloxWords(c_lo, c_hi + planes(0), k0, k1, s, e, hi + s);
        int64_t c = 0;
        for (int64_t i = s; i < e; ++i) c += hi[i] < (1u << 24) ? 1 : 0;
        counts[u + 1] = c;
      }
    });
    for (int64_t u = 0; u < units; ++u) counts[u + 1] += counts[u];
    // The low words: the k-th pair with hi < 2^24 reads word k of the third plane.
    const int64_t n_low = counts[units];
    std::vector<uint32_t> low_words(static_cast<size_t>(n_low) + 1);
    if (n_low > 0) PhiloxWords(c_lo, c_hi + planes(2), k0, k1, 0, n_low, low_words.data());
    // Pass 2: the angle words (into a buffer that stays in cache) and the transform, with each
    // pair's low word placed beside it.
    pool->ParallelFor(units, 70 * block * 10, [&](int64_t u0, int64_t u1) {
      std::vector<uint32_t> lo(block), angle(block);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t s = u * block, e = std::min(h, s + block);
        PhiloxWords(c_lo, c_hi + planes(1), k0, k1, s, e, angle.data());
        PlaceLowWords(hi + s, e - s, low_words.data() + counts[u], lo.data());
        Transform(hi + s, lo.data(), angle.data(), scale, 0, e - s, h, z + s);
      }
    });
  }
};

// x + noise for a float32 tensor x of n elements (TfDpAddGaussianNoise), in one call: the normals of gaussian_noise(n)
// (noise.py) for a draw in chunks of `chunk` elements. Chunk j (m_j = min(chunk, n - j chunk)
// elements, h_j = ceil(m_j / 2) pairs) reads planes j, C + j and 2C + j (C chunks) at the
// counter, its normals laid out as TfDpGaussianNoise's, the last one dropped when m_j is odd;
// they are added to x's elements [j chunk, j chunk + m_j) in x's flat (row-major) order. The
// output reuses x's buffer when TensorFlow can forward it. All chunks' pairs are sharded over the
// intra-op threads together.
// Without kAdd (TfDpChunkedGaussianNoise), input 0 is the count n and the output the [n]
// normals themselves: the chunks written in place, no concatenation.
// The [n] normals (kAdd: added to x) of a chunked draw at (key, c_lo, c_hi), as described above;
// hi is scratch for the pairs' high words (ceil over chunks of the pairs, see `pairs`), and
// shard(units, cost per unit, fn) runs fn(u0, u1) over ranges covering [0, units).
template <bool kAdd, typename Shard>
static void ChunkedNoise(int64_t n, uint64_t key, uint64_t c_lo, uint64_t c_hi, int64_t chunk,
                         float scale, const float* x, float* y, uint32_t* hi, Shard shard) {
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t chunk_pairs = chunk / 2;
  const int64_t last_m = n - (chunks - 1) * chunk;
  const int64_t pairs = (chunks - 1) * chunk_pairs + (last_m + 1) / 2;
  // units of kBlock pairs; chunk_pairs is a multiple of kBlock, so no unit spans two chunks
  const int64_t units = (pairs + kBlock - 1) / kBlock;
  const int64_t units_per_chunk = chunk_pairs / kBlock;
  auto chunk_pairs_of = [&](int64_t j) {
    return j + 1 < chunks ? chunk_pairs : (last_m + 1) / 2;
  };
  std::vector<int64_t> counts(units + 1, 0);
  shard(units, 10 * kBlock * 10, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t j = u / units_per_chunk, base = j * chunk_pairs;
      const int64_t s = u * kBlock - base;
      const int64_t e = std::min(chunk_pairs_of(j), s + kBlock);
      PhiloxWords(c_lo, c_hi + static_cast<uint64_t>(j), k0, k1, s, e, hi + base + s);
      int64_t c = 0;
      for (int64_t i = base + s; i < base + e; ++i) c += hi[i] < (1u << 24) ? 1 : 0;
      counts[u + 1] = c;
    }
  });
  // Ranks within each chunk: the k-th pair of chunk j with hi < 2^24 reads word k of plane 2C + j.
  std::vector<int64_t> rank0(units, 0);
  std::vector<int64_t> low_start(chunks + 1, 0);
  for (int64_t u = 0; u < units; ++u) {
    const bool first = u % units_per_chunk == 0;
    rank0[u] = first ? 0 : rank0[u - 1] + counts[u];
    if (u + 1 == units || (u + 1) % units_per_chunk == 0) {
      const int64_t j = u / units_per_chunk;
      low_start[j + 1] = low_start[j] + rank0[u] + counts[u + 1];
    }
  }
  std::vector<uint32_t> low_words(static_cast<size_t>(low_start[chunks]) + 1);
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t n_low = low_start[j + 1] - low_start[j];
    if (n_low > 0) {
      PhiloxWords(c_lo, c_hi + static_cast<uint64_t>(2 * chunks + j), k0, k1, 0, n_low,
                  low_words.data() + low_start[j]);
    }
  }
  shard(units, 70 * kBlock * 10, [&](int64_t u0, int64_t u1) {
    std::vector<uint32_t> lo(kBlock), angle_words(kBlock);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t j = u / units_per_chunk, base = j * chunk_pairs;
      const int64_t h = chunk_pairs_of(j);
      const int64_t m = j + 1 < chunks ? chunk : last_m;
      const int64_t s = u * kBlock - base, e = std::min(h, s + kBlock);
      PhiloxWords(c_lo, c_hi + static_cast<uint64_t>(chunks + j), k0, k1, s, e,
                  angle_words.data());
      const uint32_t* angle = angle_words.data();  // pair i's angle word: angle[i - s]
      PlaceLowWords(hi + base + s, e - s, low_words.data() + low_start[j] + rank0[u],
                    lo.data());
      const float* xc = kAdd ? x + j * chunk : nullptr;
      float* yc = y + j * chunk;
      // pairs whose second normal is kept (h + i < m); an odd chunk drops the last pair's
      const int64_t full = std::min(e, m - h);
      if (full > s) {
        TransformInto<kAdd>(hi + base + s, lo.data(), angle, scale, 0, full - s, h,
                            kAdd ? xc + s : nullptr, yc + s);
      }
      for (int64_t i = std::max(s, full); i < e; ++i) {
        float z[2];
        TransformInto<false>(hi + base + i, lo.data() + (i - s), angle + (i - s), scale, 0,
                             1, 1, nullptr, z);
        yc[i] = kAdd ? xc[i] + z[0] : z[0];
      }
    }
  });
}

// The number of pairs (high words) of a chunked draw of n normals in chunks of `chunk`.
static int64_t ChunkedPairs(int64_t n, int64_t chunk) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t last_m = n - (chunks - 1) * chunk;
  return (chunks - 1) * (chunk / 2) + (last_m + 1) / 2;
}

template <bool kAdd>
class ChunkedGaussianNoiseOp : public OpKernel {
 public:
  explicit ChunkedGaussianNoiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& key_t = ctx->input(1);
    const Tensor& counter_t = ctx->input(2);
    const Tensor& chunk_t = ctx->input(3);
    const Tensor& scale_t = ctx->input(4);
    OP_REQUIRES(ctx, key_t.NumElements() == 1,
                tensorflow::errors::InvalidArgument("key must have 1 element"));
    OP_REQUIRES(ctx, counter_t.NumElements() == 2,
                tensorflow::errors::InvalidArgument("counter must have 2 elements"));
    const int64_t chunk = chunk_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, chunk > 0 && chunk % (2 * kBlock) == 0,
                tensorflow::errors::InvalidArgument("chunk must be a positive multiple of ",
                                                    2 * kBlock, ", got ", chunk));
    int64_t n = x_t.NumElements();
    if (!kAdd) {
      OP_REQUIRES(ctx, x_t.NumElements() == 1,
                  tensorflow::errors::InvalidArgument("n must be a scalar"));
      n = x_t.flat<int64_t>()(0);
      OP_REQUIRES(ctx, n >= 0 && n <= (int64_t{1} << 41),
                  tensorflow::errors::InvalidArgument("n must be in [0, 2^41], got ", n));
    }
    const uint64_t key = key_t.flat<uint64_t>()(0);
    const uint64_t c_lo = counter_t.flat<uint64_t>()(0), c_hi = counter_t.flat<uint64_t>()(1);
    const float scale = scale_t.scalar<float>()();

    Tensor* y_t = nullptr;
    if (kAdd) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x_t.shape(), &y_t));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y_t));
    }
    if (n == 0) return;
    const float* x = kAdd ? x_t.flat<float>().data() : nullptr;
    float* y = y_t->flat<float>().data();
    const int64_t pairs = ChunkedPairs(n, chunk);
    Tensor words_t;  // the high words (the angle words are drawn where they are used)
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_UINT32, TensorShape({pairs}),
                                           &words_t));
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    ChunkedNoise<kAdd>(n, key, c_lo, c_hi, chunk, scale, x, y, words_t.flat<uint32_t>().data(),
                       [pool](int64_t units, int64_t cost,
                              const std::function<void(int64_t, int64_t)>& fn) {
                         pool->ParallelFor(units, cost, fn);
                       });
  }
};

#ifdef TF_DP_XLA_CUSTOM_CALL


// XLA's CPU custom-call target "TfDpChunkedGaussianNoise" (API_VERSION_STATUS_RETURNING_UNIFIED,
// as tf2xla's XlaCustomCallV2 emits it): TfDpChunkedGaussianNoise's normals inside a function
// compiled with XLA, the same values bit for bit. in = {key u64[1], counter u64[2], scale f32[]},
// out = f32[n]; the opaque string is "N CHUNK" (decimal), written and checked by
// tf_dp.dp_query.native.chunked_gaussian_noise_xla. One thread: the draw depends on no other
// value of the step, so XLA runs it beside the step's other work (with a thread per CPU here it
// competed with them, and the MLP's step was slower than with the noise drawn between steps).
static void TfDpChunkedGaussianNoiseXla(void* out, const void** in, const char* opaque,
                                        size_t opaque_len, void* /*status*/) {
  std::istringstream parse(std::string(opaque, opaque_len));
  int64_t n = 0, chunk = 0;
  parse >> n >> chunk;
  if (n <= 0) return;
  const uint64_t key = static_cast<const uint64_t*>(in[0])[0];
  const uint64_t* counter = static_cast<const uint64_t*>(in[1]);
  const float scale = static_cast<const float*>(in[2])[0];
  std::vector<uint32_t> hi(static_cast<size_t>(ChunkedPairs(n, chunk)));
  ChunkedNoise<false>(n, key, counter[0], counter[1], chunk, scale, nullptr,
                      static_cast<float*>(out), hi.data(),
                      [](int64_t units, int64_t /*cost*/,
                         const std::function<void(int64_t, int64_t)>& fn) { fn(0, units); });
}

static const bool kNoiseXlaTargetRegistered = [] {
  xla::CustomCallTargetRegistry::Global()->Register(
      "TfDpChunkedGaussianNoise", reinterpret_cast<void*>(&TfDpChunkedGaussianNoiseXla), "Host");
  return true;
}();
#endif  // TF_DP_XLA_CUSTOM_CALL

// The transform alone on given words (for tests: extreme words, every angle cell).
class BoxMullerOp : public OpKernel {
 public:
  explicit BoxMullerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& hi_t = ctx->input(0);
    const Tensor& lo_t = ctx->input(1);
    const Tensor& angle_t = ctx->input(2);
    const int64_t h = hi_t.NumElements();
    OP_REQUIRES(ctx, lo_t.NumElements() == h && angle_t.NumElements() == h,
                tensorflow::errors::InvalidArgument("hi, lo and angle must have equal sizes"));
    const float scale = ctx->input(3).scalar<float>()();
    Tensor* z_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2 * h}), &z_t));
    Transform(hi_t.flat<uint32_t>().data(), lo_t.flat<uint32_t>().data(),
              angle_t.flat<uint32_t>().data(), scale, 0, h, h, z_t->flat<float>().data());
  }
};

}  // namespace

REGISTER_OP("TfDpGaussianNoise")
    .Input("key: uint64")
    .Input("counter: uint64")
    .Input("planes: uint64")
    .Input("num_pairs: int64")
    .Input("scale: float")
    .Output("z: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::DimensionHandle pairs;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(3, &pairs));
      tensorflow::shape_inference::DimensionHandle n;
      TF_RETURN_IF_ERROR(c->Multiply(pairs, 2, &n));
      c->set_output(0, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc("tf_dp: 2 num_pairs float32 normals (scale = -2 stddev^2) by the lazy Box-Muller "
         "transform on Philox words; see tf_dp/dp_query/native.");

REGISTER_KERNEL_BUILDER(Name("TfDpGaussianNoise").Device(DEVICE_CPU), GaussianNoiseOp);

REGISTER_OP("TfDpAddGaussianNoise")
    .Input("x: float")
    .Input("key: uint64")
    .Input("counter: uint64")
    .Input("chunk: int64")
    .Input("scale: float")
    .Output("y: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("tf_dp: x + the float32 normals of a chunked lazy Box-Muller draw of x's size "
         "(scale = -2 stddev^2); see tf_dp/dp_query/native.");

REGISTER_KERNEL_BUILDER(Name("TfDpAddGaussianNoise").Device(DEVICE_CPU),
                        ChunkedGaussianNoiseOp<true>);

REGISTER_OP("TfDpChunkedGaussianNoise")
    .Input("n: int64")
    .Input("key: uint64")
    .Input("counter: uint64")
    .Input("chunk: int64")
    .Input("scale: float")
    .Output("z: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::DimensionHandle n;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(0, &n));
      c->set_output(0, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc("tf_dp: the n float32 normals of a chunked lazy Box-Muller draw (scale = -2 "
         "stddev^2), every chunk in one output; see tf_dp/dp_query/native.");

REGISTER_KERNEL_BUILDER(Name("TfDpChunkedGaussianNoise").Device(DEVICE_CPU).HostMemory("n"),
                        ChunkedGaussianNoiseOp<false>);

REGISTER_OP("TfDpBoxMuller")
    .Input("hi: uint32")
    .Input("lo: uint32")
    .Input("angle: uint32")
    .Input("scale: float")
    .Output("z: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("tf_dp: the native Box-Muller transform on given words (tests).");

REGISTER_KERNEL_BUILDER(Name("TfDpBoxMuller").Device(DEVICE_CPU), BoxMullerOp);

}  // namespace tf_dp
