// The public boundaries of the attention kernels (attention/mha.h, dsa.h, gdn.h, rope.h): every bad argument is
// rejected with a message naming the value and the rule, by the argument struct's validate() alone and by the kernel
// itself (the same message), before any work; CUDA tensors and streams are rejected until attention/cuda/ exists; and
// an allocation that cannot be served ends in seqpar's out-of-memory error, never in std::terminate.
//
// The expected messages are the documented rules; the inputs are otherwise valid, so each case isolates one rule.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attention/dsa.h"
#include "attention/cuda/ops_cuda.h"
#include "attention/gdn.h"
#include "attention/mha.h"
#include "attention/rope.h"
#include "runtime/memory.h"
#include "tests/util/device_collectives.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

using test::error_of;  // the message of the Error fn raises, "<no error>" when it returns normally

constexpr MemCategory kWs = MemCategory::kWorkspace;
constexpr const char* kNoError = "<no error>";

// check() and run() must both fail, with the same message, which contains `needle`.
void expect_rejected(const std::function<void()>& check, const std::function<void()>& run, const std::string& needle) {
  const std::string from_check = error_of(check), from_run = error_of(run);
  EXPECT_NE(from_check.find(needle), std::string::npos) << "check: '" << from_check << "', want '" << needle << "'";
  EXPECT_EQ(from_check, from_run) << "the kernel and its check disagree";
}

Tensor f32(const Shape& s, std::uint64_t seed = 1) { return test::random_tensor(s, DType::kFloat32, seed); }
Tensor zeros(const Shape& s, DType dt = DType::kFloat32) { return Tensor::zeros(s, dt, kWs); }

// The same tensor seen as if it lived on a GPU (never dereferenced: the boundary rejects it first).
TensorView on_cuda(const TensorView& t) { return TensorView(t.data(), t.dtype(), t.shape(), Device::cuda(0)); }

Stream cuda_stream() { return Stream{Device::cuda(0), nullptr}; }

// ---- MHA ------------------------------------------------------------------------------------------------------------

struct Mha {
  Tensor q = f32({1, 8, 2, 4}, 1), k = f32({1, 8, 1, 4}, 2), v = f32({1, 8, 1, 4}, 3), dout = f32({1, 8, 2, 4}, 4);
  Tensor out = zeros({1, 8, 2, 4}), lse = zeros({1, 2, 8});
  Tensor dq = zeros({1, 8, 2, 4}), dk = zeros({1, 8, 1, 4}), dv = zeros({1, 8, 1, 4});
  MhaForwardArgs args() const { return {q, k, v, {}, {}, {true, 0}, 0.0f}; }
  MhaBackwardArgs bwd() const { return {args(), out, dout, lse, {}}; }
};

