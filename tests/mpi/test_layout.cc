// Sequence layouts (positions, scatter / gather) and RoPE on layout positions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "attention/rope.h"
#include "parallel/layout.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

// Owner of global position t under the layouts with a closed form, written independently of SequenceLayout (ring rank
// only). The balanced kind has none (its chunks go to ring ranks by a greedy search, checked against its own
// contract in tests/unit/test_layout_packed.cc): std::nullopt.
std::optional<int> owner_ring_rank(LayoutKind kind, std::int64_t t, std::int64_t seq, int ring) {
  switch (kind) {
    case LayoutKind::kContiguous: return static_cast<int>(t / (seq / ring));
    case LayoutKind::kZigzag: {
      const std::int64_t chunk = t / (seq / (2 * ring));
      return static_cast<int>(chunk < ring ? chunk : 2 * ring - 1 - chunk);
    }
    case LayoutKind::kStripe: return static_cast<int>(t % ring);
    case LayoutKind::kBalanced: return std::nullopt;
  }
  return std::nullopt;
}

// Every kind: the ring shards are increasing, partition the slots, and are the concatenation of their Ulysses pieces;
// each position has the closed-form owner, or for the balanced kind each chunk [k c, (k+1) c) of tokens lies whole
// in one ring shard.
TEST(Layout, PositionsPartitionTheSequence) {
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe, LayoutKind::kBalanced}) {
    for (int ring : {1, 2, 3, 4, 8}) {
      for (int uly : {1, 2, 4}) {
        const std::int64_t seq = 2 * ring * uly * 6;
        const SequenceLayout layout(kind, seq, ring, uly);
        // seq divides as contiguous, zigzag and stripe need; balanced may pad its shards to the longest
        if (kind != LayoutKind::kBalanced) {
          ASSERT_EQ(layout.padded_len(), seq) << layout_name(kind);
        }
        std::set<std::int64_t> seen;
        std::map<std::int64_t, int> chunk_owner;  // balanced: chunk -> ring rank
        for (int r = 0; r < ring; ++r) {
          const auto shard = layout.ring_shard_positions(r);
          ASSERT_EQ(static_cast<std::int64_t>(shard.size()), layout.ring_shard_len());
          for (std::size_t i = 0; i < shard.size(); ++i) {
            if (const std::optional<int> owner = owner_ring_rank(kind, shard[i], seq, ring)) {
              EXPECT_EQ(*owner, r) << layout_name(kind) << " t=" << shard[i];
            } else if (shard[i] < seq) {  // a token, not trailing padding
              const auto at = chunk_owner.try_emplace(shard[i] / layout.chunk_len(), r).first;
              EXPECT_EQ(at->second, r) << "balanced chunk " << at->first << " is split between ring ranks " << r
                                       << " and " << at->second << " (ring " << ring << ", ulysses " << uly << ")";
            }
            if (i > 0) {
              EXPECT_LT(shard[i - 1], shard[i]) << "ring shard positions must increase";
            }
          }
          // The Ulysses pieces of the shard, in order, are the shard.
          std::vector<std::int64_t> joined;
          for (int u = 0; u < uly; ++u) {
            const auto piece = layout.positions(r * uly + u);
            joined.insert(joined.end(), piece.begin(), piece.end());
          }
          EXPECT_EQ(joined, shard);
          seen.insert(shard.begin(), shard.end());
        }
        EXPECT_EQ(static_cast<std::int64_t>(seen.size()), layout.padded_len());
        EXPECT_EQ(*seen.begin(), 0);
        EXPECT_EQ(*seen.rbegin(), layout.padded_len() - 1);
      }
    }
  }
}

TEST(Layout, AnyLengthIsPaddedAndBadSizesFail) {
  EXPECT_EQ(SequenceLayout(LayoutKind::kZigzag, 8190, 4, 1).padded_len(), 8192);
  EXPECT_EQ(SequenceLayout(LayoutKind::kContiguous, 10, 4, 1).padded_len(), 12);
  EXPECT_EQ(SequenceLayout(LayoutKind::kStripe, 12, 2, 4).padded_len(), 16);
  EXPECT_EQ(SequenceLayout(LayoutKind::kZigzag, 197, 1, 1).ring_shard_positions(0),
            SequenceLayout(LayoutKind::kContiguous, 197, 1, 1).ring_shard_positions(0));
  EXPECT_EQ(SequenceLayout(LayoutKind::kZigzag, 197, 1, 2).padded_len(), 198);
  EXPECT_THROW(SequenceLayout(LayoutKind::kZigzag, 16, 0, 1), Error);
  EXPECT_THROW(parse_layout("zig-zag"), Error);
}

