// Test inputs of the ops-table tests (test_ops, test_ops_table, test_ops_cuda_plan): seeded uniform values, their
// cast to a table's type, and the tolerance of an fp32 / fp64 result against an fp64 loop.
#pragma once

#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

namespace seqpar::attn::ops::test {

inline std::vector<double> rand_vec(std::int64_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = u(rng);
  return v;
}

template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
double tol() {
  return std::is_same_v<T, double> ? 1e-12 : 2e-5;
}

}  // namespace seqpar::attn::ops::test
