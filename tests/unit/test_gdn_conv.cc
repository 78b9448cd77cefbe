// Unit tests of the short causal depthwise conv (attention/gdn.h) against the direct fp64 conv
// (attention/reference/gdn_reference.h), whose gradients are checked against central finite differences.
// Tolerances: fp64 atol 1e-12 rtol 1e-12 (same summation length, different order); fp32 atol 1e-5 rtol 1e-5;
// bf16 outputs are compared after rounding: atol 1e-2 rtol 1e-2 (one bf16 ulp is 2^-8 relative).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "attention/gdn.h"
#include "attention/reference/gdn_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

using test::all_close, test::random_tensor, test::to_double;
constexpr MemCategory kWs = MemCategory::kWorkspace;

struct ConvCase {
  std::int64_t B = 2, S = 17, C = 70, W = 4;
  bool silu = true;
  bool with_init = true;
};

struct ConvInputs {
  Tensor x, w, init;
  ShortConvArgs args(const ConvCase& c) const {
    ShortConvArgs a;
    a.x = x;
    a.weight = w;
    if (c.with_init) a.initial_conv_state = init;
    a.use_silu = c.silu;
    return a;
  }
};

ConvInputs make(const ConvCase& c, DType dtype, std::uint64_t seed) {
  return {random_tensor({c.B, c.S, c.C}, dtype, seed), random_tensor({c.C, c.W}, dtype, seed + 1),
          random_tensor({c.B, c.W - 1, c.C}, dtype, seed + 2)};
}

ConvInputs to64(const ConvInputs& in) {
  return {Tensor::copy_of(in.x, DType::kFloat64, kWs), Tensor::copy_of(in.w, DType::kFloat64, kWs),
          Tensor::copy_of(in.init, DType::kFloat64, kWs)};
}

std::string name_of(const ConvCase& c, DType dtype) {
  return std::string(dtype_name(dtype)) + " S=" + std::to_string(c.S) + " W=" + std::to_string(c.W) +
         (c.silu ? " silu" : "") + (c.with_init ? " init" : " noinit");
}

class ShortConv : public ::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t, bool, bool>> {};

TEST_P(ShortConv, MatchesDirectConv) {
  ConvCase c;
  std::tie(c.S, c.W, c.silu, c.with_init) = GetParam();
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    const ConvInputs in = make(c, dtype, 17 + static_cast<std::uint64_t>(c.S * 8 + c.W));
    const ConvInputs in64 = to64(in);
    const double atol = dtype == DType::kFloat64 ? 1e-12 : dtype == DType::kFloat32 ? 1e-5 : 1e-2;
    const double rtol = atol;
    const std::string tag = name_of(c, dtype);

    Tensor out = Tensor::empty({c.B, c.S, c.C}, dtype, kWs);
    Tensor fin = Tensor::empty({c.B, c.W - 1, c.C}, dtype, kWs);
    short_conv_forward(in.args(c), out, fin);
    Tensor out64 = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs);
    Tensor fin64 = Tensor::empty({c.B, c.W - 1, c.C}, DType::kFloat64, kWs);
    reference::short_conv_forward(in64.args(c), out64, fin64);
    EXPECT_TRUE(all_close(to_double(out), to_double(out64), atol, rtol, tag + " out"));
    EXPECT_TRUE(all_close(to_double(fin), to_double(fin64), 0, 0, tag + " final_conv_state"));

    Tensor dout = random_tensor({c.B, c.S, c.C}, dtype, 99);
    Tensor dout64 = Tensor::copy_of(dout, DType::kFloat64, kWs);
    Tensor dx = Tensor::empty({c.B, c.S, c.C}, dtype, kWs), dw = Tensor::empty({c.C, c.W}, dtype, kWs),
           di = Tensor::empty({c.B, c.W - 1, c.C}, dtype, kWs);
    short_conv_backward(in.args(c), dout, dx, dw, di);
    Tensor dx64 = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs),
           dw64 = Tensor::empty({c.C, c.W}, DType::kFloat64, kWs),
           di64 = Tensor::empty({c.B, c.W - 1, c.C}, DType::kFloat64, kWs);
    reference::short_conv_backward(in64.args(c), dout64, dx64, dw64, di64);
    EXPECT_TRUE(all_close(to_double(dx), to_double(dx64), atol, rtol, tag + " dx"));
    // dweight sums B * S terms.
    const double wtol = atol * (dtype == DType::kFloat64 ? 1.0 : 4.0);
    EXPECT_TRUE(all_close(to_double(dw), to_double(dw64), wtol, rtol, tag + " dweight"));
    EXPECT_TRUE(all_close(to_double(di), to_double(di64), atol, rtol, tag + " dinitial_conv_state"));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ShortConv,
                         ::testing::Combine(::testing::Values<std::int64_t>(1, 2, 3, 17, 100),
                                            ::testing::Values<std::int64_t>(1, 2, 4), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "S" + std::to_string(std::get<0>(info.param)) + "_W" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_silu" : "_linear") +
                                  (std::get<3>(info.param) ? "_init" : "_noinit");
                         });

