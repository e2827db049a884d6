// tf_dp's native patch extraction for the ghost convolution rule (tf_dp/gradients/ghost/conv.py).
//
// TfDpExtractPatches: x [B, H, W, C] (channels last) -> patches [B, OH, OW, KH * KW * C] in
// (kh, kw, c) order, zeros where a patch reaches into the padding: exactly what
// tf.image.extract_patches returns (sizes [1, KH, KW, 1], strides [1, SH, SW, 1], rates
// [1, DH, DW, 1], padding "SAME" or "VALID"; the tests compare them bit for bit). A copy, no
// arithmetic, so it is exact for every dtype; one pass over the output, sharded over TensorFlow's
// intra-op threads by output rows. TensorFlow's own ExtractImagePatches kernel is about 5x slower
// than a convolution with a one-hot kernel on the reference CNN's first layer (1 channel, 8x8),
// and that convolution spends K = KH KW C multiply-adds per patch value; this kernel spends none.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"

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

class ExtractPatchesOp : public OpKernel {
 public:
  explicit ExtractPatchesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
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

 private:
  std::vector<int32_t> ksizes_, strides_, rates_;
  bool same_ = false;
};

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

}  // namespace tf_dp
