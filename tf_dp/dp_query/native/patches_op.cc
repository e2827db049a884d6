// tf_dp's native kernels for the ghost convolution rule (tf_dp/gradients/ghost/conv.py): patch
// extraction and per-example kernel gradients, outside XLA; the per-example kernel gradients also
// as an XLA CPU custom-call target (built with TF_DP_XLA_CUSTOM_CALL, see the end of the file).
//
// TfDpExtractPatches: x [B, H, W, C] (channels last) -> patches [B, OH, OW, KH * KW * C] in
// (kh, kw, c) order, zeros where a patch reaches into the padding: exactly what
// tf.image.extract_patches returns (sizes [1, KH, KW, 1], strides [1, SH, SW, 1], rates
// [1, DH, DW, 1], padding "SAME" or "VALID"; the tests compare them bit for bit). A copy, no
// arithmetic, so it is exact for every dtype; one pass over the output, sharded over TensorFlow's
// intra-op threads by output rows. TensorFlow's own ExtractImagePatches kernel is about 5x slower
// than a convolution with a one-hot kernel on the reference CNN's first layer (1 channel, 8x8),
// and that convolution spends K = KH KW C multiply-adds per patch value; this kernel spends none.
//
// TfDpConvKernelGrads: x [B, H, W, C], g [B, OH, OW, F] (channels last, float32) ->
// grads [B, KH * KW * C, F] with
//   grads[n, (i KW + j) C + c, f] = sum_{p, q} x[n, p SH + i DH - PT, q SW + j DW - PL, c] g[n, p, q, f]
// (0 where the patch reaches into the padding), the gradient of example n's loss with respect to
// a [KH, KW, C, F] kernel of the convolution (strides SH, SW; dilations DH, DW; "SAME" or
// "VALID" padding, as TensorFlow's convolutions define them) whose output gradient is g[n]: what
// the rule otherwise computes as the unfolded patches [B, OH OW, K] (TfDpExtractPatches) times
// g [B, OH OW, F], per example. Here no patch is written to memory: each example's image is
// copied into a zero-bordered buffer (the border is zeroed once per thread), and the patch values
// are read from it where the product needs them, 8 rows of the output at a time held in vector
// registers (a [8, 16 or 32] block), so the work is one pass over g per block and the memory
// traffic is the output's. On the reference CNN's first convolution (28x28x1, 8x8 stride 2, 16
// filters, B = 256) that is several times less time than the patches and a batched matrix
// product (bench/README.md). Float32 sums in a fixed order (over p, then q) with no fused
// multiply-add (the library is built with -ffp-contract=off), so the values do not depend on the
// CPU; the tests compare them with a float64 computation. Sharded over TensorFlow's intra-op
// threads by example.

#include <algorithm>
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
#include <sched.h>

#include <thread>

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

// Output size and leading padding of one spatial axis, as TensorFlow's convolutions define them.
static void Axis(int64_t size, int64_t k, int64_t s, int64_t d, bool same, int64_t* out,
                 int64_t* pad_before) {
  const int64_t span = (k - 1) * d + 1;
  if (same) {
    *out = (size + s - 1) / s;
    const int64_t total = std::max<int64_t>((*out - 1) * s + span - size, 0);
    *pad_before = total / 2;
  } else {
    *out = size >= span ? (size - span) / s + 1 : 0;
    *pad_before = 0;
  }
}

struct Geometry {
  int64_t b, h, w, c, kh, kw, sh, sw, dh, dw, oh, ow, pt, pl;
};

