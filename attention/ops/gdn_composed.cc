// The composed GDN forward (gdn_composed.h).
#include "gdn_composed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../runtime/error.h"
#include "../../runtime/tensor_ops.h"
#include "host_values.h"
#include "ops_cpu.h"

namespace seqpar::attn::ops {
namespace {

struct Segment {
  std::int64_t b = 0, t0 = 0, len = 0, state = 0;  // batch row, first token, tokens, state row
};

// Rows [begin, end) of dim `axis` (0 or 1) of a contiguous host tensor, as a view.
TensorView rows_view(const TensorView& t, int axis, std::int64_t begin, std::int64_t end) {
  if (t.empty()) return t;
  Shape s = t.shape();
  const std::size_t row = t.nbytes() / static_cast<std::size_t>(s[axis]) / (axis == 1 ? s[0] : 1);
  s[axis] = end - begin;
  return TensorView(static_cast<char*>(t.data()) + begin * row, t.dtype(), s, t.device());
}

template <typename T>
void compose(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state,
             const TensorView& m_out, const TensorView& u_out);

}  // namespace

template <typename T>
void gdn_forward_composed(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& out,
                          const TensorView& final_state) {
  args.validate(out, final_state);
  if (!args.cu_seqlens.empty()) {
    // A packed row: document by document, each as a row of its own (its own chunking: the result of a document is
    // bitwise the one it gets alone, as with the CPU kernel).
    const std::int64_t* cu = args.cu_seqlens.data_as<std::int64_t>();
    for (std::int64_t d = 0; d + 1 < args.cu_seqlens.numel(); ++d) {
      GdnForwardArgs doc = args;
      doc.cu_seqlens = TensorView();
      doc.q = rows_view(args.q, 1, cu[d], cu[d + 1]);
      doc.k = rows_view(args.k, 1, cu[d], cu[d + 1]);
      doc.v = rows_view(args.v, 1, cu[d], cu[d + 1]);
      doc.g = rows_view(args.g, 1, cu[d], cu[d + 1]);
      doc.beta = rows_view(args.beta, 1, cu[d], cu[d + 1]);
      doc.initial_state = rows_view(args.initial_state, 0, d, d + 1);
      gdn_forward_composed(ops, doc, rows_view(out, 1, cu[d], cu[d + 1]), rows_view(final_state, 0, d, d + 1));
    }
    return;
  }
  compose(ops, args, out, final_state, TensorView(), TensorView());
}

template <typename T>
void gdn_transition_composed(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& m, const TensorView& u) {
  args.validate();
  SEQPAR_CHECK(args.initial_state.empty(),
               "gdn_transition: initial_state must be empty (a map is taken from a zero "
               "start state)");
  SEQPAR_CHECK(args.cu_seqlens.empty(),
               "gdn_transition: cu_seqlens must be empty (take the map of each piece between document starts)");
  const std::int64_t B = args.q.dim(0), K = args.q.dim(3), H = args.v.dim(2), V = args.v.dim(3);
  const DType sd = dtype_v<T>;
  SEQPAR_CHECK(m.dtype() == sd && m.shape() == Shape({B, H, K, K}), "gdn_transition: m must be ", dtype_name(sd), " [",
               B, ", ", H, ", ", K, ", ", K, "], got ", m.str());
  SEQPAR_CHECK(u.dtype() == sd && u.shape() == Shape({B, H, K, V}), "gdn_transition: u must be ", dtype_name(sd), " [",
               B, ", ", H, ", ", K, ", ", V, "], got ", u.str());
  compose(ops, args, TensorView(), TensorView(), m, u);
}

namespace {

template <typename T>
void compose(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state,
             const TensorView& m_out, const TensorView& u_out) {
  const std::int64_t B = args.q.dim(0), S = args.q.dim(1), Hk = args.q.dim(2), K = args.q.dim(3);
  const std::int64_t H = args.v.dim(2), V = args.v.dim(3), G = H / Hk;
  const std::int64_t C =
      std::max<std::int64_t>(1, std::min({args.chunk_size, kGdnMaxChunkSize, std::max<std::int64_t>(S, 1)}));
  const T scale = args.scale > 0.0f ? static_cast<T>(args.scale) : T(1) / std::sqrt(static_cast<T>(K));

  std::vector<Segment> segs;
  for (std::int64_t b = 0; b < B; ++b) segs.push_back({b, 0, S, b});
  const std::int64_t nseg = static_cast<std::int64_t>(segs.size());
  std::int64_t N = 1;
  for (const Segment& s : segs) N = std::max(N, (s.len + C - 1) / C);
  const std::int64_t BH = nseg * H, NC = BH * N, R = NC * C, KV = K * V;

  // ---- 1. gather the rows of every (segment, head, chunk, token) slot; padding slots get -1 (zero rows) ----
  std::vector<std::int64_t> qk_idx(R), v_idx(R), init_idx(BH), fin_idx(BH);
  for (std::int64_t s = 0; s < nseg; ++s)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t bh = s * H + h;
      init_idx[bh] = args.initial_state.empty() ? -1 : segs[s].state * H + h;
      fin_idx[bh] = segs[s].state * H + h;
      for (std::int64_t p = 0; p < N * C; ++p) {
        const std::int64_t row = bh * N * C + p;
        const std::int64_t tok = (segs[s].b * S + segs[s].t0 + p);
        qk_idx[row] = p < segs[s].len ? tok * Hk + h / G : -1;
        v_idx[row] = p < segs[s].len ? tok * H + h : -1;
      }
    }
  const Buffer<std::int64_t> d_qk_idx(ops, qk_idx), d_v_idx(ops, v_idx), d_init_idx(ops, init_idx),
      d_fin_idx(ops, fin_idx);
  const Buffer<T> in_q(ops, host_values<T>(args.q)), in_k(ops, host_values<T>(args.k)),
      in_v(ops, host_values<T>(args.v)), in_g(ops, host_values<T>(args.g)), in_beta(ops, host_values<T>(args.beta)),
      in_init(ops, host_values<T>(args.initial_state));