TEST(MhaBoundary, ChecksAloneAndInTheKernelAgree) {
  Mha m;
  EXPECT_EQ(error_of([&] { m.args().validate(m.out, m.lse); }), kNoError);
  EXPECT_EQ(error_of([&] { m.bwd().validate(m.dq, m.dk, m.dv, true); }), kNoError);
  expect_rejected([&] { m.args().validate(m.out, m.lse, cuda_stream()); },
                  [&] { mha_forward(m.args(), m.out, m.lse, cuda_stream()); },
                  "mha_forward: stream on cuda:0, but MHA kernels have no CUDA implementation yet");
  MhaForwardArgs a = m.args();
  a.k = on_cuda(m.k);
  expect_rejected([&] { a.validate(m.out, m.lse); }, [&] { mha_forward(a, m.out, m.lse); },
                  "k fp32[1, 8, 1, 4]@cuda:0 is on cuda:0, but MHA kernels have no CUDA implementation yet");
  m.args().validate();
  EXPECT_EQ(error_of([&] { a.validate(); }), error_of([&] { a.validate(m.out, m.lse); }));
  Tensor lse_short = zeros({1, 2, 7});
  expect_rejected([&] { m.args().validate(m.out, lse_short); },
                  [&] { mha_forward(m.args(), m.out, lse_short); }, "lse has shape [1, 2, 7], expected [1, 2, 8]");
  Tensor dk_bf16 = zeros({1, 8, 1, 4}, DType::kBFloat16);
  expect_rejected([&] { m.bwd().validate(m.dq, dk_bf16, m.dv, true); },
                  [&] { mha_backward(m.bwd(), m.dq, dk_bf16, m.dv, true); },
                  "dk (accumulate = true) has dtype bf16, expected fp32");
  const std::vector<std::int64_t> short_pos{0, 1, 2};
  a = m.args();
  a.k_pos = short_pos;
  expect_rejected([&] { a.validate(m.out, m.lse); }, [&] { mha_forward(a, m.out, m.lse); },
                  "k_pos has 3 entries, expected 0 (meaning 0..7) or Sk = 8");
  Tensor delta_bad = zeros({1, 8, 2});
  expect_rejected([&] { mha_backward_delta(m.out, m.dout, delta_bad); },
                  [&] { mha_backward_delta(m.out, m.dout, delta_bad); },
                  "delta has shape [1, 8, 2], expected [1, 2, 8]");
  Tensor out_b = zeros({1, 8, 2, 4}, DType::kBFloat16);
  expect_rejected([&] { lse_merge(m.out, m.lse, out_b, m.lse); }, [&] { lse_merge(m.out, m.lse, out_b, m.lse); },
                  "lse_merge out_b has dtype bf16, expected fp32 or fp64");
  // fp64 inputs: lse and delta fp64 (an fp32 one would round them), accumulators fp64.
  Mha w;
  for (Tensor* t : {&w.q, &w.k, &w.v, &w.dout}) *t = Tensor::copy_of(*t, DType::kFloat64, kWs);
  w.dq = zeros({1, 8, 2, 4}, DType::kFloat64);
  w.dk = zeros({1, 8, 1, 4}, DType::kFloat64);
  w.dv = zeros({1, 8, 1, 4}, DType::kFloat64);
  expect_rejected([&] { w.args().validate(w.out, w.lse); }, [&] { mha_forward(w.args(), w.out, w.lse); },
                  "lse has dtype fp32, expected fp64 for fp64 inputs");
  w.lse = zeros({1, 2, 8}, DType::kFloat64);
  expect_rejected([&] { w.bwd().validate(w.dq, m.dk, w.dv, true); },
                  [&] { mha_backward(w.bwd(), w.dq, m.dk, w.dv, true); },
                  "dk (accumulate = true) has dtype fp32, expected fp64");
  EXPECT_EQ(error_of([&] { w.args().validate(w.out, w.lse); }), kNoError);
  EXPECT_EQ(error_of([&] { w.bwd().validate(w.dq, w.dk, w.dv, true); }), kNoError);
  // 16-/32-bit inputs may ask for an fp64 lse (the merges of parallel/ do).
  Tensor lse64 = zeros({1, 2, 8}, DType::kFloat64);
  EXPECT_EQ(error_of([&] { m.args().validate(m.out, lse64); }), kNoError);
}

// ---- DSA ------------------------------------------------------------------------------------------------------------

