#include "runtime/cp_grid.h"

#include <array>
#include <cstdint>
#include <utility>

#include "runtime/logging.h"

namespace seqpar {

const char* placement_name(Placement placement) {
  return placement == Placement::kUlyssesInner ? "ulysses_inner" : "ring_inner";
}

Placement parse_placement(std::string_view name) {
  if (name == "ulysses_inner") return Placement::kUlyssesInner;
  if (name == "ring_inner") return Placement::kRingInner;
  SEQPAR_THROW("placement '", name, "' is not one of ulysses_inner, ring_inner");
}

namespace {
void check_sizes(const CpGridConfig& c, const char* what) {
  SEQPAR_CHECK(c.dp_size >= 1 && c.ulysses_size >= 1 && c.ring_size >= 1, what, ": dp_size=", c.dp_size,
               ", ulysses_size=", c.ulysses_size, ", ring_size=", c.ring_size, " must all be >= 1");
}
}  // namespace

CpCoords cp_coords_of(const CpGridConfig& c, int world_rank) {
  check_sizes(c, "cp_coords_of");
  const int cp_size = c.ulysses_size * c.ring_size;
  SEQPAR_CHECK(
      0 <= world_rank && static_cast<std::int64_t>(world_rank) < static_cast<std::int64_t>(cp_size) * c.dp_size,
      "cp_coords_of: world rank ", world_rank, " is outside the grid of ", c.dp_size, " x ", cp_size, " ranks");
  CpCoords x;
  x.dp_rank = world_rank / cp_size;
  const int local = world_rank % cp_size;
  if (c.placement == Placement::kUlyssesInner) {
    x.ulysses_rank = local % c.ulysses_size;
    x.ring_rank = local / c.ulysses_size;
  } else {
    x.ring_rank = local % c.ring_size;
    x.ulysses_rank = local / c.ring_size;
  }
  x.cp_rank = x.ring_rank * c.ulysses_size + x.ulysses_rank;
  return x;
}

int world_rank_of(const CpGridConfig& c, const CpCoords& x) {
  check_sizes(c, "world_rank_of");
  SEQPAR_CHECK(0 <= x.dp_rank && x.dp_rank < c.dp_size && 0 <= x.ulysses_rank && x.ulysses_rank < c.ulysses_size &&
                   0 <= x.ring_rank && x.ring_rank < c.ring_size,
               "world_rank_of: coordinates (dp ", x.dp_rank, ", ulysses ", x.ulysses_rank, ", ring ", x.ring_rank,
               ") are outside the grid dp=", c.dp_size, " x ulysses=", c.ulysses_size, " x ring=", c.ring_size);
  const int local = c.placement == Placement::kUlyssesInner ? x.ring_rank * c.ulysses_size + x.ulysses_rank
                                                            : x.ulysses_rank * c.ring_size + x.ring_rank;
  return x.dp_rank * c.ulysses_size * c.ring_size + local;
}

CpGrid::CpGrid(Communicator& world, const CpGridConfig& config) : config_(config), world_rank_(world.rank()) {
  // One collective: max of (v, -v) for each field tells whether all ranks agree.
  std::array<std::int64_t, 8> v = {
      config.dp_size,  config.ulysses_size,  config.ring_size,  static_cast<int>(config.placement),
      -config.dp_size, -config.ulysses_size, -config.ring_size, -static_cast<int>(config.placement)};
  world.all_reduce(TensorView(v.data(), DType::kInt64, {8}), ReduceOp::kMax)->wait();
  const bool agree = v[0] == -v[4] && v[1] == -v[5] && v[2] == -v[6] && v[3] == -v[7];
  SEQPAR_CHECK(agree, "CpGrid: ranks disagree on the grid configuration (dp_size in [", -v[4], ", ", v[0],
               "], ulysses_size in [", -v[5], ", ", v[1], "], ring_size in [", -v[6], ", ", v[2],
               "], placement differs: ", v[3] != -v[7] ? "yes" : "no", "); every rank must pass the same grid");
  SEQPAR_CHECK(config.dp_size >= 1 && config.ulysses_size >= 1 && config.ring_size >= 1,
               "CpGrid: dp_size=", config.dp_size, ", ulysses_size=", config.ulysses_size,
               ", ring_size=", config.ring_size, " must all be >= 1");
  const std::int64_t product = static_cast<std::int64_t>(config.dp_size) * config.ulysses_size * config.ring_size;
  SEQPAR_CHECK(product == world.size(), "CpGrid: dp_size ", config.dp_size, " x ulysses_size ", config.ulysses_size,
               " x ring_size ", config.ring_size, " = ", product, " must equal the world size ", world.size());

  coords_ = cp_coords_of(config, world_rank_);
  const int pu = config.ulysses_size, pr = config.ring_size;
  // Colours are unique per group; keys give the group rank.
  ulysses_ = world.split(coords_.dp_rank * pr + coords_.ring_rank, coords_.ulysses_rank);
  ring_ = world.split(coords_.dp_rank * pu + coords_.ulysses_rank, coords_.ring_rank);
  cp_ = world.split(coords_.dp_rank, coords_.cp_rank);
  dp_ = world.split(coords_.cp_rank, coords_.dp_rank);
  // Names for error and log messages ("ring: irecv of ... from world rank 3 (ring rank 1) ...").
  ulysses_->set_name("ulysses");
  ring_->set_name("ring");
  cp_->set_name("cp");
  dp_->set_name("dp");
  SEQPAR_LOG(kInfo) << "grid " << str() << ": dp_rank " << coords_.dp_rank << ", ulysses_rank " << coords_.ulysses_rank
                    << ", ring_rank " << coords_.ring_rank << ", cp_rank " << coords_.cp_rank;
}

CpGrid::CpGrid(std::unique_ptr<Communicator> ulysses, std::unique_ptr<Communicator> ring,
               std::unique_ptr<Communicator> cp, std::unique_ptr<Communicator> dp, int world_rank, Placement placement)
    : world_rank_(world_rank),
      ulysses_(std::move(ulysses)),
      ring_(std::move(ring)),
      cp_(std::move(cp)),
      dp_(std::move(dp)) {
  SEQPAR_ASSERT(ulysses_ && ring_ && cp_ && dp_, "CpGrid: a null group");
  const int pu = ulysses_->size(), pr = ring_->size();
  SEQPAR_CHECK(cp_->size() == pu * pr, "CpGrid: the cp group has ", cp_->size(), " ranks (", cp_->members_str(),
               "), not ulysses_size ", pu, " x ring_size ", pr);
  config_ = CpGridConfig{dp_->size(), pu, pr, placement};
  coords_ = CpCoords{dp_->rank(), ulysses_->rank(), ring_->rank(), ring_->rank() * pu + ulysses_->rank()};
  SEQPAR_CHECK(cp_->rank() == coords_.cp_rank, "CpGrid: world rank ", world_rank, " is cp rank ", cp_->rank(),
               " but ring rank ", coords_.ring_rank, " x ulysses_size ", pu, " + ulysses rank ", coords_.ulysses_rank,
               " = ", coords_.cp_rank);
  ulysses_->set_name("ulysses");
  ring_->set_name("ring");
  cp_->set_name("cp");
  dp_->set_name("dp");
}

std::string CpGrid::str() const {
  return str_cat("dp=", config_.dp_size, " x ulysses=", config_.ulysses_size, " x ring=", config_.ring_size, " (",
                 placement_name(config_.placement), ")");
}

}  // namespace seqpar
