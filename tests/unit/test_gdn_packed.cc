// Packed rows (cu_seqlens) of the GDN kernels and the short conv (attention/gdn.h): the packed result of document d
// equals document d run alone as an unpacked row (every output, gradient, final state and initial-state gradient),
// for the kernels and for the fp64 reference, which packs on its own (token by token per document); the kernel's
// packed result against the reference's; the reference's packed gradients against central finite differences; no
// state or gradient leaks from one document into the next; one document over the whole row equals the unpacked path;
// bad cu_seqlens fail with the entry and the rule.
// Tolerances: kernel vs reference as in test_gdn.cc / test_gdn_conv.cc (fp64 1e-10 / 1e-9; fp32 5e-5 / 2e-4);
// packed vs alone and leak checks are exact (the same arithmetic on the same values).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attention/gdn.h"
#include "attention/reference/gdn_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

using test::all_close, test::random_tensor, test::to_double;
constexpr MemCategory kWs = MemCategory::kWorkspace;

Tensor cu_of(const std::vector<std::int64_t>& lens) {
  Tensor cu = Tensor::empty({static_cast<std::int64_t>(lens.size()) + 1}, DType::kInt64, kWs);
  std::int64_t* p = cu.data_as<std::int64_t>();
  p[0] = 0;
  for (std::size_t i = 0; i < lens.size(); ++i) p[i + 1] = p[i] + lens[i];
  return cu;
}

// Rows [begin, end) of a [1, T, ...] tensor, or row `begin` of a [N, ...] state (end = begin + 1), as a copy.
Tensor rows_copy(const TensorView& t, std::int64_t begin, std::int64_t end, bool states) {
  Shape s = t.shape();
  if (states) {
    s[0] = end - begin;
  } else {
    s[1] = end - begin;
  }
  Tensor out = Tensor::empty(s, t.dtype(), kWs);
  const std::size_t row = t.nbytes() / static_cast<std::size_t>(states ? t.dim(0) : t.dim(1));
  if (out.numel() > 0) std::memcpy(out.data(), static_cast<const char*>(t.data()) + begin * row, out.nbytes());
  return out;
}

// ---- GDN ------------------------------------------------------------------------------------------------------

struct Case {
  std::vector<std::int64_t> lens;
  std::int64_t H = 2, Hk = 1, K = 8, V = 6, chunk = 16;
  bool l2 = true, with_init = true, with_dfin = true;
  std::int64_t T() const {
    std::int64_t t = 0;
    for (std::int64_t l : lens) t += l;
    return t;
  }
  std::int64_t N() const { return static_cast<std::int64_t>(lens.size()); }
};

struct Data {
  Tensor q, k, v, g, beta, init, dout, dfin, cu;
};

Data make_data(const Case& c, DType dtype, std::uint64_t seed) {
  const std::int64_t T = c.T();
  const DType sd = accumulator_dtype(dtype);
  return {random_tensor({1, T, c.Hk, c.K}, dtype, seed + 1),
          random_tensor({1, T, c.Hk, c.K}, dtype, seed + 2),
          random_tensor({1, T, c.H, c.V}, dtype, seed + 3),
          random_tensor({1, T, c.H}, dtype, seed + 4, -0.3, -0.005),
          random_tensor({1, T, c.H}, dtype, seed + 5, 0.05, 0.95),
          random_tensor({c.N(), c.H, c.K, c.V}, sd, seed + 6),
          random_tensor({1, T, c.H, c.V}, dtype, seed + 7),
          random_tensor({c.N(), c.H, c.K, c.V}, sd, seed + 8),
          cu_of(c.lens)};
}

Data to64(const Data& d) {
  auto f = [](const Tensor& t) { return Tensor::copy_of(t, DType::kFloat64, kWs); };
  return {f(d.q), f(d.k), f(d.v), f(d.g), f(d.beta), f(d.init), f(d.dout), f(d.dfin), cu_of({})};
}

