// Helpers shared by the tests: seeded random tensors, fp64 copies and error comparisons that name the tensor,
// the index, both values and the rank (TransformerEngine tests/cpp habit).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace seqpar::test {

// Deterministic uniform values in [lo, hi) from `seed` (splitmix64), independent of rank and thread count.
std::vector<double> random_values(std::int64_t count, std::uint64_t seed, double lo = -1.0, double hi = 1.0);

// A tensor of `dtype` filled from random_values, rounded to `dtype`.
Tensor random_tensor(const Shape& shape, DType dtype, std::uint64_t seed, double lo = -1.0, double hi = 1.0);

// Large logits with a well-conditioned softmax: sets coordinate 0 of every row of q [.., D] to
// logits sqrt(D) and of k [.., D] to 1, so that with the default scale 1/sqrt(D) every logit is `logits` plus the
// O(1) part of the other coordinates: lse is about `logits` while the probabilities stay spread. (q and k scaled as a
// whole make every row one-hot at logits >= 1e3, with gradients of ~1e-49 that no algorithm with a rounded lse or
// delta resolves relatively; a large coordinate in both q and k makes dq's component along it a cancellation of
// condition a^2 for a = sqrt(logits sqrt(D)), 1e-10 relative at logits 1e4 even in fp64.)
void set_logit_offset(const TensorView& q, const TensorView& k, double logits);

// max |got - want| / max |want| (max |got - want| when want is all zeros): the relative error of a tensor as a whole.
double rel_err(const std::vector<double>& got, const std::vector<double>& want);

// The values of any floating tensor as fp64.
// Integer tensors (indices) convert exactly below 2^53.
std::vector<double> to_double(const TensorView& t);

struct ErrorStats {
  double max_abs = 0.0;  // max |got - want|
  double max_rel = 0.0;  // max |got - want| / max(|want|, floor)
  std::int64_t worst = -1;
  double got = 0.0, want = 0.0;
  bool nan = false;  // got has a NaN where want has none (or vice versa)
};
ErrorStats compare(const std::vector<double>& got, const std::vector<double>& want, double rel_floor = 1e-3);

// gtest assertion: |got - want| <= atol + rtol * |want| element-wise; the failure message names `what`, the flat
// index, both values and the rank.
::testing::AssertionResult all_close(const std::vector<double>& got, const std::vector<double>& want, double atol,
                                     double rtol, const std::string& what);

// Central differences (loss(x + h e_i) - loss(x - h e_i)) / 2h for every element i of the fp64 tensor x, which is
// perturbed in place (and restored) while `loss` is evaluated.
std::vector<double> central_differences(const TensorView& x, double h, const std::function<double()>& loss);

// gtest check that fn() throws seqpar::Error whose message contains `needle`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// True when every rank passes `ok`; used by MPI tests so that all ranks agree on a verdict.
bool all_ranks(Communicator& comm, bool ok);

}  // namespace seqpar::test
