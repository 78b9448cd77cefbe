// The fallback attention driver (attention/fallback_attention.h) with its CPU ops: the composition of GEMM tiles of
// scores and masked row softmax / gradient bodies over the lowered rectangles of a block, against the fp64
// reference (attention/reference), forward (out, lse) and backward (dq, dk, dv), for the blocks of every layout's
// ring steps, all-gather calls and packed rows, causal and windowed, with query tiles smaller than the rectangles.
// fp64 to 1e-12; fp32 to its rounding. On CUDA the same driver runs with cuBLAS GEMMs and the row bodies launched
// per row (attention/cuda/fallback_ops_cuda.cc), which only a GPU run checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/fallback_attention.h"
#include "attention/lowering.h"
#include "attention/reference/mha_reference.h"
#include "parallel/layout.h"
#include "util/ring_blocks.h"
#include "util/test_util.h"

namespace seqpar {
namespace {

using attn::MaskSpec;
constexpr MemCategory kWs = MemCategory::kWorkspace;

std::vector<double> finite(std::vector<double> v) {
  for (double& x : v)
    if (x == -std::numeric_limits<double>::infinity()) x = -1e300;
  return v;
}

using Block = RingBlock;

std::vector<Block> blocks() { return ring_blocks({1, 2, 3}); }

template <typename T>
std::vector<T> as(const TensorView& t) {
  const std::vector<double> d = test::to_double(t);
  return {d.begin(), d.end()};
}

// Score modifiers and dropout of a check (none by default).
struct Variant {
  std::string name;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  double dropout = 0.0;
};

template <typename T>
void check_blocks(double tol, const Variant& var = {}) {
  const std::int64_t B = 1, H = 4, Hkv = 2, D = 8;
  int checked = 0;
  for (const Block& blk : blocks()) {
    for (const auto& [causal, window] : {std::pair<bool, std::int64_t>{false, 0}, {true, 0}, {true, 5}}) {
      const MaskSpec mask(causal, window, blk.bounds.lo, blk.bounds.hi);
      const std::string what =
          blk.name + (causal ? " causal" : " full") + (window ? " window 5" : "") + (var.name.empty() ? "" : " " + var.name);
      const auto sq = static_cast<std::int64_t>(blk.q_pos.size()), sk = static_cast<std::int64_t>(blk.k_pos.size());
      const std::uint64_t seed = 100 + checked;
      const Tensor q = test::random_tensor({B, sq, H, D}, DType::kFloat64, seed);
      const Tensor k = test::random_tensor({B, sk, Hkv, D}, DType::kFloat64, seed + 1);
      const Tensor v = test::random_tensor({B, sk, Hkv, D}, DType::kFloat64, seed + 2);
      const Tensor dout = test::random_tensor({B, sq, H, D}, DType::kFloat64, seed + 3);
      attn::MhaForwardArgs a;
      a.q = q;
      a.k = k;
      a.v = v;
      a.q_pos = blk.q_pos;
      a.k_pos = blk.k_pos;
      a.mask = mask;
      // slopes and sinks of the size of values a model has (the sinks near the rows' lse, so that they matter)
      std::vector<double> slopes, sinks;
      for (std::int64_t h = 0; h < H; ++h) {
        slopes.push_back(var.alibi ? 0.25 / static_cast<double>(h + 1) : 0.0);
        sinks.push_back(0.5 * static_cast<double>(h) - 0.3);
      }
      a.mods.softcap = var.softcap;
      if (var.alibi) a.mods.alibi_slopes = TensorView(slopes.data(), DType::kFloat64, {H});
      if (var.sinks) a.mods.sinks = TensorView(sinks.data(), DType::kFloat64, {H});
      a.dropout.p = var.dropout;
      a.dropout.seed = 0x1234567890abcdefULL + static_cast<std::uint64_t>(checked);
      a.head_offset = var.dropout > 0.0 ? 3 : 0;
      Tensor want_o = Tensor::empty(q.shape(), DType::kFloat64, kWs),
             want_l = Tensor::empty({B, H, sq}, DType::kFloat64, kWs);
      Tensor want_dq = Tensor::empty(q.shape(), DType::kFloat64, kWs),
             want_dk = Tensor::empty(k.shape(), DType::kFloat64, kWs),
             want_dv = Tensor::empty(k.shape(), DType::kFloat64, kWs);
      attn::reference::mha_forward(a, want_o, want_l);
      Tensor want_ds = Tensor::empty({H}, DType::kFloat64, kWs);
      attn::reference::mha_backward(a, dout, want_dq, want_dk, want_dv, var.sinks ? want_ds.view() : TensorView{});

      const std::vector<attn::LoweredRect> rects = attn::lower_attention_block(blk.q_pos, blk.k_pos, mask);
      const std::vector<T> qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), dot = as<T>(dout);
      attn::fallback::FallbackProblem<T> p;
      p.batch = B;
      p.sq = sq;
      p.sk = sk;
      p.hq = H;
      p.hkv = Hkv;
      p.head_dim = D;
      p.scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(D)));
      p.q = qt.data();
      p.k = kt.data();
      p.v = vt.data();
      p.tile_rows = 4;  // tiles smaller than most rectangles
      p.softcap = var.softcap;
      p.alibi = var.alibi ? slopes.data() : nullptr;
      p.sinks = var.sinks ? sinks.data() : nullptr;
      p.q_pos = blk.q_pos.data();
      p.k_pos = blk.k_pos.data();
      p.dropout = a.dropout;
      p.head_offset = a.head_offset;
      attn::fallback::CpuFallbackOps<T> ops;
      std::vector<T> out(qt.size(), T(0)),
          lse(static_cast<std::size_t>(B * H * sq), -std::numeric_limits<T>::infinity());
      attn::fallback::fallback_forward(ops, p, rects, out.data(), lse.data());
      // backward with the final (fallback) out and lse, delta = rowsum(dO O)
      std::vector<T> delta(lse.size(), T(0));
      for (std::int64_t i = 0; i < sq; ++i)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t d = 0; d < D; ++d)
            delta[static_cast<std::size_t>(h * sq + i)] +=
                dot[static_cast<std::size_t>((i * H + h) * D + d)] * out[static_cast<std::size_t>((i * H + h) * D + d)];
      std::vector<T> dq(qt.size(), T(0)), dk(kt.size(), T(0)), dv(vt.size(), T(0));
      attn::fallback::fallback_backward(ops, p, rects, dot.data(), lse.data(), delta.data(), dq.data(), dk.data(),
                                        dv.data());
      auto d = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
      ASSERT_TRUE(test::all_close(d(out), test::to_double(want_o), tol, tol, what + ": out"));
      ASSERT_TRUE(test::all_close(finite(d(lse)), finite(test::to_double(want_l)), tol, tol, what + ": lse"));
      ASSERT_TRUE(test::all_close(d(dq), test::to_double(want_dq), tol, tol, what + ": dq"));
      ASSERT_TRUE(test::all_close(d(dk), test::to_double(want_dk), tol, tol, what + ": dk"));
      ASSERT_TRUE(test::all_close(d(dv), test::to_double(want_dv), tol, tol, what + ": dv"));
      ++checked;
    }
  }
  EXPECT_GT(checked, 300);
}