// Every output of one forward and backward, as fp64 values: out, final_state, dq, dk, dv, dg, dbeta, dinitial_state.
using Results = std::vector<std::vector<double>>;
const char* const kNames[] = {"out", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};

using ForwardFn = std::function<void(const GdnForwardArgs&, const TensorView&, const TensorView&)>;
using BackwardFn = std::function<void(const GdnBackwardArgs&, const TensorView&, const TensorView&, const TensorView&,
                                      const TensorView&, const TensorView&, const TensorView&)>;
struct Impl {
  ForwardFn fwd;
  BackwardFn bwd;
};
const Impl kKernel{
    [](const GdnForwardArgs& a, const TensorView& o, const TensorView& f) { gdn_forward(a, o, f); },
    [](const GdnBackwardArgs& a, const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& dg,
       const TensorView& db, const TensorView& di) { gdn_backward(a, dq, dk, dv, dg, db, di); }};
const Impl kReference{&reference::gdn_forward, &reference::gdn_backward};

// One call of `impl` on q .. dfin (B = 1 rows of `T` tokens, `n` states), packed when cu is not empty.
Results run(const Impl& impl, const Case& c, const Data& d, const TensorView& cu) {
  const std::int64_t T = d.q.dim(1), n = d.init.dim(0);
  const DType dt = d.q.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  const DType sd = d.init.dtype();
  GdnForwardArgs a{d.q, d.k, d.v, d.g, d.beta, c.with_init ? d.init.view() : TensorView(), c.l2, 0.0f, c.chunk, cu};
  Tensor out = Tensor::empty({1, T, c.H, c.V}, dt, kWs), fin = Tensor::empty({n, c.H, c.K, c.V}, sd, kWs);
  impl.fwd(a, out, fin);
  Tensor dq = Tensor::empty({1, T, c.Hk, c.K}, dt, kWs), dk = Tensor::empty({1, T, c.Hk, c.K}, dt, kWs),
         dv = Tensor::empty({1, T, c.H, c.V}, dt, kWs), dg = Tensor::empty({1, T, c.H}, dt, kWs),
         db = Tensor::empty({1, T, c.H}, dt, kWs), di = Tensor::empty({n, c.H, c.K, c.V}, sd, kWs);
  impl.bwd({a, d.dout, c.with_dfin ? d.dfin.view() : TensorView()}, dq, dk, dv, dg, db, di);
  return {to_double(out), to_double(fin), to_double(dq), to_double(dk),
          to_double(dv),  to_double(dg),  to_double(db), to_double(di)};
}

// Every document alone as an unpacked row (batch 1, one state), the results laid out as the packed ones.
Results run_alone(const Impl& impl, const Case& c, const Data& d) {
  Results all(8);
  std::int64_t begin = 0;
  for (std::int64_t doc = 0; doc < c.N(); ++doc) {
    const std::int64_t end = begin + c.lens[doc];
    auto rows = [&](const Tensor& t) { return rows_copy(t, begin, end, false); };
    auto state = [&](const Tensor& t) { return rows_copy(t, doc, doc + 1, true); };
    const Data one{rows(d.q),     rows(d.k),    rows(d.v),     rows(d.g), rows(d.beta),
                   state(d.init), rows(d.dout), state(d.dfin), Tensor()};
    const Results r = run(impl, c, one, TensorView());
    for (std::size_t i = 0; i < all.size(); ++i) all[i].insert(all[i].end(), r[i].begin(), r[i].end());
    begin = end;
  }
  return all;
}

void expect_results(const Results& got, const Results& want, double atol, double rtol, const std::string& tag) {
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(all_close(got[i], want[i], atol, rtol, tag + " " + kNames[i]));
}

