// CpGrid tests, run by ctest at 1, 2, 3, 4 and 8 ranks: for every factorization world = DP x Pu x Pr and both
// placements, the Ulysses, ring, SP and DP communicators have the right sizes and ranks and contain exactly the
// expected world ranks (all-gathered inside each group), checked against cp_coords_of / world_rank_of and against
// an independent enumeration written here; bad grids (wrong product, ranks disagreeing, sizes < 1) make every rank
// throw the same message, and the world stays usable afterwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/cp_grid.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

struct Coords {
  int dp, u, r;  // data-parallel replica, Ulysses rank, ring rank
};

// Independent enumeration of the grid (docs/design.md, "Process groups"): world ranks are handed out in increasing order by
// nested loops, replicas outermost; ulysses_inner runs the Ulysses index innermost (each Ulysses group is
// consecutive ranks), ring_inner runs the ring index innermost.
std::vector<Coords> enumerate_grid(const CpGridConfig& c) {
  std::vector<Coords> by_rank;
  for (int dp = 0; dp < c.dp_size; ++dp) {
    if (c.placement == Placement::kUlyssesInner) {
      for (int r = 0; r < c.ring_size; ++r)
        for (int u = 0; u < c.ulysses_size; ++u) by_rank.push_back({dp, u, r});
    } else {
      for (int u = 0; u < c.ulysses_size; ++u)
        for (int r = 0; r < c.ring_size; ++r) by_rank.push_back({dp, u, r});
    }
  }
  return by_rank;
}

// World ranks whose coordinates satisfy `same`, ordered by `order` (the rank inside the group).
template <typename Same, typename Order>
std::vector<std::int64_t> expected_group(const std::vector<Coords>& grid, Same same, Order order) {
  std::vector<std::pair<int, int>> keyed;  // (order, world rank)
  for (int w = 0; w < static_cast<int>(grid.size()); ++w)
    if (same(grid[w])) keyed.push_back({order(grid[w]), w});
  std::sort(keyed.begin(), keyed.end());
  std::vector<std::int64_t> out;
  for (auto& [k, w] : keyed) out.push_back(w);
  return out;
}

// World ranks of the members of `comm`, in communicator rank order.
std::vector<std::int64_t> members(Communicator& comm) {
  std::int32_t me = world().rank();
  std::vector<std::int32_t> all(comm.size(), -1);
  comm.all_gather(TensorView(&me, DType::kInt32, {1}), TensorView(all.data(), DType::kInt32, {comm.size()}))->wait();
  return std::vector<std::int64_t>(all.begin(), all.end());
}

std::vector<CpGridConfig> all_grids(int world_size) {
  std::vector<CpGridConfig> out;
  for (Placement placement : {Placement::kUlyssesInner, Placement::kRingInner})
    for (int dp = 1; dp <= world_size; ++dp)
      for (int pu = 1; dp * pu <= world_size; ++pu)
        if (world_size % (dp * pu) == 0) out.push_back({dp, pu, world_size / (dp * pu), placement});
  return out;
}

std::string grid_name(const CpGridConfig& c) {
  return str_cat("dp=", c.dp_size, " x ulysses=", c.ulysses_size, " x ring=", c.ring_size, " (",
                 placement_name(c.placement), ")");
}

