// Real-valued layer options (scale, softcap) reach the fp64 kernels as doubles: MHA with an explicit scale and
// softcap against attention materialised here from the formula (docs/design.md, "Score modifiers") and against the
// fp64 reference (forward and backward); GDN and DSA with an explicit scale against the fp64 references run on q
// pre-multiplied by the scale with scale 1 (both exact rewrites of the math). The options are values that fp32 does
// not represent, so an fp32 rounding anywhere on the way shows as a 1e-8 relative error.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "attention/dsa.h"
#include "attention/gdn.h"
#include "attention/mha.h"
#include "attention/reference/dsa_reference.h"
#include "attention/reference/gdn_reference.h"
#include "attention/reference/mha_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

constexpr DType kF64 = DType::kFloat64;
constexpr MemCategory kWs = MemCategory::kWorkspace;
// fp64 end to end: the kernels and the references differ by summation order only (S <= 20 terms of O(1)).
constexpr double kTol = 1e-12;
const double kScale = 0.9 / std::sqrt(8.0);  // not an fp32 value
constexpr double kSoftcap = 0.3;             // not an fp32 value

Tensor zeros(const Shape& shape) {
  Tensor t = Tensor::empty(shape, kF64, kWs);
  std::fill(t.view().data_as<double>(), t.view().data_as<double>() + t.numel(), 0.0);
  return t;
}

// A copy of the fp64 tensor x times s.
Tensor scaled(const TensorView& x, double s) {
  Tensor t = Tensor::empty(x.shape(), kF64, kWs);
  for (std::int64_t i = 0; i < x.numel(); ++i) t.view().data_as<double>()[i] = s * x.data_as<double>()[i];
  return t;
}

void expect_close(const TensorView& got, const TensorView& want, const char* what) {
  EXPECT_TRUE(test::all_close(test::to_double(got), test::to_double(want), kTol, kTol, what));
}

TEST(RealOptionsFp64, MhaExplicitScaleAndSoftcap) {
  const std::int64_t B = 1, S = 20, H = 2, D = 8;
  Tensor q = test::random_tensor({B, S, H, D}, kF64, 11, -2.0, 2.0);
  Tensor k = test::random_tensor({B, S, H, D}, kF64, 12, -2.0, 2.0);
  Tensor v = test::random_tensor({B, S, H, D}, kF64, 13);
  Tensor dout = test::random_tensor({B, S, H, D}, kF64, 14);
  MhaForwardArgs a{q, k, v, {}, {}, MaskSpec{true, 0}, kScale};
  a.mods.softcap = kSoftcap;
  Tensor out = zeros({B, S, H, D}), lse = zeros({B, H, S});
  mha_forward(a, out, lse);

  // o_i = sum_{j <= i} softmax_j(c tanh(s q_i . k_j / c)) v_j, materialised here
  Tensor want = zeros({B, S, H, D});
  const double *qd = q.view().data_as<double>(), *kd = k.view().data_as<double>(), *vd = v.view().data_as<double>();
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t i = 0; i < S; ++i) {
      std::vector<double> p(static_cast<std::size_t>(i + 1));
      double mx = -INFINITY, sum = 0.0;
      for (std::int64_t j = 0; j <= i; ++j) {
        double dot = 0.0;
        for (std::int64_t d = 0; d < D; ++d) dot += qd[(i * H + h) * D + d] * kd[(j * H + h) * D + d];
        p[j] = kSoftcap * std::tanh(kScale * dot / kSoftcap);
        mx = std::max(mx, p[j]);
      }
      for (double& x : p) sum += (x = std::exp(x - mx));
      for (std::int64_t d = 0; d < D; ++d) {
        double o = 0.0;
        for (std::int64_t j = 0; j <= i; ++j) o += p[j] / sum * vd[(j * H + h) * D + d];
        want.view().data_as<double>()[(i * H + h) * D + d] = o;
      }
    }
  }
  expect_close(out, want, "out (formula)");

  Tensor ref_out = zeros({B, S, H, D}), ref_lse = zeros({B, H, S});
  reference::mha_forward(a, ref_out, ref_lse);
  expect_close(out, ref_out, "out");
  expect_close(lse, ref_lse, "lse");
  Tensor dq = zeros({B, S, H, D}), dk = zeros({B, S, H, D}), dv = zeros({B, S, H, D});
  mha_backward({a, out, dout, lse}, dq, dk, dv, false);
  Tensor rdq = zeros({B, S, H, D}), rdk = zeros({B, S, H, D}), rdv = zeros({B, S, H, D});
  reference::mha_backward(a, dout, rdq, rdk, rdv);
  expect_close(dq, rdq, "dq");
  expect_close(dk, rdk, "dk");
  expect_close(dv, rdv, "dv");
}