  Buffer<T> q(ops, R * K), k(ops, R * K), v(ops, R * V), gamma(ops, R), beta(ops, R);
  ops.gather_rows(R, K, in_q.get(), K, d_qk_idx.get(), q.get(), K);
  ops.gather_rows(R, K, in_k.get(), K, d_qk_idx.get(), k.get(), K);
  ops.gather_rows(R, V, in_v.get(), V, d_v_idx.get(), v.get(), V);
  ops.gather_rows(R, 1, in_g.get(), 1, d_v_idx.get(), gamma.get(), 1);
  ops.gather_rows(R, 1, in_beta.get(), 1, d_v_idx.get(), beta.get(), 1);
  const T eps = args.use_qk_l2norm ? static_cast<T>(kGdnL2NormEps) : T(-1);
  ops.l2norm_scale_rows(R, K, q.get(), K, eps, scale);
  ops.l2norm_scale_rows(R, K, k.get(), K, eps, T(1));
  ops.cumsum_rows(NC, C, gamma.get(), C);

  // ---- 2. per chunk: decay masks, the WY representation ----
  Buffer<T> kscale(ops, R), vscale(ops, R), qscale(ops, R), kend(ops, R), end_decay(ops, NC);
  ops.gdn_chunk_scales(NC, C, gamma.get(), beta.get(), kscale.get(), vscale.get(), qscale.get(), kend.get(),
                       end_decay.get());
  Buffer<T> a(ops, NC * C * C), qk(ops, NC * C * C);
  const Batch chunks{1, NC};
  const Mat<const T> kc{k.get(), K, 0, C * K}, qc{q.get(), K, 0, C * K};
  ops.gemm(Trans::kN, Trans::kT, C, C, K, T(1), kc, kc, T(0), Mat<T>{a.get(), C, 0, C * C}, chunks);
  ops.gemm(Trans::kN, Trans::kT, C, C, K, T(1), qc, kc, T(0), Mat<T>{qk.get(), C, 0, C * C}, chunks);
  ops.gdn_chunk_masks(NC, C, gamma.get(), beta.get(), a.get(), qk.get());
  Buffer<T> w(ops, R * K), u(ops, R * V), kt(ops, R * K);
  const Batch rows_all{1, 1};
  ops.copy(R, K, Mat<const T>{k.get(), K}, Mat<T>{w.get(), K}, rows_all);
  ops.copy(R, V, Mat<const T>{v.get(), V}, Mat<T>{u.get(), V}, rows_all);
  ops.copy(R, K, Mat<const T>{k.get(), K}, Mat<T>{kt.get(), K}, rows_all);
  ops.scale_rows(R, K, w.get(), K, kscale.get());
  ops.scale_rows(R, V, u.get(), V, vscale.get());
  ops.scale_rows(R, K, kt.get(), K, kend.get());
  const Mat<const T> ac{a.get(), C, 0, C * C};
  ops.trsm_unit_lower(C, K, ac, Mat<T>{w.get(), K, 0, C * K}, chunks);
  ops.trsm_unit_lower(C, V, ac, Mat<T>{u.get(), V, 0, C * V}, chunks);

