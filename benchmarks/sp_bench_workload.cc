#include "benchmarks/sp_bench_workload.h"

#include "benchmarks/sp_bench_dsa.h"
#include "benchmarks/sp_bench_gdn.h"
#include "benchmarks/sp_bench_mha.h"
#include "parallel/layout.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

const npy::HostArray& find_array(const NamedArrays& arrays, const std::string& name) {
  for (const auto& [n, a] : arrays) {
    if (n == name) return a;
  }
  SEQPAR_THROW("sp_bench: no tensor named '", name, "'");
}

void check_workload_available(const SpBenchOptions& options) {
  switch (options.attn) {
    case AttnKind::kMha:
    case AttnKind::kDsa:
    case AttnKind::kGdn: return;
  }
  SEQPAR_THROW("--attn ", static_cast<int>(options.attn), ": unknown attention kind (available: mha, dsa, gdn)");
}

std::vector<TensorSpec> workload_input_specs(const SpBenchOptions& options) {
  check_workload_available(options);
  switch (options.attn) {
    case AttnKind::kDsa: return dsa_input_specs(options);
    case AttnKind::kGdn: return gdn_input_specs(options);
    case AttnKind::kMha: break;
  }
  return mha_input_specs(options);
}

std::unique_ptr<Workload> make_workload(const SpBenchOptions& options, const SpGrid& grid) {
  check_workload_available(options);
  switch (options.attn) {
    case AttnKind::kDsa: return make_dsa_workload(options, grid);
    case AttnKind::kGdn: return make_gdn_workload(options, grid);
    case AttnKind::kMha: break;
  }
  return make_mha_workload(options, grid);
}

double random_uniform(std::uint64_t seed, std::uint64_t tensor_id, std::uint64_t index) {
  const std::uint64_t h = splitmix64(splitmix64(seed ^ (tensor_id * 0x632be59bd9b4e019ull)) + index);
  return static_cast<double>(h >> 11) * (2.0 / 9007199254740992.0) - 1.0;  // 53 random bits -> [-1, 1)
}

void fill_random_shard(const TensorView& dst, std::uint64_t seed, std::uint64_t tensor_id, std::int64_t seq_len,
                       const std::vector<std::int64_t>& positions) {
  SEQPAR_ASSERT(dst.ndim() >= 2 && dst.dim(1) == static_cast<std::int64_t>(positions.size()), dst.str());
  const std::int64_t batch = dst.dim(0), local = dst.dim(1);
  const std::int64_t row = dst.numel() / (batch * std::max<std::int64_t>(local, 1));
  dispatch_floating(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* out = dst.data_as<T>();
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t i = 0; i < local; ++i) {
        const std::uint64_t base = static_cast<std::uint64_t>((b * seq_len + positions[i]) * row);
        T* dst_row = out + (b * local + i) * row;
        for (std::int64_t e = 0; e < row; ++e) {
          const double v = random_uniform(seed, tensor_id, base + static_cast<std::uint64_t>(e));
          if constexpr (std::is_same_v<T, double>) {
            dst_row[e] = v;
          } else {
            dst_row[e] = from_float<T>(static_cast<float>(v));
          }
        }
      }
    }
  });
}

void shard_from_full(const npy::HostArray& full, const std::vector<std::int64_t>& positions, const TensorView& dst) {
  npy::HostArray converted(dst.dtype(), full.shape);
  copy_convert(full.view(), converted.view());
  shard_sequence(converted.view(), positions, dst);
}

}  // namespace seqpar::bench