std::string tag_of(const Case& c) {
  std::string s = "lens";
  for (std::int64_t l : c.lens) s += str_cat(" ", l);
  return str_cat(s, c.with_init ? " init" : "", c.with_dfin ? " dfinal" : "", " chunk ", c.chunk);
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (const auto& lens : std::vector<std::vector<std::int64_t>>{
           {5, 0, 37, 1, 20, 0}, {0, 0, 17}, {1, 1, 1, 1, 1}, {40}, {16, 16, 3}, {0}}) {
    Case c;
    c.lens = lens;
    cs.push_back(c);
  }
  cs[1].with_init = false;
  cs[2].with_dfin = false;
  cs[4].l2 = false;
  cs[4].H = cs[4].Hk = 2;
  return cs;
}

TEST(GdnPacked, EveryDocumentEqualsItselfAlone) {
  std::uint64_t seed = 10;
  for (const Case& c : cases()) {
    const std::string tag = tag_of(c);
    for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
      const Data d = make_data(c, dtype, seed += 20);
      const Data d64 = to64(d);
      const Results kernel = run(kKernel, c, d, d.cu);
      // The kernel: packed = alone, exactly.
      expect_results(kernel, run_alone(kKernel, c, d), 0, 0, tag + " kernel packed vs alone");
      // The reference packs on its own: packed = alone, exactly; the kernel against it.
      const Results ref = run(kReference, c, d64, d.cu);
      expect_results(ref, run_alone(kReference, c, d64), 0, 0, tag + " reference packed vs alone");
      const bool f64 = dtype == DType::kFloat64;
      expect_results(kernel, ref, f64 ? 1e-10 : 5e-5, f64 ? 1e-9 : 2e-4, tag + " kernel vs reference");
    }
  }
}

TEST(GdnPacked, OneDocumentEqualsUnpackedRow) {
  Case c;
  c.lens = {70};
  const Data d = make_data(c, DType::kFloat32, 3);
  expect_results(run(kKernel, c, d, d.cu), run(kKernel, c, d, TensorView()), 0, 0, "kernel one document");
  const Data d64 = to64(d);
  expect_results(run(kReference, c, d64, d.cu), run(kReference, c, d64, TensorView()), 0, 0, "reference one document");
}

TEST(GdnPacked, ZeroLengthDocumentsPassStatesThrough) {
  Case c;
  c.lens = {0, 4, 0};
  const Data d = make_data(c, DType::kFloat64, 5);
  const Results r = run(kKernel, c, d, d.cu);
  const std::int64_t n = c.H * c.K * c.V;
  const std::vector<double> init = to_double(d.init), dfin = to_double(d.dfin);
  for (std::int64_t doc : {0, 2}) {
    for (std::int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(r[1][doc * n + i], init[doc * n + i]) << "final_state of empty document " << doc;
      EXPECT_EQ(r[7][doc * n + i], dfin[doc * n + i]) << "dinitial_state of empty document " << doc;
    }
  }
}