// The reference's gradients (x, weight, initial conv state) against central finite differences.
TEST(ShortConvReference, GradientsMatchFiniteDifferences) {
  for (bool silu : {true, false}) {
    const ConvCase c{.B = 2, .S = 5, .C = 3, .W = 4, .silu = silu};
    ConvInputs in = to64(make(c, DType::kFloat64, 5));
    const std::vector<double> wo = test::random_values(c.B * c.S * c.C, 6);
    Tensor dout = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs);
    std::memcpy(dout.data(), wo.data(), dout.nbytes());
    Tensor dx = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs),
           dw = Tensor::empty({c.C, c.W}, DType::kFloat64, kWs),
           di = Tensor::empty({c.B, c.W - 1, c.C}, DType::kFloat64, kWs);
    reference::short_conv_backward(in.args(c), dout, dx, dw, di);
    auto loss = [&]() {
      Tensor out = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs);
      reference::short_conv_forward(in.args(c), out, TensorView());
      double l = 0;
      for (std::int64_t i = 0; i < out.numel(); ++i) l += out.data_as<double>()[i] * wo[i];
      return l;
    };
    const std::pair<Tensor*, Tensor*> pairs[] = {{&in.x, &dx}, {&in.w, &dw}, {&in.init, &di}};
    const char* names[] = {"dx", "dweight", "dinitial_conv_state"};
    for (int n = 0; n < 3; ++n) {
      double* x = pairs[n].first->data_as<double>();
      std::vector<double> fd(static_cast<std::size_t>(pairs[n].first->numel()));
      for (std::size_t i = 0; i < fd.size(); ++i) {
        const double x0 = x[i];
        x[i] = x0 + 1e-6;
        const double lp = loss();
        x[i] = x0 - 1e-6;
        const double lm = loss();
        x[i] = x0;
        fd[i] = (lp - lm) / 2e-6;
      }
      EXPECT_TRUE(all_close(to_double(*pairs[n].second), fd, 1e-8, 1e-6,
                            std::string("reference conv ") + names[n] + (silu ? " silu" : "")));
    }
  }
}

