// The short causal depthwise conv composed from the ops table (gdn_composed.h, short_conv_*_composed).
//
// Every document (a batch row, or a packed row's document) becomes a run of rows of one buffer xin: its W-1 conv
// state rows (zeros when there is no initial_conv_state) and then its inputs, so that output row r reads the W
// consecutive rows from first[r]. The forward is one row kernel over the output rows; the final conv state is a
// gather of each run's last W-1 rows. The backward: the gradient before the SiLU per output row, each xin row's
// gradient from the (at most W) output rows that read it, the weight gradient per channel; dx and
// dinitial_conv_state are gathers of the xin gradient's rows.
#include <cstdint>
#include <memory>
#include <vector>

#include "../../runtime/error.h"
#include "../../runtime/tensor_ops.h"
#include "gdn_composed.h"
#include "staging.h"
#include "ops_cpu.h"

namespace seqpar::attn::ops {
namespace {

// The row plan of one call: x rows [B S] then conv state rows [N (W-1)] form the source `src`; xin rows per
// document run; first[r] per output row; state_src [xrows] (row of src, or -1 for zeros); tail [N (W-1)]: the
// xin rows of each document's last W-1 rows; head [N (W-1)]: its first W-1 (the state rows); own [B S]: output
// row r's own input row in xin.
struct ConvPlan {
  std::int64_t rows = 0, C = 0, W = 1, xrows = 0, states = 0;
  std::vector<std::int64_t> first, xin_src, tail, head, own;
};

ConvPlan conv_plan(const ShortConvArgs& a) {
  ConvPlan p;
  const std::int64_t B = a.x.dim(0), S = a.x.dim(1), W = a.weight.dim(1), h = W - 1;
  p.rows = B * S, p.C = a.x.dim(2), p.W = W;
  struct Doc {
    std::int64_t row0, len;
  };
  std::vector<Doc> docs;
  if (a.cu_seqlens.empty()) {
    for (std::int64_t b = 0; b < B; ++b) docs.push_back({b * S, S});
  } else {
    const std::int64_t* cu = a.cu_seqlens.data_as<std::int64_t>();
    for (std::int64_t d = 0; d + 1 < a.cu_seqlens.numel(); ++d) docs.push_back({cu[d], cu[d + 1] - cu[d]});
  }
  p.states = static_cast<std::int64_t>(docs.size());
  p.first.resize(static_cast<std::size_t>(p.rows));
  p.own.resize(static_cast<std::size_t>(p.rows));
  const bool with_state = !a.initial_conv_state.empty();
  for (std::int64_t d = 0; d < p.states; ++d) {
    const std::int64_t x0 = p.xrows;
    for (std::int64_t k = 0; k < h; ++k) {
      p.xin_src.push_back(with_state ? p.rows + d * h + k : -1);
      p.head.push_back(x0 + k);
    }
    for (std::int64_t t = 0; t < docs[d].len; ++t) {
      p.xin_src.push_back(docs[d].row0 + t);
      p.first[docs[d].row0 + t] = x0 + t;
      p.own[docs[d].row0 + t] = x0 + t + h;
    }
    p.xrows = x0 + h + docs[d].len;
    for (std::int64_t k = 0; k < h; ++k) p.tail.push_back(x0 + docs[d].len + k);
  }
  return p;
}

// xin [xrows, C] of the table from x and the conv states.
template <typename T>
std::unique_ptr<Buffer<T>> gather_xin(Ops<T>& ops, const ShortConvArgs& a, const ConvPlan& p) {
  const Input<T> x(ops, a.x, "x"), st(ops, a.initial_conv_state, "initial_conv_state");
  const std::int64_t nx = a.x.numel(), ns = st.get() != nullptr ? a.initial_conv_state.numel() : 0;
  const Buffer<T> sb(ops, nx + ns);
  const Batch one{1, 1};
  if (nx > 0) ops.copy(1, nx, Mat<const T>{x.get(), nx}, Mat<T>{sb.get(), nx}, one);
  if (ns > 0) ops.copy(1, ns, Mat<const T>{st.get(), ns}, Mat<T>{sb.get() + nx, ns}, one);
  const Buffer<std::int64_t> idx(ops, p.xin_src);
  auto xin = std::make_unique<Buffer<T>>(ops, p.xrows * p.C);
  ops.gather_rows(p.xrows, p.C, sb.get(), p.C, idx.get(), xin->get(), p.C);
  return xin;
}

// dst = rows idx of src [*, C].
template <typename T>
void write_rows(Ops<T>& ops, const TensorView& dst, const T* src, std::int64_t C,
                const std::vector<std::int64_t>& idx) {
  if (dst.empty() || dst.numel() == 0) return;
  const Buffer<std::int64_t> ib(ops, idx);
  Buffer<T> buf(ops, dst.numel());
  ops.gather_rows(static_cast<std::int64_t>(idx.size()), C, src, C, ib.get(), buf.get(), C);
  write_output(ops, buf.get(), dst, "output");
}

}  // namespace

template <typename T>
void short_conv_forward_composed(Ops<T>& ops, const ShortConvArgs& args, const TensorView& out,
                                 const TensorView& final_conv_state) {
  args.validate(out, final_conv_state);
  const ConvPlan p = conv_plan(args);
  const auto xin = gather_xin(ops, args, p);
  const Buffer<std::int64_t> first(ops, p.first);
  const Input<T> weight(ops, args.weight, "weight");
  Buffer<T> y(ops, p.rows * p.C);
  ops.short_conv_rows(p.rows, p.C, p.W, xin->get(), first.get(), weight.get(), args.use_silu, y.get());
  std::vector<std::int64_t> all(static_cast<std::size_t>(p.rows));
  for (std::int64_t r = 0; r < p.rows; ++r) all[r] = r;
  write_rows(ops, out, y.get(), p.C, all);
  write_rows(ops, final_conv_state, xin->get(), p.C, p.tail);
}

template <typename T>
void short_conv_backward_composed(Ops<T>& ops, const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                  const TensorView& dweight, const TensorView& dinitial_conv_state) {
  args.validate(dout, dx, dweight, dinitial_conv_state);
  const ConvPlan p = conv_plan(args);
  const auto xin = gather_xin(ops, args, p);
  const Buffer<std::int64_t> first(ops, p.first);
  const Input<T> weight(ops, args.weight, "weight");
  const Input<T> dpre_in(ops, dout, "dout", /*writable=*/true);
  T* const dpre = dpre_in.mut();
  ops.short_conv_dpre_rows(p.rows, p.C, p.W, xin->get(), first.get(), weight.get(), args.use_silu, dpre);
  if (!dx.empty() || !dinitial_conv_state.empty()) {
    std::vector<std::int64_t> src(static_cast<std::size_t>(p.xrows * p.W), -1);
    for (std::int64_t r = 0; r < p.rows; ++r)
      for (std::int64_t w = 0; w < p.W; ++w) src[(p.first[r] + w) * p.W + w] = r;
    const Buffer<std::int64_t> sb(ops, src);
    Buffer<T> dxin(ops, p.xrows * p.C);
    ops.short_conv_dx_rows(p.xrows, p.C, p.W, dpre, sb.get(), weight.get(), dxin.get());
    write_rows(ops, dx, dxin.get(), p.C, p.own);
    write_rows(ops, dinitial_conv_state, dxin.get(), p.C, p.head);
  }
  if (!dweight.empty()) {
    Buffer<T> dw(ops, p.C * p.W);
    ops.short_conv_dweight(p.rows, p.C, p.W, dpre, xin->get(), first.get(), dw.get());
    write_output(ops, dw.get(), dweight, "dweight");
  }
}

template void short_conv_forward_composed<float>(Ops<float>&, const ShortConvArgs&, const TensorView&,
                                                 const TensorView&);
template void short_conv_forward_composed<double>(Ops<double>&, const ShortConvArgs&, const TensorView&,
                                                  const TensorView&);
template void short_conv_backward_composed<float>(Ops<float>&, const ShortConvArgs&, const TensorView&,
                                                  const TensorView&, const TensorView&, const TensorView&);
template void short_conv_backward_composed<double>(Ops<double>&, const ShortConvArgs&, const TensorView&,
                                                   const TensorView&, const TensorView&, const TensorView&);

void short_conv_forward_composed_cpu(const ShortConvArgs& args, const TensorView& out,
                                     const TensorView& final_conv_state) {
  with_cpu_ops(args.x.dtype(), [&](auto& ops) { short_conv_forward_composed(ops, args, out, final_conv_state); });
}

void short_conv_backward_composed_cpu(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                      const TensorView& dweight, const TensorView& dinitial_conv_state) {
  with_cpu_ops(args.x.dtype(),
               [&](auto& ops) { short_conv_backward_composed(ops, args, dout, dx, dweight, dinitial_conv_state); });
}

}  // namespace seqpar::attn::ops
