// The attention kernels on the device named by SEQPAR_TEST_DEVICE (cpu, the default, or cuda), against fp64
// references computed on the host: the row kernels (lse merge, masked row softmax with lse, RoPE pairs) and MHA
// forward / backward through the public boundary (attention/mha.h), at tiny shapes (the *Tiny* cases, which
// scripts/gpu_check.sh runs under compute-sanitizer) and small ones. With SEQPAR_TEST_DEVICE=cpu the same cases run
// the CPU code (the dry run of the GPU check); with cuda and no usable device every case skips with the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "attention/kernels/row_ops.h"
#include "attention/mha.h"
#include "attention/reference/mha_reference.h"
#include "attention/reference/rope_reference.h"
#include "attention/rope.h"
#include "runtime/tensor_ops.h"
#include "util/test_util.h"

#if defined(SEQPAR_WITH_CUDA)
#include "attention/cuda/row_kernels.h"
#endif

namespace seqpar {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr MemCategory kWs = MemCategory::kWorkspace;

// The device under test, or the reason it cannot be used.
struct TestDevice {
  Device device;
  std::string skip;
};
TestDevice test_device() {
  const char* env = std::getenv("SEQPAR_TEST_DEVICE");
  const std::string name = env == nullptr || *env == '\0' ? "cpu" : env;
  if (name == "cpu") return {Device::cpu(), ""};
  if (name != "cuda") return {Device::cpu(), "SEQPAR_TEST_DEVICE=" + name + " must be cpu or cuda"};
  const std::string why = cuda_unavailable_reason();
  return {Device::cuda(0), why.empty() ? "" : "SEQPAR_TEST_DEVICE=cuda: " + why};
}

#define SKIP_WITHOUT_DEVICE(td)                                          \
  const TestDevice td = test_device();                                   \
  if (!td.skip.empty()) {                                                \
    if (td.skip.find("must be") != std::string::npos) FAIL() << td.skip; \
    GTEST_SKIP() << td.skip;                                             \
  }

// A copy of host tensor t on `d` (same dtype), and back.
Tensor on(const TensorView& t, Device d) {
  Tensor r = Tensor::empty(t.shape(), t.dtype(), kWs, d);
  copy_convert(t, r.view());
  return r;
}
Tensor to_host(const TensorView& t) {
  Tensor r = Tensor::empty(t.shape(), t.dtype(), kWs);
  copy_convert(t, r.view());
  return r;
}

TEST(RowKernelsTiny, LseMergeMatchesLogAddExp) {
  SKIP_WITHOUT_DEVICE(td);
  const std::int64_t B = 1, S = 5, H = 2, D = 3;
  Tensor out = test::random_tensor({B, S, H, D}, DType::kFloat32, 1),
         out_b = test::random_tensor({B, S, H, D}, DType::kFloat32, 2);
  Tensor lse = test::random_tensor({B, H, S}, DType::kFloat32, 3, -4, 4),
         lse_b = test::random_tensor({B, H, S}, DType::kFloat32, 4, -4, 4);
  lse.data_as<float>()[0] = -HUGE_VALF;                              // one side empty
  lse.data_as<float>()[1] = lse_b.data_as<float>()[1] = -HUGE_VALF;  // both empty
  lse_b.data_as<float>()[2] = lse.data_as<float>()[2] + 40.0f;       // a large difference
  const std::vector<double> o1 = test::to_double(out), o2 = test::to_double(out_b), l1 = test::to_double(lse),
                            l2 = test::to_double(lse_b);
  // fp64 reference: lse = log(e^l1 + e^l2), out = (e^l1 o1 + e^l2 o2) / e^lse
  std::vector<double> want_o(o1.size()), want_l(l1.size());
  for (std::int64_t t = 0; t < B * S * H; ++t) {
    const std::int64_t i = (t / H) % S, h = t % H, li = h * S + i;
    const double m = std::max(l1[li], l2[li]);
    want_l[li] = m == -kInf ? -kInf : m + std::log(std::exp(l1[li] - m) + std::exp(l2[li] - m));
    for (std::int64_t d = 0; d < D; ++d) {
      const std::int64_t e = t * D + d;
      want_o[e] = m == -kInf ? 0.0 : std::exp(l1[li] - want_l[li]) * o1[e] + std::exp(l2[li] - want_l[li]) * o2[e];
    }
  }
  if (td.device.is_cpu()) {
    float* po = out.data_as<float>();
    float* pl = lse.data_as<float>();
    for (std::int64_t t = 0; t < B * S * H; ++t) {
      const std::int64_t li = (t % H) * S + (t / H) % S;
      const auto w = attn::rowops::lse_merge_weights(pl[li], lse_b.data_as<float>()[li]);
      for (std::int64_t d = 0; d < D; ++d)
        po[t * D + d] = attn::rowops::lse_merge_value(w, po[t * D + d], out_b.data_as<float>()[t * D + d]);
      pl[li] = w.lse;
    }
  } else {
#if defined(SEQPAR_WITH_CUDA)
    Tensor d_out = on(out, td.device), d_lse = on(lse, td.device), d_ob = on(out_b, td.device),
           d_lb = on(lse_b, td.device);
    attn::cuda::LseMergeParams p;
    p.out = d_out.data_as<float>();
    p.lse = d_lse.data_as<float>();
    p.out_b = d_ob.data_as<float>();
    p.lse_b = d_lb.data_as<float>();
    p.batch = B;
    p.seq = S;
    p.heads = H;
    p.head_dim = D;
    attn::cuda::lse_merge_rows(p, nullptr);
    out = to_host(d_out);
    lse = to_host(d_lse);
#endif
  }
  EXPECT_TRUE(test::all_close(test::to_double(out), want_o, 1e-6, 1e-5, "out"));
  EXPECT_TRUE(test::all_close(test::to_double(lse), want_l, 1e-6, 1e-6, "lse"));
}

TEST(RowKernelsTiny, MaskedSoftmaxMatchesFp64) {
  SKIP_WITHOUT_DEVICE(td);
  const std::int64_t rows = 7, n = 9;
  Tensor scores = test::random_tensor({rows, n}, DType::kFloat32, 5, -6, 6);
  const std::vector<std::int64_t> begin = {0, 2, 4, 0, 9, -3, 3}, end = {9, 5, 4, 1, 9, 20, 8};  // empty, clamped
  const std::vector<double> s = test::to_double(scores);
  std::vector<double> want_p(rows * n, 0.0), want_l(rows, -kInf);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = std::max<std::int64_t>(begin[r], 0), e = std::min(end[r], n);
    double sum = 0.0;
    for (std::int64_t j = b; j < e; ++j) sum += std::exp(s[r * n + j]);
    if (sum == 0.0) continue;
    want_l[r] = std::log(sum);
    for (std::int64_t j = b; j < e; ++j) want_p[r * n + j] = std::exp(s[r * n + j]) / sum;
  }
  Tensor probs = Tensor::empty({rows, n}, DType::kFloat32, kWs), lse = Tensor::empty({rows}, DType::kFloat32, kWs);
  if (td.device.is_cpu()) {
    for (std::int64_t r = 0; r < rows; ++r)
      lse.data_as<float>()[r] = attn::rowops::masked_softmax_row(scores.data_as<float>() + r * n, n, begin[r], end[r],
                                                                 probs.data_as<float>() + r * n);
  } else {
#if defined(SEQPAR_WITH_CUDA)
    Tensor hb = Tensor::empty({rows}, DType::kInt64, kWs), he = Tensor::empty({rows}, DType::kInt64, kWs);
    std::copy(begin.begin(), begin.end(), hb.data_as<std::int64_t>());
    std::copy(end.begin(), end.end(), he.data_as<std::int64_t>());
    Tensor d_s = on(scores, td.device), d_b = on(hb, td.device), d_e = on(he, td.device);
    Tensor d_p = Tensor::empty({rows, n}, DType::kFloat32, kWs, td.device),
           d_l = Tensor::empty({rows}, DType::kFloat32, kWs, td.device);
    attn::cuda::MaskedSoftmaxParams p;
    p.scores = d_s.data_as<float>();
    p.probs = d_p.data_as<float>();
    p.lse = d_l.data_as<float>();
    p.begin = d_b.data_as<std::int64_t>();
    p.end = d_e.data_as<std::int64_t>();
    p.rows = rows;
    p.n = n;
    attn::cuda::masked_softmax_rows(p, nullptr);
    probs = to_host(d_p);
    lse = to_host(d_l);
#endif
  }
  EXPECT_TRUE(test::all_close(test::to_double(probs), want_p, 1e-7, 1e-5, "probs"));
  EXPECT_TRUE(test::all_close(test::to_double(lse), want_l, 1e-6, 1e-6, "lse"));
}