// Pure arithmetic, every world size up to 24: cp_coords_of / world_rank_of agree with the enumeration.
TEST(CpGrid, CoordinateArithmeticMatchesEnumeration) {
  int grids = 0;
  for (int n = 1; n <= 24; ++n) {
    for (const CpGridConfig& c : all_grids(n)) {
      ++grids;
      const std::vector<Coords> grid = enumerate_grid(c);
      ASSERT_EQ(static_cast<int>(grid.size()), n);
      for (int w = 0; w < n; ++w) {
        const CpCoords x = cp_coords_of(c, w);
        const Coords& e = grid[w];
        ASSERT_TRUE(x.dp_rank == e.dp && x.ulysses_rank == e.u && x.ring_rank == e.r &&
                    x.cp_rank == e.r * c.ulysses_size + e.u)
            << grid_name(c) << " world rank " << w << ": got (" << x.dp_rank << ", " << x.ulysses_rank << ", "
            << x.ring_rank << ", sp " << x.cp_rank << "), want (" << e.dp << ", " << e.u << ", " << e.r << ")";
        ASSERT_EQ(world_rank_of(c, x), w) << grid_name(c);
      }
    }
  }
  EXPECT_EQ(grids, 2 * 203) << "number of ordered factorizations of 1..24, times 2 placements";
  const CpGridConfig c{2, 2, 2, Placement::kUlyssesInner};
  EXPECT_THROW(cp_coords_of(c, 8), Error);
  EXPECT_THROW(cp_coords_of(c, -1), Error);
  EXPECT_THROW(cp_coords_of({1, 0, 2, Placement::kRingInner}, 0), Error);
  EXPECT_THROW(world_rank_of(c, {0, 2, 0, 0}), Error);
  EXPECT_THROW(world_rank_of(c, {2, 0, 0, 0}), Error);
  EXPECT_EQ(parse_placement("ring_inner"), Placement::kRingInner);
  EXPECT_EQ(parse_placement("ulysses_inner"), Placement::kUlyssesInner);
  EXPECT_THROW(parse_placement("ring-inner"), Error);
}

TEST(CpGrid, MembershipForEveryFactorizationAndPlacement) {
  Communicator& w = world();
  const int p = w.size(), me = w.rank();
  for (const CpGridConfig& c : all_grids(p)) {
    SCOPED_TRACE(grid_name(c));
    CpGrid grid(w, c);
    const std::vector<Coords> table = enumerate_grid(c);
    const Coords e = table[me];
    const int pu = c.ulysses_size, pr = c.ring_size;

    EXPECT_EQ(grid.str(), grid_name(c));
    EXPECT_EQ(grid.world_rank(), me);
    EXPECT_EQ(grid.coords().dp_rank, e.dp);
    EXPECT_EQ(grid.coords().ulysses_rank, e.u);
    EXPECT_EQ(grid.coords().ring_rank, e.r);
    EXPECT_EQ(grid.coords().cp_rank, e.r * pu + e.u);
    const CpCoords x = cp_coords_of(c, me);
    EXPECT_TRUE(x.dp_rank == grid.coords().dp_rank && x.ulysses_rank == grid.coords().ulysses_rank &&
                x.ring_rank == grid.coords().ring_rank && x.cp_rank == grid.coords().cp_rank);

    EXPECT_EQ(grid.ulysses().size(), pu);
    EXPECT_EQ(grid.ulysses().rank(), e.u);
    EXPECT_EQ(grid.ring().size(), pr);
    EXPECT_EQ(grid.ring().rank(), e.r);
    EXPECT_EQ(grid.cp().size(), pu * pr);
    EXPECT_EQ(grid.cp().rank(), e.r * pu + e.u);
    // Names for error messages, and the world rank of every group rank (the grid's arithmetic, independently of
    // the communicators' own bookkeeping).
    EXPECT_EQ(grid.ulysses().name(), "ulysses");
    EXPECT_EQ(grid.ring().name(), "ring");
    EXPECT_EQ(grid.cp().name(), "cp");
    EXPECT_EQ(grid.dp().name(), "dp");
    for (int u = 0; u < pu; ++u) {
      EXPECT_EQ(grid.ulysses().world_rank_of(u), world_rank_of(c, {e.dp, u, e.r, e.r * pu + u}));
    }
    for (int r = 0; r < pr; ++r) {
      EXPECT_EQ(grid.ring().world_rank_of(r), world_rank_of(c, {e.dp, e.u, r, r * pu + e.u}));
    }
    EXPECT_EQ(grid.dp().size(), c.dp_size);
    EXPECT_EQ(grid.dp().rank(), e.dp);

    const auto ulysses_want = expected_group(
        table, [&](const Coords& o) { return o.dp == e.dp && o.r == e.r; }, [](const Coords& o) { return o.u; });
    const auto ring_want = expected_group(
        table, [&](const Coords& o) { return o.dp == e.dp && o.u == e.u; }, [](const Coords& o) { return o.r; });
    const auto sp_want = expected_group(
        table, [&](const Coords& o) { return o.dp == e.dp; }, [&](const Coords& o) { return o.r * pu + o.u; });
    const auto dp_want = expected_group(
        table, [&](const Coords& o) { return o.u == e.u && o.r == e.r; }, [](const Coords& o) { return o.dp; });
    const auto ulysses_got = members(grid.ulysses());
    const auto ring_got = members(grid.ring());
    const auto sp_got = members(grid.cp());
    const auto dp_got = members(grid.dp());
    EXPECT_EQ(ulysses_got, ulysses_want) << "rank " << me << ": Ulysses group";
    EXPECT_EQ(ring_got, ring_want) << "rank " << me << ": ring group";
    EXPECT_EQ(sp_got, sp_want) << "rank " << me << ": CP group";
    EXPECT_EQ(dp_got, dp_want) << "rank " << me << ": DP group";

    // The members also follow from world_rank_of over the coordinates that vary inside each group.
    for (int k = 0; k < static_cast<int>(ulysses_got.size()); ++k)
      EXPECT_EQ(ulysses_got[k], world_rank_of(c, {e.dp, k, e.r, e.r * pu + k}));
    for (int k = 0; k < static_cast<int>(ring_got.size()); ++k)
      EXPECT_EQ(ring_got[k], world_rank_of(c, {e.dp, e.u, k, k * pu + e.u}));
    for (int k = 0; k < static_cast<int>(dp_got.size()); ++k)
      EXPECT_EQ(dp_got[k], world_rank_of(c, {k, e.u, e.r, e.r * pu + e.u}));

    // Placement property: the inner group is consecutive world ranks.
    const auto& inner = c.placement == Placement::kUlyssesInner ? ulysses_got : ring_got;
    for (std::size_t k = 1; k < inner.size(); ++k) EXPECT_EQ(inner[k], inner[0] + static_cast<std::int64_t>(k));
  }
}