// GDN without the L2 normalisation reads q only as scale * q: gdn(q; s) = gdn(s q; 1), and dq(q; s) = s dq(s q; 1).
TEST(RealOptionsFp64, GdnExplicitScale) {
  const std::int64_t B = 1, S = 20, H = 2, K = 8, V = 8;
  Tensor q = test::random_tensor({B, S, H, K}, kF64, 21);
  Tensor k = test::random_tensor({B, S, H, K}, kF64, 22, -0.3, 0.3);
  Tensor v = test::random_tensor({B, S, H, V}, kF64, 23);
  Tensor g = test::random_tensor({B, S, H}, kF64, 24, -0.5, -0.01);
  Tensor beta = test::random_tensor({B, S, H}, kF64, 25, 0.1, 0.9);
  Tensor dout = test::random_tensor({B, S, H, V}, kF64, 26);
  Tensor qs = scaled(q, kScale);
  GdnForwardArgs a = gdn_args(q, k, v, g, beta, false, kScale);
  a.chunk_size = 4;
  GdnForwardArgs r = gdn_args(qs, k, v, g, beta, false, 1.0);
  Tensor out = zeros({B, S, H, V}), fs = zeros({B, H, K, V}), want = zeros({B, S, H, V}), rfs = zeros({B, H, K, V});
  gdn_forward(a, out, fs);
  reference::gdn_forward(r, want, rfs);
  expect_close(out, want, "out");
  expect_close(fs, rfs, "final_state");

  Tensor dq = zeros({B, S, H, K}), dk = zeros({B, S, H, K}), dv = zeros({B, S, H, V}), dg = zeros({B, S, H}),
         db = zeros({B, S, H});
  Tensor rdq = zeros({B, S, H, K}), rdk = zeros({B, S, H, K}), rdv = zeros({B, S, H, V}), rdg = zeros({B, S, H}),
         rdb = zeros({B, S, H});
  gdn_backward({a, dout, {}}, dq, dk, dv, dg, db, {});
  reference::gdn_backward({r, dout, {}}, rdq, rdk, rdv, rdg, rdb, {});
  expect_close(dq, scaled(rdq, kScale), "dq");
  expect_close(dk, rdk, "dk");
  expect_close(dv, rdv, "dv");
  expect_close(dg, rdg, "dg");
  expect_close(db, rdb, "dbeta");
}

// DSA's scale multiplies q . c only (the values are c's first dim_v columns): dsa(q; s) = dsa(s q; 1).
TEST(RealOptionsFp64, DsaExplicitScale) {
  const std::int64_t B = 1, S = 20, H = 2, Dqk = 16, Dv = 8, Kt = 5;
  Tensor q = test::random_tensor({B, S, H, Dqk}, kF64, 31, -2.0, 2.0);
  Tensor c = test::random_tensor({B, S, Dqk}, kF64, 32, -2.0, 2.0);
  Tensor dout = test::random_tensor({B, S, H, Dv}, kF64, 33);
  Tensor topk = Tensor::empty({B, S, Kt}, DType::kInt64, kWs);
  for (std::int64_t t = 0; t < S; ++t) {  // keys t - 8, t - 6, ..., t (those >= 0), ascending, -1 padded
    std::vector<std::int64_t> row;
    for (std::int64_t j = std::max<std::int64_t>(0, t - 2 * (Kt - 1)); j <= t; j += 2) row.push_back(j);
    row.resize(static_cast<std::size_t>(Kt), -1);
    std::copy(row.begin(), row.end(), topk.view().data_as<std::int64_t>() + t * Kt);
  }
  Tensor qs = scaled(q, kScale);
  DsaAttentionArgs a{q, c, topk, {}, {}, Dv, kScale};
  DsaAttentionArgs r{qs, c, topk, {}, {}, Dv, 1.0};
  Tensor out = zeros({B, S, H, Dv}), lse = zeros({B, H, S}), want = zeros({B, S, H, Dv}), rlse = zeros({B, H, S});
  dsa_attention_forward(a, out, lse);
  reference::dsa_attention_forward(r, want, rlse);
  expect_close(out, want, "out");
  expect_close(lse, rlse, "lse");

  Tensor dq = zeros({B, S, H, Dqk}), dc = zeros({B, S, Dqk}), rdq = zeros({B, S, H, Dqk}), rdc = zeros({B, S, Dqk});
  DsaAttentionBackwardArgs ba{a, out, dout, lse, {}, {}};
  dsa_attention_backward(ba, dq, dc, false);
  reference::dsa_attention_backward(r, dout, rdq, rdc);
  expect_close(dq, scaled(rdq, kScale), "dq");
  expect_close(dc, rdc, "dc");
}

}  // namespace
}  // namespace seqpar::attn