// Two pieces with the conv state passed by hand (the halo) equal one call, for values and gradients; the second
// piece is shorter than W - 1 in one case, so its final state reaches back into the first piece.
TEST(ShortConvSplit, HaloByHandEqualsOneCall) {
  for (std::int64_t cut : {1, 2, 9, 13}) {
    ConvCase c;
    c.S = 14;
    c.W = 4;
    const ConvInputs in = make(c, DType::kFloat64, 31);
    Tensor out = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs);
    short_conv_forward(in.args(c), out, TensorView());
    Tensor dout = random_tensor({c.B, c.S, c.C}, DType::kFloat64, 32);
    Tensor dx = Tensor::empty({c.B, c.S, c.C}, DType::kFloat64, kWs),
           dw = Tensor::empty({c.C, c.W}, DType::kFloat64, kWs),
           di = Tensor::empty({c.B, c.W - 1, c.C}, DType::kFloat64, kWs);
    short_conv_backward(in.args(c), dout, dx, dw, di);

    auto slice = [&](const TensorView& t, std::int64_t s0, std::int64_t s1) {
      Tensor o = Tensor::empty({c.B, s1 - s0, c.C}, DType::kFloat64, kWs);
      for (std::int64_t b = 0; b < c.B; ++b) {
        std::memcpy(o.data_as<double>() + b * (s1 - s0) * c.C, t.data_as<double>() + (b * c.S + s0) * c.C,
                    static_cast<std::size_t>((s1 - s0) * c.C) * sizeof(double));
      }
      return o;
    };
    const std::int64_t bounds[3] = {0, cut, c.S};
    Tensor state = Tensor::copy_of(in.init, DType::kFloat64, kWs);
    std::vector<Tensor> states;
    std::vector<double> got_out, got_dx;
    std::vector<double> dw_sum(static_cast<std::size_t>(c.C * c.W), 0.0);
    std::vector<std::vector<double>> piece_dx(2);
    std::vector<Tensor> piece_x(2);
    for (int pi = 0; pi < 2; ++pi) {
      const std::int64_t n = bounds[pi + 1] - bounds[pi];
      piece_x[pi] = slice(in.x, bounds[pi], bounds[pi + 1]);
      ShortConvArgs a;
      a.x = piece_x[pi];
      a.weight = in.w;
      a.initial_conv_state = state;
      Tensor po = Tensor::empty({c.B, n, c.C}, DType::kFloat64, kWs);
      Tensor next = Tensor::empty({c.B, c.W - 1, c.C}, DType::kFloat64, kWs);
      short_conv_forward(a, po, next);
      Tensor full_piece = slice(out, bounds[pi], bounds[pi + 1]);
      EXPECT_TRUE(
          all_close(to_double(po), to_double(full_piece), 1e-13, 1e-13, "piece out, cut " + std::to_string(cut)));
      states.push_back(std::move(state));
      state = std::move(next);
    }
    // Backward: piece 2's dinitial_conv_state goes back to the owners of those inputs (piece 1's last rows, and
    // before that the global initial state when piece 1 is shorter than W - 1).
    std::vector<Tensor> pdx(2), pdi(2);
    for (int pi = 1; pi >= 0; --pi) {
      const std::int64_t n = bounds[pi + 1] - bounds[pi];
      ShortConvArgs a;
      a.x = piece_x[pi];
      a.weight = in.w;
      a.initial_conv_state = states[pi];
      Tensor pdout = slice(dout, bounds[pi], bounds[pi + 1]);
      pdx[pi] = Tensor::empty({c.B, n, c.C}, DType::kFloat64, kWs);
      pdi[pi] = Tensor::empty({c.B, c.W - 1, c.C}, DType::kFloat64, kWs);
      Tensor pdw = Tensor::empty({c.C, c.W}, DType::kFloat64, kWs);
      short_conv_backward(a, pdout, pdx[pi], pdw, pdi[pi]);
      for (std::int64_t i = 0; i < c.C * c.W; ++i) dw_sum[i] += pdw.data_as<double>()[i];
    }
    // Row r of piece 2's halo is xin row (cut - (W-1) + r): piece 1 row when >= 0, else the initial state's row.
    const std::int64_t Wm1 = c.W - 1;
    for (std::int64_t b = 0; b < c.B; ++b) {
      for (std::int64_t r = 0; r < Wm1; ++r) {
        const std::int64_t t = cut - Wm1 + r;
        double* dst = t >= 0 ? pdx[0].data_as<double>() + (b * cut + t) * c.C
                             : pdi[0].data_as<double>() + (b * Wm1 + t + Wm1) * c.C;
        for (std::int64_t ch = 0; ch < c.C; ++ch) dst[ch] += pdi[1].data_as<double>()[(b * Wm1 + r) * c.C + ch];
      }
    }
    std::vector<double> joined(static_cast<std::size_t>(c.B * c.S * c.C));
    for (std::int64_t b = 0; b < c.B; ++b) {
      for (int pi = 0; pi < 2; ++pi) {
        const std::int64_t n = bounds[pi + 1] - bounds[pi];
        std::memcpy(joined.data() + (b * c.S + bounds[pi]) * c.C, pdx[pi].data_as<double>() + b * n * c.C,
                    static_cast<std::size_t>(n * c.C) * sizeof(double));
      }
    }
    const std::string tag = " cut " + std::to_string(cut);
    EXPECT_TRUE(all_close(joined, to_double(dx), 1e-13, 1e-12, "split dx" + tag));
    EXPECT_TRUE(all_close(dw_sum, to_double(dw), 1e-12, 1e-12, "split dweight" + tag));
    EXPECT_TRUE(all_close(to_double(pdi[0]), to_double(di), 1e-13, 1e-12, "split dinitial_conv_state" + tag));
  }
}

TEST(ShortConvErrors, RejectsBadShapes) {
  ConvCase c;
  const ConvInputs in = make(c, DType::kFloat32, 1);
  Tensor out = Tensor::empty({c.B, c.S, c.C}, DType::kFloat32, kWs);
  ShortConvArgs a = in.args(c);
  Tensor w_bad = Tensor::empty({c.C + 1, c.W}, DType::kFloat32, kWs);
  a.weight = w_bad;
  EXPECT_THROW(short_conv_forward(a, out, TensorView()), Error);
  a = in.args(c);
  Tensor init_bad = Tensor::empty({c.B, c.W, c.C}, DType::kFloat32, kWs);
  a.initial_conv_state = init_bad;
  EXPECT_THROW(short_conv_forward(a, out, TensorView()), Error);
}

}  // namespace
}  // namespace seqpar::attn
