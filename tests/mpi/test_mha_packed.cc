// MHA / GQA on packed rows (cu_seqlens) and padded lengths under ring (p2p, all-gather), Ulysses and USP (both
// placements), every layout kind (docs/design.md section 15). The independent check: the packed result of document
// d equals document d run alone through the unpacked single-rank path, for every output and gradient; padding rows
// of every local tensor are exactly 0 (lse -inf) and nothing is NaN; bad packings fail on every rank before any
// message.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "parallel/usp.h"
#include "runtime/sp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

constexpr std::int64_t kHq = 4, kHkv = 2, kDim = 16;

test::MhaShape packed_shape(std::int64_t tokens, attn::MaskSpec mask) {
  test::MhaShape s;
  s.batch = 1;
  s.seq = tokens;
  s.hq = kHq;
  s.hkv = kHkv;
  s.dim = kDim;
  s.dtype = DType::kFloat64;
  s.mask = mask;
  return s;
}

// Padding rows of this rank's local tensors are exactly 0 (lse -inf); no element is NaN.
void expect_clean_padding(const SequenceLayout& layout, int sp_rank, const std::vector<Tensor>& local,
                          const std::string& what) {
  const std::vector<std::int64_t> tok = layout.token_index(sp_rank);
  const std::int64_t rows = layout.local_len();
  bool ok = true;
  for (std::size_t t = 0; t < local.size(); ++t) {
    const std::vector<double> x = test::to_double(local[t].view());
    const bool is_lse = t == 1;  // [1, H, S_local]
    const std::int64_t inner = static_cast<std::int64_t>(x.size()) / rows;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(x.size()); ++i) {
      const std::int64_t row = is_lse ? i % rows : i / inner;
      if (std::isnan(x[i])) ok = false;
      if (tok[row] >= 0) continue;
      if (is_lse ? x[i] != -std::numeric_limits<double>::infinity() : x[i] != 0.0) ok = false;
    }
  }
  EXPECT_TRUE(ok) << what << ": a padding row is not 0 (lse -inf) or a value is NaN";
}

struct MaskCase {
  attn::MaskSpec mask;
  RingImpl impl;
};

std::string mask_name(const MaskCase& m) {
  return str_cat(m.mask.causal ? "causal" : "full", m.mask.window > 0 ? str_cat("_w", m.mask.window) : "", "_",
                 ring_impl_name(m.impl));
}

// Every grid and kind on one packing: the CP result equals the per-document result.
void check_packing(const std::vector<std::int64_t>& lens, const std::vector<MaskCase>& masks,
                   const std::vector<LayoutKind>& kinds) {
  const std::vector<std::int64_t> cu = cu_seqlens_of(lens);
  for (const MaskCase& m : masks) {
    const test::MhaShape s = packed_shape(cu.back(), m.mask);
    const test::MhaProblem p(s);
    const test::MhaResult want = test::per_document_result(s, p, cu);
    for (const SpGridConfig& gc : test::usp_grids(kHq)) {
      const SpGrid grid(world(), gc);
      const CpGroups groups = CpGroups::from(grid);
      for (LayoutKind kind : kinds) {
        const SequenceLayout layout = SequenceLayout::packed_for_groups(groups, cu, kind);
        RingAttentionConfig cfg;
        cfg.impl = m.impl;
        cfg.causal = m.mask.causal;
        cfg.window = m.mask.window;
        std::vector<Tensor> local;
        const test::MhaResult got = test::usp_result(grid, s, p, cfg, layout, nullptr, &local);
        const std::string what = str_cat("T=", cu.back(), " docs=", lens.size(), " ", mask_name(m), " u",
                                         gc.ulysses_size, "_", placement_name(gc.placement), " ", layout_name(kind));
        expect_clean_padding(layout, groups.sp_rank(), local, what);
        test::expect_mha_close(got, want, 1e-10, what);
      }
    }
  }
}

const std::vector<MaskCase> kAllMasks = {{{true, 0}, RingImpl::kP2P},
                                         {{false, 0}, RingImpl::kP2P},
                                         {{true, 5}, RingImpl::kP2P},
                                         {{true, 0}, RingImpl::kAllGather},
                                         {{false, 0}, RingImpl::kAllGather}};
const std::vector<LayoutKind> kAllKinds = {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe,
                                           LayoutKind::kBalanced};

// An odd total with zero-length documents, documents of length 1, documents shorter than the number of ranks and a
// long one.
TEST(MhaPacked, MixedDocumentsMatchEachDocumentAlone) {
  check_packing({37, 1, 0, 64, 3, 0, 90, 2}, kAllMasks, kAllKinds);
}

TEST(MhaPacked, AllDocumentsOfLengthOne) {
  check_packing(std::vector<std::int64_t>(13, 1), {{{true, 0}, RingImpl::kP2P}, {{false, 0}, RingImpl::kAllGather}},
                kAllKinds);
}

