// Inference caches on one device (attention/kv_cache.h, attention/dsa_cache.h, attention/gdn_decode.h): N decode
// steps of n tokens after a T-token prefill return rows T..T+Nn-1 of the fp64 reference over the T + Nn tokens (MHA
// with B = 2 and GQA: out and lse; DSA: topk_indices bitwise those of the single-device training selection, out and
// lse against the fp64 reference; GDN: out and the final state; the short conv: out and its tail); the ledger's
// persistent_cache holds exactly the documented bytes; a refused append or step leaves the cache unchanged. Tolerances:
// test::decode_atol / decode_rtol (tests/util/decode_problem.h).
#include <gtest/gtest.h>

#include "attention/dsa_cache.h"
#include "attention/gdn_decode.h"
#include "attention/kv_cache.h"
#include "tests/util/decode_problem.h"

namespace seqpar::attn {
namespace {

using test::all_close, test::persistent_bytes, test::rows_of, test::to_double;
constexpr MemCategory kWs = MemCategory::kWorkspace;

TEST(KvCache, LedgerHoldsTheFormulaForOneLayer) {
  const std::int64_t before = persistent_bytes();
  const KvCacheSpec spec{2, 100, 2, 16, DType::kBFloat16, Device::cpu()};
  {
    MhaKvCache cache(spec);
    // M_KV = 2 L B Hkv T D bytes with L = 1, T = capacity, 2 bytes per bf16 element.
    EXPECT_EQ(mha_kv_cache_bytes(spec), 2 * 1 * 2 * 2 * 100 * 16 * 2);
    EXPECT_EQ(persistent_bytes() - before, mha_kv_cache_bytes(spec));
  }
  EXPECT_EQ(persistent_bytes(), before);
}

struct MhaCase {
  DType dtype;
  std::int64_t n;  // new tokens per step
};
std::string case_name(const MhaCase& c) { return str_cat(dtype_name(c.dtype), "_n", c.n); }

class MhaDecode : public ::testing::TestWithParam<MhaCase> {};

TEST_P(MhaDecode, StepsEqualRowsOfTheWholeSequence) {
  const MhaCase c = GetParam();
  const std::int64_t B = 2, hq = 4, hkv = 2, D = 16;
  const test::DecodeSchedule sched{37, 4, c.n};
  const test::MhaDecodeProblem p(B, sched.total(), hq, hkv, D, c.dtype, 11);
  MhaKvCache cache(KvCacheSpec{B, sched.total(), hkv, D, c.dtype, Device::cpu()});
  cache.append(rows_of(p.k, 0, sched.prompt), rows_of(p.v, 0, sched.prompt));
  const DType acc = accumulator_dtype(c.dtype);
  for (std::int64_t step = 0; step < sched.steps; ++step) {
    const std::int64_t t0 = sched.first(step), t1 = t0 + c.n;
    cache.append(rows_of(p.k, t0, t1), rows_of(p.v, t0, t1));
    Tensor out = Tensor::empty({B, c.n, hq, D}, c.dtype, kWs), lse = Tensor::empty({B, hq, c.n}, acc, kWs);
    mha_decode(cache, rows_of(p.q, t0, t1), test::step_positions(t0, t1), out, lse);
    test::expect_step_close(out, lse, p.ref_out, p.ref_lse, t0, t1, c.dtype, str_cat("step ", step));
  }
  EXPECT_EQ(cache.length(), sched.total());
}

INSTANTIATE_TEST_SUITE_P(Cases, MhaDecode,
                         ::testing::Values(MhaCase{DType::kFloat32, 1}, MhaCase{DType::kFloat32, 3},
                                           MhaCase{DType::kFloat64, 1}, MhaCase{DType::kFloat64, 2}),
                         [](const auto& info) { return case_name(info.param); });

TEST(KvCache, RefusedAppendsAndStepsChangeNothing) {
  const KvCacheSpec spec{2, 8, 2, 16, DType::kFloat32, Device::cpu()};
  MhaKvCache cache(spec);
  cache.append(test::random_tensor({2, 6, 2, 16}, DType::kFloat32, 1),
               test::random_tensor({2, 6, 2, 16}, DType::kFloat32, 2));
  const std::vector<double> k_before = to_double(cache.k_rows(1));
  const auto expect_unchanged = [&] {
    EXPECT_EQ(cache.length(), 6);
    EXPECT_EQ(to_double(cache.k_rows(1)), k_before);
  };
  const Tensor three = test::random_tensor({2, 3, 2, 16}, DType::kFloat32, 3);
  test::expect_error([&] { cache.append(three, three); }, "3 new tokens after 6 stored would run past the capacity 8");
  expect_unchanged();
  const Tensor other = test::random_tensor({2, 1, 4, 16}, DType::kFloat32, 4);
  test::expect_error([&] { cache.append(other, other); }, "k_new (the cache's [B, n, Hkv, D])");
  expect_unchanged();
  const Tensor one = test::random_tensor({2, 1, 2, 16}, DType::kFloat32, 5);
  const std::vector<std::int64_t> back{3};
  test::expect_error([&] { cache.append(one, one, back); }, "must follow the last stored position 5");
  expect_unchanged();
  const Tensor q = test::random_tensor({2, 1, 4, 16}, DType::kFloat64, 6);
  Tensor out = Tensor::empty({2, 1, 4, 16}, DType::kFloat32, kWs), lse = Tensor::empty({2, 4, 1}, DType::kFloat32, kWs);
  const std::vector<std::int64_t> q_pos{6};
  test::expect_error([&] { mha_decode(cache, q, q_pos, out, lse); }, "q has dtype fp64, the cache fp32");
}

// ---- DSA ---------------------------------------------------------------------------------------------------------

TEST(DsaCache, LedgerHoldsTheFormulaForOneLayer) {
  const std::int64_t before = persistent_bytes();
  const DsaCacheSpec spec{2, 100, 32, 72, DType::kBFloat16};
  {
    DsaCache cache(spec);
    // M = L B T (Di + Dqk) bytes with L = 1, T = capacity, 2 bytes per bf16 element.
    EXPECT_EQ(dsa_cache_bytes(spec), 1 * 2 * 100 * (32 + 72) * 2);
    EXPECT_EQ(persistent_bytes() - before, dsa_cache_bytes(spec));
  }
  EXPECT_EQ(persistent_bytes(), before);
}

struct DsaCase {
  DType dtype;
  std::int64_t n;
  std::int64_t window = 0;
  // The indexer's heads and dim, the prompt length, the cache slots left free after the last step, and k. A decode
  // step of n <= 4 query rows reads the cache's keys in place (n = 5: panels, as training does) while the training
  // forward (over the whole sequence) converts them into panels first: the larger shapes cross several 64-key blocks,
  // heads that are not a multiple of the SIMD width, and (bf16) keys converted per block.
  std::int64_t hi = 2, di = 8, prompt = 37, spare = 0, topk = 9;
};
std::string case_name(const DsaCase& c) {
  return str_cat(dtype_name(c.dtype), "_n", c.n, c.window > 0 ? str_cat("_window", c.window) : "",
                 c.prompt != 37 ? str_cat("_hi", c.hi, "_di", c.di, "_prompt", c.prompt, "_spare", c.spare) : "");
}

class DsaDecode : public ::testing::TestWithParam<DsaCase> {};

TEST_P(DsaDecode, StepsEqualRowsOfTheTrainingForward) {
  const DsaCase c = GetParam();
  const std::int64_t B = 2, H = 4, dqk = 24, dv = 16;
  const test::DecodeSchedule sched{c.prompt, 4, c.n};
  const test::DsaDecodeProblem p(B, sched.total(), H, dqk, dv, c.hi, c.di, c.topk, c.window, c.dtype, 41);
  EXPECT_TRUE(p.ref_topk_matches) << "the kernels' fp64 selection differs from the fp64 reference's";
  DsaCache cache(DsaCacheSpec{B, sched.total() + c.spare, c.di, dqk, c.dtype});
  cache.append(rows_of(p.k_idx, 0, sched.prompt), rows_of(p.c, 0, sched.prompt));
  const DType acc = accumulator_dtype(c.dtype);
  // out may be of any floating dtype: fp32 for a bf16 cache keeps bf16's rounding out of the comparison
  const DType out_dtype = c.dtype == DType::kBFloat16 ? DType::kFloat32 : c.dtype;
  for (std::int64_t step = 0; step < sched.steps; ++step) {
    const std::int64_t t0 = sched.first(step), t1 = t0 + c.n;
    cache.append(rows_of(p.k_idx, t0, t1), rows_of(p.c, t0, t1));
    const std::vector<std::int64_t> q_pos = test::step_positions(t0, t1);
    const Tensor q = rows_of(p.q, t0, t1), q_idx = rows_of(p.q_idx, t0, t1), w = rows_of(p.w, t0, t1);
    DsaDecodeArgs a{q, q_idx, w, q_pos, c.window, dv};
    Tensor topk = Tensor::empty({B, c.n, c.topk}, DType::kInt64, kWs);
    Tensor out = Tensor::empty({B, c.n, H, dv}, out_dtype, kWs), lse = Tensor::empty({B, H, c.n}, acc, kWs);
    dsa_decode(cache, a, topk, out, lse);
    EXPECT_EQ(to_double(topk), to_double(rows_of(p.topk_indices, t0, t1))) << "topk_indices of step " << step;
    test::expect_step_close(out, lse, p.ref_out, p.ref_lse, t0, t1, c.dtype, str_cat("step ", step));
  }
  EXPECT_EQ(cache.length(), sched.total());
}

INSTANTIATE_TEST_SUITE_P(Cases, DsaDecode,
                         ::testing::Values(DsaCase{DType::kFloat32, 1}, DsaCase{DType::kFloat32, 3},
                                           DsaCase{DType::kFloat64, 1}, DsaCase{DType::kFloat64, 2, 20},
                                           DsaCase{DType::kFloat32, 1, 0, 20, 40, 300, 7, 40},
                                           DsaCase{DType::kFloat32, 2, 100, 32, 32, 300, 0, 40},
                                           DsaCase{DType::kBFloat16, 1, 0, 20, 40, 300, 3, 40},
                                           DsaCase{DType::kFloat64, 3, 0, 20, 40, 300, 5, 40},
                                           DsaCase{DType::kFloat32, 4, 0, 20, 40, 300, 0, 40},
                                           DsaCase{DType::kFloat32, 5}),
                         [](const auto& info) { return case_name(info.param); });

TEST(DsaCache, RefusedAppendsAndStepsChangeNothing) {
  const DsaCacheSpec spec{2, 8, 8, 16, DType::kFloat32};
  DsaCache cache(spec);
  cache.append(test::random_tensor({2, 6, 8}, DType::kFloat32, 1), test::random_tensor({2, 6, 16}, DType::kFloat32, 2));
  const std::vector<double> k_before = to_double(cache.k_idx_rows(1)), c_before = to_double(cache.c_rows(1));
  const auto expect_unchanged = [&] {
    EXPECT_EQ(cache.length(), 6);
    EXPECT_EQ(to_double(cache.k_idx_rows(1)), k_before);
    EXPECT_EQ(to_double(cache.c_rows(1)), c_before);
  };
  const auto rows = [](std::int64_t n, std::int64_t width, std::uint64_t seed) {
    return test::random_tensor({2, n, width}, DType::kFloat32, seed);
  };
  test::expect_error([&] { cache.append(rows(3, 8, 3), rows(3, 16, 4)); },
                     "DsaCache::append: 3 new tokens after 6 stored would run past the capacity 8");
  expect_unchanged();
  test::expect_error([&] { cache.append(rows(1, 8, 5), rows(1, 12, 6)); }, "c_new (the cache's [B, n, Dqk])");
  expect_unchanged();
  const std::vector<std::int64_t> back{3};
  test::expect_error([&] { cache.append(rows(1, 8, 7), rows(1, 16, 8), back); },
                     "must follow the last stored position 5");
  expect_unchanged();
  const Tensor q = test::random_tensor({2, 1, 2, 16}, DType::kFloat64, 9);
  const Tensor q_idx = test::random_tensor({2, 1, 2, 8}, DType::kFloat32, 10);
  const Tensor w = test::random_tensor({2, 1, 2}, DType::kFloat32, 11);
  const std::vector<std::int64_t> q_pos{6};
  Tensor topk = Tensor::empty({2, 1, 4}, DType::kInt64, kWs);
  Tensor out = Tensor::empty({2, 1, 2, 16}, DType::kFloat32, kWs), lse = Tensor::empty({2, 2, 1}, DType::kFloat32, kWs);
  test::expect_error(
      [&] {
        dsa_decode(cache, {q, q_idx, w, q_pos, 0, 16}, topk, out, lse);
      },
      "q has dtype fp64, the cache fp32");
  expect_unchanged();
}

// ---- GDN ---------------------------------------------------------------------------------------------------------

struct GdnCase {
  DType dtype;
  std::int64_t n;
};
std::string case_name(const GdnCase& c) { return str_cat(dtype_name(c.dtype), "_n", c.n); }

class GdnDecode : public ::testing::TestWithParam<GdnCase> {};

TEST_P(GdnDecode, StepsEqualTheRecurrenceOverTheWholeSequence) {
  const GdnCase c = GetParam();
  const std::int64_t B = 2, hk = 2, hv = 4, K = 16, V = 8;
  const test::DecodeSchedule sched{21, 4, c.n};
  const test::GdnDecodeProblem p(B, sched.total(), hk, hv, K, V, c.dtype, 21);
  const std::int64_t before = persistent_bytes();
  GdnCacheSpec spec;
  spec.batch = B;
  spec.value_heads = hv;
  spec.key_dim = K;
  spec.value_dim = V;
  spec.state_dtype = accumulator_dtype(c.dtype);
  GdnCache cache(spec);
  const std::int64_t cache_bytes = persistent_bytes() - before;
  EXPECT_EQ(cache_bytes, gdn_cache_bytes(spec));
  EXPECT_EQ(cache_bytes, B * hv * K * V * static_cast<std::int64_t>(dtype_size(spec.state_dtype)));
  // Prefill: the chunked kernel over the prompt, its final state into the cache.
  {
    const auto rows = [&](const TensorView& t) { return rows_of(t, 0, sched.prompt); };
    const Tensor q = rows(p.q), k = rows(p.k), v = rows(p.v), g = rows(p.g), beta = rows(p.beta);
    Tensor out = Tensor::empty({B, sched.prompt, hv, V}, c.dtype, kWs);
    Tensor final_state = Tensor::empty({B, hv, K, V}, spec.state_dtype, kWs);
    gdn_forward(gdn_args(q, k, v, g, beta), out, final_state);
    cache.set_state(final_state, sched.prompt);
  }
  for (std::int64_t step = 0; step < sched.steps; ++step) {
    const std::int64_t t0 = sched.first(step), t1 = t0 + c.n;
    const auto rows = [&](const TensorView& t) { return rows_of(t, t0, t1); };
    const Tensor q = rows(p.q), k = rows(p.k), v = rows(p.v), g = rows(p.g), beta = rows(p.beta);
    Tensor out = Tensor::empty({B, c.n, hv, V}, c.dtype, kWs);
    gdn_decode(cache, gdn_args(q, k, v, g, beta), out);
    EXPECT_TRUE(all_close(to_double(out), to_double(rows(p.ref_out)), test::decode_atol(c.dtype),
                          test::decode_rtol(c.dtype), str_cat("out of step ", step)));
  }
  EXPECT_EQ(cache.length(), sched.total());
  EXPECT_TRUE(all_close(to_double(cache.state()), to_double(p.ref_final), test::decode_atol(c.dtype),
                        test::decode_rtol(c.dtype), "final_state"));
  EXPECT_EQ(persistent_bytes() - before, cache_bytes);  // constant in the number of tokens
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnDecode,
                         ::testing::Values(GdnCase{DType::kFloat32, 1}, GdnCase{DType::kFloat32, 3},
                                           GdnCase{DType::kFloat64, 1}, GdnCase{DType::kFloat64, 2}),
                         [](const auto& info) { return case_name(info.param); });

TEST(GdnDecode, RefusedStepChangesNothing) {
  GdnCacheSpec spec;
  spec.batch = 1;
  spec.value_heads = 2;
  spec.key_dim = 4;
  spec.value_dim = 4;
  GdnCache cache(spec);
  const Tensor init = test::random_tensor({1, 2, 4, 4}, DType::kFloat32, 1);
  cache.set_state(init, 5);
  const Tensor q = test::random_tensor({1, 1, 2, 8}, DType::kFloat32, 2);  // K = 8: not the cache's
  const Tensor v = test::random_tensor({1, 1, 2, 4}, DType::kFloat32, 3);
  const Tensor g = test::random_tensor({1, 1, 2}, DType::kFloat32, 4);
  Tensor out = Tensor::empty({1, 1, 2, 4}, DType::kFloat32, kWs);
  test::expect_error([&] { gdn_decode(cache, gdn_args(q, q, v, g, g), out); }, "do not match the cache");
  EXPECT_EQ(cache.length(), 5);
  EXPECT_EQ(to_double(cache.state()), to_double(init));
}

TEST(ShortConvDecode, StepsEqualTheConvOverTheWholeSequence) {
  const std::int64_t B = 2, C = 12, W = 4, T = 9, steps = 5;
  const Tensor x = test::random_tensor({B, T + steps, C}, DType::kFloat64, 31);
  const Tensor w = test::random_tensor({C, W}, DType::kFloat64, 32);
  Tensor ref = Tensor::empty({B, T + steps, C}, DType::kFloat64, kWs);
  reference::short_conv_forward(test::conv_args(x, w), ref, {});
  GdnCacheSpec spec;
  spec.batch = B;
  spec.conv_channels = C;
  spec.conv_width = W;
  spec.conv_dtype = DType::kFloat64;
  GdnCache cache(spec);
  Tensor prompt_out = Tensor::empty({B, T, C}, DType::kFloat64, kWs);
  Tensor tail = Tensor::empty({B, W - 1, C}, DType::kFloat64, kWs);
  short_conv_forward(test::conv_args(rows_of(x, 0, T), w), prompt_out, tail);
  cache.set_conv_state(tail);
  for (std::int64_t t = T; t < T + steps; ++t) {
    Tensor out = Tensor::empty({B, 1, C}, DType::kFloat64, kWs);
    short_conv_decode(cache, test::conv_args(rows_of(x, t, t + 1), w), out);
    EXPECT_TRUE(all_close(to_double(out), to_double(rows_of(ref, t, t + 1)), 1e-12, 1e-12, str_cat("out at ", t)));
  }
  EXPECT_TRUE(all_close(to_double(cache.conv_state()), to_double(rows_of(x, T + steps - (W - 1), T + steps)), 0, 0,
                        "conv tail"));
}

// A cache too large for the node is an Error naming the cache, its shape and the bytes asked for, and the ledger is
// unchanged (the positions' reserve used to run first and escape as an unnamed std::bad_alloc).
TEST(CacheErrors, CapacityTooLargeForTheNodeNamesTheCache) {
  const std::int64_t before = persistent_bytes();
  const std::int64_t huge = std::int64_t{1} << 40;
  test::expect_error(
      [&] {
        MhaKvCache cache(KvCacheSpec{1, huge, 8, 128, DType::kFloat32, Device::cpu()});
      },
      "MhaKvCache: K and V of [1, 1099511627776, 8, 128] fp32 (batch, capacity, kv_heads, head_dim): "
      "out of memory: allocating 4503599627370496 bytes of persistent_cache");
  test::expect_error(
      [&] {
        DsaCache cache(DsaCacheSpec{1, huge, 128, 576, DType::kBFloat16});
      },
      "DsaCache: batch 1, capacity 1099511627776, index_dim 128 + latent_dim 576 bf16: out of memory: "
      "allocating 281474976710656 bytes of persistent_cache");
  // GDN's state has no capacity, but batch x heads x K x V can be as large (it named nothing: a bare "out of memory").
  test::expect_error(
      [&] {
        GdnCache cache(GdnCacheSpec{std::int64_t{1} << 20, 64, 1 << 12, 1 << 12, DType::kFloat32});
      },
      "GdnCache: state of [1048576, 64, 4096, 4096] fp32 (batch, value_heads, key_dim, value_dim) and conv tail of "
      "[1048576, 0, 0] fp32: out of memory: allocating 4503599627370496 bytes of persistent_cache");
  test::expect_error(
      [&] {
        GdnCache cache(GdnCacheSpec{huge, huge, 128, 128, DType::kFloat32});
      },
      "GdnCache: state of [1099511627776, 1099511627776, 128, 128] fp32");
  EXPECT_EQ(persistent_bytes(), before);
  // A shape whose element count overflows is refused by name too.
  test::expect_error(
      [&] {
        MhaKvCache cache(KvCacheSpec{huge, huge, 8, 128, DType::kFloat32, Device::cpu()});
      },
      "MhaKvCache: K and V of [1099511627776, 1099511627776, 8, 128] fp32");
}

}  // namespace
}  // namespace seqpar::attn