// B = 1, Sq = Sk = 4, H = 2, Dqk = 8, Dv = 4, Hi = 2, Di = 4, k = 2. Row t selects positions {t - 1, t} (or {0}).
struct Dsa {
  Tensor q = f32({1, 4, 2, 8}, 1), c = f32({1, 4, 8}, 2), q_idx = f32({1, 4, 2, 4}, 3), w = f32({1, 4, 2}, 4),
         k_idx = f32({1, 4, 4}, 5), topk = zeros({1, 4, 2}, DType::kInt64);
  Tensor out = zeros({1, 4, 2, 4}), lse = zeros({1, 2, 4}), dout = f32({1, 4, 2, 4}, 6);
  Tensor dq = zeros({1, 4, 2, 8}), dc = zeros({1, 4, 8}), slots = zeros({1, 4, 2});
  Tensor dq_idx = zeros({1, 4, 2, 4}), dw = zeros({1, 4, 2}), dk_idx = zeros({1, 4, 4});
  Dsa() {
    std::int64_t* t = topk.data_as<std::int64_t>();
    const std::int64_t rows[4][2] = {{0, -1}, {0, 1}, {1, 2}, {2, 3}};
    for (int r = 0; r < 4; ++r) {
      t[2 * r] = rows[r][0];
      t[2 * r + 1] = rows[r][1];
    }
  }
  DsaAttentionArgs attn() const {
    DsaAttentionArgs a{q, c, topk, {}, {}};
    a.dim_v = 4;
    return a;
  }
  DsaAttentionBackwardArgs bwd() const { return {attn(), out, dout, lse, {}, {}}; }
  DsaIndexerArgs indexer() const { return {q_idx, w, k_idx, {}, {}}; }
};

TEST(DsaBoundary, AttentionArgumentsAreRejectedWithTheirRule) {
  Dsa d;
  EXPECT_EQ(error_of([&] { d.attn().validate(d.out, d.lse); }), kNoError);
  EXPECT_EQ(error_of([&] { d.bwd().validate(d.dq, d.dc, true); }), kNoError);
  auto forward_rejects = [&](const DsaAttentionArgs& a, const std::string& needle) {
    expect_rejected([&] { a.validate(d.out, d.lse); },
                    [&] { dsa_attention_forward(a, d.out, d.lse); }, needle);
    EXPECT_EQ(error_of([&] { a.validate(); }),
              error_of([&] { dsa_attention_forward(a, d.out, d.lse); }));
  };
  DsaAttentionArgs a = d.attn();
  a.dim_v = 9;
  forward_rejects(a, "dim_v = 9 must be in [1, Dqk = 8]");
  a = d.attn();
  Tensor c16 = test::random_tensor({1, 4, 8}, DType::kBFloat16, 2);
  a.c = c16;
  forward_rejects(a, "q and c must share one dtype, got fp32 and bf16");
  a = d.attn();
  const std::vector<std::int64_t> c_pos{0, 2, 2, 3};
  a.c_pos = c_pos;
  forward_rejects(a, "c_pos must be strictly increasing, but c_pos[2] = 2 follows 2");
  a = d.attn();
  a.q = on_cuda(d.q);
  forward_rejects(a, "is on cuda:0, but DSA kernels have no CUDA implementation yet");
  std::int64_t* t = d.topk.data_as<std::int64_t>();
  t[5] = 1;  // row 2: {1, 1}
  forward_rejects(d.attn(), "topk_indices row (b=0, t=2) must be strictly ascending, but slot 1 holds 1 after 1");
  t[5] = 3;  // row 2: {1, 3}, 3 > query position 2
  forward_rejects(d.attn(), "topk_indices row (b=0, t=2) selects position 3 after its query position 2");
  t[5] = 2;
  t[0] = -1;
  t[1] = 0;  // row 0: {-1, 0}
  forward_rejects(d.attn(), "topk_indices row (b=0, t=0) must be padded with -1 after its valid entries");
  t[0] = 0;
  t[1] = -1;
  expect_rejected([&] { d.attn().validate(d.out, d.lse, cuda_stream()); },
                  [&] { dsa_attention_forward(d.attn(), d.out, d.lse, cuda_stream()); },
                  "dsa_attention_forward: stream on cuda:0, but DSA kernels have no CUDA implementation yet");
  Tensor out_wide = zeros({1, 4, 2, 8});
  expect_rejected([&] { d.attn().validate(out_wide, d.lse); },
                  [&] { dsa_attention_forward(d.attn(), out_wide, d.lse); },
                  "out has shape [1, 4, 2, 8], expected [1, 4, 2, 4]");
  Tensor lse16 = zeros({1, 2, 4}, DType::kFloat16);
  expect_rejected([&] { dsa_attention_probs(d.attn(), lse16, d.slots); },
                  [&] { dsa_attention_probs(d.attn(), lse16, d.slots); },
                  "lse has dtype fp16, expected fp32 or fp64 for fp32 inputs");
  Tensor dc16 = zeros({1, 4, 8}, DType::kBFloat16);
  expect_rejected([&] { d.bwd().validate(d.dq, dc16, true); },
                  [&] { dsa_attention_backward(d.bwd(), d.dq, dc16, true); },
                  "dc (accumulate = true) has dtype bf16, expected fp32");
  DsaAttentionBackwardArgs b = d.bwd();
  b.out = TensorView();
  expect_rejected([&] { b.validate(d.dq, d.dc, true); },
                  [&] { dsa_attention_backward(b, d.dq, d.dc, true); }, "out (needed for delta, which was not given)");
  Tensor delta_bad = zeros({1, 4, 2});
  expect_rejected([&] { dsa_attention_delta(d.out, d.dout, delta_bad); },
                  [&] { dsa_attention_delta(d.out, d.dout, delta_bad); },
                  "delta has shape [1, 4, 2], expected [1, 2, 4]");
}

