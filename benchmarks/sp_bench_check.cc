#include "benchmarks/sp_bench_check.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/error.h"

namespace seqpar::bench {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kSlots = 6;  // per tensor: max|D-K|, max|K|, max|D-R|, max|K-R|, max|R|, the rounding floor

// The elements as fp64: floating arrays through convert(); int64 arrays (DSA topk_indices, exact below 2^53)
// element by element, since convert() does not cross between integer and floating types.
std::vector<double> to_double(const npy::HostArray& x) {
  const std::size_t n = static_cast<std::size_t>(x.numel());
  std::vector<double> r(n);
  if (x.dtype == DType::kInt64) {
    const std::int64_t* p = x.view().data_as<std::int64_t>();
    for (std::size_t i = 0; i < n; ++i) r[i] = static_cast<double>(p[i]);
  } else {
    convert(x.bytes.data(), x.dtype, r.data(), DType::kFloat64, n);
  }
  return r;
}

// max |a - b| and max |b| over finite b; equal infinities count as equal, any other non-finite difference is +inf.
void compare(const npy::HostArray& got, const npy::HostArray& want, double& max_abs, double& max_ref) {
  SEQPAR_CHECK(got.shape == want.shape, "sp_bench: gathered shape ", shape_str(got.shape),
               " differs from the reference shape ", shape_str(want.shape));
  const std::vector<double> a = to_double(got), b = to_double(want);
  max_abs = 0;
  max_ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(b[i])) max_ref = std::max(max_ref, std::abs(b[i]));
    if (a[i] == b[i]) continue;  // also equal infinities
    const double d = std::abs(a[i] - b[i]);
    max_abs = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(max_abs, d);
  }
}

bool rule1_ok(double max_abs, double max_ref, const Tolerance& tol) { return max_abs <= tol.atol + tol.rtol * max_ref; }

bool reference_fits(const Fp64ReferenceCost& cost) {
  return cost.bytes > 0 && cost.bytes <= kFp64ReferenceMaxBytes && cost.flops <= kFp64ReferenceMaxFlops;
}

const npy::HostArray* find_or_null(const NamedArrays& arrays, const std::string& name) {
  for (const auto& [n, a] : arrays) {
    if (n == name) return &a;
  }
  return nullptr;
}

Fp64ReferenceCost fp64_reference_cost(const SpBenchOptions& o) {
  const WorkloadKind& kind = find_workload_kind(o.attn);
  return kind.fp64_reference_cost ? kind.fp64_reference_cost(o) : Fp64ReferenceCost{};
}

}  // namespace