// Perturbing every input of document 1 (and its initial state, dout and dfinal_state) changes nothing that belongs to
// documents 0 and 2: no state leaks forward, no gradient leaks backward.
TEST(GdnPacked, NoLeaksBetweenDocuments) {
  Case c;
  c.lens = {23, 30, 19};
  for (const Impl* impl : {&kKernel, &kReference}) {
    const Data d = make_data(c, DType::kFloat64, 7);
    const Results base = run(*impl, c, d, d.cu);
    const Data p = make_data(c, DType::kFloat64, 8);
    auto splice = [&](const Tensor& dst, const Tensor& src, bool states) {
      const std::size_t row = dst.nbytes() / static_cast<std::size_t>(states ? c.N() : c.T());
      const std::int64_t begin = states ? 1 : c.lens[0], len = states ? 1 : c.lens[1];
      std::memcpy(static_cast<char*>(dst.data()) + begin * row, static_cast<const char*>(src.data()) + begin * row,
                  len * row);
    };
    for (auto [dst, src] :
         {std::pair{&d.q, &p.q}, {&d.k, &p.k}, {&d.v, &p.v}, {&d.g, &p.g}, {&d.beta, &p.beta}, {&d.dout, &p.dout}})
      splice(*dst, *src, false);
    splice(d.init, p.init, true);
    splice(d.dfin, p.dfin, true);
    const Results pert = run(*impl, c, d, d.cu);
    // Per result: the elements of documents 0 and 2 (token rows or state rows) are unchanged.
    for (std::size_t i = 0; i < base.size(); ++i) {
      const bool states = i == 1 || i == 7;
      const std::size_t per = base[i].size() / static_cast<std::size_t>(states ? c.N() : c.T());
      const std::size_t lo = per * static_cast<std::size_t>(states ? 1 : c.lens[0]);
      const std::size_t hi = per * static_cast<std::size_t>(states ? 2 : c.lens[0] + c.lens[1]);
      bool changed_inside = false;
      for (std::size_t e = 0; e < base[i].size(); ++e) {
        if (e >= lo && e < hi) {
          changed_inside |= base[i][e] != pert[i][e];
        } else {
          ASSERT_EQ(base[i][e], pert[i][e]) << kNames[i] << " element " << e << " outside document 1 changed";
        }
      }
      EXPECT_TRUE(changed_inside) << kNames[i] << ": the perturbation of document 1 did not reach it";
    }
  }
}

// The reference's packed gradients against central differences of L = sum(out * dout) + sum(final_state * dfinal).
TEST(GdnPacked, ReferenceGradientsMatchFiniteDifferences) {
  Case c;
  c.lens = {3, 0, 4, 1};
  c.H = 2;
  c.Hk = 1;
  c.K = 3;
  c.V = 2;
  Data d = make_data(c, DType::kFloat64, 9);
  const Results r = run(kReference, c, d, d.cu);
  auto loss = [&] {
    const GdnForwardArgs a{d.q, d.k, d.v, d.g, d.beta, d.init, c.l2, 0.0f, c.chunk, d.cu};
    Tensor out = Tensor::empty(d.dout.shape(), DType::kFloat64, kWs),
           fin = Tensor::empty(d.init.shape(), DType::kFloat64, kWs);
    reference::gdn_forward(a, out, fin);
    double l = 0;
    const std::vector<double> o = to_double(out), f = to_double(fin), wo = to_double(d.dout), wf = to_double(d.dfin);
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * wo[i];
    for (std::size_t i = 0; i < f.size(); ++i) l += f[i] * wf[i];
    return l;
  };
  const Tensor* inputs[] = {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.init};
  const int grads[] = {2, 3, 4, 5, 6, 7};
  for (int i = 0; i < 6; ++i) {
    // h = 1e-6 on O(1) values: truncation ~1e-12, cancellation ~1e-10.
    EXPECT_TRUE(all_close(r[grads[i]], test::central_differences(*inputs[i], 1e-6, loss), 1e-8, 1e-6,
                          std::string("reference packed ") + kNames[grads[i]]));
  }
}