TEST(DsaBoundary, IndexerArgumentsAreRejectedWithTheirRule) {
  Dsa d;
  Tensor scores = zeros({1, 4, 2}), positions = zeros({1, 4, 2}, DType::kInt64);
  const DsaTopkState state{scores, positions};
  EXPECT_EQ(error_of([&] { d.indexer().validate(state); }), kNoError);
  DsaIndexerArgs a = d.indexer();
  Tensor k_wide = f32({1, 4, 5});
  a.k_idx = k_wide;
  expect_rejected([&] { a.validate(state); }, [&] { dsa_indexer_topk_block(a, state); },
                  "k_idx must be [B, Sk, Di] = [1, Sk, 4], got [1, 4, 5]");
  EXPECT_EQ(error_of([&] { a.validate(); }), error_of([&] { dsa_indexer_topk_block(a, state); }));
  a = d.indexer();
  Tensor w_bad = f32({1, 4, 3});
  a.w = w_bad;
  expect_rejected([&] { dsa_indexer_topk(a, d.topk); }, [&] { dsa_indexer_topk(a, d.topk); },
                  "w has shape [1, 4, 3], expected [1, 4, 2]");
  a = d.indexer();
  const std::vector<std::int64_t> q_pos{0, 1, 2};
  a.q_pos = q_pos;
  expect_rejected([&] { a.validate(state); }, [&] { dsa_indexer_topk_block(a, state); },
                  "q_pos has 3 entries, expected 0 (meaning 0..3) or Sq = 4");
  Tensor state16 = zeros({1, 4, 2}, DType::kFloat16);
  const DsaTopkState bad_state{state16, positions};
  expect_rejected([&] { dsa_topk_init(bad_state); }, [&] { dsa_topk_init(bad_state); },
                  "top-k state scores has dtype fp16, expected fp32 or fp64 (the DSA accumulator dtypes)");
  // fp64 scores are the accumulator dtype of fp64 inputs only.
  Tensor scores64 = zeros({1, 4, 2}, DType::kFloat64);
  const DsaTopkState wide_state{scores64, positions};
  expect_rejected([&] { d.indexer().validate(wide_state); },
                  [&] { dsa_indexer_topk_block(d.indexer(), wide_state); },
                  "top-k state scores (fp32 indexer inputs) has dtype fp64, expected fp32");
  Tensor scores3 = zeros({1, 4, 3}), positions3 = zeros({1, 4, 3}, DType::kInt64);
  const DsaTopkState other{scores3, positions3};
  expect_rejected([&] { dsa_topk_merge(state, other); }, [&] { dsa_topk_merge(state, other); },
                  "top-k states to merge must have one shape, got [1, 4, 2] and [1, 4, 3]");
  Tensor topk3 = zeros({1, 4, 3}, DType::kInt64);
  expect_rejected([&] { dsa_topk_finalize(state, topk3); }, [&] { dsa_topk_finalize(state, topk3); },
                  "topk_indices has shape [1, 4, 3], expected [1, 4, 2]");
  Tensor scores16 = zeros({1, 4, 2}, DType::kFloat16);
  expect_rejected([&] { dsa_indexer_scores_selected(d.indexer(), d.topk, scores16); },
                  [&] { dsa_indexer_scores_selected(d.indexer(), d.topk, scores16); },
                  "scores has dtype fp16, expected fp32");
  const DsaIndexerLossArgs loss{scores16, d.slots, d.topk};
  expect_rejected([&] { loss.validate(TensorView()); }, [&] { dsa_indexer_loss(loss, TensorView()); },
                  "probs has dtype fp16, expected fp32 or fp64 (the DSA accumulator dtypes)");
  Tensor dk_bad = zeros({1, 3, 4});
  expect_rejected([&] { dsa_indexer_backward(d.indexer(), d.topk, d.slots, d.dq_idx, d.dw, dk_bad, false); },
                  [&] { dsa_indexer_backward(d.indexer(), d.topk, d.slots, d.dq_idx, d.dw, dk_bad, false); },
                  "dk_idx has shape [1, 3, 4], expected [1, 4, 4]");
  expect_rejected(
      [&] {
        DsaIndexerLossArgs{d.slots, d.slots, d.topk}.validate(TensorView(), cuda_stream());
      },
      [&] {
        dsa_indexer_loss({d.slots, d.slots, d.topk}, TensorView(), cuda_stream());
      },
      "dsa_indexer_loss: stream on cuda:0, but DSA kernels have no CUDA implementation yet");
}

