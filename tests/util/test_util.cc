#include "tests/util/test_util.h"

#include <cmath>
#include <sstream>

#include "runtime/error.h"

namespace seqpar::test {

std::vector<double> random_values(std::int64_t count, std::uint64_t seed, double lo, double hi) {
  std::vector<double> out(static_cast<std::size_t>(count));
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (auto& x : out) {
    state += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
    x = lo + (hi - lo) * u;
  }
  return out;
}

Tensor random_tensor(const Shape& shape, DType dtype, std::uint64_t seed, double lo, double hi) {
  const std::vector<double> values = random_values(shape_numel(shape), seed, lo, hi);
  Tensor t = Tensor::empty(shape, dtype, MemCategory::kWorkspace);
  convert(values.data(), DType::kFloat64, t.data(), dtype, values.size());
  return t;
}

void set_logit_offset(const TensorView& q, const TensorView& k, double logits) {
  for (const TensorView* t : {&q, &k}) {
    const std::int64_t D = t->dim(t->ndim() - 1);
    const double a = t == &q ? logits * std::sqrt(static_cast<double>(D)) : 1.0;
    char* p = static_cast<char*>(t->data());
    const std::size_t row_bytes = static_cast<std::size_t>(D) * dtype_size(t->dtype());
    for (std::int64_t r = 0; r < t->numel() / D; ++r) convert(&a, DType::kFloat64, p + r * row_bytes, t->dtype(), 1);
  }
}

double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  SEQPAR_CHECK(got.size() == want.size(), "rel_err: ", got.size(), " values against ", want.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num = std::max(num, std::abs(got[i] - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return den > 0.0 ? num / den : num;
}

std::vector<double> to_double(const TensorView& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::kInt64 || t.dtype() == DType::kInt32) {  // indices: exact as doubles below 2^53
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = t.dtype() == DType::kInt64 ? static_cast<double>(static_cast<const std::int64_t*>(t.data())[i])
                                          : static_cast<double>(static_cast<const std::int32_t*>(t.data())[i]);
    }
    return out;
  }
  convert(t.data(), t.dtype(), out.data(), DType::kFloat64, out.size());
  return out;
}

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& want, double rel_floor) {
  SEQPAR_CHECK(got.size() == want.size(), "compare: sizes differ (", got.size(), " vs ", want.size(), ")");
  ErrorStats s;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) {
      s.nan = true;
      s.worst = static_cast<std::int64_t>(i);
      s.got = got[i];
      s.want = want[i];
      continue;
    }
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double err = std::abs(got[i] - want[i]);
    if (err > s.max_abs || std::isnan(err)) {
      s.max_abs = err;
      if (!s.nan) {
        s.worst = static_cast<std::int64_t>(i);
        s.got = got[i];
        s.want = want[i];
      }
    }
    s.max_rel = std::max(s.max_rel, err / std::max(std::abs(want[i]), rel_floor));
  }
  return s;
}

::testing::AssertionResult all_close(const std::vector<double>& got, const std::vector<double>& want, double atol,
                                     double rtol, const std::string& what) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "rank " << process_rank() << ": " << what << " has " << got.size()
                                         << " elements, expected " << want.size();
  }
  std::int64_t bad = 0, first = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool both_same_inf = std::isinf(want[i]) && got[i] == want[i];
    const bool ok = both_same_inf || std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i]);
    if (!ok) {
      if (first < 0) first = static_cast<std::int64_t>(i);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rank " << process_rank() << ": " << what << ": " << bad << " of "
                                       << got.size() << " elements differ; first at flat index " << first << ": got "
                                       << got[first] << ", want " << want[first] << " (atol " << atol << ", rtol "
                                       << rtol << ")";
}

std::vector<double> central_differences(const TensorView& x, double h, const std::function<double()>& loss) {
  double* v = x.data_as<double>();
  std::vector<double> fd(static_cast<std::size_t>(x.numel()));
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = v[i];
    v[i] = x0 + h;
    const double lp = loss();
    v[i] = x0 - h;
    const double lm = loss();
    v[i] = x0;
    fd[static_cast<std::size_t>(i)] = (lp - lm) / (2 * h);
  }
  return fd;
}

bool all_ranks(Communicator& comm, bool ok) {
  std::int32_t v = ok ? 0 : 1;
  comm.all_reduce(TensorView(&v, DType::kInt32, {1}), ReduceOp::kMax)->wait();
  return v == 0;
}

}  // namespace seqpar::test