TEST(RowKernelsTiny, RopePairsMatchFp64Rotation) {
  SKIP_WITHOUT_DEVICE(td);
  const std::int64_t rows = 3, D = 8, half = D / 2;
  Tensor x = test::random_tensor({rows, D}, DType::kFloat32, 6);
  Tensor ang = test::random_tensor({rows, half}, DType::kFloat64, 7, -3, 3);
  Tensor c = Tensor::empty({rows, half}, DType::kFloat32, kWs), s = Tensor::empty({rows, half}, DType::kFloat32, kWs);
  for (std::int64_t t = 0; t < rows * half; ++t) {
    c.data_as<float>()[t] = static_cast<float>(std::cos(ang.data_as<double>()[t]));
    s.data_as<float>()[t] = static_cast<float>(std::sin(ang.data_as<double>()[t]));
  }
  const std::vector<double> x0 = test::to_double(x), cd = test::to_double(c), sd = test::to_double(s);
  std::vector<double> want(x0.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = x0[r * D + i], b = x0[r * D + i + half], cc = cd[r * half + i], ss = sd[r * half + i];
      want[r * D + i] = a * cc - b * ss;
      want[r * D + i + half] = b * cc + a * ss;
    }
  for (const bool inverse : {false, true}) {  // forward, then back to x0
    if (td.device.is_cpu()) {
      float* p = x.data_as<float>();
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t i = 0; i < half; ++i) {
          float& a = p[r * D + i];
          float& b = p[r * D + i + half];
          const float cc = c.data_as<float>()[r * half + i], ss = s.data_as<float>()[r * half + i];
          if (inverse) {
            attn::rowops::rope_unrotate_pair(a, b, cc, ss, a, b);
          } else {
            attn::rowops::rope_rotate_pair(a, b, cc, ss, a, b);
          }
        }
    } else {
#if defined(SEQPAR_WITH_CUDA)
      Tensor d_x = on(x, td.device), d_c = on(c, td.device), d_s = on(s, td.device);
      attn::cuda::RopePairsParams p;
      p.x = d_x.data_as<float>();
      p.cos = d_c.data_as<float>();
      p.sin = d_s.data_as<float>();
      p.rows = rows;
      p.head_dim = D;
      p.inverse = inverse;
      attn::cuda::rope_rotate_half_rows(p, nullptr);
      x = to_host(d_x);
#endif
    }
    EXPECT_TRUE(test::all_close(test::to_double(x), inverse ? x0 : want, 1e-6, 1e-5, inverse ? "x back" : "x rotated"));
  }
}

