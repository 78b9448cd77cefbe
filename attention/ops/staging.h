// Internal to attention/ops/: how the compositions bring tensors into a table's memory and their results back.
//   input   a tensor on the table's device (ops.device()) is used in place when its dtype is T (no copy), else
//           converted there by the table's convert_in into a table buffer; a host tensor of a device table is
//           uploaded as it is (its own dtype: bf16 moves 2 bytes an element) and converted on the device; a tensor on
//           another device is refused by name. The CPU table's device is the host, so host tensors take the first
//           two forms there.
//   output  a table buffer of T into a tensor: on the table's device by the table's copy (dtype T) or convert_out;
//           a host tensor of a device table: converted on the device when its dtype is not T, then downloaded.
// Integer tensors (indices, cu_seqlens) stay host tensors that the compositions read on the host.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "../../runtime/error.h"
#include "../../runtime/tensor.h"
#include "ops.h"

namespace seqpar::attn::ops {

// What the staging did in this process so far (tests check that a tensor already in the table's form is used in
// place and that nothing is converted on the host).
struct StagingCounts {
  std::int64_t in_place = 0;      // inputs used where they lie
  std::int64_t converted_in = 0;  // inputs converted on the table's device (convert_in)
  std::int64_t copied_in = 0;     // inputs copied on the table's device (a writable copy of a dtype-T tensor)
  std::int64_t uploaded = 0;      // inputs uploaded from the host to a device table
  std::int64_t written = 0;       // outputs written on the table's device (copy or convert_out)
  std::int64_t downloaded = 0;    // outputs downloaded from a device table to the host
};
StagingCounts staging_counts();
namespace detail {
enum class StagingEvent { kInPlace, kConvertedIn, kCopiedIn, kUploaded, kWritten, kDownloaded };
void note_staging(StagingEvent e);

// Raises unless `t` is on `table`'s device or on the host (what: the argument's name).
void check_stageable(const TensorView& t, const char* what, const char* table, Device table_device);
}  // namespace detail

// An input tensor as T elements in the table's memory (nullptr for an empty tensor). writable: the composition will
// write into the elements, so a dtype-T tensor on the table's device is copied rather than used in place.
template <typename T>
class Input {
 public:
  Input(Ops<T>& ops, const TensorView& t, const char* what, bool writable = false) {
    if (t.empty() || t.numel() == 0) return;
    SEQPAR_CHECK(is_floating(t.dtype()), what, " ", t.str(), ": expected a floating dtype (fp64, fp32, bf16, fp16)");
    detail::check_stageable(t, what, ops.name(), ops.device());
    const std::int64_t n = t.numel();
    using detail::StagingEvent;
    if (t.device() == ops.device()) {
      if (t.dtype() == dtype_v<T> && !writable) {
        p_ = static_cast<const T*>(t.data());
        detail::note_staging(StagingEvent::kInPlace);
        return;
      }
      buf_ = std::make_unique<Buffer<T>>(ops, n);
      if (t.dtype() == dtype_v<T>) {
        ops.copy(1, n, Mat<const T>{static_cast<const T*>(t.data()), n}, Mat<T>{buf_->get(), n}, Batch{1, 1});
        detail::note_staging(StagingEvent::kCopiedIn);
      } else {
        ops.convert_in(t.data(), t.dtype(), buf_->get(), n);
        detail::note_staging(StagingEvent::kConvertedIn);
      }
    } else {  // a host tensor of a device table
      buf_ = std::make_unique<Buffer<T>>(ops, n);
      if (t.dtype() == dtype_v<T>) {
        ops.upload(buf_->get(), t.data(), t.nbytes());
      } else {
        const Buffer<unsigned char> raw(ops, static_cast<std::int64_t>(t.nbytes()));
        ops.upload(raw.get(), t.data(), t.nbytes());
        ops.convert_in(raw.get(), t.dtype(), buf_->get(), n);
      }
      detail::note_staging(StagingEvent::kUploaded);
    }
    p_ = buf_->get();
  }
  Input(const Input&) = delete;
  Input& operator=(const Input&) = delete;
  const T* get() const { return p_; }
  // The elements, writable (constructed with writable = true).
  T* mut() const { return buf_ ? buf_->get() : nullptr; }

 private:
  std::unique_ptr<Buffer<T>> buf_;
  const T* p_ = nullptr;
};

// dst = src (dst.numel() elements of T in the table's memory), converted to dst's dtype. Nothing for an empty dst.
template <typename T>
void write_output(Ops<T>& ops, const T* src, const TensorView& dst, const char* what) {
  if (dst.empty() || dst.numel() == 0) return;
  SEQPAR_CHECK(is_floating(dst.dtype()), what, " ", dst.str(), ": expected a floating dtype (fp64, fp32, bf16, fp16)");
  detail::check_stageable(dst, what, ops.name(), ops.device());
  const std::int64_t n = dst.numel();
  using detail::StagingEvent;
  if (dst.device() == ops.device()) {
    if (dst.dtype() == dtype_v<T>) {
      if (static_cast<const void*>(src) != dst.data())
        ops.copy(1, n, Mat<const T>{src, n}, Mat<T>{static_cast<T*>(dst.data()), n}, Batch{1, 1});
    } else {
      ops.convert_out(src, dst.data(), dst.dtype(), n);
    }
    detail::note_staging(StagingEvent::kWritten);
    return;
  }
  if (dst.dtype() == dtype_v<T>) {
    ops.download(dst.data(), src, dst.nbytes());
  } else {
    const Buffer<unsigned char> raw(ops, static_cast<std::int64_t>(dst.nbytes()));
    ops.convert_out(src, raw.get(), dst.dtype(), n);
    ops.download(dst.data(), raw.get(), dst.nbytes());
  }
  detail::note_staging(StagingEvent::kDownloaded);
}

}  // namespace seqpar::attn::ops