TEST(FallbackAttention, Fp64MatchesReferenceOnEveryLayoutsBlocks) { check_blocks<double>(1e-12); }

// The variants through the row bodies a CUDA device runs (fallback_rows.h: mod_score, dropout_factor with the Philox
// body of attention/dropout.h, fallback_sink_row), against the reference, which computes them its own way
// (transform per pair, dropout_keep per pair, sinks as logaddexp).
TEST(FallbackAttention, SoftcapMatchesReference) { check_blocks<double>(1e-12, {"softcap 2", 2.0f}); }
TEST(FallbackAttention, AlibiMatchesReferenceOnGlobalPositions) {
  check_blocks<double>(1e-12, {"alibi", 0.0f, true});
}
TEST(FallbackAttention, SinksJoinEachRowOnce) { check_blocks<double>(1e-12, {"sinks", 0.0f, false, true}); }
TEST(FallbackAttention, DropoutDrawsTheCpuMask) { check_blocks<double>(1e-12, {"dropout 0.3", 0.0f, false, false, 0.3}); }
TEST(FallbackAttention, AllVariantsTogether) {
  check_blocks<double>(1e-12, {"softcap alibi sinks dropout", 3.0f, true, true, 0.2});
  check_blocks<float>(3e-5, {"softcap alibi sinks dropout fp32", 3.0f, true, true, 0.2});
}

// fp32 arithmetic (sums over <= 41 keys and D = 8 products): a few ulps of the O(1) values.
TEST(FallbackAttention, Fp32MatchesReferenceToRounding) { check_blocks<float>(2e-5); }

TEST(FallbackAttention, RowBandIsTheMaskModel) {
  // band_of_row against sdpa_mask_visible, every mask kind, shapes with sq <, =, > sk
  for (const std::int64_t sq : {1, 3, 6}) {
    for (const std::int64_t sk : {1, 4, 6, 9}) {
      for (const bool causal : {false, true}) {
        for (const std::int64_t left : {0, 1, 3}) {
          for (const auto align : {attn::DiagonalAlignment::kTopLeft, attn::DiagonalAlignment::kBottomRight}) {
            attn::SdpaMask m;
            m.causal = causal;
            m.left_bound = left;
            m.align = align;
            const attn::fallback::RowBand band = attn::fallback::fallback_row_band(m, sq, sk);
            for (std::int64_t i = 0; i < sq; ++i) {
              std::int64_t begin = 0, end = 0;
              attn::fallback::band_of_row(band, i, begin, end);
              for (std::int64_t j = 0; j < sk; ++j)
                ASSERT_EQ(j >= begin && j < end, attn::sdpa_mask_visible(m, sq, sk, i, j))
                    << attn::sdpa_mask_str(m) << " sq " << sq << " sk " << sk << " i " << i << " j " << j;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace seqpar