// ---- MHA forward / backward through the public boundary, on the device ----

struct MhaCase {
  const char* name;
  DType dtype;
  std::int64_t B, Sq, Sk, Hq, Hkv, D;
  bool causal;
  std::int64_t window;
};

// Per storage dtype: bf16 ~1e-2 and fp16 ~3e-3 relative (the outputs' rounding: 2^-8 and 2^-11 steps, plus fp32
// arithmetic over the keys), fp32 the CPU kernel's 3e-4, fp64 1e-10.
double tolerance(DType d) {
  switch (d) {
    case DType::kBFloat16: return 2e-2;
    case DType::kFloat16: return 4e-3;
    case DType::kFloat32: return 3e-4;
    default: return 1e-10;
  }
}

class DeviceMha : public ::testing::TestWithParam<MhaCase> {};

// The variants of a case (none by default): soft-capping, ALiBi (alibi_slopes(Hq)), sinks, dropout.
struct MhaMods {
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  double dropout = 0.0;
};

void check_mha_case(const TestDevice& td, const MhaCase& c, const MhaMods& m = {}) {
  const Tensor q = test::random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, 11);
  const Tensor k = test::random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, 12);
  const Tensor v = test::random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, 13);
  const Tensor dout = test::random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, 14);
  // fp64 reference on the same rounded inputs; bottom-right positions when Sq < Sk (queries are the last Sq)
  std::vector<std::int64_t> q_pos(static_cast<std::size_t>(c.Sq));
  for (std::int64_t i = 0; i < c.Sq; ++i) q_pos[static_cast<std::size_t>(i)] = c.Sk - c.Sq + i;
  auto f64 = [](const TensorView& t) { return Tensor::copy_of(t, DType::kFloat64, kWs); };
  const Tensor q64 = f64(q), k64 = f64(k), v64 = f64(v), do64 = f64(dout);
  attn::MhaForwardArgs ra;
  ra.q = q64;
  ra.k = k64;
  ra.v = v64;
  ra.q_pos = q_pos;
  ra.mask = attn::MaskSpec(c.causal, c.window);
  const std::vector<float> slopes = attn::alibi_slopes(c.Hq);
  std::vector<double> sinks;
  for (std::int64_t h = 0; h < c.Hq; ++h) sinks.push_back(0.4 * static_cast<double>(h) - 0.5);
  ra.mods.softcap = m.softcap;
  if (m.alibi) ra.mods.alibi_slopes = TensorView(const_cast<float*>(slopes.data()), DType::kFloat32, {c.Hq});
  if (m.sinks) ra.mods.sinks = TensorView(sinks.data(), DType::kFloat64, {c.Hq});
  ra.dropout.p = m.dropout;
  ra.dropout.seed = 2024;
  ra.head_offset = m.dropout > 0.0 ? 1 : 0;
  Tensor want_o = Tensor::empty(q.shape(), DType::kFloat64, kWs),
         want_l = Tensor::empty({c.B, c.Hq, c.Sq}, DType::kFloat64, kWs);
  attn::reference::mha_forward(ra, want_o, want_l);
  Tensor want_dq = Tensor::empty(q.shape(), DType::kFloat64, kWs),
         want_dk = Tensor::empty(k.shape(), DType::kFloat64, kWs),
         want_dv = Tensor::empty(k.shape(), DType::kFloat64, kWs);
  Tensor want_ds = Tensor::empty({c.Hq}, DType::kFloat64, kWs);
  attn::reference::mha_backward(ra, do64, want_dq, want_dk, want_dv, m.sinks ? want_ds.view() : TensorView{});

  const Device d = td.device;
  const Tensor dq_ = on(q, d), dk_ = on(k, d), dv_ = on(v, d), ddo = on(dout, d);
  attn::MhaForwardArgs a = ra;
  a.q = dq_;
  a.k = dk_;
  a.v = dv_;
  const DType acc = accumulator_dtype(c.dtype);
  Tensor out = Tensor::empty(q.shape(), c.dtype, kWs, d), lse = Tensor::empty({c.B, c.Hq, c.Sq}, acc, kWs, d);
  const Stream stream{d, nullptr};
  attn::mha_forward(a, out, lse, stream);
  attn::MhaBackwardArgs b;
  b.fwd = a;
  b.out = out;
  b.dout = ddo;
  b.lse = lse;
  Tensor gq = Tensor::empty(q.shape(), c.dtype, kWs, d), gk = Tensor::empty(k.shape(), c.dtype, kWs, d),
         gv = Tensor::empty(k.shape(), c.dtype, kWs, d);
  attn::mha_backward(b, gq, gk, gv, false, stream);
  stream.synchronize();
  const double tol = tolerance(c.dtype);
  EXPECT_TRUE(test::all_close(test::to_double(to_host(out)), test::to_double(want_o), tol, tol, "out"));
  EXPECT_TRUE(test::all_close(test::to_double(to_host(lse)), test::to_double(want_l), 2e-5, 2e-5, "lse"));
  EXPECT_TRUE(test::all_close(test::to_double(to_host(gq)), test::to_double(want_dq), tol, tol, "dq"));
  EXPECT_TRUE(test::all_close(test::to_double(to_host(gk)), test::to_double(want_dk), tol, tol, "dk"));
  EXPECT_TRUE(test::all_close(test::to_double(to_host(gv)), test::to_double(want_dv), tol, tol, "dv"));
}