// ---- bad grids ------------------------------------------------------------------------------------------

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// Builds a grid that must fail; returns this rank's error message ("" when it did not throw).
std::string grid_error(const CpGridConfig& c) {
  try {
    CpGrid grid(world(), c);
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

// Every rank threw, and all messages are identical (their hashes, all-gathered, agree); returns the message.
void expect_same_error_everywhere(const std::string& message, const std::string& want) {
  Communicator& w = world();
  std::int64_t mine = message.empty() ? 0 : static_cast<std::int64_t>(fnv1a(message) >> 1);
  std::vector<std::int64_t> all(w.size(), -1);
  w.all_gather(TensorView(&mine, DType::kInt64, {1}), TensorView(all.data(), DType::kInt64, {w.size()}))->wait();
  EXPECT_FALSE(message.empty()) << "rank " << w.rank() << " did not throw";
  for (int q = 0; q < w.size(); ++q) {
    EXPECT_NE(all[q], 0) << "rank " << q << " did not throw";
    EXPECT_EQ(all[q], all[0]) << "rank " << q << "'s message differs from rank 0's";
  }
  EXPECT_EQ(message, want) << "rank " << w.rank();
}

TEST(CpGrid, ProductOtherThanWorldSizeFailsOnEveryRankWithTheSameMessage) {
  const int p = world().size();
  expect_same_error_everywhere(grid_error({1, p + 1, 1, Placement::kUlyssesInner}),
                               str_cat("CpGrid: dp_size 1 x ulysses_size ", p + 1, " x ring_size 1 = ", p + 1,
                                       " must equal the world size ", p));
  expect_same_error_everywhere(
      grid_error({2, 1, p, Placement::kRingInner}),
      str_cat("CpGrid: dp_size 2 x ulysses_size 1 x ring_size ", p, " = ", 2 * p, " must equal the world size ", p));
  expect_same_error_everywhere(grid_error({1, 0, p, Placement::kUlyssesInner}),
                               str_cat("CpGrid: dp_size=1, ulysses_size=0, ring_size=", p, " must all be >= 1"));
  expect_same_error_everywhere(grid_error({-p, -1, 1, Placement::kUlyssesInner}),
                               str_cat("CpGrid: dp_size=", -p, ", ulysses_size=-1, ring_size=1 must all be >= 1"));
  // The failed constructions sent nothing else: a good grid works right after.
  CpGrid good(world(), {1, 1, p, Placement::kUlyssesInner});
  EXPECT_EQ(members(good.ring()).size(), static_cast<std::size_t>(p));
}

TEST(CpGrid, RanksDisagreeingFailOnEveryRankWithTheSameMessage) {
  Communicator& w = world();
  const int p = w.size(), me = w.rank();
  if (p < 2) GTEST_SKIP() << "needs at least 2 ranks to disagree";
  // Rank 0 passes a different ulysses_size (both configurations would be valid on their own).
  {
    CpGridConfig c{1, 1, p, Placement::kUlyssesInner};
    if (me == 0) c = {1, p, 1, Placement::kUlyssesInner};
    expect_same_error_everywhere(
        grid_error(c), str_cat("CpGrid: ranks disagree on the grid configuration (dp_size in [1, 1], ulysses_size in "
                               "[1, ",
                               p, "], ring_size in [1, ", p,
                               "], placement differs: no); every rank must "
                               "pass the same grid"));
  }
  // The last rank passes another placement.
  {
    CpGridConfig c{1, 1, p, me == p - 1 ? Placement::kRingInner : Placement::kUlyssesInner};
    expect_same_error_everywhere(
        grid_error(c), str_cat("CpGrid: ranks disagree on the grid configuration (dp_size in [1, 1], ulysses_size in "
                               "[1, 1], ring_size in [",
                               p, ", ", p,
                               "], placement differs: yes); every rank must "
                               "pass the same grid"));
  }
  // One rank's configuration has a wrong product as well: the disagreement is reported, the same on every rank.
  {
    CpGridConfig c{1, p, 1, Placement::kUlyssesInner};
    if (me == 1) c.dp_size = 3;
    expect_same_error_everywhere(
        grid_error(c), str_cat("CpGrid: ranks disagree on the grid configuration (dp_size in [1, 3], ulysses_size in "
                               "[",
                               p, ", ", p,
                               "], ring_size in [1, 1], placement differs: no); every rank must "
                               "pass the same grid"));
  }
  CpGrid good(w, {1, p, 1, Placement::kRingInner});
  EXPECT_EQ(members(good.ulysses()).size(), static_cast<std::size_t>(p));
}

// ---- adopted groups ---------------------------------------------------------------------------------------

// The adopting constructor (how the Python module's torch.distributed groups become a grid): the same four groups,
// split here by hand, give the same configuration and coordinates as the grid that splits them itself, and the
// adopted groups carry the grid's names.
TEST(CpGrid, AdoptedGroupsGiveTheSameGrid) {
  Communicator& w = world();
  const int p = w.size();
  for (int pu = 1; pu <= p; ++pu) {
    if (p % pu != 0) continue;
    const int pr = p / pu;
    const CpGridConfig config{1, pu, pr, Placement::kUlyssesInner};
    const CpGrid split(w, config);
    const CpCoords x = split.coords();
    CpGrid adopted(w.split(x.ring_rank, x.ulysses_rank), w.split(x.ulysses_rank, x.ring_rank), w.split(0, x.cp_rank),
                   w.split(x.cp_rank, 0), w.rank(), Placement::kUlyssesInner);
    EXPECT_EQ(adopted.str(), split.str());
    EXPECT_EQ(adopted.coords().ulysses_rank, x.ulysses_rank);
    EXPECT_EQ(adopted.coords().ring_rank, x.ring_rank);
    EXPECT_EQ(adopted.coords().cp_rank, x.cp_rank);
    EXPECT_EQ(adopted.coords().dp_rank, 0);
    EXPECT_EQ(adopted.ring().world_ranks(), split.ring().world_ranks());
    EXPECT_EQ(adopted.ulysses().name(), "ulysses");
    EXPECT_EQ(adopted.cp().name(), "cp");
  }
}

// A cp group that is not ulysses_size x ring_size ranks is refused, naming both.
TEST(CpGrid, AdoptedCpGroupOfTheWrongSizeFails) {
  Communicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs 2 ranks (a cp group of 1 against a ring of 2)";
  test::expect_error(
      [&] {
        CpGrid grid(w.split(w.rank(), 0), w.split(0, w.rank()), w.split(w.rank(), 0), w.split(w.rank(), 0), w.rank(),
                    Placement::kUlyssesInner);
      },
      str_cat("the cp group has 1 ranks (world rank ", w.rank(), "), not ulysses_size 1 x ring_size ", w.size()));
}

}  // namespace
}  // namespace seqpar