CheckReport check_outputs(Communicator& world, const CpGrid& grid, Workload& wl, const SpBenchOptions& o,
                          const NamedArrays& got, const NamedArrays* inputs, bool reference_ready, Progress& progress) {
  const std::string& against = o.check_against;
  const bool vs_reference = against == "reference";
  const std::vector<std::string> names = wl.output_names();
  const std::size_t n = names.size();
  std::vector<double> err(kSlots * n, 0);
  for (std::size_t t = 0; t < n; ++t) err[kSlots * t + 2] = err[kSlots * t + 3] = -1;
  CheckReport report;
  report.against = against;
  if (grid.coords().cp_rank == 0) {
    if (!reference_ready) {
      progress.note("check: single-rank reference", true);
      wl.reference_setup(inputs);
      wl.reference_forward();
      wl.reference_backward();
    }
    const NamedArrays want = wl.reference_outputs();
    bool all_ok = true;
    for (std::size_t t = 0; t < n; ++t) {
      double* e = &err[kSlots * t];
      compare(find_array(got, names[t]), find_array(want, names[t]), e[0], e[1]);
      all_ok = all_ok && rule1_ok(e[0], e[1], wl.tolerance(names[t]));
    }
    const Fp64ReferenceCost cost = fp64_reference_cost(o);
    const bool fits = reference_fits(cost);
    if ((!all_ok || vs_reference) && fits) {
      progress.note("check: fp64 reference", true);
      const NamedArrays exact = wl.fp64_reference_outputs();
      for (std::size_t t = 0; t < n; ++t) {
        const npy::HostArray* r = find_or_null(exact, names[t]);
        if (r == nullptr) continue;
        double* e = &err[kSlots * t];
        compare(find_array(got, names[t]), *r, e[2], e[4]);
        compare(find_array(want, names[t]), *r, e[3], e[4]);
        e[5] = wl.rounding_floor(names[t]);
      }
    } else if (!all_ok) {
      report.fp64_note =
          cost.bytes <= 0
              ? str_cat("this workload has no fp64 reference")
              : str_cat("the fp64 reference does not fit: it needs ", cost.bytes / kGiB, " GiB and ", cost.flops,
                        " FLOPs (limits ", kFp64ReferenceMaxBytes / kGiB, " GiB, ", kFp64ReferenceMaxFlops, ")");
    }
  }
  all_reduce(world, err, ReduceOp::kMax, kLongWaitS);

  for (std::size_t t = 0; t < n; ++t) {
    const double* e = &err[kSlots * t];
    const Tolerance tol = wl.tolerance(names[t]);
    CheckResult c;
    c.name = names[t];
    c.max_abs = e[0];
    c.max_ref = e[1];
    c.atol = tol.atol;
    c.rtol = tol.rtol;
    c.fp64_err = e[2];
    c.one_rank_fp64_err = e[3];
    c.max_fp64 = e[4];
    c.ok = rule1_ok(c.max_abs, c.max_ref, tol);
    if (vs_reference && c.fp64_err >= 0) {
      c.rule = "reference";
      c.ok = std::isfinite(c.fp64_err) && (rule1_ok(c.fp64_err, c.max_fp64, tol) || c.fp64_err <= e[5]);
    } else if (!c.ok && c.fp64_err >= 0) {
      c.rule = "fp64";
      // An infinite error is never within bounds, even when the one-rank kernel's is infinite too (overflow).
      c.ok = std::isfinite(c.fp64_err) &&
             c.fp64_err <= std::max({kFp64ErrorFactor * c.one_rank_fp64_err, tol.atol + tol.rtol * c.max_fp64, e[5]});
    }
    report.passed = report.passed && c.ok;
    report.tensors.push_back(c);
  }
  return report;
}

void check_reference_fits(const SpBenchOptions& o) {
  const Fp64ReferenceCost cost = fp64_reference_cost(o);
  SEQPAR_CHECK(cost.bytes > 0, "--check-against reference: --attn ", o.attn, " has no fp64 reference");
  SEQPAR_CHECK(reference_fits(cost), "--check-against reference: the fp64 reference of this problem needs ",
               cost.bytes / kGiB, " GiB and ", cost.flops, " FLOPs; it runs only within ",
               kFp64ReferenceMaxBytes / kGiB, " GiB and ", kFp64ReferenceMaxFlops,
               " FLOPs (make --seq, --batch or the heads smaller, or use "
               "--check-against 1-rank)");
}

void corrupt_for_test(NamedArrays& got, const std::string& name) {
  std::string names;
  for (auto& [n, a] : got) {
    names += (names.empty() ? "" : ", ") + n;
    if (n != name || a.numel() == 0) continue;
    if (a.dtype == DType::kInt64) {
      a.view().data_as<std::int64_t>()[0] += 1;
      return;
    }
    std::vector<double> x = to_double(a);
    double max_abs = 0;
    for (double v : x) max_abs = std::max(max_abs, std::abs(v));
    x[0] += 0.1 * (max_abs + 1);
    convert(x.data(), DType::kFloat64, a.bytes.data(), a.dtype, x.size());
    return;
  }
  SEQPAR_THROW("--test-corrupt ", name, ": no such output (outputs: ", names, ")");
}

}  // namespace seqpar::bench
