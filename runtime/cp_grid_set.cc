#include "runtime/cp_grid_set.h"

#include <algorithm>
#include <array>
#include <cstdint>

#include "runtime/error.h"

namespace seqpar {
namespace {

std::vector<CpGridConfig> rings_of(const std::vector<int>& degrees) {
  std::vector<CpGridConfig> c;
  for (int d : degrees) c.push_back(CpGridConfig{1, 1, d, Placement::kUlyssesInner});
  return c;
}

std::string configs_str(const std::vector<CpGridConfig>& configs) {
  std::string s;
  for (const CpGridConfig& c : configs)
    s += str_cat(s.empty() ? "" : ", ", "ulysses ", c.ulysses_size, " x ring ", c.ring_size, " (",
                 placement_name(c.placement), ")");
  return s.empty() ? "none" : s;
}

}  // namespace

CpGridSet::CpGridSet(Communicator& world, const std::vector<int>& degrees) : CpGridSet(world, rings_of(degrees)) {}

CpGridSet::CpGridSet(Communicator& world, std::vector<CpGridConfig> configs)
    : world_size_(world.size()), world_rank_(world.rank()) {
  // Agreement first (one all-reduce of max over (n, digest, -n, -digest)), so that every later check sees the same
  // list on every rank and raises the same error.
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a over the fields
  const auto mix = [&h](std::int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<std::uint64_t>(v >> (8 * b)) & 0xFF;
      h *= 1099511628211ULL;
    }
  };
  for (const CpGridConfig& c : configs) {
    mix(c.ulysses_size);
    mix(c.ring_size);
    mix(static_cast<int>(c.placement));
  }
  const auto digest = static_cast<std::int64_t>(h >> 2);
  const auto n = static_cast<std::int64_t>(configs.size());
  std::array<std::int64_t, 4> v = {n, digest, -n, -digest};
  world.all_reduce(TensorView(v.data(), DType::kInt64, {4}), ReduceOp::kMax)->wait();
  SEQPAR_CHECK(v[0] == -v[2] && v[1] == -v[3], "CpGridSet: ranks disagree on the grids (this rank, world rank ",
               world_rank_, ": ", configs_str(configs), "); every rank must pass the same degrees in the same order");
  SEQPAR_CHECK(!configs.empty(), "CpGridSet: no degree given");
  for (CpGridConfig& c : configs) {
    SEQPAR_CHECK(c.ulysses_size >= 1 && c.ring_size >= 1, "CpGridSet: ulysses_size ", c.ulysses_size, " and ring_size ",
                 c.ring_size, " must be >= 1");
    const std::int64_t d = static_cast<std::int64_t>(c.ulysses_size) * c.ring_size;
    SEQPAR_CHECK(world_size_ % d == 0, "CpGridSet: degree ", d, " (ulysses_size ", c.ulysses_size, " x ring_size ",
                 c.ring_size, ") must divide the world size ", world_size_);
    c.dp_size = static_cast<int>(world_size_ / d);
  }
  std::stable_sort(configs.begin(), configs.end(), [](const CpGridConfig& a, const CpGridConfig& b) {
    return a.ulysses_size * a.ring_size < b.ulysses_size * b.ring_size;
  });
  for (std::size_t i = 1; i < configs.size(); ++i) {
    const int d = configs[i].ulysses_size * configs[i].ring_size;
    SEQPAR_CHECK(d != configs[i - 1].ulysses_size * configs[i - 1].ring_size, "CpGridSet: degree ", d,
                 " is given twice (", configs_str(configs), "); one grid per degree");
  }
  for (const CpGridConfig& c : configs) {
    degrees_.push_back(c.ulysses_size * c.ring_size);
    grids_.push_back(std::make_unique<CpGrid>(world, c));
  }
}

bool CpGridSet::has(int degree) const { return std::find(degrees_.begin(), degrees_.end(), degree) != degrees_.end(); }

const CpGrid& CpGridSet::grid(int degree) const {
  const auto it = std::find(degrees_.begin(), degrees_.end(), degree);
  SEQPAR_CHECK(it != degrees_.end(), "CpGridSet: no grid of degree ", degree, " (built: ", str(), ")");
  return *grids_[static_cast<std::size_t>(it - degrees_.begin())];
}

std::string CpGridSet::str() const {
  std::string s = "degrees ";
  for (std::size_t i = 0; i < degrees_.size(); ++i) s += str_cat(i ? ", " : "", degrees_[i]);
  return str_cat(s, " over ", world_size_, " ranks");
}

}  // namespace seqpar
