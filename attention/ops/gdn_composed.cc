// The composed GDN forward, backward, segment map and map algebra (gdn_composed.h).
#include "gdn_composed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../../runtime/error.h"
#include "../../runtime/tensor_ops.h"
#include "staging.h"
#include "ops_cpu.h"

namespace seqpar::attn::ops {
namespace {

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
template <typename T>
void compose_backward(Ops<T>& ops, const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                      const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                      const TensorView& dinitial_state);

// Document d (rows [begin, end)) of a packed row's forward arguments, as an unpacked row.
GdnForwardArgs document(const GdnForwardArgs& args, std::int64_t d, std::int64_t begin, std::int64_t end) {
  GdnForwardArgs doc = args;
  doc.cu_seqlens = TensorView();
  doc.q = rows_view(args.q, 1, begin, end);
  doc.k = rows_view(args.k, 1, begin, end);
  doc.v = rows_view(args.v, 1, begin, end);
  doc.g = rows_view(args.g, 1, begin, end);
  doc.beta = rows_view(args.beta, 1, begin, end);
  doc.initial_state = rows_view(args.initial_state, 0, d, d + 1);
  return doc;
}

}  // namespace

template <typename T>
void gdn_forward_composed(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& out,
                          const TensorView& final_state) {
  args.validate(out, final_state);
  if (!args.cu_seqlens.empty()) {
    // A packed row: document by document, each as a row of its own (its own chunking: the result of a document is
    // bitwise the one it gets alone, as with the CPU kernel).
    const std::int64_t* cu = args.cu_seqlens.data_as<std::int64_t>();
    for (std::int64_t d = 0; d + 1 < args.cu_seqlens.numel(); ++d)
      gdn_forward_composed(ops, document(args, d, cu[d], cu[d + 1]), rows_view(out, 1, cu[d], cu[d + 1]),
                           rows_view(final_state, 0, d, d + 1));
    return;
  }
  compose(ops, args, out, final_state, TensorView(), TensorView());
}

template <typename T>
void gdn_backward_composed(Ops<T>& ops, const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                           const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                           const TensorView& dinitial_state) {
  args.validate(dq, dk, dv, dg, dbeta, dinitial_state);
  if (!args.fwd.cu_seqlens.empty()) {  // document by document, as the forward
    const std::int64_t* cu = args.fwd.cu_seqlens.data_as<std::int64_t>();
    for (std::int64_t d = 0; d + 1 < args.fwd.cu_seqlens.numel(); ++d) {
      const std::int64_t b = cu[d], e = cu[d + 1];
      const GdnBackwardArgs doc{document(args.fwd, d, b, e), rows_view(args.dout, 1, b, e),
                                rows_view(args.dfinal_state, 0, d, d + 1)};
      gdn_backward_composed(ops, doc, rows_view(dq, 1, b, e), rows_view(dk, 1, b, e), rows_view(dv, 1, b, e),
                            rows_view(dg, 1, b, e), rows_view(dbeta, 1, b, e), rows_view(dinitial_state, 0, d, d + 1));
    }
    return;
  }
  compose_backward(ops, args, dq, dk, dv, dg, dbeta, dinitial_state);
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

// The sizes of one call: R = B Hv segments (batch row, value head) of N chunks of C tokens.
struct Dims {
  std::int64_t B = 0, S = 0, Hk = 0, K = 0, H = 0, V = 0, G = 1, C = 1, N = 1, BH = 0, NC = 0, R = 0, KV = 0;
  explicit Dims(const GdnForwardArgs& a)
      : B(a.q.dim(0)), S(a.q.dim(1)), Hk(a.q.dim(2)), K(a.q.dim(3)), H(a.v.dim(2)), V(a.v.dim(3)), G(H / Hk) {
    C = std::max<std::int64_t>(1, std::min({a.chunk_size, kGdnMaxChunkSize, std::max<std::int64_t>(S, 1)}));
    N = std::max<std::int64_t>(1, (S + C - 1) / C);
    BH = B * H, NC = BH * N, R = NC * C, KV = K * V;
  }
};

template <typename T>
using Buf = std::unique_ptr<Buffer<T>>;

// Steps 1 to 4 of the file comment (what the forward, the segment map and the backward share), as table calls.
template <typename T>
struct Prepared {
  const Dims d;
  Ops<T>& ops;
  T scale, eps;
  // Row maps: qk_idx / v_idx [R] (slot -> row of q, k / of v, g, beta; -1 for padding), state_idx [BH] (segment ->
  // state row), rev_idx [NC] ((bh, j) -> (bh, N - 1 - j)).
  Buf<std::int64_t> qk_idx, v_idx, state_idx, rev_idx;
  std::unique_ptr<Input<T>> in_q, in_k;  // the raw inputs (the L2 norm backward reads them)
  Buf<T> q, k, v, gamma, beta;  // [R, *]: normalised and scaled q, normalised k
  Buf<T> kscale, vscale, qscale, kend, end_decay;
  Buf<T> kk, qk;    // raw k k^T, q k^T [NC, C, C] (backward only)
  Buf<T> a, p;      // A and the masked decayed q k^T [NC, C, C]
  Buf<T> w, u, kt;  // W, U, K~ [R, *]
  Buf<T> m, st;     // chunk maps M_c [NC, K, K]; states [BH, N + 1, K, V]

  template <typename E>
  Buf<E> make(std::int64_t n) {
    return std::make_unique<Buffer<E>>(ops, n);
  }
  template <typename E>
  Buf<E> make(const std::vector<E>& host) {
    return std::make_unique<Buffer<E>>(ops, host);
  }

  // with_v: gather v and compute U (the forward, the map, the full backward); raw: keep k k^T and q k^T.
  Prepared(Ops<T>& o, const GdnForwardArgs& args, bool with_v, bool raw) : d(args), ops(o) {
    const std::int64_t R = d.R, K = d.K, V = d.V, C = d.C, N = d.N, NC = d.NC;
    scale = args.scale > 0.0 ? static_cast<T>(args.scale) : T(1) / std::sqrt(static_cast<T>(K));
    eps = args.use_qk_l2norm ? static_cast<T>(kGdnL2NormEps) : T(-1);
    std::vector<std::int64_t> qki(R), vi(R), sti(d.BH), rev(NC);
    for (std::int64_t bh = 0; bh < d.BH; ++bh) {
      const std::int64_t b = bh / d.H, h = bh % d.H;
      sti[bh] = bh;
      for (std::int64_t j = 0; j < N; ++j) rev[bh * N + j] = bh * N + N - 1 - j;
      for (std::int64_t t = 0; t < N * C; ++t) {
        const std::int64_t tok = b * d.S + t;
        qki[bh * N * C + t] = t < d.S ? tok * d.Hk + h / d.G : -1;
        vi[bh * N * C + t] = t < d.S ? tok * d.H + h : -1;
      }
    }
    qk_idx = make(qki), v_idx = make(vi), state_idx = make(sti), rev_idx = make(rev);
    in_q = std::make_unique<Input<T>>(ops, args.q, "q");
    in_k = std::make_unique<Input<T>>(ops, args.k, "k");

    // ---- 1. gather, L2 norm and scale, cumulative decay ----
    q = make<T>(R * K), k = make<T>(R * K), v = make<T>(R * V), gamma = make<T>(R), beta = make<T>(R);
    {
      const Input<T> in_g(ops, args.g, "g"), in_beta(ops, args.beta, "beta");
      ops.gather_rows(R, K, in_q->get(), K, qk_idx->get(), q->get(), K);
      ops.gather_rows(R, K, in_k->get(), K, qk_idx->get(), k->get(), K);
      ops.gather_rows(R, 1, in_g.get(), 1, v_idx->get(), gamma->get(), 1);
      ops.gather_rows(R, 1, in_beta.get(), 1, v_idx->get(), beta->get(), 1);
    }
    if (with_v) {
      const Input<T> in_v(ops, args.v, "v");
      ops.gather_rows(R, V, in_v.get(), V, v_idx->get(), v->get(), V);
    }
    ops.l2norm_scale_rows(R, K, q->get(), K, eps, scale);
    ops.l2norm_scale_rows(R, K, k->get(), K, eps, T(1));
    ops.cumsum_rows(NC, C, gamma->get(), C);

    // ---- 2. per chunk: decay masks, the WY representation ----
    kscale = make<T>(R), vscale = make<T>(R), qscale = make<T>(R), kend = make<T>(R), end_decay = make<T>(NC);
    ops.gdn_chunk_scales(NC, C, gamma->get(), beta->get(), kscale->get(), vscale->get(), qscale->get(), kend->get(),
                         end_decay->get());
    a = make<T>(NC * C * C), p = make<T>(NC * C * C);
    const Batch chunks{1, NC};
    const Mat<const T> kc{k->get(), K, 0, C * K}, qc{q->get(), K, 0, C * K};
    ops.gemm(Trans::kN, Trans::kT, C, C, K, T(1), kc, kc, T(0), Mat<T>{a->get(), C, 0, C * C}, chunks);
    ops.gemm(Trans::kN, Trans::kT, C, C, K, T(1), qc, kc, T(0), Mat<T>{p->get(), C, 0, C * C}, chunks);
    if (raw) {
      kk = make<T>(NC * C * C), qk = make<T>(NC * C * C);
      const Batch all{1, 1};
      ops.copy(NC * C, C, Mat<const T>{a->get(), C}, Mat<T>{kk->get(), C}, all);
      ops.copy(NC * C, C, Mat<const T>{p->get(), C}, Mat<T>{qk->get(), C}, all);
    }
    ops.gdn_chunk_masks(NC, C, gamma->get(), beta->get(), a->get(), p->get());
    w = make<T>(R * K), u = make<T>(R * V), kt = make<T>(R * K);
    const Batch rows_all{1, 1};
    ops.copy(R, K, Mat<const T>{k->get(), K}, Mat<T>{w->get(), K}, rows_all);
    ops.copy(R, K, Mat<const T>{k->get(), K}, Mat<T>{kt->get(), K}, rows_all);
    ops.scale_rows(R, K, w->get(), K, kscale->get());
    ops.scale_rows(R, K, kt->get(), K, kend->get());
    const Mat<const T> ac{a->get(), C, 0, C * C};
    ops.trsm_unit_lower(C, K, ac, Mat<T>{w->get(), K, 0, C * K}, chunks);
    if (with_v) {
      ops.copy(R, V, Mat<const T>{v->get(), V}, Mat<T>{u->get(), V}, rows_all);
      ops.scale_rows(R, V, u->get(), V, vscale->get());
      ops.trsm_unit_lower(C, V, ac, Mat<T>{u->get(), V, 0, C * V}, chunks);
    }
  }

  Mat<const T> chunked(const Buf<T>& b, std::int64_t width) const {
    return Mat<const T>{b->get(), width, d.N * d.C * width, d.C * width};
  }

  // ---- 3. chunk maps; 4. the scan for the chunk start states ----
  // st [BH, N + 1, K, V]: st[bh, 0] = the segment's initial state (init: its values, or empty for zeros),
  // st[bh, c + 1] = the state after chunk c. m: the scanned maps (the last one of a segment is its map).
  void scan_states(const TensorView& initial_state) {
    const Input<T> init(ops, initial_state, "initial_state");
    const std::int64_t K = d.K, V = d.V, N = d.N, KV = d.KV;
    m = make<T>(d.NC * K * K), st = make<T>(d.BH * (N + 1) * KV);
    const Batch seg_chunks{d.BH, N};
    const Mat<T> mm{m->get(), K, N * K * K, K * K};
    const Mat<T> st_next{st->get() + KV, V, (N + 1) * KV, KV};
    const Mat<const T> st0{st->get(), V, (N + 1) * KV, 0};
    ops.scaled_identity(K, end_decay->get(), N, 1, mm, seg_chunks);
    ops.gemm(Trans::kT, Trans::kN, K, K, d.C, T(-1), chunked(kt, K), chunked(w, K), T(1), mm, seg_chunks);
    ops.gemm(Trans::kT, Trans::kN, K, V, d.C, T(1), chunked(kt, K), chunked(u, V), T(0), st_next, seg_chunks);
    if (init.get() != nullptr) ops.gather_rows(d.BH, KV, init.get(), KV, state_idx->get(), st->get(), (N + 1) * KV);
    scan_affine(ops, d.BH, N, K, V, mm, st_next);
    if (init.get() != nullptr)
      ops.gemm(Trans::kN, Trans::kN, K, V, K, T(1), Mat<const T>{m->get(), K, N * K * K, K * K}, st0, T(1), st_next,
               seg_chunks);
  }

  // dst (any dtype, `rows` rows of `width`) = rows of src (stride ld) scattered by idx.
  void write(const TensorView& dst, std::int64_t rows, const T* src, std::int64_t width, std::int64_t ld,
             const Buf<std::int64_t>& idx) {
    if (dst.empty()) return;
    Buffer<T> buf(ops, dst.numel());
    ops.scatter_add_rows(rows, width, src, ld, idx->get(), buf.get(), width);
    write_output(ops, buf.get(), dst, "output");
  }
};

template <typename T>
void compose(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state,
             const TensorView& m_out, const TensorView& u_out) {
  Prepared<T> pr(ops, args, true, false);
  const Dims& d = pr.d;
  const std::int64_t K = d.K, V = d.V, C = d.C, N = d.N, KV = d.KV;
  pr.scan_states(args.initial_state);
  if (!m_out.empty()) {  // a segment map: the scan's last element (the start state is zero)
    pr.write(m_out, d.BH, pr.m->get() + (N - 1) * K * K, K * K, N * K * K, pr.state_idx);
    pr.write(u_out, d.BH, pr.st->get() + N * KV, KV, (N + 1) * KV, pr.state_idx);
    return;
  }
  pr.write(final_state, d.BH, pr.st->get() + N * KV, KV, (N + 1) * KV, pr.state_idx);

  // ---- 5. outputs ----
  // V' = U - W S_c (in place of u); out = diag(e^gamma) Q S_c + (Q K^T masked) V'
  const Batch seg_chunks{d.BH, N};
  const Mat<const T> st_start{pr.st->get(), V, (N + 1) * KV, KV};
  ops.gemm(Trans::kN, Trans::kN, C, V, K, T(-1), pr.chunked(pr.w, K), st_start, T(1),
           Mat<T>{pr.u->get(), V, N * C * V, C * V}, seg_chunks);
  Buffer<T> o(ops, d.R * V);
  ops.scale_rows(d.R, K, pr.q->get(), K, pr.qscale->get());
  const Mat<T> oc{o.get(), V, N * C * V, C * V};
  ops.gemm(Trans::kN, Trans::kN, C, V, K, T(1), pr.chunked(pr.q, K), st_start, T(0), oc, seg_chunks);
  ops.gemm(Trans::kN, Trans::kN, C, V, C, T(1), Mat<const T>{pr.p->get(), C, N * C * C, C * C}, pr.chunked(pr.u, V),
           T(1), oc, seg_chunks);
  pr.write(out, d.R, o.get(), V, V, pr.v_idx);
}

// The backward of one unpacked call (docs/design.md, "The ops table": the chunk adjoints, the reverse scan of
// (M_c^T, L_c) for every chunk's dS_end, then the per-chunk gradients by batched GEMMs and the row kernels).
template <typename T>
void compose_backward(Ops<T>& ops, const GdnBackwardArgs& args, const TensorView& dq_out, const TensorView& dk_out,
                      const TensorView& dv_out, const TensorView& dg_out, const TensorView& dbeta_out,
                      const TensorView& dinit_out) {
  const bool full = !dq_out.empty() || !dk_out.empty() || !dv_out.empty() || !dg_out.empty() || !dbeta_out.empty();
  Prepared<T> pr(ops, args.fwd, full, full);
  const Dims& d = pr.d;
  const std::int64_t K = d.K, V = d.V, C = d.C, N = d.N, NC = d.NC, R = d.R, KV = d.KV, KK = K * K;
  const Batch chunks{1, NC};
  const Batch all{1, 1};
  const auto cm = [C](const Buf<T>& b, std::int64_t width) { return Mat<const T>{b->get(), width, 0, C * width}; };
  const auto cw = [C](const Buf<T>& b, std::int64_t width) { return Mat<T>{b->get(), width, 0, C * width}; };
  const auto sq = [](const Buf<T>& b, std::int64_t rows, std::int64_t cols) {
    return Mat<const T>{b->get(), cols, 0, rows * cols};
  };
  const auto sqw = [](const Buf<T>& b, std::int64_t rows, std::int64_t cols) {
    return Mat<T>{b->get(), cols, 0, rows * cols};
  };

  // dO and diag(e^gamma) dO
  Buf<T> dout = pr.template make<T>(R * V), dog = pr.template make<T>(R * V);
  if (!args.dout.empty()) {
    const Input<T> in_dout(ops, args.dout, "dout");
    ops.gather_rows(R, V, in_dout.get(), V, pr.v_idx->get(), dout->get(), V);
  }
  ops.copy(R, V, Mat<const T>{dout->get(), V}, Mat<T>{dog->get(), V}, all);
  ops.scale_rows(R, V, dog->get(), V, pr.qscale->get());

  // dS_start = M_c^T dS_end + L_c per chunk, with M_c^T = e^(gamma_C) I - W^T K~ and L_c = Q^T dOg - W^T X,
  // X = P^T dO (dV' = K~ dS_end + X).
  Buf<T> x = pr.template make<T>(R * V), mt = pr.template make<T>(NC * KK), l = pr.template make<T>(NC * KV);
  ops.gemm(Trans::kT, Trans::kN, C, V, C, T(1), sq(pr.p, C, C), cm(dout, V), T(0), cw(x, V), chunks);
  ops.gemm(Trans::kT, Trans::kN, K, V, C, T(1), cm(pr.q, K), cm(dog, V), T(0), sqw(l, K, V), chunks);
  ops.gemm(Trans::kT, Trans::kN, K, V, C, T(-1), cm(pr.w, K), cm(x, V), T(1), sqw(l, K, V), chunks);
  ops.scaled_identity(K, pr.end_decay->get(), 0, 1, sqw(mt, K, K), chunks);
  ops.gemm(Trans::kT, Trans::kN, K, K, C, T(-1), cm(pr.w, K), cm(pr.kt, K), T(1), sqw(mt, K, K), chunks);
  pr.m.reset();

  // The reverse scan: the chunks of each segment in reverse order; dsr[bh, 0] = dS_final, dsr[bh, j + 1] = dS_start
  // of chunk N - 1 - j.
  Buf<T> mr = pr.template make<T>(NC * KK), dsr = pr.template make<T>(d.BH * (N + 1) * KV);
  ops.gather_rows(NC, KK, mt->get(), KK, pr.rev_idx->get(), mr->get(), KK);
  {
    // rows (bh, j) of L reversed into dsr[bh, j + 1]: gather to a compact buffer first, then copy with the stride
    Buffer<T> lr(ops, NC * KV);
    ops.gather_rows(NC, KV, l->get(), KV, pr.rev_idx->get(), lr.get(), KV);
    ops.copy(N, KV, Mat<const T>{lr.get(), KV, N * KV, 0}, Mat<T>{dsr->get() + KV, KV, (N + 1) * KV, 0},
             Batch{d.BH, 1});
  }
  mt.reset(), l.reset();
  const Mat<T> mrm{mr->get(), K, N * KK, KK};
  const Mat<T> dsr_next{dsr->get() + KV, V, (N + 1) * KV, KV};
  const Batch seg_chunks{d.BH, N};
  if (!args.dfinal_state.empty()) {
    const Input<T> in_dfin(ops, args.dfinal_state, "dfinal_state");
    ops.gather_rows(d.BH, KV, in_dfin.get(), KV, pr.state_idx->get(), dsr->get(), (N + 1) * KV);
  }
  scan_affine(ops, d.BH, N, K, V, mrm, dsr_next);
  if (!args.dfinal_state.empty())
    ops.gemm(Trans::kN, Trans::kN, K, V, K, T(1), Mat<const T>{mr->get(), K, N * KK, KK},
             Mat<const T>{dsr->get(), V, (N + 1) * KV, 0}, T(1), dsr_next, seg_chunks);
  mr.reset();
  pr.write(dinit_out, d.BH, dsr->get() + N * KV, KV, (N + 1) * KV, pr.state_idx);
  if (!full) return;

  // Chunk start states S_0 and end-state gradients dS, both [NC, K, V] in chunk order.
  pr.scan_states(args.fwd.initial_state);
  pr.m.reset();
  Buf<T> s0 = pr.template make<T>(NC * KV), ds = pr.template make<T>(NC * KV);
  {
    std::vector<std::int64_t> si(NC), di(NC);
    for (std::int64_t bh = 0; bh < d.BH; ++bh)
      for (std::int64_t c = 0; c < N; ++c) {
        si[bh * N + c] = bh * (N + 1) + c;
        di[bh * N + c] = bh * (N + 1) + N - 1 - c;
      }
    const Buffer<std::int64_t> sidx(ops, si), didx(ops, di);
    ops.gather_rows(NC, KV, pr.st->get(), KV, sidx.get(), s0->get(), KV);
    ops.gather_rows(NC, KV, dsr->get(), KV, didx.get(), ds->get(), KV);
  }
  pr.st.reset(), dsr.reset();

  // T = (I + A)^-1 explicitly (the backward multiplies by T^T); V' = U - W S_0; dV' = K~ dS + X.
  Buf<T> tinv = pr.template make<T>(NC * C * C), vp = pr.template make<T>(R * V);
  {
    const T one = T(1);
    const Buffer<T> ones(ops, std::vector<T>{one});
    ops.scaled_identity(C, ones.get(), 0, 0, sqw(tinv, C, C), chunks);
  }
  ops.trsm_unit_lower(C, C, sq(pr.a, C, C), sqw(tinv, C, C), chunks);
  ops.copy(R, V, Mat<const T>{pr.u->get(), V}, Mat<T>{vp->get(), V}, all);
  ops.gemm(Trans::kN, Trans::kN, C, V, K, T(-1), cm(pr.w, K), sq(s0, K, V), T(1), cw(vp, V), chunks);
  Buf<T>& dvp = x;
  ops.gemm(Trans::kN, Trans::kN, C, V, K, T(1), cm(pr.kt, K), sq(ds, K, V), T(1), cw(dvp, V), chunks);

  // Inter-chunk output term: dq = dOg S_0^T (and dgamma_i += dq_i . q_i); end state: dK~ = V' dS^T,
  // (dk += diag(kend) dK~, dgamma from K~ and from e^(gamma_C) S_0).
  Buf<T> dq = pr.template make<T>(R * K), dkt = pr.template make<T>(R * K);
  Buf<T> dqq = pr.template make<T>(R), dktk = pr.template make<T>(R), sds = pr.template make<T>(NC);
  ops.gemm(Trans::kN, Trans::kT, C, K, V, T(1), cm(dog, V), sq(s0, K, V), T(0), cw(dq, K), chunks);
  ops.row_dots(R, K, dq->get(), K, pr.q->get(), K, dqq->get());
  ops.row_dots(NC, KV, s0->get(), KV, ds->get(), KV, sds->get());
  ops.gemm(Trans::kN, Trans::kT, C, K, V, T(1), cm(vp, V), sq(ds, K, V), T(0), cw(dkt, K), chunks);
  ops.row_dots(R, K, dkt->get(), K, pr.kt->get(), K, dktk->get());
  ops.scale_rows(R, K, dkt->get(), K, pr.kend->get());
  dog.reset(), ds.reset();

  // Intra-chunk term: dP = dO V'^T. V' = U - W S_0: dW = -dV' S_0^T. W = T diag(beta e^gamma) K, U = T diag(beta) V:
  // dkb = T^T dW, dvb = T^T dV', dA = -(dvb U^T + dkb W^T).
  Buf<T> dp = pr.template make<T>(NC * C * C), dw = pr.template make<T>(R * K);
  ops.gemm(Trans::kN, Trans::kT, C, C, V, T(1), cm(dout, V), cm(vp, V), T(0), sqw(dp, C, C), chunks);
  ops.gemm(Trans::kN, Trans::kT, C, K, V, T(-1), cm(dvp, V), sq(s0, K, V), T(0), cw(dw, K), chunks);
  dout.reset(), vp.reset(), s0.reset();
  Buf<T> dkb = pr.template make<T>(R * K), dvb = pr.template make<T>(R * V), da = pr.template make<T>(NC * C * C);
  ops.gemm(Trans::kT, Trans::kN, C, K, C, T(1), sq(tinv, C, C), cm(dw, K), T(0), cw(dkb, K), chunks);
  ops.gemm(Trans::kT, Trans::kN, C, V, C, T(1), sq(tinv, C, C), cm(dvp, V), T(0), cw(dvb, V), chunks);
  ops.gemm(Trans::kN, Trans::kT, C, C, V, T(-1), cm(dvb, V), cm(pr.u, V), T(0), sqw(da, C, C), chunks);
  ops.gemm(Trans::kN, Trans::kT, C, C, K, T(-1), cm(dkb, K), cm(pr.w, K), T(1), sqw(da, C, C), chunks);
  tinv.reset(), dw.reset(), dvp.reset();
  Buf<T> dkbk = pr.template make<T>(R), dvbv = pr.template make<T>(R);
  ops.row_dots(R, K, dkb->get(), K, pr.k->get(), K, dkbk->get());
  ops.row_dots(R, V, dvb->get(), V, pr.v->get(), V, dvbv->get());
  ops.scale_rows(R, V, dvb->get(), V, pr.vscale->get());  // dv
  ops.scale_rows(R, K, dkb->get(), K, pr.kscale->get());  // dk's part through W

  // The masks: d(q k^T), d(k k^T) and the masks' part of dgamma, dbeta; then dq += d(q k^T) K,
  // dk += d(q k^T)^T Q + d(k k^T) K; then the scales' part and dg = the reverse cumulative sum of dgamma.
  Buf<T> dqk = pr.template make<T>(NC * C * C), dkk = pr.template make<T>(NC * C * C);
  Buf<T> dgamma = pr.template make<T>(R), dbeta = pr.template make<T>(R);
  ops.gdn_chunk_masks_backward(NC, C, pr.gamma->get(), pr.beta->get(), pr.kk->get(), pr.qk->get(), dp->get(), da->get(),
                               dqk->get(), dkk->get(), dgamma->get(), dbeta->get());
  ops.gemm(Trans::kN, Trans::kN, C, K, C, T(1), sq(dqk, C, C), cm(pr.k, K), T(1), cw(dq, K), chunks);
  ops.gemm(Trans::kT, Trans::kN, C, K, C, T(1), sq(dqk, C, C), cm(pr.q, K), T(1), cw(dkb, K), chunks);
  ops.gemm(Trans::kN, Trans::kN, C, K, C, T(1), sq(dkk, C, C), cm(pr.k, K), T(1), cw(dkb, K), chunks);
  ops.gdn_chunk_scales_backward(NC, C, pr.gamma->get(), pr.beta->get(), dqq->get(), dkbk->get(), dvbv->get(),
                                dktk->get(), sds->get(), dgamma->get(), dbeta->get());

  // Scatter to the token rows (value heads of one key head add in value-head order), then through the L2 norm and
  // the scale of the raw q, k.
  const std::int64_t rows_qk = d.B * d.S * d.Hk;
  if (!dq_out.empty()) {
    Buffer<T> g(ops, rows_qk * K);
    ops.scatter_add_rows(R, K, dq->get(), K, pr.qk_idx->get(), g.get(), K);
    ops.l2norm_scale_backward_rows(rows_qk, K, pr.in_q->get(), K, g.get(), K, pr.eps, pr.scale);
    write_output(ops, g.get(), dq_out, "dq");
  }
  if (!dk_out.empty()) {
    Buffer<T> g(ops, rows_qk * K);
    ops.scatter_add_rows(R, K, dkt->get(), K, pr.qk_idx->get(), g.get(), K);
    ops.scatter_add_rows(R, K, dkb->get(), K, pr.qk_idx->get(), g.get(), K);
    ops.l2norm_scale_backward_rows(rows_qk, K, pr.in_k->get(), K, g.get(), K, pr.eps, T(1));
    write_output(ops, g.get(), dk_out, "dk");
  }
  pr.write(dv_out, R, dvb->get(), V, V, pr.v_idx);
  pr.write(dg_out, R, dgamma->get(), 1, 1, pr.v_idx);
  pr.write(dbeta_out, R, dbeta->get(), 1, 1, pr.v_idx);
}

}  // namespace

template <typename T>
void gdn_map_product_composed(Ops<T>& ops, bool transpose_m, const TensorView& m, const TensorView& x,
                              const TensorView& addend, const TensorView& out) {
  SEQPAR_CHECK(
      m.ndim() == 4 && m.dim(2) == m.dim(3) && out.ndim() == 4 && m.dtype() == dtype_v<T> && out.dtype() == dtype_v<T>,
      "gdn map product: m must be [B, H, K, K] and out [B, H, K, N] of ", dtype_name(dtype_v<T>), ", got ", m.str(),
      " and ", out.str());
  const std::int64_t maps = m.dim(0) * m.dim(1), K = m.dim(2), n = out.dim(3);
  SEQPAR_CHECK(out.dim(0) * out.dim(1) == maps && out.dim(2) == K && (x.empty() ? n == K : x.shape() == out.shape()) &&
                   (addend.empty() || addend.shape() == out.shape()),
               "gdn map product: x ", x.str(), ", addend ", addend.str(), " and out ", out.str(), " do not match m ",
               m.str());
  const Input<T> mb(ops, m, "m"), xb(ops, x, "x"), ab(ops, addend, "addend");
  Buffer<T> ob(ops, maps * K * n);
  const Batch batch{1, maps}, batch1{1, 1};
  Mat<const T> xm{xb.get(), n, 0, K * n};
  std::unique_ptr<Buffer<T>> id;
  if (x.empty()) {  // the identity
    id = std::make_unique<Buffer<T>>(ops, K * K);
    const Buffer<T> one(ops, std::vector<T>{T(1)});
    ops.scaled_identity(K, one.get(), 0, 0, Mat<T>{id->get(), K}, batch1);
    xm = Mat<const T>{id->get(), K, 0, 0};
  }
  if (ab.get() != nullptr) ops.copy(1, ob.size(), Mat<const T>{ab.get(), ob.size()}, Mat<T>{ob.get(), ob.size()}, batch1);
  ops.gemm(transpose_m ? Trans::kT : Trans::kN, Trans::kN, K, n, K, T(1), Mat<const T>{mb.get(), K, 0, K * K}, xm,
           addend.empty() ? T(0) : T(1), Mat<T>{ob.get(), n, 0, K * n}, batch);
  write_output(ops, ob.get(), out, "out");
}

template void gdn_forward_composed<float>(Ops<float>&, const GdnForwardArgs&, const TensorView&, const TensorView&);
template void gdn_forward_composed<double>(Ops<double>&, const GdnForwardArgs&, const TensorView&, const TensorView&);
template void gdn_backward_composed<float>(Ops<float>&, const GdnBackwardArgs&, const TensorView&, const TensorView&,
                                           const TensorView&, const TensorView&, const TensorView&, const TensorView&);
template void gdn_backward_composed<double>(Ops<double>&, const GdnBackwardArgs&, const TensorView&, const TensorView&,
                                            const TensorView&, const TensorView&, const TensorView&, const TensorView&);
template void gdn_transition_composed<float>(Ops<float>&, const GdnForwardArgs&, const TensorView&, const TensorView&);
template void gdn_transition_composed<double>(Ops<double>&, const GdnForwardArgs&, const TensorView&,
                                              const TensorView&);

template void gdn_map_product_composed<float>(Ops<float>&, bool, const TensorView&, const TensorView&,
                                              const TensorView&, const TensorView&);
template void gdn_map_product_composed<double>(Ops<double>&, bool, const TensorView&, const TensorView&,
                                               const TensorView&, const TensorView&);

void gdn_map_product_composed_cpu(bool transpose_m, const TensorView& m, const TensorView& x, const TensorView& addend,
                                  const TensorView& out) {
  with_cpu_ops(m.dtype(), [&](auto& ops) { gdn_map_product_composed(ops, transpose_m, m, x, addend, out); });
}

void gdn_forward_composed_cpu(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) { gdn_forward_composed(ops, args, out, final_state); });
}

void gdn_backward_composed_cpu(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                               const TensorView& dinitial_state) {
  with_cpu_ops(args.fwd.q.dtype(),
               [&](auto& ops) { gdn_backward_composed(ops, args, dq, dk, dv, dg, dbeta, dinitial_state); });
}

void gdn_transition_composed_cpu(const GdnForwardArgs& args, const TensorView& m, const TensorView& u) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) { gdn_transition_composed(ops, args, m, u); });
}

}  // namespace seqpar::attn::ops
