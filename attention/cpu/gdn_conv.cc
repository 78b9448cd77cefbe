// Short causal depthwise convolution with an initial conv state (the W-1 inputs before the segment) and optional
// SiLU, forward and backward (attention/gdn.h). The layout [B, S, C] keeps channels contiguous, so the inner loops
// run over a block of channels; OpenMP over (batch, channel block) in the forward and over channel blocks in the
// backward, whose weight gradient sums over (b, t) in a fixed order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/cpu/gdn_cpu.h"
#include "attention/cpu/scratch.h"

namespace seqpar::attn::cpu {
namespace {

constexpr std::int64_t kChannelBlock = 64;
using ConvDims = ShortConvDims;

// Compute type: double for fp64 storage, float otherwise.
template <typename S>
using Acc = std::conditional_t<std::is_same_v<S, double>, double, float>;

template <typename S>
Acc<S> ld(S x) {
  return static_cast<Acc<S>>(to_float(x));
}

template <typename S>
S st(Acc<S> x) {
  if constexpr (std::is_same_v<S, double>) {
    return x;
  } else {
    return S(static_cast<float>(x));
  }
}

// xin(b, t, c) for t in [-(W-1), S): the initial conv state for negative t (zero when absent), x otherwise.
template <typename S>
struct InputRows {
  const S* x;
  const S* xs;  // may be null
  std::int64_t S_, C, W;
  const S* row(std::int64_t b, std::int64_t t) const {
    if (t >= 0) return x + (b * S_ + t) * C;
    if (xs == nullptr) return nullptr;
    return xs + (b * (W - 1) + (t + W - 1)) * C;
  }
};

template <typename T>
T sigmoid(T y) {
  return T(1) / (T(1) + std::exp(-y));
}

template <typename S>
void conv_forward_impl(const ShortConvArgs& a, const ConvDims& d, const TensorView& out,
                       const TensorView& final_state) {
  using T = Acc<S>;
  const S* x = a.x.data_as<S>();
  const S* wt = a.weight.data_as<S>();
  const S* xs = a.initial_conv_state.empty() ? nullptr : a.initial_conv_state.data_as<S>();
  S* o = out.data_as<S>();
  const InputRows<S> in{x, xs, d.S, d.C, d.W};
  const std::int64_t nblk = (d.C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static)
  for (std::int64_t job = 0; job < d.B * nblk; ++job) {
    const std::int64_t b = job / nblk, c0 = (job % nblk) * kChannelBlock, c1 = std::min(d.C, c0 + kChannelBlock);
    T y[kChannelBlock];
    for (std::int64_t t = 0; t < d.S; ++t) {
      std::fill(y, y + (c1 - c0), T(0));
      for (std::int64_t w = 0; w < d.W; ++w) {
        const S* r = in.row(b, t - (d.W - 1) + w);
        if (r == nullptr) continue;
        for (std::int64_t c = c0; c < c1; ++c) y[c - c0] += ld(wt[c * d.W + w]) * ld(r[c]);
      }
      S* orow = o + (b * d.S + t) * d.C;
      for (std::int64_t c = c0; c < c1; ++c) {
        const T v = y[c - c0];
        orow[c] = st<S>(a.use_silu ? v * sigmoid(v) : v);
      }
    }
    if (!final_state.empty()) {
      S* fs = final_state.data_as<S>();
      for (std::int64_t i = 0; i < d.W - 1; ++i) {
        const S* r = in.row(b, d.S - (d.W - 1) + i);
        for (std::int64_t c = c0; c < c1; ++c) fs[(b * (d.W - 1) + i) * d.C + c] = r == nullptr ? S(T(0)) : r[c];
      }
    }
  }
}

template <typename S>
void conv_backward_impl(const ShortConvArgs& a, const ConvDims& d, const TensorView& dout, const TensorView& dx,
                        const TensorView& dweight, const TensorView& dinit) {
  using T = Acc<S>;
  const S* x = a.x.data_as<S>();
  const S* wt = a.weight.data_as<S>();
  const S* xs = a.initial_conv_state.empty() ? nullptr : a.initial_conv_state.data_as<S>();
  const S* go = dout.data_as<S>();
  const InputRows<S> in{x, xs, d.S, d.C, d.W};
  const std::int64_t nblk = (d.C + kChannelBlock - 1) / kChannelBlock;
  const std::int64_t L = d.S + d.W - 1;                  // rows of xin
  const std::int64_t nb = std::min(d.C, kChannelBlock);  // channels of the widest block
  const WorkerScratch<T> ws({nb * d.W, L * nb, d.S * nb}, "short_conv_backward scratch");
#pragma omp parallel
  {
    // dw of the block, the gradient of its xin rows (one batch), dy (one batch)
    const std::span<T> dw = ws.buffer(0), dxin = ws.buffer(1), dy = ws.buffer(2);
#pragma omp for schedule(static)
    for (std::int64_t blk = 0; blk < nblk; ++blk) {
      const std::int64_t c0 = blk * kChannelBlock, c1 = std::min(d.C, c0 + kChannelBlock), nc = c1 - c0;
      std::fill(dw.begin(), dw.end(), T(0));
      for (std::int64_t b = 0; b < d.B; ++b) {
        // dy = dout * silu'(y), with y recomputed.
        for (std::int64_t t = 0; t < d.S; ++t) {
          T* dyt = dy.data() + t * nc;
          const S* gr = go + (b * d.S + t) * d.C;
          if (a.use_silu) {
            std::fill(dyt, dyt + nc, T(0));
            for (std::int64_t w = 0; w < d.W; ++w) {
              const S* r = in.row(b, t - (d.W - 1) + w);
              if (r == nullptr) continue;
              for (std::int64_t c = c0; c < c1; ++c) dyt[c - c0] += ld(wt[c * d.W + w]) * ld(r[c]);
            }
            for (std::int64_t c = c0; c < c1; ++c) {
              const T y = dyt[c - c0];
              const T s = sigmoid(y);
              dyt[c - c0] = ld(gr[c]) * s * (T(1) + y * (T(1) - s));
            }
          } else {
            for (std::int64_t c = c0; c < c1; ++c) dyt[c - c0] = ld(gr[c]);
          }
        }
        // y[t] = sum_w weight[w] xin[t + w]: dxin[t + w] += weight[w] dy[t]; dweight[w] += dy[t] xin[t + w].
        std::fill(dxin.begin(), dxin.begin() + L * nc, T(0));
        for (std::int64_t t = 0; t < d.S; ++t) {
          const T* dyt = dy.data() + t * nc;
          for (std::int64_t w = 0; w < d.W; ++w) {
            T* dr = dxin.data() + (t + w) * nc;
            for (std::int64_t c = c0; c < c1; ++c) dr[c - c0] += ld(wt[c * d.W + w]) * dyt[c - c0];
            const S* r = in.row(b, t - (d.W - 1) + w);
            if (r == nullptr) continue;
            T* dwc = dw.data();
            for (std::int64_t c = c0; c < c1; ++c) dwc[(c - c0) * d.W + w] += dyt[c - c0] * ld(r[c]);
          }
        }
        if (!dx.empty()) {
          S* px = dx.data_as<S>();
          for (std::int64_t t = 0; t < d.S; ++t) {
            for (std::int64_t c = c0; c < c1; ++c)
              px[(b * d.S + t) * d.C + c] = st<S>(dxin[(t + d.W - 1) * nc + c - c0]);
          }
        }
        if (!dinit.empty()) {
          S* pi = dinit.data_as<S>();
          for (std::int64_t i = 0; i < d.W - 1; ++i) {
            for (std::int64_t c = c0; c < c1; ++c) pi[(b * (d.W - 1) + i) * d.C + c] = st<S>(dxin[i * nc + c - c0]);
          }
        }
      }
      if (!dweight.empty()) {
        S* pw = dweight.data_as<S>();
        for (std::int64_t c = c0; c < c1; ++c) {
          for (std::int64_t w = 0; w < d.W; ++w) pw[c * d.W + w] = st<S>(dw[(c - c0) * d.W + w]);
        }
      }
    }
  }
}

}  // namespace

void short_conv_forward_cpu(const ShortConvArgs& args, const ShortConvDims& d, const TensorView& out,
                            const TensorView& final_conv_state) {
  dispatch_floating(args.x.dtype(),
                    [&](auto zero) { conv_forward_impl<decltype(zero)>(args, d, out, final_conv_state); });
}

void short_conv_backward_cpu(const ShortConvArgs& args, const ShortConvDims& d, const TensorView& dout,
                             const TensorView& dx, const TensorView& dweight, const TensorView& dinitial_conv_state) {
  dispatch_floating(args.x.dtype(), [&](auto zero) {
    conv_backward_impl<decltype(zero)>(args, d, dout, dx, dweight, dinitial_conv_state);
  });
}

}  // namespace seqpar::attn::cpu