// Scatter then gather returns the user's tokens for padded and packed layouts of every kind; padding rows of the
// local pieces are zero, real rows hold the token the layout names (token_index).
TEST(Layout, PaddedAndPackedScatterGatherRoundTrip) {
  const int n = world().size();
  const std::vector<std::vector<std::int64_t>> rows = {{197}, {1, 0, 5, 1, 30, 2}, {1}, {3, 3, 3}};
  for (const auto& lens : rows) {
    const auto cu = cu_seqlens_of(lens);
    for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe, LayoutKind::kBalanced}) {
      for (int uly : {1, 2}) {
        if (n % uly != 0) continue;
        const SequenceLayout layout = SequenceLayout::packed(kind, cu, n / uly, uly);
        const std::int64_t T = layout.seq_len();
        Tensor full = test::random_tensor({1, T, 3}, DType::kFloat32, 5);
        Tensor local = Tensor::empty({1, layout.local_len(), 3}, DType::kFloat32, MemCategory::kWorkspace);
        scatter_sequence(world(), layout, full.view(), local.view());
        const auto tok = layout.token_index(world().rank());
        const float* f = full.data_as<float>();
        const float* l = local.data_as<float>();
        for (std::size_t i = 0; i < tok.size(); ++i) {
          for (int c = 0; c < 3; ++c) {
            EXPECT_EQ(l[i * 3 + c], tok[i] < 0 ? 0.0f : f[tok[i] * 3 + c]) << layout_name(kind) << " row " << i;
          }
        }
        Tensor back = Tensor::zeros(full.shape(), DType::kFloat32, MemCategory::kWorkspace);
        gather_sequence(world(), layout, local.view(), back.view());
        EXPECT_EQ(test::to_double(back), test::to_double(full)) << layout_name(kind) << " ulysses " << uly;
        Tensor root_back = Tensor::zeros(full.shape(), DType::kFloat32, MemCategory::kWorkspace);
        gather_sequence_to_root(world(), layout, local.view(), root_back.view());
        if (world().rank() == 0) {
          EXPECT_EQ(test::to_double(root_back), test::to_double(full));
        }
      }
    }
  }
  // B > 1 with a packed layout: one clear error on every rank, before any message.
  const SequenceLayout packed = SequenceLayout::packed(LayoutKind::kZigzag, std::vector<std::int64_t>{0, 3, 9}, n);
  Tensor full = Tensor::zeros({2, 9, 3}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor local = Tensor::zeros({2, packed.local_len(), 3}, DType::kFloat32, MemCategory::kWorkspace);
  try {
    scatter_sequence(world(), packed, full.view(), local.view());
    ADD_FAILURE() << "B = 2 with a packed layout must fail";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("has batch B = 2; a packed layout (cu_seqlens) takes B = 1"), std::string::npos)
        << e.message();
  }
}

TEST(Layout, ScatterGatherRoundTripIsIdentity) {
  const int n = world().size();
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
    for (int uly : {1, 2}) {
      if (n % uly != 0) continue;
      const SequenceLayout layout(kind, 2 * n * 5, n / uly, uly);
      Tensor full = test::random_tensor({2, layout.seq_len(), 3, 4}, DType::kBFloat16, 7);
      Tensor local = Tensor::empty({2, layout.local_len(), 3, 4}, DType::kBFloat16, MemCategory::kWorkspace);
      scatter_sequence(world(), layout, full.view(), local.view());
      Tensor expect = Tensor::empty(local.shape(), DType::kBFloat16, MemCategory::kWorkspace);
      shard_sequence(full.view(), layout.positions(world().rank()), expect.view());
      EXPECT_EQ(test::to_double(local), test::to_double(expect));
      Tensor back = Tensor::zeros(full.shape(), DType::kBFloat16, MemCategory::kWorkspace);
      gather_sequence(world(), layout, local.view(), back.view());
      EXPECT_EQ(test::to_double(back), test::to_double(full)) << layout_name(kind) << " ulysses " << uly;
    }
  }
}