// patches[n, p, q, (i, j, c)] = x[n, p sh + i dh - pt, q sw + j dw - pl, c], 0 outside x. One
// unit of work: an output row (ow patches) of one example. With dw = 1 the in-range columns of a
// kernel row are contiguous in x and in the patch, and are copied as one run.
template <typename U>
static void Copy(const Geometry& g, const void* x_data, void* y_data,
                 tensorflow::thread::ThreadPool* pool) {
  const U* x = static_cast<const U*>(x_data);
  U* y = static_cast<U*>(y_data);
  const int64_t depth = g.kh * g.kw * g.c;
  pool->ParallelFor(g.b * g.oh, g.ow * depth * static_cast<int64_t>(sizeof(U)),
                    [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r / g.oh, p = r % g.oh;
      U* out = y + r * g.ow * depth;
      const U* image = x + n * g.h * g.w * g.c;
      for (int64_t q = 0; q < g.ow; ++q) {
        const int64_t col0 = q * g.sw - g.pl;
        // kernel columns j with 0 <= col0 + j dw < w
        int64_t jlo = 0, jhi = g.kw;
        while (jlo < g.kw && col0 + jlo * g.dw < 0) ++jlo;
        while (jhi > jlo && col0 + (jhi - 1) * g.dw >= g.w) --jhi;
        for (int64_t i = 0; i < g.kh; ++i) {
          const int64_t row = p * g.sh + i * g.dh - g.pt;
          if (row < 0 || row >= g.h || jhi <= jlo) {
            for (int64_t e = 0; e < g.kw * g.c; ++e) out[e] = U(0);
            out += g.kw * g.c;
            continue;
          }
          for (int64_t e = 0; e < jlo * g.c; ++e) out[e] = U(0);
          const U* src = image + (row * g.w + col0 + jlo * g.dw) * g.c;
          U* dst = out + jlo * g.c;
          if (g.dw == 1) {
            const int64_t run = (jhi - jlo) * g.c;
            for (int64_t e = 0; e < run; ++e) dst[e] = src[e];
          } else {
            for (int64_t j = jlo; j < jhi; ++j) {
              for (int64_t e = 0; e < g.c; ++e) dst[e] = src[e];
              src += g.dw * g.c;
              dst += g.c;
            }
          }
          for (int64_t e = jhi * g.c; e < g.kw * g.c; ++e) out[e] = U(0);
          out += g.kw * g.c;
        }
      }
    }
  });
}

// The attributes both kernels take: 2-D window sizes, strides, dilation rates (all >= 1) and
// "SAME" or "VALID" padding.
class WindowOp : public OpKernel {
 public:
  explicit WindowOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ksizes", &ksizes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("strides", &strides_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rates", &rates_));
    std::string padding;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding", &padding));
    OP_REQUIRES(ctx, ksizes_.size() == 2 && strides_.size() == 2 && rates_.size() == 2,
                tensorflow::errors::InvalidArgument("ksizes, strides and rates need 2 values"));
    for (int i = 0; i < 2; ++i) {
      OP_REQUIRES(ctx, ksizes_[i] >= 1 && strides_[i] >= 1 && rates_[i] >= 1,
                  tensorflow::errors::InvalidArgument(
                      "ksizes, strides and rates must be >= 1"));
    }
    OP_REQUIRES(ctx, padding == "SAME" || padding == "VALID",
                tensorflow::errors::InvalidArgument("padding must be SAME or VALID, got ",
                                                    padding));
    same_ = padding == "SAME";
  }

 protected:
  std::vector<int32_t> ksizes_, strides_, rates_;
  bool same_ = false;
};

class ExtractPatchesOp : public WindowOp {
 public:
  explicit ExtractPatchesOp(OpKernelConstruction* ctx) : WindowOp(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    OP_REQUIRES(ctx, x_t.dims() == 4,
                tensorflow::errors::InvalidArgument("x must be [B, H, W, C], got rank ",
                                                    x_t.dims()));
    const int64_t b = x_t.dim_size(0), h = x_t.dim_size(1), w = x_t.dim_size(2),
                  c = x_t.dim_size(3);
    const int64_t kh = ksizes_[0], kw = ksizes_[1], sh = strides_[0], sw = strides_[1],
                  dh = rates_[0], dw = rates_[1];
    int64_t oh, ow, pt, pl;
    Axis(h, kh, sh, dh, same_, &oh, &pt);
    Axis(w, kw, sw, dw, same_, &ow, &pl);
    const int64_t depth = kh * kw * c;
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({b, oh, ow, depth}), &y_t));
    if (y_t->NumElements() == 0) return;
    const int64_t bytes = tensorflow::DataTypeSize(x_t.dtype());
    const Geometry g{b, h, w, c, kh, kw, sh, sw, dh, dw, oh, ow, pt, pl};
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    // the copy moves raw elements: an unsigned integer of the element's width
    if (bytes == 2) {
      Copy<uint16_t>(g, x_t.data(), y_t->data(), pool);
    } else if (bytes == 4) {
      Copy<uint32_t>(g, x_t.data(), y_t->data(), pool);
    } else {
      Copy<uint64_t>(g, x_t.data(), y_t->data(), pool);
    }
  }
};

// 16 float32 lanes (one AVX-512 register; two or four narrower ones elsewhere).
typedef float V16 __attribute__((vector_size(64)));