// ---- GDN ------------------------------------------------------------------------------------------------------------

// B = 1, S = 6, H = 2, K = 4, V = 3.
struct Gdn {
  Tensor q = f32({1, 6, 2, 4}, 1), k = f32({1, 6, 2, 4}, 2), v = f32({1, 6, 2, 3}, 3), g = f32({1, 6, 2}, 4),
         beta = f32({1, 6, 2}, 5);
  Tensor out = zeros({1, 6, 2, 3}), state = zeros({1, 2, 4, 3}), m = zeros({1, 2, 4, 4}), m2 = zeros({1, 2, 4, 4});
  Tensor dq = zeros({1, 6, 2, 4}), dg = zeros({1, 6, 2});
  GdnForwardArgs args() const { return {q, k, v, g, beta, {}}; }
};

TEST(GdnBoundary, ArgumentsAreRejectedWithTheirRule) {
  Gdn d;
  EXPECT_EQ(error_of([&] { d.args().validate(d.out, d.state); }), kNoError);
  auto forward_rejects = [&](const GdnForwardArgs& a, const std::string& needle) {
    expect_rejected([&] { a.validate(d.out, d.state); }, [&] { gdn_forward(a, d.out, d.state); }, needle);
    EXPECT_EQ(error_of([&] { a.validate(); }), error_of([&] { gdn_forward(a, d.out, d.state); }));
  };
  GdnForwardArgs a = d.args();
  a.chunk_size = 0;
  forward_rejects(a, "gdn: chunk_size must be >= 1, got 0");
  a = d.args();
  Tensor k5 = f32({1, 6, 2, 5});
  a.k = k5;
  forward_rejects(a, "k has shape [1, 6, 2, 5], expected [1, 6, 2, 4]");
  a = d.args();
  Tensor init64 = zeros({1, 2, 4, 3}, DType::kFloat64);
  a.initial_state = init64;
  forward_rejects(a, "initial_state has dtype fp64, expected fp32");
  a = d.args();
  a.scale = std::numeric_limits<float>::quiet_NaN();
  forward_rejects(a, "GDN scale nan must be finite");
  a = d.args();
  a.v = on_cuda(d.v);
  forward_rejects(a, "is on cuda:0, but GDN kernels have no CUDA implementation yet");
  if (ops::cuda_ops_built()) {
    // the CUDA route (gdn.cc): host tensors on a CUDA stream are uploaded to the stream's device; the checks pass
    EXPECT_EQ(error_of([&] { d.args().validate(d.out, d.state, cuda_stream()); }), kNoError);
  } else {
    expect_rejected([&] { d.args().validate(d.out, d.state, cuda_stream()); },
                    [&] { gdn_forward(d.args(), d.out, d.state, cuda_stream()); },
                    "gdn_forward: stream on cuda:0, but GDN kernels have no CUDA implementation yet");
  }
  Tensor out4 = zeros({1, 6, 2, 4});
  expect_rejected([&] { d.args().validate(out4, TensorView()); },
                  [&] { gdn_forward(d.args(), out4, TensorView()); },
                  "out has shape [1, 6, 2, 4], expected [1, 6, 2, 3]");
  const GdnBackwardArgs b{d.args(), d.out, {}};
  Tensor dg_bad = zeros({1, 6, 3});
  expect_rejected([&] { b.validate(d.dq, {}, {}, dg_bad, {}, {}); },
                  [&] { gdn_backward(b, d.dq, {}, {}, dg_bad, {}, {}); }, "dg has shape [1, 6, 3], expected [1, 6, 2]");
  a = d.args();
  a.initial_state = d.state;
  expect_rejected([&] { gdn_transition(a, d.m, d.state); }, [&] { gdn_transition(a, d.m, d.state); },
                  "gdn_transition: initial_state must be empty");
}

