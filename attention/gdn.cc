// Public boundary of the GDN kernels: argument validation (callable on its own through the validate members of the
// argument structs) and dispatch to the CPU kernels in cpu/, or, for CUDA tensors on a CUDA stream in a CUDA build, to
// the compositions on the CUDA ops table (attention/ops/gdn_composed.h). Math: attention/gdn.h.
#include "attention/gdn.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "attention/boundary.h"
#include "attention/cpu/gdn_cpu.h"
#include "attention/cuda/ops_cuda.h"
#include "attention/ops/gdn_composed.h"
#include "attention/ops/gdn_hook.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"

namespace seqpar::attn {
namespace {

constexpr const char* kFamily = "GDN";

void check_floating(const TensorView& t, const char* what) { detail::check_floating(t, what, kFamily); }

// Activations and their gradients: any floating dtype, of `shape`.
void check_activation(const TensorView& t, const Shape& shape, const char* what) {
  check_floating(t, what);
  check_shape(t, shape, what);
}

// The document bounds of a packed row of `total` tokens (int64 [N+1], host): starts at 0, no entry negative,
// non-decreasing, ends at `total`. Returns them; empty when cu_seqlens is empty (an unpacked batch).
std::vector<std::int64_t> validate_cu_seqlens(const TensorView& cu_seqlens, std::int64_t batch, std::int64_t total,
                                              const char* fn) {
  if (cu_seqlens.empty()) return {};
  detail::check_host(cu_seqlens, "cu_seqlens", kFamily);
  SEQPAR_CHECK(cu_seqlens.device().is_cpu(), fn, ": cu_seqlens ", cu_seqlens.str(), " is on ",
               cu_seqlens.device().str(), ", but document bounds are read on the host (pass a host tensor)");
  SEQPAR_CHECK(cu_seqlens.dtype() == DType::kInt64 && cu_seqlens.ndim() == 1, fn,
               ": cu_seqlens must be int64 [N+1], got ", cu_seqlens.str());
  SEQPAR_CHECK(batch == 1, fn, ": a packed row (cu_seqlens given) must have batch size 1, got B = ", batch,
               " (pack the batch into one row)");
  const std::int64_t* p = cu_seqlens.data_as<std::int64_t>();
  std::vector<std::int64_t> cu(p, p + cu_seqlens.numel());
  for (std::size_t i = 0; i < cu.size(); ++i)
    SEQPAR_CHECK(cu[i] >= 0, fn, ": cu_seqlens[", i, "] = ", cu[i], " is negative (document bounds are >= 0)");
  SEQPAR_CHECK(cu.front() == 0, fn, ": cu_seqlens[0] must be 0, got ", cu.front());
  detail::check_non_decreasing(cu, "cu_seqlens");
  SEQPAR_CHECK(cu.back() == total, fn, ": cu_seqlens must end at the row's token count T = ", total,
               ", got cu_seqlens[", cu.size() - 1, "] = ", cu.back());
  return cu;
}

// Validated sizes and, for a packed row, the document bounds. States are [num_states, H, K, V]: one per batch row,
// or one per document.
struct Checked {
  cpu::GdnDims d;
  std::vector<std::int64_t> cu;
  std::int64_t num_states() const { return cu.empty() ? d.B : static_cast<std::int64_t>(cu.size()) - 1; }
};

// States and their gradients [B, H, K, V] ([N, H, K, V] packed) in the state dtype.
void check_state(const TensorView& t, const Checked& c, DType state_dtype, const char* what) {
  detail::check_host_tensor(t, {c.num_states(), c.d.H, c.d.K, c.d.V}, state_dtype, what, kFamily);
}

Checked validate_forward_args(const GdnForwardArgs& a) {
  SEQPAR_CHECK(a.q.ndim() == 4, "gdn: q must be [B, S, Hk, K], got ", shape_str(a.q.shape()));
  SEQPAR_CHECK(a.v.ndim() == 4, "gdn: v must be [B, S, Hv, V], got ", shape_str(a.v.shape()));
  cpu::GdnDims d{a.q.dim(0), a.q.dim(1), a.v.dim(2), a.q.dim(2), a.q.dim(3), a.v.dim(3)};
  SEQPAR_CHECK(d.Hk >= 1 && d.H >= 1 && d.H % d.Hk == 0, "gdn: value heads Hv = ", d.H, " (v ", shape_str(a.v.shape()),
               ") must be a positive multiple of key heads Hk = ", d.Hk, " (q ", shape_str(a.q.shape()),
               "): value head h reads key head h / (Hv / Hk)");
  SEQPAR_CHECK(a.chunk_size >= 1, "gdn: chunk_size must be >= 1, got ", a.chunk_size);
  // A chunk longer than the sequence is one partial chunk of S tokens: size the per-worker scratch ([C, C] and
  // [C, K] buffers) for the S rows it can hold, not for chunk_size (a chunk_size of 100000 on 256 tokens would
  // otherwise ask for 200 GB). Same chunks, same arithmetic. A chunk above kGdnMaxChunkSize runs as chunks of that
  // length.
  d.C = std::min({a.chunk_size, kGdnMaxChunkSize, std::max<std::int64_t>(d.S, 1)});
  SEQPAR_CHECK(d.K >= 1 && d.V >= 1, "gdn: head dims K and V must be >= 1, got K = ", d.K, ", V = ", d.V);
  check_activation(a.q, a.q.shape(), "q");
  check_activation(a.k, {d.B, d.S, d.Hk, d.K}, "k");
  check_activation(a.v, {d.B, d.S, d.H, d.V}, "v");
  check_activation(a.g, {d.B, d.S, d.H}, "g");
  check_activation(a.beta, {d.B, d.S, d.H}, "beta");
  SEQPAR_CHECK(std::isfinite(a.scale), "GDN scale ", a.scale, " must be finite (0 or less: 1/sqrt(K))");
  const Checked c{d, validate_cu_seqlens(a.cu_seqlens, d.B, d.S, "gdn")};
  if (!a.initial_state.empty()) check_state(a.initial_state, c, accumulator_dtype(a.q.dtype()), "initial_state");
  return c;
}

Checked validate_forward(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state) {
  const Checked c = validate_forward_args(args);
  const cpu::GdnDims& d = c.d;
  check_activation(out, {d.B, d.S, d.H, d.V}, "out");
  if (!final_state.empty()) check_state(final_state, c, accumulator_dtype(args.q.dtype()), "final_state");
  return c;
}

Checked validate_backward(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state) {
  const Checked c = validate_forward_args(args.fwd);
  const cpu::GdnDims& d = c.d;
  const DType sd = accumulator_dtype(args.fwd.q.dtype());
  const Shape qk{d.B, d.S, d.Hk, d.K}, vo{d.B, d.S, d.H, d.V}, gb{d.B, d.S, d.H};
  if (!args.dout.empty()) check_activation(args.dout, vo, "dout");
  if (!args.dfinal_state.empty()) check_state(args.dfinal_state, c, sd, "dfinal_state");
  if (!dq.empty()) check_activation(dq, qk, "dq");
  if (!dk.empty()) check_activation(dk, qk, "dk");
  if (!dv.empty()) check_activation(dv, vo, "dv");
  if (!dg.empty()) check_activation(dg, gb, "dg");
  if (!dbeta.empty()) check_activation(dbeta, gb, "dbeta");
  if (!dinitial_state.empty()) check_state(dinitial_state, c, sd, "dinitial_state");
  return c;
}

cpu::GdnDims validate_transition(const GdnForwardArgs& args, const TensorView& m, const TensorView& u) {
  const cpu::GdnDims d = validate_forward_args(args).d;
  SEQPAR_CHECK(args.initial_state.empty(),
               "gdn_transition: initial_state must be empty (the map is taken from a zero start)");
  SEQPAR_CHECK(args.cu_seqlens.empty(),
               "gdn_transition: cu_seqlens must be empty (take the map of each piece between document starts)");
  const DType sd = accumulator_dtype(args.q.dtype());
  detail::check_host_tensor(m, {d.B, d.H, d.K, d.K}, sd, "m", kFamily);
  detail::check_host_tensor(u, {d.B, d.H, d.K, d.V}, sd, "u", kFamily);
  return d;
}

// ---- segment maps ----

void check_map_matrix(const TensorView& m, const char* what) {
  detail::check_host(m, what, kFamily);
  SEQPAR_CHECK(m.ndim() == 4 && m.dim(2) == m.dim(3), "gdn: ", what, " must be [B, H, K, K], got ",
               shape_str(m.shape()));
  SEQPAR_CHECK(m.dtype() == DType::kFloat32 || m.dtype() == DType::kFloat64, "gdn: ", what,
               " must be fp32 or fp64 (the state dtype), got ", dtype_name(m.dtype()));
}

// Checks that `t` is [B, H, K, *] with m's B, H, K and dtype, and the given last dim (< 0: any).
void check_like(const TensorView& t, const TensorView& m, std::int64_t last, const char* what) {
  detail::check_host(t, what, kFamily);
  SEQPAR_CHECK(t.ndim() == 4, "gdn: ", what, " must be 4-d [B, H, K, *], got ", shape_str(t.shape()));
  check_shape(t, {m.dim(0), m.dim(1), m.dim(2), last < 0 ? t.dim(3) : last}, what);
  check_dtype(t, m.dtype(), what);
}

void check_distinct(const TensorView& out, const TensorView& in, const char* fn, const char* out_name,
                    const char* in_name) {
  SEQPAR_CHECK(out.data() != in.data(), fn, ": ", out_name, " may not alias ", in_name);
}

struct Named {
  const TensorView& t;
  const char* name;
};

// out = op(m) x (+ addend, when not empty): x, addend, out [B, H, K, N] like m; out may not alias x.
void check_map_product(const TensorView& m, Named x, Named addend, Named out, const char* fn, const Stream& stream) {
  detail::check_stream(stream, fn, kFamily);
  check_map_matrix(m, "m");
  check_like(x.t, m, -1, x.name);
  check_like(out.t, m, x.t.dim(3), out.name);
  if (!addend.t.empty()) check_like(addend.t, m, x.t.dim(3), addend.name);
  check_distinct(out.t, x.t, fn, out.name, x.name);
}

// ---- short conv ----

// Conv tensors share x's dtype.
void check_like_x(const TensorView& t, const Shape& shape, const ShortConvArgs& a, const char* what) {
  detail::check_host_tensor(t, shape, a.x.dtype(), what, kFamily);
}

// Conv states and their gradients: [B, W-1, C], or [N, W-1, C] for a packed row.
Shape conv_state_shape(const cpu::ShortConvDims& d) {
  const std::int64_t n = d.cu_seqlens.empty() ? d.B : static_cast<std::int64_t>(d.cu_seqlens.size()) - 1;
  return {n, d.W - 1, d.C};
}

cpu::ShortConvDims validate_conv_args(const ShortConvArgs& a) {
  check_floating(a.x, "x");
  detail::check_host(a.weight, "weight", kFamily);
  SEQPAR_CHECK(a.x.ndim() == 3, "short_conv: x must be [B, S, C], got ", shape_str(a.x.shape()));
  SEQPAR_CHECK(a.weight.ndim() == 2, "short_conv: weight must be [C, W], got ", shape_str(a.weight.shape()));
  cpu::ShortConvDims d{a.x.dim(0), a.x.dim(1), a.x.dim(2), a.weight.dim(1)};
  SEQPAR_CHECK(d.W >= 1, "short_conv: kernel width W must be >= 1, got ", d.W);
  check_shape(a.weight, {d.C, d.W}, "weight");
  check_dtype(a.weight, a.x.dtype(), "weight");
  d.cu_seqlens = validate_cu_seqlens(a.cu_seqlens, d.B, d.S, "short_conv");
  if (!a.initial_conv_state.empty()) check_like_x(a.initial_conv_state, conv_state_shape(d), a, "initial_conv_state");
  return d;
}

// The checks of the kernels without an argument struct of their own.

void check_gdn_transition_compose(const TensorView& m2, const TensorView& u2, const TensorView& m1,
                                  const TensorView& u1, const TensorView& m, const TensorView& u, Stream stream) {
  detail::check_stream(stream, "gdn_transition_compose", kFamily);
  check_map_matrix(m2, "m2");
  check_like(m1, m2, m2.dim(2), "m1");
  check_like(m, m2, m2.dim(2), "m");
  check_like(u2, m2, -1, "u2");
  check_like(u1, m2, u2.dim(3), "u1");
  check_like(u, m2, u2.dim(3), "u");
  for (const TensorView* in : {&m1, &m2}) check_distinct(m, *in, "gdn_transition_compose", "m", "m1 or m2");
  for (const TensorView* in : {&u1, &u2}) check_distinct(u, *in, "gdn_transition_compose", "u", "u1 or u2");
}

void check_gdn_transition_apply(const TensorView& m, const TensorView& u, const TensorView& s_start,
                                const TensorView& s_end, Stream stream) {
  check_map_product(m, {s_start, "s_start"}, {u, "u"}, {s_end, "s_end"}, "gdn_transition_apply", stream);
}

void check_gdn_transition_apply_adjoint(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                        const TensorView& ds_start, Stream stream) {
  check_map_product(m, {ds_end, "ds_end"}, {local, "local"}, {ds_start, "ds_start"}, "gdn_transition_apply_adjoint",
                    stream);
}

void check_gdn_transition_transpose(const TensorView& m, const TensorView& mt, Stream stream) {
  detail::check_stream(stream, "gdn_transition_transpose", kFamily);
  check_map_matrix(m, "m");
  check_like(mt, m, m.dim(2), "mt");
  check_distinct(mt, m, "gdn_transition_transpose", "mt", "m");
}

}  // namespace

// ---- validation of the argument structs --------------------------------------------------------------------------

namespace {
// In a build with the CUDA ops table, the checks of a call on a CUDA stream accept tensors on that device (the CUDA
// route: the validate members then raise exactly what the routed call raises).
void accept_route_device(std::optional<detail::AcceptDevice>& accept, const Stream& stream) {
  if (stream.device.is_cuda() && ops::cuda_ops_built()) accept.emplace(stream.device);
}
}  // namespace

void GdnForwardArgs::validate() const { validate_forward_args(*this); }

void GdnForwardArgs::validate(const TensorView& out, const TensorView& final_state, Stream stream) const {
  std::optional<detail::AcceptDevice> accept;
  accept_route_device(accept, stream);
  detail::check_stream(stream, "gdn_forward", kFamily);
  validate_forward(*this, out, final_state);
}

void GdnBackwardArgs::validate(const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& dg,
                               const TensorView& dbeta, const TensorView& dinitial_state, Stream stream) const {
  std::optional<detail::AcceptDevice> accept;
  accept_route_device(accept, stream);
  detail::check_stream(stream, "gdn_backward", kFamily);
  validate_backward(*this, dq, dk, dv, dg, dbeta, dinitial_state);
}

void ShortConvArgs::validate() const { validate_conv_args(*this); }

void ShortConvArgs::validate(const TensorView& out, const TensorView& final_conv_state, Stream stream) const {
  std::optional<detail::AcceptDevice> accept;
  accept_route_device(accept, stream);
  detail::check_stream(stream, "short_conv_forward", kFamily);
  const cpu::ShortConvDims d = validate_conv_args(*this);
  check_like_x(out, {d.B, d.S, d.C}, *this, "out");
  if (!final_conv_state.empty()) check_like_x(final_conv_state, conv_state_shape(d), *this, "final_conv_state");
}

void ShortConvArgs::validate(const TensorView& dout, const TensorView& dx, const TensorView& dweight,
                             const TensorView& dinitial_conv_state, Stream stream) const {
  std::optional<detail::AcceptDevice> accept;
  accept_route_device(accept, stream);
  detail::check_stream(stream, "short_conv_backward", kFamily);
  const cpu::ShortConvDims d = validate_conv_args(*this);
  check_like_x(dout, {d.B, d.S, d.C}, *this, "dout");
  if (!dx.empty()) check_like_x(dx, {d.B, d.S, d.C}, *this, "dx");
  if (!dweight.empty()) check_like_x(dweight, {d.C, d.W}, *this, "dweight");
  if (!dinitial_conv_state.empty())
    check_like_x(dinitial_conv_state, conv_state_shape(d), *this, "dinitial_conv_state");
}

// ---- the kernels ---------------------------------------------------------------------------------------------------

namespace {

// Rows [begin, end) of a [1, T, ...] tensor as a [1, end - begin, ...] view (an empty view stays empty).
TensorView doc_rows(const TensorView& t, std::int64_t begin, std::int64_t end) {
  if (t.empty()) return {};
  Shape rows(t.shape().begin() + 1, t.shape().end());
  const TensorView part = t.reshape(rows).slice0(begin, end);
  rows[0] = end - begin;
  rows.insert(rows.begin(), 1);
  return part.reshape(rows);
}

// State d of a [N, ...] state tensor as [1, ...] (an empty view stays empty).
TensorView doc_state(const TensorView& t, std::int64_t d) { return t.empty() ? TensorView() : t.slice0(d, d + 1); }

// dst = src, or zeros when src is empty (states: fp32 or fp64, same dtype).
void copy_or_zero(const TensorView& src, const TensorView& dst) {
  if (dst.empty()) return;
  if (src.empty()) {
    std::memset(dst.data(), 0, dst.nbytes());
  } else {
    std::memcpy(dst.data(), src.data(), dst.nbytes());
  }
}

// The arguments and sizes of document `doc` (rows [begin, end), end > begin) of a packed row.
struct Document {
  GdnForwardArgs args;
  cpu::GdnDims d;
};

Document document(const GdnForwardArgs& a, const cpu::GdnDims& d, std::int64_t doc, std::int64_t begin,
                  std::int64_t end) {
  Document r{a, d};
  r.args.q = doc_rows(a.q, begin, end);
  r.args.k = doc_rows(a.k, begin, end);
  r.args.v = doc_rows(a.v, begin, end);
  r.args.g = doc_rows(a.g, begin, end);
  r.args.beta = doc_rows(a.beta, begin, end);
  r.args.initial_state = doc_state(a.initial_state, doc);
  r.args.cu_seqlens = TensorView();
  r.d.S = end - begin;
  r.d.C = std::min({a.chunk_size, kGdnMaxChunkSize, r.d.S});
  return r;
}

// The CUDA route: a CUDA stream in a build with the CUDA ops table runs f(table) on the table of the stream's device
// (fp64 arithmetic for fp64 `dtype`, else fp32), issuing on that stream, with the argument checks accepting tensors
// on that device (boundary.h AcceptDevice); the composition validates its arguments first (the kernels' checks) and
// stages the tensors (attention/ops/staging.h: in place on the device, host tensors uploaded). False otherwise (a
// build without CUDA refuses the stream in the checks that follow, as before).
template <typename F>
bool on_cuda_table(const Stream& stream, DType dtype, F&& f) {
  if (!stream.device.is_cuda() || !ops::cuda_ops_built()) return false;
  const detail::AcceptDevice accept(stream.device);
  ops::with_cuda_ops(dtype, stream.device, stream, f);
  return true;
}

}  // namespace

void gdn_forward(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state, Stream stream) {
  if (on_cuda_table(stream, args.q.dtype(), [&](auto& t) { ops::gdn_forward_composed(t, args, out, final_state); }))
    return;
  detail::check_stream(stream, "gdn_forward", kFamily);
  if (ops::detail::gdn_forward_hooked(args, out, final_state)) return;  // test mode (attention/ops/gdn_hook.h)
  const Checked c = validate_forward(args, out, final_state);
  if (c.cu.empty()) {
    cpu::gdn_forward_cpu(args, c.d, out, final_state);
    return;
  }
  // A packed row: every document on its own rows from its own initial state.
  for (std::int64_t doc = 0; doc + 1 < static_cast<std::int64_t>(c.cu.size()); ++doc) {
    const std::int64_t begin = c.cu[doc], end = c.cu[doc + 1];
    if (begin == end) {
      copy_or_zero(doc_state(args.initial_state, doc), doc_state(final_state, doc));
      continue;
    }
    const Document dc = document(args, c.d, doc, begin, end);
    cpu::gdn_forward_cpu(dc.args, dc.d, doc_rows(out, begin, end), doc_state(final_state, doc));
  }
}

void gdn_backward(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state, Stream stream) {
  if (on_cuda_table(stream, args.fwd.q.dtype(), [&](auto& t) {
        ops::gdn_backward_composed(t, args, dq, dk, dv, dg, dbeta, dinitial_state);
      }))
    return;
  detail::check_stream(stream, "gdn_backward", kFamily);
  if (ops::detail::gdn_backward_hooked(args, dq, dk, dv, dg, dbeta, dinitial_state)) return;  // test mode
  const Checked c = validate_backward(args, dq, dk, dv, dg, dbeta, dinitial_state);
  if (c.cu.empty()) {
    cpu::gdn_backward_cpu(args, c.d, dq, dk, dv, dg, dbeta, dinitial_state);
    return;
  }
  for (std::int64_t doc = 0; doc + 1 < static_cast<std::int64_t>(c.cu.size()); ++doc) {
    const std::int64_t begin = c.cu[doc], end = c.cu[doc + 1];
    if (begin == end) {  // the state passes through unchanged: so does its gradient
      copy_or_zero(doc_state(args.dfinal_state, doc), doc_state(dinitial_state, doc));
      continue;
    }
    const Document dc = document(args.fwd, c.d, doc, begin, end);
    GdnBackwardArgs b{dc.args, doc_rows(args.dout, begin, end), doc_state(args.dfinal_state, doc)};
    cpu::gdn_backward_cpu(b, dc.d, doc_rows(dq, begin, end), doc_rows(dk, begin, end), doc_rows(dv, begin, end),
                          doc_rows(dg, begin, end), doc_rows(dbeta, begin, end), doc_state(dinitial_state, doc));
  }
}

namespace {

// The sizes of a window (GdnWindow) of the whole tensors in `args` (whose initial_state is the window's), checked.
cpu::GdnDims validate_window(const GdnForwardArgs& args, const GdnWindow& w, const char* fn) {
  GdnForwardArgs whole = args;
  whole.initial_state = {};
  const Checked c = validate_forward_args(whole);
  SEQPAR_CHECK(args.cu_seqlens.empty(), fn, ": cu_seqlens must be empty (a window runs one sequence per batch row)");
  cpu::GdnDims d = c.d;
  SEQPAR_CHECK(w.num_rows >= 1 && w.row_begin >= 0 && w.row_begin + w.num_rows <= d.S, fn, ": rows [", w.row_begin,
               ", ", w.row_begin + w.num_rows, ") must be a non-empty range inside the ", d.S, " rows of q");
  SEQPAR_CHECK(w.num_heads >= 1 && w.head_begin >= 0 && w.head_begin + w.num_heads <= d.H, fn, ": value heads [",
               w.head_begin, ", ", w.head_begin + w.num_heads, ") must be a non-empty range inside the ", d.H,
               " value heads of v");
  d.rows_total = d.S;
  d.row0 = w.row_begin;
  d.S = w.num_rows;
  d.heads_total = d.H;
  d.key_heads_total = d.Hk;
  d.head0 = w.head_begin;
  d.H = w.num_heads;
  d.Hk = w.num_heads;  // each value head on its own: dq and dk are per value head
  d.C = std::min({args.chunk_size, kGdnMaxChunkSize, d.S});
  const DType sd = accumulator_dtype(args.q.dtype());
  if (!args.initial_state.empty())
    detail::check_host_tensor(args.initial_state, {d.B, d.H, d.K, d.V}, sd, "initial_state", kFamily);
  return d;
}

// The test-mode route (gdn_hook.h) takes whole tensors: a window runs there value head by value head, through
// copies of the head's rows (with its key head's) and of its state.
Tensor window_rows(const TensorView& t, std::int64_t row_begin, std::int64_t num_rows, std::int64_t head) {
  Shape s = t.shape();
  s[1] = num_rows;
  s[2] = 1;
  Tensor out = Tensor::empty(s, t.dtype(), MemCategory::kWorkspace);
  const std::int64_t width = t.ndim() == 4 ? t.dim(3) : 1, esize = static_cast<std::int64_t>(dtype_size(t.dtype()));
  const auto* src = static_cast<const char*>(t.data());
  auto* dst = static_cast<char*>(out.data());
  for (std::int64_t b = 0; b < t.dim(0); ++b)
    for (std::int64_t r = 0; r < num_rows; ++r)
      std::memcpy(dst + (b * num_rows + r) * width * esize,
                  src + ((b * t.dim(1) + row_begin + r) * t.dim(2) + head) * width * esize,
                  static_cast<std::size_t>(width * esize));
  return out;
}

void put_window_rows(const TensorView& part, const TensorView& t, std::int64_t row_begin, std::int64_t head) {
  const std::int64_t num_rows = part.dim(1), width = t.ndim() == 4 ? t.dim(3) : 1,
                     esize = static_cast<std::int64_t>(dtype_size(t.dtype()));
  const auto* src = static_cast<const char*>(part.data());
  auto* dst = static_cast<char*>(t.data());
  for (std::int64_t b = 0; b < t.dim(0); ++b)
    for (std::int64_t r = 0; r < num_rows; ++r)
      std::memcpy(dst + ((b * t.dim(1) + row_begin + r) * t.dim(2) + head) * width * esize,
                  src + (b * num_rows + r) * width * esize, static_cast<std::size_t>(width * esize));
}

// States [B, heads, K, V] seen as [B, 1, heads, K V]: head i is "row 0" of head i.
TensorView state_rows(const TensorView& t) { return t.reshape({t.dim(0), 1, t.dim(1), t.dim(2) * t.dim(3)}); }

// Value head d.head0 + i of a window as whole tensors: args over copies (kept alive in `keep`).
GdnForwardArgs window_head(const GdnForwardArgs& args, const cpu::GdnDims& d, const GdnWindow& window,
                           std::int64_t i, std::vector<Tensor>& keep) {
  const std::int64_t G = d.heads_total / d.key_heads_total, r0 = window.row_begin, n = window.num_rows,
                     h = d.head0 + i;
  auto copy = [&](const TensorView& t, std::int64_t head) {
    keep.push_back(window_rows(t, r0, n, head));
    return keep.back().view();
  };
  GdnForwardArgs a = args;
  a.q = copy(args.q, h / G);
  a.k = copy(args.k, h / G);
  a.v = copy(args.v, h);
  a.g = copy(args.g, h);
  a.beta = copy(args.beta, h);
  a.initial_state = TensorView();
  if (!args.initial_state.empty()) {
    keep.push_back(window_rows(state_rows(args.initial_state), 0, 1, i));
    a.initial_state = keep.back().view().reshape({d.B, 1, d.K, d.V});
  }
  return a;
}

// A [B, 1, K, V] state part into head i of `whole` [B, heads, K, V].
void put_state(const TensorView& part, const TensorView& whole, std::int64_t i) {
  put_window_rows(part.reshape({part.dim(0), 1, 1, part.dim(2) * part.dim(3)}), state_rows(whole), 0, i);
}

}  // namespace

void gdn_forward_window(const GdnForwardArgs& args, const GdnWindow& window, const TensorView& out,
                        const TensorView& final_state, Stream stream) {
  gdn_forward_window(args, window, out, final_state, nullptr, stream);
}

void gdn_backward_window(const GdnBackwardArgs& args, const GdnWindow& window, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                         const TensorView& dinitial_state, Stream stream) {
  gdn_backward_window(args, window, dq, dk, dv, dg, dbeta, dinitial_state, nullptr, stream);
}

namespace {

// `ahead` (when given) was made for this window and direction.
void check_ahead(const GdnAhead* ahead, const GdnWindow& w, bool backward, const char* fn) {
  if (ahead == nullptr) return;
  const GdnWindow& a = ahead->window;
  SEQPAR_CHECK(ahead->backward == backward && a.row_begin == w.row_begin && a.num_rows == w.num_rows &&
                   a.head_begin == w.head_begin && a.num_heads == w.num_heads,
               fn, ": the work ahead (", ahead->backward ? "backward" : "forward", ", rows [", a.row_begin, ", ",
               a.row_begin + a.num_rows, "), value heads [", a.head_begin, ", ", a.head_begin + a.num_heads,
               ")) must be made for this call's ", backward ? "backward" : "forward", " window (rows [", w.row_begin,
               ", ", w.row_begin + w.num_rows, "), value heads [", w.head_begin, ", ", w.head_begin + w.num_heads,
               "))");
}

cpu::GdnAheadBuffer ahead_buffer(const GdnAhead* ahead) {
  if (ahead == nullptr || !ahead->buffer.defined()) return {};
  return {const_cast<void*>(ahead->buffer.data()), ahead->chunks_done};
}

GdnAhead make_ahead(const GdnForwardArgs& args, const GdnWindow& window, bool backward, const char* fn) {
  GdnForwardArgs a = args;
  a.initial_state = {};  // not read by the forward's work ahead; the backward's is checked by its step
  const cpu::GdnDims d = validate_window(a, window, fn);
  GdnAhead ahead;
  ahead.window = window;
  ahead.backward = backward;
  ahead.num_chunks = d.num_chunks();
  // The test-mode route computes nothing ahead.
  if (backward ? ops::detail::gdn_backward_hook_active() : ops::detail::gdn_forward_hook_active()) return ahead;
  ahead.buffer = Tensor::empty({cpu::gdn_ahead_numel_cpu(d, backward)}, accumulator_dtype(args.q.dtype()),
                               MemCategory::kWorkspace);
  return ahead;
}

}  // namespace

GdnAhead gdn_forward_ahead(const GdnForwardArgs& args, const GdnWindow& window) {
  return make_ahead(args, window, false, "gdn_forward_ahead");
}

GdnAhead gdn_backward_ahead(const GdnBackwardArgs& args, const GdnWindow& window) {
  return make_ahead(args.fwd, window, true, "gdn_backward_ahead");
}

std::int64_t gdn_ahead_bytes(const GdnForwardArgs& args, const GdnWindow& window, bool backward) {
  GdnForwardArgs a = args;
  a.initial_state = {};
  const cpu::GdnDims d = validate_window(a, window, "gdn_ahead_bytes");
  return cpu::gdn_ahead_numel_cpu(d, backward) *
         static_cast<std::int64_t>(dtype_size(accumulator_dtype(args.q.dtype())));
}

bool gdn_ahead_step(const GdnForwardArgs& args, GdnAhead& ahead, std::int64_t max_chunks, Stream stream) {
  detail::check_stream(stream, "gdn_ahead_step", kFamily);
  SEQPAR_CHECK(max_chunks >= 1, "gdn_ahead_step: max_chunks ", max_chunks, " must be >= 1");
  if (!ahead.buffer.defined() || ahead.complete()) return true;
  GdnForwardArgs a = args;
  if (!ahead.backward) a.initial_state = {};
  const cpu::GdnDims d = validate_window(a, ahead.window, "gdn_ahead_step");
  const std::int64_t end = std::min(ahead.num_chunks, ahead.chunks_done + max_chunks);
  cpu::gdn_ahead_cpu(a, d, ahead.backward, ahead_buffer(&ahead), ahead.chunks_done, end);
  ahead.chunks_done = end;
  return ahead.complete();
}

void gdn_forward_window(const GdnForwardArgs& args, const GdnWindow& window, const TensorView& out,
                        const TensorView& final_state, const GdnAhead* ahead, Stream stream) {
  detail::check_stream(stream, "gdn_forward_window", kFamily);
  const cpu::GdnDims d = validate_window(args, window, "gdn_forward_window");
  check_activation(out, args.v.shape(), "out");
  const DType sd = accumulator_dtype(args.q.dtype());
  if (!final_state.empty()) detail::check_host_tensor(final_state, {d.B, d.H, d.K, d.V}, sd, "final_state", kFamily);
  check_ahead(ahead, window, false, "gdn_forward_window");
  if (ops::detail::gdn_forward_hook_active()) {
    for (std::int64_t i = 0; i < d.H; ++i) {
      std::vector<Tensor> keep;
      const GdnForwardArgs a = window_head(args, d, window, i, keep);
      Tensor o = Tensor::empty(a.v.shape(), out.dtype(), MemCategory::kWorkspace), fin;
      if (!final_state.empty()) fin = Tensor::empty({d.B, 1, d.K, d.V}, final_state.dtype(), MemCategory::kWorkspace);
      gdn_forward(a, o.view(), fin.defined() ? fin.view() : TensorView(), stream);
      put_window_rows(o.view(), out, window.row_begin, d.head0 + i);
      if (fin.defined()) put_state(fin.view(), final_state, i);
    }
    return;
  }
  const cpu::GdnAheadBuffer buf = ahead_buffer(ahead);
  cpu::gdn_forward_cpu(args, d, out, final_state, buf.data != nullptr ? &buf : nullptr);
}

void gdn_backward_window(const GdnBackwardArgs& args, const GdnWindow& window, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                         const TensorView& dinitial_state, GdnAhead* ahead, Stream stream) {
  detail::check_stream(stream, "gdn_backward_window", kFamily);
  const cpu::GdnDims d = validate_window(args.fwd, window, "gdn_backward_window");
  const DType sd = accumulator_dtype(args.fwd.q.dtype());
  const Shape per_value_head{d.B, d.rows_total, d.heads_total, d.K}, vo = args.fwd.v.shape(), gb = args.fwd.g.shape();
  if (!args.dout.empty()) check_activation(args.dout, vo, "dout");
  if (!args.dfinal_state.empty())
    detail::check_host_tensor(args.dfinal_state, {d.B, d.H, d.K, d.V}, sd, "dfinal_state", kFamily);
  if (!dq.empty()) check_activation(dq, per_value_head, "dq (per value head)");
  if (!dk.empty()) check_activation(dk, per_value_head, "dk (per value head)");
  if (!dv.empty()) check_activation(dv, vo, "dv");
  if (!dg.empty()) check_activation(dg, gb, "dg");
  if (!dbeta.empty()) check_activation(dbeta, gb, "dbeta");
  if (!dinitial_state.empty())
    detail::check_host_tensor(dinitial_state, {d.B, d.H, d.K, d.V}, sd, "dinitial_state", kFamily);
  check_ahead(ahead, window, true, "gdn_backward_window");
  if (ops::detail::gdn_backward_hook_active()) {
    for (std::int64_t i = 0; i < d.H; ++i) {
      const std::int64_t h = d.head0 + i, r0 = window.row_begin;
      std::vector<Tensor> keep;
      GdnBackwardArgs a{window_head(args.fwd, d, window, i, keep), TensorView(), TensorView()};
      if (!args.dout.empty()) {
        keep.push_back(window_rows(args.dout, r0, window.num_rows, h));
        a.dout = keep.back().view();
      }
      if (!args.dfinal_state.empty()) {
        keep.push_back(window_rows(state_rows(args.dfinal_state), 0, 1, i));
        a.dfinal_state = keep.back().view().reshape({d.B, 1, d.K, d.V});
      }
      auto part = [&](const TensorView& whole, const TensorView& like) {
        return whole.empty() ? Tensor() : Tensor::empty(like.shape(), whole.dtype(), MemCategory::kWorkspace);
      };
      auto view = [](const Tensor& t) { return t.defined() ? t.view() : TensorView(); };
      const Tensor pdq = part(dq, a.fwd.q), pdk = part(dk, a.fwd.k), pdv = part(dv, a.fwd.v), pdg = part(dg, a.fwd.g),
                   pdb = part(dbeta, a.fwd.beta),
                   pds = dinitial_state.empty()
                             ? Tensor()
                             : Tensor::empty({d.B, 1, d.K, d.V}, dinitial_state.dtype(), MemCategory::kWorkspace);
      gdn_backward(a, view(pdq), view(pdk), view(pdv), view(pdg), view(pdb), view(pds), stream);
      if (pdq.defined()) put_window_rows(pdq.view(), dq, r0, h);
      if (pdk.defined()) put_window_rows(pdk.view(), dk, r0, h);
      if (pdv.defined()) put_window_rows(pdv.view(), dv, r0, h);
      if (pdg.defined()) put_window_rows(pdg.view(), dg, r0, h);
      if (pdb.defined()) put_window_rows(pdb.view(), dbeta, r0, h);
      if (pds.defined()) put_state(pds.view(), dinitial_state, i);
    }
    return;
  }
  const cpu::GdnAheadBuffer buf = ahead_buffer(ahead);
  cpu::gdn_backward_cpu(args, d, dq, dk, dv, dg, dbeta, dinitial_state, buf.data != nullptr ? &buf : nullptr);
  const bool full = !dq.empty() || !dk.empty() || !dv.empty() || !dg.empty() || !dbeta.empty();
  if (full && buf.data != nullptr) ahead->chunks_done = ahead->num_chunks;  // the sweep completed it in place
}

void gdn_transition(const GdnForwardArgs& args, const TensorView& m, const TensorView& u, Stream stream) {
  if (on_cuda_table(stream, args.q.dtype(), [&](auto& t) { ops::gdn_transition_composed(t, args, m, u); })) return;
  detail::check_stream(stream, "gdn_transition", kFamily);
  if (ops::detail::gdn_transition_hooked(args, m, u)) return;  // test mode (attention/ops/gdn_hook.h)
  cpu::gdn_transition_cpu(args, validate_transition(args, m, u), m, u);
}

void gdn_transition_compose(const TensorView& m2, const TensorView& u2, const TensorView& m1, const TensorView& u1,
                            const TensorView& m, const TensorView& u, Stream stream) {
  if (stream.device.is_cuda() && ops::cuda_ops_built()) {
    const detail::AcceptDevice accept(stream.device);
    check_gdn_transition_compose(m2, u2, m1, u1, m, u, stream);
    on_cuda_table(stream, m2.dtype(), [&](auto& t) {
      ops::gdn_map_product_composed(t, false, m2, m1, {}, m);
      ops::gdn_map_product_composed(t, false, m2, u1, u2, u);
    });
    return;
  }
  check_gdn_transition_compose(m2, u2, m1, u1, m, u, stream);
  if (ops::detail::gdn_map_product_hooked(false, m2, m1, {}, m)) {  // test mode: two products
    ops::detail::gdn_map_product_hooked(false, m2, u1, u2, u);
    return;
  }
  cpu::gdn_transition_compose_cpu(m2, u2, m1, u1, m, u);
}

void gdn_transition_apply(const TensorView& m, const TensorView& u, const TensorView& s_start, const TensorView& s_end,
                          Stream stream) {
  if (stream.device.is_cuda() && ops::cuda_ops_built()) {
    const detail::AcceptDevice accept(stream.device);
    check_gdn_transition_apply(m, u, s_start, s_end, stream);
    on_cuda_table(stream, m.dtype(), [&](auto& t) { ops::gdn_map_product_composed(t, false, m, s_start, u, s_end); });
    return;
  }
  check_gdn_transition_apply(m, u, s_start, s_end, stream);
  if (ops::detail::gdn_map_product_hooked(false, m, s_start, u, s_end)) return;  // test mode
  cpu::gdn_transition_apply_cpu(m, u, s_start, s_end);
}

void gdn_transition_apply_adjoint(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                  const TensorView& ds_start, Stream stream) {
  if (stream.device.is_cuda() && ops::cuda_ops_built()) {
    const detail::AcceptDevice accept(stream.device);
    check_gdn_transition_apply_adjoint(m, ds_end, local, ds_start, stream);
    on_cuda_table(stream, m.dtype(),
                  [&](auto& t) { ops::gdn_map_product_composed(t, true, m, ds_end, local, ds_start); });
    return;
  }
  check_gdn_transition_apply_adjoint(m, ds_end, local, ds_start, stream);
  if (ops::detail::gdn_map_product_hooked(true, m, ds_end, local, ds_start)) return;  // test mode
  cpu::gdn_transition_apply_adjoint_cpu(m, ds_end, local, ds_start);
}

void gdn_transition_transpose(const TensorView& m, const TensorView& mt, Stream stream) {
  if (stream.device.is_cuda() && ops::cuda_ops_built()) {
    const detail::AcceptDevice accept(stream.device);
    check_gdn_transition_transpose(m, mt, stream);
    on_cuda_table(stream, m.dtype(), [&](auto& t) { ops::gdn_map_product_composed(t, true, m, {}, {}, mt); });
    return;
  }
  check_gdn_transition_transpose(m, mt, stream);
  if (ops::detail::gdn_map_product_hooked(true, m, {}, {}, mt)) return;  // test mode
  cpu::gdn_transition_transpose_cpu(m, mt);
}

void short_conv_forward(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state,
                        Stream stream) {
  if (on_cuda_table(stream, args.x.dtype(),
                    [&](auto& t) { ops::short_conv_forward_composed(t, args, out, final_conv_state); }))
    return;
  args.validate(out, final_conv_state, stream);
  if (ops::detail::short_conv_forward_hooked(args, out, final_conv_state)) return;  // test mode
  cpu::short_conv_forward_cpu(args, validate_conv_args(args), out, final_conv_state);
}

void short_conv_backward(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dinitial_conv_state, Stream stream) {
  if (on_cuda_table(stream, args.x.dtype(), [&](auto& t) {
        ops::short_conv_backward_composed(t, args, dout, dx, dweight, dinitial_conv_state);
      }))
    return;
  args.validate(dout, dx, dweight, dinitial_conv_state, stream);
  if (ops::detail::short_conv_backward_hooked(args, dout, dx, dweight, dinitial_conv_state)) return;  // test mode
  cpu::short_conv_backward_cpu(args, validate_conv_args(args), dout, dx, dweight, dinitial_conv_state);
}

GdnForwardArgs gdn_args(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, bool use_qk_l2norm, double scale) {
  GdnForwardArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.g = g;
  a.beta = beta;
  a.use_qk_l2norm = use_qk_l2norm;
  a.scale = scale;
  return a;
}

}  // namespace seqpar::attn