struct ConvGeometry {
  int64_t h, w, c, kh, kw, sh, sw, dh, dw, oh, ow, pt, pl, f;
  int64_t hp, wp;  // the zero-bordered image the patches read: rows -pt .. hp - pt - 1, etc.
};

// out[kk, f0 .. f0 + fb) = sum_t xp[base[t] + off[kk]] g[t, f0 .. f0 + fb) for KB rows kk,
// the block's KB x NV accumulators in registers.
template <int KB, int NV>
static inline void Block(const float* xp, const int64_t* base, const int64_t* off,
                         const float* g, int64_t t_count, int64_t f, int64_t f0, int64_t fb,
                         float* out) {
  V16 acc[KB][NV];
  for (int kk = 0; kk < KB; ++kk) {
    for (int v = 0; v < NV; ++v) acc[kk][v] = V16{};
  }
  int64_t o[KB];
  for (int kk = 0; kk < KB; ++kk) o[kk] = off[kk];
  const bool full = fb == 16 * NV;
  for (int64_t t = 0; t < t_count; ++t) {
    V16 gv[NV];
    const float* gt = g + t * f + f0;
    if (full) {
      std::memcpy(gv, gt, sizeof(gv));
    } else {
      float tmp[16 * NV] = {};
      for (int64_t e = 0; e < fb; ++e) tmp[e] = gt[e];
      std::memcpy(gv, tmp, sizeof(gv));
    }
    const float* xt = xp + base[t];
    for (int kk = 0; kk < KB; ++kk) {
      const float a = xt[o[kk]];
      for (int v = 0; v < NV; ++v) acc[kk][v] += a * gv[v];
    }
  }
  for (int kk = 0; kk < KB; ++kk) {
    if (full) {
      std::memcpy(out + kk * f + f0, acc[kk], sizeof(acc[kk]));
      continue;
    }
    float tmp[16 * NV];
    std::memcpy(tmp, acc[kk], sizeof(tmp));
    for (int64_t e = 0; e < fb; ++e) out[kk * f + f0 + e] = tmp[e];
  }
}

// One example: out [K, F] from its bordered image xp and its output gradient g [OH OW, F].
template <int KB, int NV>
static void ExampleGrads(const ConvGeometry& s, const float* xp, const int64_t* base,
                         const int64_t* off, const float* g, float* out) {
  const int64_t t_count = s.oh * s.ow, k_count = s.kh * s.kw * s.c;
  for (int64_t f0 = 0; f0 < s.f; f0 += 16 * NV) {
    const int64_t fb = std::min<int64_t>(16 * NV, s.f - f0);
    int64_t k0 = 0;
    for (; k0 + KB <= k_count; k0 += KB) {
      Block<KB, NV>(xp, base, off + k0, g, t_count, s.f, f0, fb, out + k0 * s.f);
    }
    for (; k0 < k_count; ++k0) {
      Block<1, NV>(xp, base, off + k0, g, t_count, s.f, f0, fb, out + k0 * s.f);
    }
  }
}

// The image [h, w, c] into the interior of xp [hp, wp, c], whose border is already zero.
static void CopyInterior(const ConvGeometry& s, const float* image, float* xp) {
  const int64_t rows = std::min(s.h, s.hp - s.pt), cols = std::min(s.w, s.wp - s.pl);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = image + r * s.w * s.c;
    float* dst = xp + ((r + s.pt) * s.wp + s.pl) * s.c;
    for (int64_t e = 0; e < cols * s.c; ++e) dst[e] = src[e];
  }
}