TEST(GdnBoundary, SegmentMapArgumentsAreRejectedWithTheirRule) {
  Gdn d;
  Tensor u = zeros({1, 2, 4, 3}), u2 = zeros({1, 2, 4, 3}), out_m = zeros({1, 2, 4, 4}), out_u = zeros({1, 2, 4, 3});
  EXPECT_EQ(error_of([&] { gdn_transition_compose(d.m2, u2, d.m, u, out_m, out_u); }), kNoError);
  expect_rejected([&] { gdn_transition_compose(d.m2, u2, d.m, u, d.m, out_u); },
                  [&] { gdn_transition_compose(d.m2, u2, d.m, u, d.m, out_u); },
                  "gdn_transition_compose: m may not alias m1 or m2");
  expect_rejected([&] { gdn_transition_apply(d.m, u, d.state, d.state); },
                  [&] { gdn_transition_apply(d.m, u, d.state, d.state); },
                  "gdn_transition_apply: s_end may not alias s_start");
  Tensor mt_bad = zeros({1, 2, 4, 3});
  expect_rejected([&] { gdn_transition_transpose(d.m, mt_bad); }, [&] { gdn_transition_transpose(d.m, mt_bad); },
                  "mt has shape [1, 2, 4, 3], expected [1, 2, 4, 4]");
  Tensor m16 = zeros({1, 2, 4, 4}, DType::kBFloat16);
  expect_rejected([&] { gdn_transition_apply_adjoint(m16, u, {}, out_u); },
                  [&] { gdn_transition_apply_adjoint(m16, u, {}, out_u); },
                  "gdn: m must be fp32 or fp64 (the state dtype), got bf16");
}