TEST_P(DeviceMha, ForwardBackwardMatchFp64Reference) {
  SKIP_WITHOUT_DEVICE(td);
  check_mha_case(td, GetParam());
}

// Soft-capping, ALiBi, sinks and dropout on the device (the exact fallback, attention/cuda/mha_cuda.h) against the
// fp64 reference, which regenerates the dropout mask pair by pair: the device must draw the CPU's mask.
TEST(DeviceMhaVariants, TinyVariantsMatchFp64Reference) {
  SKIP_WITHOUT_DEVICE(td);
  const MhaCase causal{"causal", DType::kFloat32, 1, 12, 12, 2, 1, 16, true, 0};
  const MhaCase window{"window", DType::kBFloat16, 1, 8, 16, 2, 2, 16, true, 5};
  const MhaCase fp64{"fp64", DType::kFloat64, 2, 9, 9, 4, 2, 8, false, 0};
  for (const MhaCase& c : {causal, window, fp64}) {
    SCOPED_TRACE(c.name);
    check_mha_case(td, c, {3.0f, false, false, 0.0});
    check_mha_case(td, c, {0.0f, true, false, 0.0});
    check_mha_case(td, c, {0.0f, false, true, 0.0});
    check_mha_case(td, c, {0.0f, false, false, 0.25});
    check_mha_case(td, c, {5.0f, true, true, 0.1});
  }
}