// y [b, K, F] for the geometry s (sizes, strides, dilations, output sizes and leading padding
// set; t = OH OW > 0): shard(b, cost per example, fn) runs fn(n0, n1) over ranges of examples
// that together cover [0, b).
template <typename Shard>
static void KernelGrads(ConvGeometry s, int64_t b, const float* x, const float* g, float* y,
                        Shard shard) {
  const int64_t k_count = s.kh * s.kw * s.c, t_count = s.oh * s.ow;
  s.hp = (s.oh - 1) * s.sh + (s.kh - 1) * s.dh + 1;
  s.wp = (s.ow - 1) * s.sw + (s.kw - 1) * s.dw + 1;
  std::vector<int64_t> base(t_count), off(k_count);
  for (int64_t p = 0; p < s.oh; ++p) {
    for (int64_t q = 0; q < s.ow; ++q) base[p * s.ow + q] = (p * s.sh * s.wp + q * s.sw) * s.c;
  }
  for (int64_t i = 0; i < s.kh; ++i) {
    for (int64_t j = 0; j < s.kw; ++j) {
      for (int64_t c = 0; c < s.c; ++c) {
        off[(i * s.kw + j) * s.c + c] = (i * s.dh * s.wp + j * s.dw) * s.c + c;
      }
    }
  }
  const int64_t cost = 2 * t_count * k_count * s.f + s.hp * s.wp * s.c;
  shard(b, cost, [&](int64_t n0, int64_t n1) {
    std::vector<float> xp(s.hp * s.wp * s.c, 0.0f);  // the border stays zero
    for (int64_t n = n0; n < n1; ++n) {
      CopyInterior(s, x + n * s.h * s.w * s.c, xp.data());
      const float* gn = g + n * t_count * s.f;
      float* out = y + n * k_count * s.f;
      if (s.f % 32 == 0) {
        ExampleGrads<8, 2>(s, xp.data(), base.data(), off.data(), gn, out);
      } else {
        ExampleGrads<8, 1>(s, xp.data(), base.data(), off.data(), gn, out);
      }
    }
  });
}

class ConvKernelGradsOp : public WindowOp {
 public:
  explicit ConvKernelGradsOp(OpKernelConstruction* ctx) : WindowOp(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_t = ctx->input(0);
    const Tensor& g_t = ctx->input(1);
    OP_REQUIRES(ctx, x_t.dims() == 4 && g_t.dims() == 4,
                tensorflow::errors::InvalidArgument("x and g must be [B, H, W, C] and "
                                                    "[B, OH, OW, F], got ranks ",
                                                    x_t.dims(), " and ", g_t.dims()));
    ConvGeometry s{};
    const int64_t b = x_t.dim_size(0);
    s.h = x_t.dim_size(1);
    s.w = x_t.dim_size(2);
    s.c = x_t.dim_size(3);
    s.kh = ksizes_[0], s.kw = ksizes_[1], s.sh = strides_[0], s.sw = strides_[1];
    s.dh = rates_[0], s.dw = rates_[1];
    Axis(s.h, s.kh, s.sh, s.dh, same_, &s.oh, &s.pt);
    Axis(s.w, s.kw, s.sw, s.dw, same_, &s.ow, &s.pl);
    s.f = g_t.dim_size(3);
    OP_REQUIRES(ctx, g_t.dim_size(0) == b && g_t.dim_size(1) == s.oh && g_t.dim_size(2) == s.ow,
                tensorflow::errors::InvalidArgument(
                    "g must be [", b, ", ", s.oh, ", ", s.ow, ", F] for x of shape ",
                    x_t.shape().DebugString(), " and this convolution, got ",
                    g_t.shape().DebugString()));
    const int64_t k_count = s.kh * s.kw * s.c;
    Tensor* y_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({b, k_count, s.f}), &y_t));
    if (y_t->NumElements() == 0) return;
    float* y = y_t->flat<float>().data();
    if (s.oh * s.ow == 0) {
      std::fill(y, y + y_t->NumElements(), 0.0f);
      return;
    }
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    KernelGrads(s, b, x_t.flat<float>().data(), g_t.flat<float>().data(), y,
                [pool](int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
                  pool->ParallelFor(n, cost, fn);
                });
  }
};

#ifdef TF_DP_XLA_CUSTOM_CALL

// The CPUs this process may run on (its affinity mask), at least 1.
static int64_t UsableCpus() {
  static const int64_t count = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
      return static_cast<int64_t>(CPU_COUNT(&set));
    }
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return count;
}

// Runs fn(n0, n1) over [0, n) split into one contiguous range per usable CPU (at most n): this
// thread and std::threads started for the call (XLA's legacy custom-call API gives no pool).
static void ThreadShard(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t shards = std::max<int64_t>(1, std::min(UsableCpus(), n));
  std::vector<std::thread> threads;
  for (int64_t i = 1; i < shards; ++i) {
    threads.emplace_back(fn, n * i / shards, n * (i + 1) / shards);
  }
  fn(0, n / shards);
  for (auto& t : threads) t.join();
}

