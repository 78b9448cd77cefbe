// Internal to parallel/: what the decode layers of a token-sharded cache share (MhaDecodeCp,
// parallel/decode_cp.h; DsaDecodeCp, parallel/dsa_decode_cp.h): the exact merge of the ranks' partial
// (out, lse) and the lse's hi + lo transport (docs/design.md, "MHA decode over a sharded cache"), and the
// re-sharding of a prompt's rows from the compute layout to the ranks that store them. Not a public header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#include "cp_common.h"
#include "decode_cp.h"
#include "layout.h"

namespace seqpar::decode_detail {

// [0, 1, ..., n) shifted by `first`.
std::vector<std::int64_t> iota_from(std::int64_t first, std::int64_t n);

// The fields every decode-side call shares: the sharding and the length / step of the cache it is given.
void add_cache_fields(Fingerprint& fp, std::int64_t length, std::int64_t steps);

// Adds the fields of a sharded cache (ShardedCache: its sharding, capacity, batch, dtype, length and step count), the
// layout's (when given) and the tensors to `fp` (which holds the layer's own fields), then runs `check` over groups.cp.
template <typename Cache>
void agree_on_cache(AgreementCheck& check, const CpGroups& groups, Fingerprint& fp, const Cache& cache,
                    const SequenceLayout* layout,
                    std::initializer_list<std::pair<std::string_view, TensorView>> tensors) {
  const CacheSharding& sh = cache.sharding();
  fp.add_text("shard", cache_shard_name(sh.kind()))
      .add_int("interleave", sh.interleave())
      .add_int("capacity", cache.spec().capacity)
      .add_int("batch", cache.spec().batch)
      .add_text("cache dtype", dtype_name(cache.spec().dtype));
  add_cache_fields(fp, cache.length(), cache.num_steps());
  if (layout != nullptr) add_layout_fields(fp, *layout);
  fp.add_tensors(tensors);
  check.run(groups.cp, fp, groups.stream);
}

// A decode cache holds one request per batch row: a prompt layout packing several documents into a row is refused,
// naming `who` and the documents (after the agreement check, so every rank raises alike).
void check_one_request(const SequenceLayout& layout, const char* who);

// A view at element `offset` of a flat buffer, with `shape`.
TensorView sub_view(const Tensor& buf, std::int64_t offset, const Shape& shape);

// The exact merge of P shards' (out_r, lse_r) (parallel/decode_cp.h), in fp64 and rank order. recv holds P blocks
// of [out_r (B n Hq D) | lse hi (B Hq n) | lse lo (B Hq n)] of type T; out [B, n, Hq, D] of T, lse [B, Hq, n] of T.
template <typename T>
void merge_shards(const T* recv, int num_ranks, std::int64_t B, std::int64_t n, std::int64_t hq, std::int64_t dim,
                  T* out, T* lse) {
  const std::int64_t rows = B * n * hq, block = rows * (dim + 2);
  std::vector<double> w(static_cast<std::size_t>(num_ranks)), acc(static_cast<std::size_t>(dim));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t h = 0; h < hq; ++h) {
        const std::int64_t o_off = ((b * n + i) * hq + h) * dim, l_off = (b * hq + h) * n + i;
        double m = -std::numeric_limits<double>::infinity();
        for (int r = 0; r < num_ranks; ++r) {
          const T* blk = recv + r * block;
          w[r] = static_cast<double>(blk[rows * dim + l_off]) + static_cast<double>(blk[rows * dim + rows + l_off]);
          m = std::max(m, w[r]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        if (m == -std::numeric_limits<double>::infinity()) {  // no rank holds a visible key
          for (std::int64_t d = 0; d < dim; ++d) out[o_off + d] = T(0);
          lse[l_off] = static_cast<T>(m);
          continue;
        }
        double l = 0;
        for (int r = 0; r < num_ranks; ++r) {
          w[r] = std::exp(w[r] - m);  // 0 for a shard with lse -inf (its out is 0)
          l += w[r];
          const T* o = recv + r * block + o_off;
          for (std::int64_t d = 0; d < dim; ++d) acc[d] += w[r] * static_cast<double>(o[d]);
        }
        for (std::int64_t d = 0; d < dim; ++d) out[o_off + d] = static_cast<T>(acc[d] / l);
        lse[l_off] = static_cast<T>(m + std::log(l));
      }
    }
  }
}

// lse (fp64) written as hi + lo of type T.
template <typename T>
void split_lse(const double* lse, std::int64_t count, T* hi, T* lo) {
  for (std::int64_t i = 0; i < count; ++i) {
    hi[i] = static_cast<T>(lse[i]);
    lo[i] = std::isfinite(lse[i]) ? static_cast<T>(lse[i] - static_cast<double>(hi[i])) : T(0);
  }
}

// split_lse of the fp64 `lse` [count] into `buf` (fp32 or fp64, the accumulator dtype) at elements
// [offset, offset + count) (hi) and [offset + count, offset + 2 count) (lo).
void split_lse_into(const TensorView& lse, const Tensor& buf, std::int64_t offset);
// merge_shards of the num_parts blocks of `recv` (fp32 or fp64) into out [B, n, H, dim] and lse [B, H, n] (recv's
// dtype each).
void merge_shards_into(const Tensor& recv, int num_parts, const Tensor& out, const Tensor& lse);

// The rows a rank stores after a re-sharding, and their global tokens (increasing).
struct StoredRows {
  std::vector<Tensor> rows;  // one per input tensor: [B, m, ...] (dimension 2 divided by `copies`)
  std::vector<std::int64_t> tokens;
};

// Moves the rows of `tensors` ([B, S_local, ...], one dtype; local row i holds token layout.token_index(cp_rank)[i]
// + offset, padding rows (token -1) go nowhere) from the compute layout to the CP ranks that store them, with one
// all_to_all_v over groups.cp: CP rank d stores the tokens that cache rank d / copies owns (sharding.owner) and, when
// copies > 1, the entries [(d % copies) e, (d % copies + 1) e) of dimension 2 (e = dim(2) / copies: under USP the
// heads of Ulysses rank d % copies). Bytes sent by a rank: the elements of one destination's share of a row times
// bytes(dtype) per (token, destination) pair it sends to another rank. Returns this rank's rows, tokens
// sharding.owned(cp_rank / copies, offset, offset + layout.seq_len()). Collective over groups.cp; counted in
// counters (bytes_*, exposed_comm_s, compute_s).
StoredRows reshard_to_owners(const CpGroups& groups, CpCounters& counters, const CacheSharding& sharding, int copies,
                             const SequenceLayout& layout, std::int64_t offset,
                             std::initializer_list<TensorView> tensors);

}  // namespace seqpar::decode_detail