// Gathering to one root gives root the full tensor (the one scattered, checked element by element) and leaves the
// other ranks' `full` untouched; also for [B, H, S] tensors (seq_dim 2) and a root other than 0.
TEST(Layout, GatherToRootRebuildsTheFullTensorOnRootOnly) {
  const int n = world().size();
  const int root = n - 1;
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
    const SequenceLayout layout(kind, 2 * n * 3, n, 1);
    for (int seq_dim : {1, 2}) {
      const Shape full_shape = seq_dim == 1 ? Shape{2, layout.seq_len(), 3} : Shape{2, 3, layout.seq_len()};
      const Shape local_shape = seq_dim == 1 ? Shape{2, layout.local_len(), 3} : Shape{2, 3, layout.local_len()};
      Tensor full = test::random_tensor(full_shape, DType::kFloat32, 11);
      Tensor local = Tensor::empty(local_shape, DType::kFloat32, MemCategory::kWorkspace);
      if (seq_dim == 1) {
        shard_sequence(full.view(), layout.positions(world().rank()), local.view());
      } else {
        shard_sequence_bhs(full.view(), layout.positions(world().rank()), local.view());
      }
      Tensor back = Tensor::zeros(full_shape, DType::kFloat32, MemCategory::kWorkspace);
      gather_sequence_to_root(world(), layout, local.view(), back.view(), root, seq_dim);
      const std::vector<double> expect =
          world().rank() == root ? test::to_double(full) : std::vector<double>(full.numel(), 0.0);
      EXPECT_EQ(test::to_double(back), expect) << layout_name(kind) << " seq_dim " << seq_dim;
    }
  }
  // Non-root ranks may pass an empty `full`; a root outside the communicator fails on every rank.
  const SequenceLayout layout(LayoutKind::kZigzag, 2 * n, n, 1);
  Tensor local = Tensor::zeros({1, layout.local_len()}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor full = Tensor::zeros({1, layout.seq_len()}, DType::kFloat32, MemCategory::kWorkspace);
  gather_sequence_to_root(world(), layout, local.view(), world().rank() == 0 ? full.view() : TensorView{});
  EXPECT_THROW(gather_sequence_to_root(world(), layout, local.view(), full.view(), n), Error);
}

TEST(Rope, MatchesClosedFormAndFollowsLayoutPositions) {
  const std::int64_t B = 2, S = 48, H = 3, D = 16;
  Tensor x = test::random_tensor({B, S, H, D}, DType::kFloat64, 3);
  Tensor rotated = Tensor::copy_of(x.view(), DType::kFloat64, MemCategory::kWorkspace);
  std::vector<std::int64_t> pos(S);
  for (std::int64_t i = 0; i < S; ++i) pos[i] = 1000 + 7 * i;  // arbitrary increasing positions
  attn::rope_forward(rotated.view(), pos);
  // Closed form: (x1 + i x2) * exp(i * pos * theta^(-2j/D)) in complex arithmetic.
  const double* xi = x.data_as<double>();
  const double* yo = rotated.data_as<double>();
  double max_err = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t j = 0; j < D / 2; ++j) {
          const std::int64_t base = ((b * S + s) * H + h) * D;
          const double angle = pos[s] * std::pow(10000.0, -2.0 * j / D);
          const double re = xi[base + j] * std::cos(angle) - xi[base + j + D / 2] * std::sin(angle);
          const double im = xi[base + j] * std::sin(angle) + xi[base + j + D / 2] * std::cos(angle);
          max_err = std::max({max_err, std::abs(re - yo[base + j]), std::abs(im - yo[base + j + D / 2])});
        }
  EXPECT_LT(max_err, 1e-12);
  // Backward is the inverse rotation (orthogonal map).
  attn::rope_backward(rotated.view(), pos);
  EXPECT_TRUE(test::all_close(test::to_double(rotated), test::to_double(x), 1e-12, 0, "rope_backward(rope(x))"));

  // On every layout, RoPE of a shard with its global positions equals the shard of RoPE on the full sequence.
  const int n = world().size();
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
    const SequenceLayout layout(kind, 2 * n * 4, n, 1);
    Tensor full = test::random_tensor({1, layout.seq_len(), 2, 8}, DType::kFloat32, 9);
    const auto my_pos = layout.positions(world().rank());
    Tensor local = Tensor::empty({1, layout.local_len(), 2, 8}, DType::kFloat32, MemCategory::kWorkspace);
    shard_sequence(full.view(), my_pos, local.view());
    attn::rope_forward(local.view(), my_pos);
    std::vector<std::int64_t> all(layout.seq_len());
    for (std::int64_t i = 0; i < layout.seq_len(); ++i) all[i] = i;
    attn::rope_forward(full.view(), all);
    Tensor expect = Tensor::empty(local.shape(), DType::kFloat32, MemCategory::kWorkspace);
    shard_sequence(full.view(), my_pos, expect.view());
    EXPECT_EQ(test::to_double(local), test::to_double(expect)) << layout_name(kind);
  }
  Tensor odd = Tensor::zeros({1, 4, 1, 3}, DType::kFloat32, MemCategory::kWorkspace);
  std::vector<std::int64_t> p4 = {0, 1, 2, 3};
  EXPECT_THROW(attn::rope_forward(odd.view(), p4), Error);
}

}  // namespace
}  // namespace seqpar
