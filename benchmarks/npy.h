// A small, strict reader and writer of NumPy .npy files (format versions 1.0, 2.0 and 3.0), for sp_bench's
// --inputs / --dump.
//
// Accepted element types: little-endian '<f8' (fp64), '<f4' (fp32), '<i4' (int32), '<i8' (int64), C order
// (fortran_order False), any rank including 0-d. Anything else (big-endian, Fortran order, object arrays,
// truncated data, a malformed header dictionary, trailing bytes) is an Error naming the file and what was wrong;
// the reader never reads past what it checked. Data is kept in host memory outside the memory ledger: these are
// the benchmark's full, unsharded tensors, not part of the measured working set.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tensor.h"

namespace seqpar::npy {

// A host array: dtype, shape and contiguous row-major bytes (not counted by the memory ledger).
struct HostArray {
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<std::byte> bytes;

  HostArray() = default;
  HostArray(DType dtype_, Shape shape_);  // zero-filled
  TensorView view() const;
  std::int64_t numel() const { return shape_numel(shape); }
};

// The parsed header dictionary.
struct Header {
  std::string descr;  // e.g. "<f4"
  bool fortran_order = false;
  Shape shape;
};

// Parses the header dictionary text (what follows the length field, e.g.
// "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"). Throws Error naming `what` on any deviation.
Header parse_header(std::string_view text, const std::string& what);
// The dtype for a descr ("<f4" -> fp32, ...); throws Error naming `what` and the accepted types otherwise.
DType dtype_of_descr(const std::string& descr, const std::string& what);
const char* descr_of(DType dtype);  // "<f8", "<f4", "<i4", "<i8"; throws for bf16 / fp16

// Reads only the preamble and the header dictionary of a file (its shape, for sp_bench --inputs). Throws Error naming
// the path for unreadable or malformed files.
Header read_header(const std::string& path);
// Reads a whole file. Throws Error naming the path for unreadable, malformed or unsupported files.
HostArray read(const std::string& path);
// Reads `path` and checks it has `shape`; throws Error naming the path, the expected and the found shape.
HostArray read_expect(const std::string& path, const Shape& shape);
// Writes `t` (fp64, fp32, int32, int64; bf16 / fp16 are written as fp32) as a version 1.0 file. Not atomic: a
// failure may leave a partial file (sp_bench --dump writes through bench::write_file_atomic instead).
void write(const std::string& path, const TensorView& t);
// The same file content into `out` (the caller checks the stream); `what` names the destination in errors.
void write(std::ostream& out, const TensorView& t, const std::string& what);

}  // namespace seqpar::npy
