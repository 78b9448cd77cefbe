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

// One document: rows [begin, end) of batch b, whose W-1 inputs before it are row `state` of the conv state. An
// unpacked batch has one per batch row ({b, 0, S, b}); a packed row one per document ({0, cu[i], cu[i+1], i}).
struct ConvDoc {
  std::int64_t b, begin, end, state;
};

std::vector<ConvDoc> conv_docs(const ConvDims& d) {
  std::vector<ConvDoc> docs;
  if (d.cu_seqlens.empty()) {
    for (std::int64_t b = 0; b < d.B; ++b) docs.push_back({b, 0, d.S, b});
  } else {
    for (std::size_t i = 0; i + 1 < d.cu_seqlens.size(); ++i)
      docs.push_back({0, d.cu_seqlens[i], d.cu_seqlens[i + 1], static_cast<std::int64_t>(i)});
  }
  return docs;
}

// xin rows of a document, t in [begin - (W-1), end): x for t >= begin, else the document's conv state (null when
// absent: zeros). No row of another document is ever returned.
template <typename S>
struct InputRows {
  const S* x;
  const S* xs;  // may be null
  std::int64_t S_, C, W;
  const S* row(const ConvDoc& doc, std::int64_t t) const {
    if (t >= doc.begin) return x + (doc.b * S_ + t) * C;
    if (xs == nullptr) return nullptr;
    return xs + (doc.state * (W - 1) + (t - doc.begin + W - 1)) * C;
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
  const std::vector<ConvDoc> docs = conv_docs(d);
  const std::int64_t nblk = (d.C + kChannelBlock - 1) / kChannelBlock;
  const auto njobs = static_cast<std::int64_t>(docs.size()) * nblk;
#pragma omp parallel for schedule(static)
  for (std::int64_t job = 0; job < njobs; ++job) {
    const ConvDoc& doc = docs[job / nblk];
    const std::int64_t c0 = (job % nblk) * kChannelBlock, c1 = std::min(d.C, c0 + kChannelBlock);
    T y[kChannelBlock];
    for (std::int64_t t = doc.begin; t < doc.end; ++t) {
      std::fill(y, y + (c1 - c0), T(0));
      for (std::int64_t w = 0; w < d.W; ++w) {
        const S* r = in.row(doc, t - (d.W - 1) + w);
        if (r == nullptr) continue;
        for (std::int64_t c = c0; c < c1; ++c) y[c - c0] += ld(wt[c * d.W + w]) * ld(r[c]);
      }
      S* orow = o + (doc.b * d.S + t) * d.C;
      for (std::int64_t c = c0; c < c1; ++c) {
        const T v = y[c - c0];
        orow[c] = st<S>(a.use_silu ? v * sigmoid(v) : v);
      }
    }
    if (!final_state.empty()) {
      S* fs = final_state.data_as<S>();
      for (std::int64_t i = 0; i < d.W - 1; ++i) {
        const S* r = in.row(doc, doc.end - (d.W - 1) + i);
        for (std::int64_t c = c0; c < c1; ++c)
          fs[(doc.state * (d.W - 1) + i) * d.C + c] = r == nullptr ? S(T(0)) : r[c];
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
  const std::vector<ConvDoc> docs = conv_docs(d);
  const std::int64_t nblk = (d.C + kChannelBlock - 1) / kChannelBlock;
  std::int64_t longest = 0;  // rows of the longest document
  for (const ConvDoc& doc : docs) longest = std::max(longest, doc.end - doc.begin);
  const std::int64_t L = longest + d.W - 1;              // rows of its xin
  const std::int64_t nb = std::min(d.C, kChannelBlock);  // channels of the widest block
  const WorkerScratch<T> ws({nb * d.W, L * nb, longest * nb}, "short_conv_backward scratch");
#pragma omp parallel
  {
    // dw of the block, the gradient of its xin rows (one document), dy (one document)
    const std::span<T> dw = ws.buffer(0), dxin = ws.buffer(1), dy = ws.buffer(2);
#pragma omp for schedule(static)
    for (std::int64_t blk = 0; blk < nblk; ++blk) {
      const std::int64_t c0 = blk * kChannelBlock, c1 = std::min(d.C, c0 + kChannelBlock), nc = c1 - c0;
      std::fill(dw.begin(), dw.end(), T(0));
      for (const ConvDoc& doc : docs) {
        const std::int64_t len = doc.end - doc.begin;
        // dy = dout * silu'(y), with y recomputed; row i of dy is token doc.begin + i.
        for (std::int64_t i = 0; i < len; ++i) {
          const std::int64_t t = doc.begin + i;
          T* dyt = dy.data() + i * nc;
          const S* gr = go + (doc.b * d.S + t) * d.C;
          if (a.use_silu) {
            std::fill(dyt, dyt + nc, T(0));
            for (std::int64_t w = 0; w < d.W; ++w) {
              const S* r = in.row(doc, t - (d.W - 1) + w);
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
        // y[t] = sum_w weight[w] xin[t + w]: dxin[t + w] += weight[w] dy[t]; dweight[w] += dy[t] xin[t + w]. Row j of
        // dxin is xin row doc.begin - (W-1) + j.
        std::fill(dxin.begin(), dxin.begin() + (len + d.W - 1) * nc, T(0));
        for (std::int64_t i = 0; i < len; ++i) {
          const T* dyt = dy.data() + i * nc;
          for (std::int64_t w = 0; w < d.W; ++w) {
            T* dr = dxin.data() + (i + w) * nc;
            for (std::int64_t c = c0; c < c1; ++c) dr[c - c0] += ld(wt[c * d.W + w]) * dyt[c - c0];
            const S* r = in.row(doc, doc.begin + i - (d.W - 1) + w);
            if (r == nullptr) continue;
            T* dwc = dw.data();
            for (std::int64_t c = c0; c < c1; ++c) dwc[(c - c0) * d.W + w] += dyt[c - c0] * ld(r[c]);
          }
        }
        if (!dx.empty()) {
          S* px = dx.data_as<S>();
          for (std::int64_t i = 0; i < len; ++i) {
            for (std::int64_t c = c0; c < c1; ++c)
              px[(doc.b * d.S + doc.begin + i) * d.C + c] = st<S>(dxin[(i + d.W - 1) * nc + c - c0]);
          }
        }
        if (!dinit.empty()) {
          S* pi = dinit.data_as<S>();
          for (std::int64_t i = 0; i < d.W - 1; ++i) {
            for (std::int64_t c = c0; c < c1; ++c)
              pi[(doc.state * (d.W - 1) + i) * d.C + c] = st<S>(dxin[i * nc + c - c0]);
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