TEST(GdnPacked, RejectsBadCuSeqlens) {
  Case c;
  c.lens = {4, 5};
  const Data d = make_data(c, DType::kFloat32, 11);
  Tensor out = Tensor::empty({1, 9, c.H, c.V}, DType::kFloat32, kWs);
  auto with_cu = [&](const std::vector<std::int64_t>& values) {
    Tensor cu = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::kInt64, kWs);
    std::memcpy(cu.data(), values.data(), cu.nbytes());
    return cu;
  };
  auto fwd = [&](const TensorView& cu, const TensorView& init) {
    gdn_forward({d.q, d.k, d.v, d.g, d.beta, init, true, 0.0f, 16, cu}, out, {});
  };
  test::expect_error([&] { fwd(with_cu({1, 4, 9}), {}); }, "cu_seqlens[0] must be 0, got 1");
  test::expect_error([&] { fwd(with_cu({0, 5, 4, 9}), {}); }, "cu_seqlens must be non-decreasing");
  test::expect_error([&] { fwd(with_cu({0, -2, 9}), {}); }, "cu_seqlens[1] = -2 is negative");
  test::expect_error(
      [&] {
        fwd(with_cu({0, 4, 8}), {});
      },
      "must end at the row's token count T = 9, got cu_seqlens[2] = 8");
  Tensor cu32 = Tensor::empty({3}, DType::kInt32, kWs);
  test::expect_error([&] { fwd(cu32, {}); }, "cu_seqlens must be int64 [N+1]");
  // initial_state must have one state per document.
  Tensor init1 = Tensor::zeros({1, c.H, c.K, c.V}, DType::kFloat32, kWs);
  test::expect_error([&] { fwd(d.cu, init1); }, "initial_state");
  // B > 1 with cu_seqlens.
  Tensor q2 = random_tensor({2, 9, c.Hk, c.K}, DType::kFloat32, 1),
         v2 = random_tensor({2, 9, c.H, c.V}, DType::kFloat32, 2), g2 = random_tensor({2, 9, c.H}, DType::kFloat32, 3),
         out2 = Tensor::empty({2, 9, c.H, c.V}, DType::kFloat32, kWs);
  test::expect_error(
      [&] {
        gdn_forward({q2, q2, v2, g2, g2, {}, true, 0.0f, 16, d.cu}, out2, {});
      },
      "must have batch size 1, got B = 2");
  // The transition map refuses a packed row.
  Tensor m = Tensor::empty({1, c.H, c.K, c.K}, DType::kFloat32, kWs),
         u = Tensor::empty({1, c.H, c.K, c.V}, DType::kFloat32, kWs);
  test::expect_error(
      [&] {
        gdn_transition({d.q, d.k, d.v, d.g, d.beta, {}, true, 0.0f, 16, d.cu}, m, u);
      },
      "gdn_transition: cu_seqlens must be empty");
  // The short conv runs the same checks.
  ShortConvArgs ca;
  ca.x = random_tensor({1, 9, 5}, DType::kFloat32, 4);
  Tensor w = random_tensor({5, 3}, DType::kFloat32, 5);
  ca.weight = w;
  Tensor cbad = with_cu({0, 4, 10});
  ca.cu_seqlens = cbad;
  Tensor y = Tensor::empty({1, 9, 5}, DType::kFloat32, kWs);
  test::expect_error([&] { short_conv_forward(ca, y, {}); },
                     "short_conv: cu_seqlens must end at the row's token count T = 9");
}

// ---- short conv ---------------------------------------------------------------------------------------------------

struct ConvRun {
  std::vector<double> out, fin, dx, dw, dinit;
};

using ConvFwd = std::function<void(const ShortConvArgs&, const TensorView&, const TensorView&)>;
using ConvBwd = std::function<void(const ShortConvArgs&, const TensorView&, const TensorView&, const TensorView&,
                                   const TensorView&)>;

// x [1, T, C], init [n, W-1, C], dout like x; packed when cu is not empty.
ConvRun run_conv(const ConvFwd& fwd, const ConvBwd& bwd, const TensorView& x, const TensorView& w,
                 const TensorView& init, const TensorView& dout, const TensorView& cu) {
  ShortConvArgs a;
  a.x = x;
  a.weight = w;
  a.initial_conv_state = init;
  a.cu_seqlens = cu;
  Tensor out = Tensor::empty(x.shape(), x.dtype(), kWs), fin = Tensor::empty(init.shape(), x.dtype(), kWs);
  fwd(a, out, fin);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), kWs), dw = Tensor::empty(w.shape(), x.dtype(), kWs),
         di = Tensor::empty(init.shape(), x.dtype(), kWs);
  bwd(a, dout, dx, dw, di);
  return {to_double(out), to_double(fin), to_double(dx), to_double(dw), to_double(di)};
}