TEST(ShortConvBoundary, ArgumentsAreRejectedWithTheirRule) {
  Tensor x = f32({1, 6, 5}), weight = f32({5, 3}), out = zeros({1, 6, 5}), dx = zeros({1, 6, 5});
  const ShortConvArgs ok{x, weight, {}, true};
  EXPECT_EQ(error_of([&] { ok.validate(out, {}); }), kNoError);
  Tensor w64 = zeros({5, 3}, DType::kFloat64);
  ShortConvArgs a{x, w64, {}, true};
  expect_rejected([&] { a.validate(out, {}); }, [&] { short_conv_forward(a, out, {}); },
                  "weight has dtype fp64, expected fp32");
  EXPECT_EQ(error_of([&] { a.validate(); }), error_of([&] { short_conv_forward(a, out, {}); }));
  Tensor w0 = zeros({5, 0});
  a = {x, w0, {}, true};
  expect_rejected([&] { a.validate(out, {}); }, [&] { short_conv_forward(a, out, {}); },
                  "short_conv: kernel width W must be >= 1, got 0");
  Tensor halo = zeros({1, 3, 5});
  a = {x, weight, halo, true};
  expect_rejected([&] { a.validate(out, {}); }, [&] { short_conv_forward(a, out, {}); },
                  "initial_conv_state has shape [1, 3, 5], expected [1, 2, 5]");
  Tensor dx_bad = zeros({1, 5, 5});
  expect_rejected([&] { ok.validate(out, dx_bad, {}, {}); },
                  [&] { short_conv_backward(ok, out, dx_bad, {}, {}); }, "dx has shape [1, 5, 5], expected [1, 6, 5]");
  if (ops::cuda_ops_built())  // the CUDA route: host tensors on a CUDA stream are uploaded
    EXPECT_EQ(error_of([&] { ok.validate(out, dx, {}, {}, cuda_stream()); }), kNoError);
  else
    expect_rejected([&] { ok.validate(out, dx, {}, {}, cuda_stream()); },
                    [&] { short_conv_backward(ok, out, dx, {}, {}, cuda_stream()); },
                    "short_conv_backward: stream on cuda:0, but GDN kernels have no CUDA implementation yet");
}

// ---- RoPE -----------------------------------------------------------------------------------------------------------

TEST(RopeBoundary, ArgumentsAreRejectedWithTheirRule) {
  Tensor x = f32({1, 4, 2, 6}), odd = f32({1, 4, 2, 7}), ints = zeros({1, 4, 2, 6}, DType::kInt32);
  const std::vector<std::int64_t> pos{0, 1, 2, 3}, short_pos{0, 1, 2};
  EXPECT_EQ(error_of([&] { RopeConfig{}.validate(x, pos); }), kNoError);
  auto rejects = [&](const TensorView& t, std::span<const std::int64_t> p, double theta, const std::string& needle) {
    RopeConfig cfg;
    cfg.theta = theta;
    EXPECT_NE(error_of([&] { cfg.validate(t, p); }).find(needle), std::string::npos) << needle;
    EXPECT_NE(error_of([&] { rope_forward(t, p, theta); }).find(needle), std::string::npos) << needle;
    EXPECT_NE(error_of([&] { rope_backward(t, p, theta); }).find(needle), std::string::npos) << needle;
  };
  rejects(odd, pos, kDefaultRopeTheta, "head dim 7 must be even");
  rejects(x, short_pos, kDefaultRopeTheta, "3 positions for a sequence of 4");
  rejects(x, pos, 0.0, "theta 0 must be positive and finite");
  rejects(ints, pos, kDefaultRopeTheta, "has dtype int32, expected a floating dtype");
  if (ops::cuda_ops_built())  // the CUDA kernel (rope_cuda.cu) takes the tensor: the checks pass
    EXPECT_EQ(error_of([&] { RopeConfig{}.validate(on_cuda(x), pos); }), kNoError);
  else
    rejects(on_cuda(x), pos, kDefaultRopeTheta, "is on cuda:0, but RoPE kernels have no CUDA implementation yet");
}

// ---- allocation failure ---------------------------------------------------------------------------------------------
//
// Shapes whose per-thread scratch is far beyond any address space (>= 2^48 bytes), with inputs that are views of a
// small buffer: the boundary accepts them (shapes agree), the scratch allocation before the parallel region fails,
// and the kernel must raise seqpar's out-of-memory error (it used to allocate inside the region: std::terminate).
// The inputs are never read. Under AddressSanitizer the test runs with allocator_may_return_null=1 (CMakeLists.txt).

// A view of `shape` over a small real buffer.
TensorView fake(const Tensor& backing, const Shape& shape) {
  return TensorView(backing.data(), DType::kFloat32, shape);
}