// XLA's CPU custom-call target "TfDpConvKernelGrads" (API_VERSION_STATUS_RETURNING_UNIFIED, as
// tf2xla's XlaCustomCallV2 emits it): the same computation as the op, for the ghost rule under
// XLA, where TensorFlow kernels cannot run. in = {x [B, H, W, C], g [B, OH, OW, F]} (float32,
// XLA's default row-major layout), out = [B, K, F]; the opaque string is "B H W C KH KW SH SW
// DH DW SAME F" (decimal integers; SAME 1 or 0), written and checked by
// tf_dp.dp_query.native.conv_kernel_grads_xla, which also checks g's shape before emitting the
// call. The legacy API has no thread pool: the examples are split over one thread per usable CPU
// (this one and std::threads started for the call).
static void TfDpConvKernelGradsXla(void* out, const void** in, const char* opaque,
                                       size_t opaque_len, void* /*status*/) {
  std::string config(opaque, opaque_len);
  int64_t v[12];
  std::istringstream parse(config);
  for (int64_t& e : v) parse >> e;
  ConvGeometry s{};
  const int64_t b = v[0];
  s.h = v[1], s.w = v[2], s.c = v[3], s.kh = v[4], s.kw = v[5], s.sh = v[6], s.sw = v[7];
  s.dh = v[8], s.dw = v[9];
  const bool same = v[10] != 0;
  s.f = v[11];
  Axis(s.h, s.kh, s.sh, s.dh, same, &s.oh, &s.pt);
  Axis(s.w, s.kw, s.sw, s.dw, same, &s.ow, &s.pl);
  float* y = static_cast<float*>(out);
  const int64_t size = b * s.kh * s.kw * s.c * s.f;
  if (size == 0) return;
  if (s.oh * s.ow == 0) {
    std::fill(y, y + size, 0.0f);
    return;
  }
  KernelGrads(s, b, static_cast<const float*>(in[0]), static_cast<const float*>(in[1]), y,
              [](int64_t n, int64_t /*cost*/, const std::function<void(int64_t, int64_t)>& fn) {
                ThreadShard(n, fn);
              });
}

static const bool kXlaTargetRegistered = [] {
  xla::CustomCallTargetRegistry::Global()->Register(
      "TfDpConvKernelGrads", reinterpret_cast<void*>(&TfDpConvKernelGradsXla), "Host");
  return true;
}();
#endif  // TF_DP_XLA_CUSTOM_CALL

}  // namespace

REGISTER_OP("TfDpExtractPatches")
    .Input("x: T")
    .Output("patches: T")
    .Attr("T: {float, double, half, bfloat16}")
    .Attr("ksizes: list(int)")
    .Attr("strides: list(int)")
    .Attr("rates: list(int)")
    .Attr("padding: string")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      // static sizes are what the rule passes; the kernel computes the exact shape
      tensorflow::shape_inference::ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &x));
      c->set_output(0, c->UnknownShapeOfRank(4));
      return absl::OkStatus();
    })
    .Doc("tf_dp: tf.image.extract_patches for [B, H, W, C] inputs as one copy pass; see "
         "tf_dp/dp_query/native.");

#define TF_DP_REGISTER_PATCHES(T)                                                     \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("TfDpExtractPatches").Device(DEVICE_CPU).TypeConstraint<T>("T"),           \
      ExtractPatchesOp);
TF_DP_REGISTER_PATCHES(float);
TF_DP_REGISTER_PATCHES(double);
TF_DP_REGISTER_PATCHES(Eigen::half);
TF_DP_REGISTER_PATCHES(Eigen::bfloat16);
#undef TF_DP_REGISTER_PATCHES

REGISTER_OP("TfDpConvKernelGrads")
    .Input("x: float")
    .Input("g: float")
    .Output("grads: float")
    .Attr("ksizes: list(int)")
    .Attr("strides: list(int)")
    .Attr("rates: list(int)")
    .Attr("padding: string")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      // static sizes are what the rule passes (the wrapper sets them); the kernel checks them
      tensorflow::shape_inference::ShapeHandle x, g;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &g));
      c->set_output(0, c->UnknownShapeOfRank(3));
      return absl::OkStatus();
    })
    .Doc("tf_dp: per-example gradients [B, KH KW C, F] of a 2-D convolution's kernel from its "
         "input and output gradient; see tf_dp/dp_query/native.");

REGISTER_KERNEL_BUILDER(Name("TfDpConvKernelGrads").Device(DEVICE_CPU), ConvKernelGradsOp);

}  // namespace tf_dp
