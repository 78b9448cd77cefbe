// What the decode layers share (parallel/decode_shared.h).
#include "parallel/decode_shared.h"

#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::decode_detail {

void check_one_request(const SequenceLayout& layout, const char* who) {
  SEQPAR_CHECK(layout.num_docs() <= 1, who, ": the layout packs ", layout.num_docs(),
               " documents into one row (cu_seqlens of ", layout.num_docs() + 1,
               " entries); a decode cache holds one request per batch row: give each document its own row (batch) or "
               "its own cache, with an unpacked layout (SequenceLayout::for_groups)");
}

std::vector<std::int64_t> iota_from(std::int64_t first, std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = first + i;
  return v;
}

void add_cache_fields(Fingerprint& fp, std::int64_t length, std::int64_t steps) {
  fp.add_int("cache_length", length).add_int("cache_steps", steps);
}

TensorView sub_view(const Tensor& buf, std::int64_t offset, const Shape& shape) {
  auto* p = static_cast<char*>(buf.data()) + static_cast<std::size_t>(offset) * dtype_size(buf.dtype());
  return TensorView(p, buf.dtype(), shape, buf.view().device());
}

void split_lse_into(const TensorView& lse, const Tensor& buf, std::int64_t offset) {
  SEQPAR_CHECK(lse.dtype() == DType::kFloat64, "split_lse_into: lse ", lse.str(), " must be fp64");
  const std::int64_t count = lse.numel();
  const auto* l = static_cast<const double*>(lse.data());
  if (buf.dtype() == DType::kFloat64) {
    split_lse(l, count, buf.data_as<double>() + offset, buf.data_as<double>() + offset + count);
  } else {
    split_lse(l, count, buf.data_as<float>() + offset, buf.data_as<float>() + offset + count);
  }
}

void merge_shards_into(const Tensor& recv, int num_parts, const Tensor& out, const Tensor& lse) {
  const std::int64_t B = out.dim(0), n = out.dim(1), h = out.dim(2), dim = out.dim(3);
  if (recv.dtype() == DType::kFloat64) {
    merge_shards(recv.data_as<double>(), num_parts, B, n, h, dim, out.data_as<double>(), lse.data_as<double>());
  } else {
    merge_shards(recv.data_as<float>(), num_parts, B, n, h, dim, out.data_as<float>(), lse.data_as<float>());
  }
}