// The error names the kernel's scratch, the bytes asked for (>= 2^48) and the ledger's totals by category; the
// ledger is unchanged by the failed call.
void expect_out_of_memory(const std::function<void()>& fn, const std::string& what) {
  const MemorySnapshot before = memory_ledger().snapshot();
  const std::string m = error_of(fn);
  const MemorySnapshot after = memory_ledger().snapshot();
  ASSERT_EQ(m.rfind("out of memory: ", 0), 0u) << m;
  EXPECT_NE(m.find(what), std::string::npos) << m;
  const std::size_t at = m.find(" asked for ");
  ASSERT_NE(at, std::string::npos) << m;
  EXPECT_GE(std::stod(m.substr(at + 11)), 0x1p48) << m;
  for (int c = 0; c < kNumMemCategories; ++c) {
    EXPECT_NE(m.find(str_cat(mem_category_name(static_cast<MemCategory>(c)), " ")), std::string::npos) << m;
  }
  // The totals at the failure: what the ledger held before the call, plus any small buffer the call took first.
  const std::size_t total_at = m.find(", total ");
  ASSERT_NE(total_at, std::string::npos) << m;
  const double total = std::stod(m.substr(total_at + 8));
  EXPECT_GE(total, static_cast<double>(before.total_current)) << m;
  EXPECT_LT(total, static_cast<double>(before.total_current) + 0x1p20) << m;
  EXPECT_EQ(after.total_current, before.total_current) << "a failed call must release what it took";
}

TEST(AttentionOutOfMemory, MhaBackwardPerThreadScratch) {
  // D = 2^42: one row of q per thread is 2^44 bytes, the per-thread buffers (q, dout, dq, K, K^T, V^T of 64 keys)
  // about 2^52.
  const std::int64_t D = std::int64_t{1} << 42;
  Tensor backing = zeros({64});
  const TensorView q = fake(backing, {1, 1, 1, D}), k = fake(backing, {1, 1, 1, D});
  Tensor lse = zeros({1, 1, 1}), delta = zeros({1, 1, 1});
  const MhaBackwardArgs b{{q, k, k, {}, {}, {}, 0.0f}, q, q, lse, delta};
  expect_out_of_memory([&] { mha_backward(b, q, k, k, false); }, "mha_backward");
  expect_out_of_memory([&] { mha_forward(b.fwd, q, lse); }, "mha_forward");
}

TEST(AttentionOutOfMemory, DsaAndGdnScratch) {
  Tensor backing = zeros({64});
  const std::int64_t D = std::int64_t{1} << 46;
  Tensor topk = zeros({1, 1, 1}, DType::kInt64), lse = zeros({1, 1, 1});
  DsaAttentionArgs a{fake(backing, {1, 1, 1, D}), fake(backing, {1, 1, D}), topk, {}, {}};
  a.dim_v = 1;
  expect_out_of_memory([&] { dsa_attention_forward(a, fake(backing, {1, 1, 1, 1}), lse); }, "dsa_attention_forward");
  // GDN: the [K, V] state of one thread's chunk scratch, K = V = 2^23.
  const std::int64_t K = std::int64_t{1} << 23;
  GdnForwardArgs g;
  g.q = g.k = fake(backing, {1, 1, 1, K});
  g.v = fake(backing, {1, 1, 1, K});
  g.g = g.beta = fake(backing, {1, 1, 1});
  expect_out_of_memory([&] { gdn_forward(g, fake(backing, {1, 1, 1, K}), TensorView()); }, "GDN");
  // Short conv backward: the per-thread rows of one batch, S = 2^47.
  const std::int64_t S = std::int64_t{1} << 47;
  const ShortConvArgs c{fake(backing, {1, S, 1}), fake(backing, {1, 4}), {}, true};
  expect_out_of_memory([&] { short_conv_backward(c, fake(backing, {1, S, 1}), {}, {}, {}); }, "short_conv_backward");
}

}  // namespace
}  // namespace seqpar::attn