TEST(ShortConvPacked, EveryDocumentEqualsItselfAlone) {
  const std::vector<std::int64_t> lens = {2, 0, 9, 1, 5};
  const std::int64_t T = 17, C = 70, W = 4, N = static_cast<std::int64_t>(lens.size());
  const ConvFwd kfwd = [](const ShortConvArgs& a, const TensorView& o, const TensorView& f) {
    short_conv_forward(a, o, f);
  };
  const ConvBwd kbwd = [](const ShortConvArgs& a, const TensorView& g, const TensorView& dx, const TensorView& dw,
                          const TensorView& di) { short_conv_backward(a, g, dx, dw, di); };
  Tensor x = random_tensor({1, T, C}, DType::kFloat64, 1), w = random_tensor({C, W}, DType::kFloat64, 2),
         init = random_tensor({N, W - 1, C}, DType::kFloat64, 3), dout = random_tensor({1, T, C}, DType::kFloat64, 4);
  Tensor cu = cu_of(lens);
  const ConvRun packed = run_conv(kfwd, kbwd, x, w, init, dout, cu);
  const ConvRun ref = run_conv(&reference::short_conv_forward, &reference::short_conv_backward, x, w, init, dout, cu);
  const std::pair<const std::vector<double>*, const std::vector<double>*> pairs[] = {{&packed.out, &ref.out},
                                                                                     {&packed.fin, &ref.fin},
                                                                                     {&packed.dx, &ref.dx},
                                                                                     {&packed.dw, &ref.dw},
                                                                                     {&packed.dinit, &ref.dinit}};
  const char* names[] = {"out", "final_conv_state", "dx", "dweight", "dinitial_conv_state"};
  for (int i = 0; i < 5; ++i)
    EXPECT_TRUE(all_close(*pairs[i].first, *pairs[i].second, 1e-12, 1e-12,
                          std::string("conv kernel vs reference ") + names[i]));
  // Each document alone (kernel and reference): the same rows; dweight is the sum over documents.
  for (const bool use_ref : {false, true}) {
    const ConvFwd f = use_ref ? ConvFwd(&reference::short_conv_forward) : kfwd;
    const ConvBwd b = use_ref ? ConvBwd(&reference::short_conv_backward) : kbwd;
    const ConvRun& want = use_ref ? ref : packed;
    std::vector<double> dw_sum(static_cast<std::size_t>(C * W), 0.0);
    std::int64_t begin = 0;
    for (std::int64_t doc = 0; doc < N; ++doc) {
      const std::int64_t end = begin + lens[doc];
      Tensor xd = rows_copy(x, begin, end, false), gd = rows_copy(dout, begin, end, false),
             id = rows_copy(init, doc, doc + 1, true);
      const ConvRun one = run_conv(f, b, xd, w, id, gd, TensorView());
      const std::string tag = std::string(use_ref ? "reference" : "kernel") + " document " + std::to_string(doc);
      auto part = [](const std::vector<double>& v, std::int64_t lo, std::int64_t hi) {
        return std::vector<double>(v.begin() + lo, v.begin() + hi);
      };
      EXPECT_TRUE(all_close(part(want.out, begin * C, end * C), one.out, 0, 0, tag + " out"));
      EXPECT_TRUE(all_close(part(want.dx, begin * C, end * C), one.dx, 0, 0, tag + " dx"));
      EXPECT_TRUE(all_close(part(want.fin, doc * (W - 1) * C, (doc + 1) * (W - 1) * C), one.fin, 0, 0, tag + " final"));
      EXPECT_TRUE(all_close(part(want.dinit, doc * (W - 1) * C, (doc + 1) * (W - 1) * C), one.dinit, 0, 0,
                            tag + " dinitial_conv_state"));
      for (std::size_t i = 0; i < dw_sum.size(); ++i) dw_sum[i] += one.dw[i];
      begin = end;
    }
    EXPECT_TRUE(all_close(want.dw, dw_sum, 1e-12, 1e-12, std::string(use_ref ? "reference" : "kernel") + " dweight"));
  }
}

}  // namespace
}  // namespace seqpar::attn