// RoPE on the device (attention/rope.h: the pair body of kernels/row_ops.h launched per pair) against the fp64
// reference, forward and backward, rotate-half and interleaved, partial, with YaRN's attention factor. Tiny, like
// the variants above, so that scripts/gpu_check.sh's kernel phase and its compute-sanitizer runs take both.
TEST(DeviceRope, TinyRotationsMatchFp64Reference) {
  SKIP_WITHOUT_DEVICE(td);
  const std::vector<std::int64_t> pos = {0, 3, 4, 9, 100, 1000, 65536};
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    for (const bool interleaved : {false, true}) {
      attn::RopeConfig cfg;
      cfg.pairing = interleaved ? attn::RopePairing::kInterleaved : attn::RopePairing::kRotateHalf;
      cfg.rotary_dim = 8;
      cfg.column_offset = interleaved ? 4 : 0;
      cfg.scaling = attn::RopeScaling::kYarn;
      cfg.yarn.factor = 4;
      cfg.yarn.original_max_position_embeddings = 64;
      const Tensor x = test::random_tensor({2, static_cast<std::int64_t>(pos.size()), 3, 16}, dtype, 31);
      for (const bool backward : {false, true}) {
        const Tensor x64 = Tensor::copy_of(x, DType::kFloat64, kWs);
        Tensor want = Tensor::empty(x.shape(), DType::kFloat64, kWs);
        backward ? attn::reference::rope_backward(cfg, pos, x64.view(), want.view())
                 : attn::reference::rope_forward(cfg, pos, x64.view(), want.view());
        const Tensor xd = on(x, td.device);
        backward ? attn::rope_backward(xd.view(), pos, cfg) : attn::rope_forward(xd.view(), pos, cfg);
        const double tol = dtype == DType::kBFloat16 ? 1e-2 : dtype == DType::kFloat32 ? 1e-5 : 1e-12;
        EXPECT_TRUE(test::all_close(test::to_double(to_host(xd)), test::to_double(want), tol, tol,
                                    std::string(dtype_name(dtype)) + (interleaved ? " interleaved" : " rotate-half") +
                                        (backward ? " backward" : " forward")));
      }
    }
  }
}

const MhaCase kCases[] = {
    {"Tiny_bf16_causal", DType::kBFloat16, 1, 8, 8, 2, 1, 16, true, 0},
    {"Tiny_fp32_full", DType::kFloat32, 1, 5, 7, 2, 2, 8, false, 0},
    {"bf16_gqa_causal_d128", DType::kBFloat16, 2, 64, 64, 4, 2, 128, true, 0},
    {"fp16_window_bottom_right", DType::kFloat16, 1, 48, 80, 4, 1, 64, true, 16},
    {"fp32_full_d64", DType::kFloat32, 1, 40, 40, 2, 1, 64, false, 0},
    {"fp64_causal", DType::kFloat64, 1, 24, 24, 2, 1, 32, true, 0},
};
INSTANTIATE_TEST_SUITE_P(Device, DeviceMha, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<MhaCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace seqpar