// Fewer tokens than ranks: most ranks hold only padding and still run every exchange.
TEST(MhaPacked, FewerTokensThanRanks) {
  check_packing({1, 2}, {{{true, 0}, RingImpl::kP2P}, {{false, 0}, RingImpl::kP2P}, {{true, 0}, RingImpl::kAllGather}},
                kAllKinds);
}

// One document spanning every rank, packed, equals today's unpacked path bit for bit (no document bound restricts
// anything); an odd unpacked length (197) is padded and equals the single-rank result.
TEST(MhaPacked, OneDocumentEqualsTheUnpackedPath) {
  for (std::int64_t T : {std::int64_t{8} * world().size() * 2, std::int64_t{197}}) {
    for (bool causal : {true, false}) {
      const test::MhaShape s = packed_shape(T, {causal, 0});
      const test::MhaProblem p(s);
      const test::MhaResult single = test::single_rank_result(s, p);
      for (const SpGridConfig& gc : test::usp_grids(kHq)) {
        const SpGrid grid(world(), gc);
        const CpGroups groups = CpGroups::from(grid);
        RingAttentionConfig cfg;
        cfg.causal = causal;
        const std::vector<std::int64_t> cu = {0, T};
        const std::string what = str_cat("T=", T, causal ? " causal" : " full", " u", gc.ulysses_size);
        const test::MhaResult packed =
            test::usp_result(grid, s, p, cfg, SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kZigzag));
        const test::MhaResult unpacked =
            test::usp_result(grid, s, p, cfg, SequenceLayout::for_groups(groups, T, LayoutKind::kZigzag));
        EXPECT_EQ(packed.out, unpacked.out) << what;
        EXPECT_EQ(packed.dq, unpacked.dq) << what;
        EXPECT_EQ(packed.dk, unpacked.dk) << what;
        EXPECT_EQ(packed.dv, unpacked.dv) << what;
        test::expect_mha_close(unpacked, single, 1e-10, what);
      }
    }
  }
}

// The ring skips the compute of a KV block that shares no document with the local queries (it still travels): with
// one document per ring rank (contiguous, equal lengths) no rank computes any block but its own.
TEST(MhaPacked, RingSkipsBlocksOfOtherDocuments) {
  const int n = world().size();
  const std::int64_t len = 16;
  const std::vector<std::int64_t> cu = cu_seqlens_of(std::vector<std::int64_t>(n, len));
  const test::MhaShape s = packed_shape(cu.back(), {true, 0});
  const test::MhaProblem p(s);
  const SpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  RingAttentionConfig cfg;
  CpCounters counters;
  test::usp_result(grid, s, p, cfg, SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kContiguous), &counters);
  // FLOPs of the own block only: 4 B Hq D per visible pair forward and 2.5 times that backward, len (len + 1) / 2
  // causal pairs.
  const double own = 4.0 * kHq * kDim * static_cast<double>(len * (len + 1) / 2);
  EXPECT_DOUBLE_EQ(counters.flops, 3.5 * own);
}

// Bad packings fail with one clear error on every rank before any message: B > 1, and ranks that disagree on
// cu_seqlens (the agreement check names the digest).
TEST(MhaPacked, BadPackingsFailOnEveryRank) {
  const int n = world().size();
  const SpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  const std::vector<std::int64_t> cu = {0, 5, 12};
  // The error of a forward of USP over `layout` with batch B (empty: none).
  auto forward_error = [&](const SequenceLayout& layout, std::int64_t batch) {
    UspAttention usp(groups, layout, RingAttentionConfig{});
    const std::int64_t sl = layout.local_len();
    Tensor q = Tensor::zeros({batch, sl, kHq, kDim}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor k = Tensor::zeros({batch, sl, kHkv, kDim}, DType::kFloat32, MemCategory::kWorkspace);
    try {
      usp.forward(q.view(), k.view(), k.view());
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  std::string message = forward_error(SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kZigzag), 2);
  EXPECT_NE(message.find("has batch B = 2; a packed layout (cu_seqlens) takes B = 1"), std::string::npos) << message;
  EXPECT_TRUE(test::all_ranks(world(), !message.empty()));
  if (n == 1) return;
  // Rank 0 was handed another packing of the same total (contiguous: the same padded length, so only the digest
  // differs).
  const std::vector<std::int64_t> other = {0, 6, 12};
  message = forward_error(
      SequenceLayout::packed_for_groups(groups, world().rank() == 0 ? other : cu, LayoutKind::kContiguous), 1);
  EXPECT_NE(message.find("disagree on cu_seqlens digest"), std::string::npos) << message;
  EXPECT_TRUE(test::all_ranks(world(), !message.empty()));
}

}  // namespace
}  // namespace seqpar