StoredRows reshard_to_owners(const CpGroups& groups, CpCounters& counters, const CacheSharding& sh, int copies,
                             const SequenceLayout& layout, std::int64_t offset,
                             std::initializer_list<TensorView> tensors) {
  const std::vector<TensorView> ts(tensors);
  SEQPAR_CHECK(!ts.empty() && copies >= 1, "reshard_to_owners: no tensors or copies ", copies, " < 1");
  const int P = groups.cp.size(), me = groups.cp_rank();
  const std::int64_t B = ts[0].dim(0), T = layout.seq_len();
  const DType dtype = ts[0].dtype();
  // The shape of one destination's share of m rows of tensor i, and its elements per row.
  const auto piece_shape = [&](std::size_t i, std::int64_t m) {
    Shape shape = ts[i].shape();
    shape[1] = m;
    if (copies > 1) shape[2] /= copies;
    return shape;
  };
  std::vector<std::int64_t> per_row(ts.size());
  std::int64_t row = 0;  // elements per token over all tensors
  for (std::size_t i = 0; i < ts.size(); ++i) {
    SEQPAR_CHECK(ts[i].dtype() == dtype && ts[i].ndim() >= 2 && ts[i].dim(0) == B &&
                     (copies == 1 || (ts[i].ndim() >= 3 && ts[i].dim(2) % copies == 0)),
                 "reshard_to_owners: ", ts[i].str(), " must be [B, S_local, ...] of ", dtype_name(dtype),
                 copies > 1 ? str_cat(" with dimension 2 divisible by ", copies) : std::string());
    const Shape one = piece_shape(i, 1);
    per_row[i] = 1;
    for (std::size_t d = 1; d < one.size(); ++d) per_row[i] *= one[d];
    row += per_row[i];
  }
  // Global tokens of a rank's rows: the layout's tokens (not its slots: a padded layout holds padding rows, token -1,
  // which are stored nowhere) plus `offset` (a chunk after `offset` cached tokens).
  const auto tokens_of = [&](int cp_rank) {
    std::vector<std::int64_t> pos = layout.token_index(cp_rank);
    for (std::int64_t& t : pos) t = t < 0 ? -1 : t + offset;
    return pos;
  };
  const DeviceAlloc alloc{ts[0].device(), groups.stream};
  ScopedTimer timer(counters.compute_s);
  // Send: for each destination d, the rows of my tokens it stores, tensor after tensor, each [B, m, ...].
  const std::vector<std::int64_t> mine = tokens_of(me);
  std::vector<std::vector<std::int64_t>> to(P);
  for (int d = 0; d < P; ++d) {
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (mine[i] >= 0 && sh.owner(mine[i]) == d / copies) to[d].push_back(static_cast<std::int64_t>(i));
    }
  }
  std::vector<std::int64_t> send_counts(P), recv_counts(P);
  std::int64_t send_total = 0, recv_total = 0;
  for (int d = 0; d < P; ++d) send_total += send_counts[d] = B * static_cast<std::int64_t>(to[d].size()) * row;
  // Receive: from each source, the rows of its tokens I store, in its (increasing) order.
  StoredRows stored;
  stored.tokens = sh.owned(me / copies, offset, offset + T);
  std::vector<std::vector<std::int64_t>> from(P);  // indices into stored.tokens
  for (int src = 0; src < P; ++src) {
    for (std::int64_t t : tokens_of(src)) {
      if (t >= 0 && sh.owner(t) == me / copies) {
        from[src].push_back(std::lower_bound(stored.tokens.begin(), stored.tokens.end(), t) - stored.tokens.begin());
      }
    }
    recv_total += recv_counts[src] = B * static_cast<std::int64_t>(from[src].size()) * row;
  }
  Tensor send = alloc.empty({send_total}, dtype, MemCategory::kCommBuffer);
  Tensor recv = alloc.empty({recv_total}, dtype, MemCategory::kCommBuffer);
  std::int64_t off = 0;
  for (int d = 0; d < P; ++d) {
    const std::int64_t m = static_cast<std::int64_t>(to[d].size());
    if (m == 0) continue;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const TensorView dst = sub_view(send, off, piece_shape(i, m));
      off += B * m * per_row[i];
      if (copies == 1) {
        gather_rows(ts[i], 1, to[d], dst, groups.stream);
        continue;
      }
      Shape all = ts[i].shape();
      all[1] = m;
      Tensor rows = alloc.empty(all, dtype, MemCategory::kWorkspace);
      gather_rows(ts[i], 1, to[d], rows, groups.stream);
      const std::int64_t e = ts[i].dim(2) / copies;
      gather_rows(rows, 2, iota_from((d % copies) * e, e), dst, groups.stream);
    }
  }
  {
    CommMeter meter(groups, counters);
    WorkHandle w = groups.cp.all_to_all_v(send, send_counts, recv, recv_counts);
    timed_wait(groups.cp, w, &counters.exposed_comm_s);
  }
  const std::int64_t m_all = static_cast<std::int64_t>(stored.tokens.size());
  for (std::size_t i = 0; i < ts.size(); ++i) {
    stored.rows.push_back(alloc.empty(piece_shape(i, m_all), dtype, MemCategory::kWorkspace));
  }
  off = 0;
  for (int src = 0; src < P; ++src) {
    const std::int64_t m = static_cast<std::int64_t>(from[src].size());
    if (m == 0) continue;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      scatter_rows(sub_view(recv, off, piece_shape(i, m)), 1, from[src], stored.rows[i], groups.stream);
      off += B * m * per_row[i];
    }
  }
  return stored;
}

}  // namespace seqpar::decode_detail
