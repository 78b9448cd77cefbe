// Lowered execution of MHA (attention/lowering.h): every rectangle of a block run as its own kernel call with its
// cuDNN-style mask in the kernel's terms, merged with the lse merge, must equal one kernel call over the block
// (fp64: 1e-12; fp32 / bf16: their rounding), forward and backward, for the blocks of every layout's ring steps,
// all-gather calls and packed rows, with and without causal, window, soft-capping, sinks, ALiBi and dropout.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/lowering.h"
#include "parallel/layout.h"
#include "runtime/tensor_ops.h"
#include "util/ring_blocks.h"
#include "util/test_util.h"

namespace seqpar {
namespace {

using attn::MaskSpec;

// -inf (an lse of a row with no key) becomes a finite sentinel on both sides, so that all_close compares the rows.
std::vector<double> finite(std::vector<double> v) {
  for (double& x : v)
    if (x == -std::numeric_limits<double>::infinity()) x = -1e300;
  return v;
}

using Block = RingBlock;

std::vector<Block> blocks() { return ring_blocks({1, 2, 3, 4}); }

struct Problem {
  Tensor q, k, v, dout;
  Tensor sinks;
};

Problem make_problem(const Block& blk, DType dtype, std::uint64_t seed) {
  const std::int64_t B = blk.bounds.lo.empty() ? 2 : 1, H = 4, Hkv = 2, D = 8;
  const auto sq = static_cast<std::int64_t>(blk.q_pos.size()), sk = static_cast<std::int64_t>(blk.k_pos.size());
  Problem p;
  p.q = test::random_tensor({B, sq, H, D}, dtype, seed);
  p.k = test::random_tensor({B, sk, Hkv, D}, dtype, seed + 1);
  p.v = test::random_tensor({B, sk, Hkv, D}, dtype, seed + 2);
  p.dout = test::random_tensor({B, sq, H, D}, dtype, seed + 3);
  p.sinks = test::random_tensor({H}, DType::kFloat64, seed + 4);
  return p;
}

struct Variant {
  const char* name;
  bool causal;
  std::int64_t window;
  float softcap;
  bool sinks;
  bool alibi = false;     // slopes alibi_slopes(H): the bias reads the global positions (mod_q_pos / mod_k_pos)
  double dropout = 0.0;   // the mask is keyed by the global positions too
};

// The forward arguments of `p` on the block's positions and document bounds, with the causal flag and window.
attn::MhaForwardArgs block_args(const Block& blk, const Problem& p, bool causal, std::int64_t window) {
  attn::MhaForwardArgs a;
  a.q = p.q.view();
  a.k = p.k.view();
  a.v = p.v.view();
  a.q_pos = blk.q_pos;
  a.k_pos = blk.k_pos;
  a.mask = MaskSpec(causal, window, blk.bounds.lo, blk.bounds.hi);
  return a;
}

void check_agreement(DType dtype, double tol) {
  const Variant variants[] = {{"full", false, 0, 0.0f, false},
                              {"causal", true, 0, 0.0f, false},
                              {"causal window 5", true, 5, 0.0f, false},
                              {"causal window 1 softcap sinks", true, 1, 3.0f, true},
                              {"full softcap sinks", false, 0, 2.0f, true},
                              {"causal alibi", true, 0, 0.0f, false, true},
                              {"causal window 3 dropout 0.3", true, 3, 0.0f, false, false, 0.3},
                              {"full alibi dropout 0.2 softcap sinks", false, 0, 2.0f, true, true, 0.2}};
  std::int64_t n = 0;
  const std::int64_t rects_before = attn::lowered_rects_executed();
  std::uint64_t seed = 1;
  for (const Block& blk : blocks()) {
    for (const Variant& var : variants) {
      const Problem p = make_problem(blk, dtype, seed += 10);
      attn::MhaForwardArgs a = block_args(blk, p, var.causal, var.window);
      a.mods.softcap = var.softcap;
      if (var.sinks) a.mods.sinks = p.sinks.view();
      const std::vector<float> slopes = attn::alibi_slopes(p.q.dim(2));
      if (var.alibi) a.mods.alibi_slopes = TensorView(const_cast<float*>(slopes.data()), DType::kFloat32, {p.q.dim(2)});
      a.dropout.p = var.dropout;
      a.dropout.seed = seed * 7919;
      a.head_offset = var.dropout > 0.0 ? 2 : 0;
      const DType acc = accumulator_dtype(dtype);
      const Shape lse_shape = {p.q.dim(0), p.q.dim(2), p.q.dim(1)};
      Tensor out0 = Tensor::empty(p.q.shape(), dtype, MemCategory::kWorkspace);
      Tensor lse0 = Tensor::empty(lse_shape, acc, MemCategory::kWorkspace);
      Tensor out1 = Tensor::empty(p.q.shape(), dtype, MemCategory::kWorkspace);
      Tensor lse1 = Tensor::empty(lse_shape, acc, MemCategory::kWorkspace);
      attn::mha_forward(a, out0.view(), lse0.view());
      attn::mha_forward_lowered(a, out1.view(), lse1.view());
      const std::string what = blk.name + " " + var.name;
      ASSERT_TRUE(test::all_close(test::to_double(out1.view()), test::to_double(out0.view()), tol, tol, what + " out"));
      ASSERT_TRUE(test::all_close(finite(test::to_double(lse1.view())), finite(test::to_double(lse0.view())), tol, tol,
                                  what + " lse"));
      attn::MhaBackwardArgs b;
      b.fwd = a;
      b.out = out0.view();
      b.dout = p.dout.view();
      b.lse = lse0.view();
      Tensor g0[3], g1[3];
      for (int t = 0; t < 3; ++t) {
        const Shape& s = t == 0 ? p.q.shape() : p.k.shape();
        g0[t] = Tensor::empty(s, dtype, MemCategory::kWorkspace);
        g1[t] = Tensor::empty(s, dtype, MemCategory::kWorkspace);
      }
      attn::mha_backward(b, g0[0].view(), g0[1].view(), g0[2].view(), false);
      attn::mha_backward_lowered(b, g1[0].view(), g1[1].view(), g1[2].view(), false);
      const char* names[] = {" dq", " dk", " dv"};
      for (int t = 0; t < 3; ++t)
        ASSERT_TRUE(
            test::all_close(test::to_double(g1[t].view()), test::to_double(g0[t].view()), tol, tol, what + names[t]));
      ++n;
    }
  }
  std::cout << "lowered execution (" << dtype_name(dtype) << "): " << n << " blocks agree, "
            << attn::lowered_rects_executed() - rects_before << " rectangles run\n";
  EXPECT_GT(attn::lowered_rects_executed(), rects_before);
}

TEST(LoweredAttention, AgreesWithOneKernelCallFp64) {
  if (attn::lowered_attention_enabled()) GTEST_SKIP() << "SEQPAR_LOWERED_ATTENTION=1 lowers the reference call too";
  check_agreement(DType::kFloat64, 1e-12);
}

TEST(LoweredAttention, AgreesWithOneKernelCallFp32) {
  if (attn::lowered_attention_enabled()) GTEST_SKIP() << "SEQPAR_LOWERED_ATTENTION=1 lowers the reference call too";
  // Per-rectangle online softmax and fp32 gradient sums in another order: a few fp32 ulps of the O(1) values.
  check_agreement(DType::kFloat32, 2e-5);
}

// The environment switch routes mha_forward / mha_backward through the lowering (or not), as the ctest
// registrations with the suffix .lowered rely on.
TEST(LoweredAttention, EnvironmentSwitchRoutesTheKernelCalls) {
  const Block blk = blocks()[4];  // contiguous, ring 2, rank 0 against its own keys
  const Problem p = make_problem(blk, DType::kFloat64, 7);
  attn::MhaForwardArgs a = block_args(blk, p, true, 0);
  Tensor out = Tensor::empty(p.q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({p.q.dim(0), p.q.dim(2), p.q.dim(1)}, DType::kFloat64, MemCategory::kWorkspace);
  const std::int64_t before = attn::lowered_rects_executed();
  attn::mha_forward(a, out.view(), lse.view());
  const std::int64_t ran = attn::lowered_rects_executed() - before;
  if (attn::lowered_attention_enabled()) {
    EXPECT_GT(ran, 0);
    // dropout and ALiBi are lowered too (their sub-blocks read the global positions through mod_q_pos / mod_k_pos)
    a.dropout.p = 0.25f;
    const std::vector<float> slopes = attn::alibi_slopes(p.q.dim(2));
    a.mods.alibi_slopes = TensorView(const_cast<float*>(slopes.data()), DType::kFloat32, {p.q.dim(2)});
    const std::int64_t before_variants = attn::lowered_rects_executed();
    attn::mha_forward(a, out.view(), lse.view());
    EXPECT_GT(attn::lowered_rects_executed(), before_variants);
  } else {
    EXPECT_EQ(ran, 0);
  }
}

}  // namespace
}  // namespace seqpar