  // ---- 3. chunk maps; 4. the scan for the chunk start states ----
  // st [BH, N + 1, K, V]: st[bh, 0] = the segment's initial state, st[bh, c + 1] = the state after chunk c.
  Buffer<T> m(ops, NC * K * K), st(ops, BH * (N + 1) * KV);
  const Batch seg_chunks{BH, N};
  const Mat<T> mm{m.get(), K, N * K * K, K * K};
  const Mat<T> st_next{st.get() + KV, V, (N + 1) * KV, KV};
  const Mat<const T> st_start{st.get(), V, (N + 1) * KV, KV}, st0{st.get(), V, (N + 1) * KV, 0};
  const Mat<const T> ktc{kt.get(), K, N * C * K, C * K}, wc{w.get(), K, N * C * K, C * K};
  const Mat<const T> uc{u.get(), V, N * C * V, C * V};
  ops.scaled_identity(K, end_decay.get(), N, 1, mm, seg_chunks);
  ops.gemm(Trans::kT, Trans::kN, K, K, C, T(-1), ktc, wc, T(1), mm, seg_chunks);
  ops.gemm(Trans::kT, Trans::kN, K, V, C, T(1), ktc, uc, T(0), st_next, seg_chunks);
  ops.gather_rows(BH, KV, in_init.get(), KV, d_init_idx.get(), st.get(), (N + 1) * KV);
  scan_affine(ops, BH, N, K, V, mm, st_next);
  if (!args.initial_state.empty())
    ops.gemm(Trans::kN, Trans::kN, K, V, K, T(1), Mat<const T>{m.get(), K, N * K * K, K * K}, st0, T(1), st_next,
             seg_chunks);

  const auto write = [&](const TensorView& dst, const T* src, std::int64_t width, std::int64_t ld) {
    Buffer<T> buf(ops, dst.numel());
    ops.scatter_add_rows(BH, width, src, ld, d_fin_idx.get(), buf.get(), width);
    std::vector<T> host(static_cast<std::size_t>(buf.size()));
    ops.download(host.data(), buf.get(), host.size() * sizeof(T));
    copy_convert(TensorView(host.data(), dtype_v<T>, dst.shape()), dst);
  };
  if (!m_out.empty()) {  // a segment map: the scan's last element (the start state is zero)
    write(m_out, m.get() + (N - 1) * K * K, K * K, N * K * K);
    write(u_out, st.get() + N * KV, KV, (N + 1) * KV);
    return;
  }
  if (!final_state.empty()) write(final_state, st.get() + N * KV, KV, (N + 1) * KV);

  // ---- 5. outputs ----
  // V' = U - W S_c (in place of u); out = diag(e^gamma) Q S_c + (Q K^T masked) V'
  ops.gemm(Trans::kN, Trans::kN, C, V, K, T(-1), wc, st_start, T(1), Mat<T>{u.get(), V, N * C * V, C * V}, seg_chunks);
  Buffer<T> o(ops, R * V);
  ops.scale_rows(R, K, q.get(), K, qscale.get());
  const Mat<T> oc{o.get(), V, N * C * V, C * V};
  ops.gemm(Trans::kN, Trans::kN, C, V, K, T(1), Mat<const T>{q.get(), K, N * C * K, C * K}, st_start, T(0), oc,
           seg_chunks);
  ops.gemm(Trans::kN, Trans::kN, C, V, C, T(1), Mat<const T>{qk.get(), C, N * C * C, C * C}, uc, T(1), oc, seg_chunks);

  Buffer<T> out_t(ops, B * S * H * V);
  ops.scatter_add_rows(R, V, o.get(), V, d_v_idx.get(), out_t.get(), V);
  if (!out.empty()) {
    std::vector<T> host(static_cast<std::size_t>(out_t.size()));
    ops.download(host.data(), out_t.get(), host.size() * sizeof(T));
    copy_convert(TensorView(host.data(), dtype_v<T>, out.shape()), out);
  }
}

}  // namespace

template void gdn_forward_composed<float>(Ops<float>&, const GdnForwardArgs&, const TensorView&, const TensorView&);
template void gdn_forward_composed<double>(Ops<double>&, const GdnForwardArgs&, const TensorView&, const TensorView&);
template void gdn_transition_composed<float>(Ops<float>&, const GdnForwardArgs&, const TensorView&, const TensorView&);
template void gdn_transition_composed<double>(Ops<double>&, const GdnForwardArgs&, const TensorView&,
                                              const TensorView&);

void gdn_forward_composed_cpu(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) { gdn_forward_composed(ops, args, out, final_state); });
}

void gdn_transition_composed_cpu(const GdnForwardArgs& args, const TensorView& m, const TensorView& u) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) { gdn_transition_composed(ops, args, m, u); });
}

}  // namespace seqpar::attn::ops
