// Internal to attention/ops/: a host tensor's elements as a std::vector<T> (converted when its dtype differs), the
// form in which the compositions upload their inputs to a table's memory. Empty for an empty tensor.
#pragma once

#include <vector>

#include "../../runtime/dtype.h"
#include "../../runtime/tensor.h"
#include "../../runtime/tensor_ops.h"

namespace seqpar::attn::ops {

template <typename T>
std::vector<T> host_values(const TensorView& t) {
  if (t.empty()) return {};
  std::vector<T> v(static_cast<std::size_t>(t.numel()));
  copy_convert(t, TensorView(v.data(), dtype_v<T>, t.shape()));
  return v;
}

}  // namespace seqpar::attn::ops
