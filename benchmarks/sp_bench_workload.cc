#include "benchmarks/sp_bench_workload.h"

#include <algorithm>
#include <numeric>

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

// Function-local, so that registrations from other files' static initialisers find it constructed.
std::vector<WorkloadKind>& registry() {
  static std::vector<WorkloadKind> kinds;
  return kinds;
}

}  // namespace

const npy::HostArray& find_array(const NamedArrays& arrays, const std::string& name) {
  for (const auto& [n, a] : arrays) {
    if (n == name) return a;
  }
  SEQPAR_THROW("sp_bench: no tensor named '", name, "'");
}

Tolerance fp32_accumulator_tolerance(DType dtype, const std::string& what) {
  switch (dtype) {
    case DType::kFloat64: return {1e-9, 1e-5};
    case DType::kFloat32: return {1e-6, 1e-4};
    case DType::kBFloat16: return {1e-3, 2e-2};
    case DType::kFloat16: return {1e-4, 5e-3};
    default: break;
  }
  SEQPAR_THROW("sp_bench: no tolerance for dtype ", dtype_name(dtype), " (", what, ")");
}

double spec_elements(const std::vector<TensorSpec>& specs) {
  double n = 0;
  for (const TensorSpec& s : specs) n += static_cast<double>(shape_numel(s.shape));
  return n;
}

bool register_workload_kind(WorkloadKind kind) {
  std::vector<WorkloadKind>& kinds = registry();
  for (const WorkloadKind& k : kinds) {
    SEQPAR_CHECK(k.name != kind.name, "sp_bench: attention kind '", kind.name, "' registered twice");
  }
  const auto at = std::find_if(kinds.begin(), kinds.end(), [&](const WorkloadKind& k) { return k.name > kind.name; });
  kinds.insert(at, std::move(kind));
  return true;
}

const std::vector<WorkloadKind>& workload_kinds() { return registry(); }

std::string workload_kind_names(const std::string& separator) {
  std::string names;
  for (const WorkloadKind& k : registry()) names += (names.empty() ? "" : separator) + k.name;
  return names;
}

const WorkloadKind& find_workload_kind(const std::string& name) {
  for (const WorkloadKind& k : registry()) {
    if (k.name == name) return k;
  }
  SEQPAR_THROW("--attn ", name, ": unknown attention kind (registered: ", workload_kind_names(", "), ")");
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
        T* dst_row = out + (b * local + i) * row;
        if (positions[i] < 0) {
          std::fill(dst_row, dst_row + row, T{});
          continue;
        }
        const std::uint64_t base = static_cast<std::uint64_t>((b * seq_len + positions[i]) * row);
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
  gather_token_rows(converted.view(), 1, positions, dst);
}

void affine_inplace(const TensorView& t, double offset, double slope) {
  dispatch_floating(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data_as<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double x = offset + slope * static_cast<double>(to_float(p[i]));
      if constexpr (std::is_same_v<T, double>) {
        p[i] = x;
      } else {
        p[i] = from_float<T>(static_cast<float>(x));
      }
    }
  });
}

std::vector<std::int64_t> all_positions(std::int64_t seq_len) {
  std::vector<std::int64_t> pos(static_cast<std::size_t>(seq_len));
  std::iota(pos.begin(), pos.end(), std::int64_t{0});
  return pos;
}

NamedArrays zero_arrays(const std::vector<ArraySpec>& specs) {
  NamedArrays r;
  for (const ArraySpec& s : specs) r.emplace_back(s.name, npy::HostArray(s.dtype, s.shape));
  return r;
}

std::vector<TensorView> views_of(const NamedArrays& arrays) {
  std::vector<TensorView> views;
  for (const auto& [name, a] : arrays) views.push_back(a.view());
  return views;
}

NamedArrays widen_to_fp64(const NamedArrays& arrays) {
  NamedArrays r;
  for (const auto& [name, a] : arrays) {
    if (a.dtype == DType::kInt64) {
      r.emplace_back(name, a);
      continue;
    }
    npy::HostArray wide(DType::kFloat64, a.shape);
    copy_convert(a.view(), wide.view());
    r.emplace_back(name, std::move(wide));
  }
  return r;
}

PhaseCounters phase_counters(const CpCounters& c) {
  PhaseCounters p;
  p.exposed_comm_s = c.total_exposed_s();  // the all-to-alls are not overlapped with computation
  p.bytes_sent = c.total_bytes_sent();
  p.executed_flops = c.flops;
  return p;
}

PhaseCounters phase_counters_with_rounds(const CpCounters& c) {
  PhaseCounters p = phase_counters(c);
  p.message_rounds = c.message_rounds;
  return p;
}

std::vector<Tensor> local_tensors(DType dtype, const std::vector<Shape>& shapes, MemCategory category) {
  std::vector<Tensor> out;
  out.reserve(shapes.size());
  for (const Shape& s : shapes) out.push_back(Tensor::empty(s, dtype, category));
  return out;
}

std::vector<TensorView> views_of(const std::vector<Tensor>& tensors) {
  std::vector<TensorView> out;
  out.reserve(tensors.size());
  for (const Tensor& t : tensors) out.push_back(t.view());
  return out;
}

}  // namespace seqpar::bench
