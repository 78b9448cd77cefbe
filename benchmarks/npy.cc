#include "benchmarks/npy.h"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>

#include "runtime/error.h"
#include "runtime/tensor_checks.h"

namespace seqpar::npy {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicLen = 6;
// numpy refuses headers above this size when reading untrusted files; so do we.
constexpr std::size_t kMaxHeaderLen = 1 << 20;

// A cursor over the header dictionary text.
class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  [[noreturn]] void fail(const std::string& why) const {
    SEQPAR_THROW(what_, ": malformed .npy header: ", why, " at offset ", pos_, " in \"", printable(), "\"");
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool peek(char c) {
    skip_ws();
    return pos_ < s_.size() && s_[pos_] == c;
  }
  void expect(char c) {
    if (!peek(c)) fail(str_cat("expected '", c, "'"));
    ++pos_;
  }
  bool at_end() {
    skip_ws();
    return pos_ == s_.size();
  }
  std::string string_literal() {
    skip_ws();
    if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"')) fail("expected a quoted string");
    const char quote = s_[pos_++];
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != quote) {
      if (s_[pos_] == '\\') fail("escape sequences are not supported");
      out.push_back(s_[pos_++]);
    }
    if (pos_ >= s_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }
  bool boolean() {
    skip_ws();
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    fail("expected True or False");
  }
  std::int64_t integer() {
    skip_ws();
    if (pos_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[pos_])))
      fail("expected a non-negative integer");
    std::int64_t v = 0;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) {
      const int digit = s_[pos_++] - '0';
      if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10) fail("integer overflow in shape");
      v = v * 10 + digit;
    }
    // numpy may write Python long suffixes in very old files ("3L"); accept them.
    if (pos_ < s_.size() && s_[pos_] == 'L') ++pos_;
    return v;
  }
  Shape tuple() {
    expect('(');
    Shape shape;
    if (peek(')')) {
      ++pos_;
      return shape;
    }
    while (true) {
      shape.push_back(integer());
      if (peek(',')) {
        ++pos_;
        if (peek(')')) break;
        continue;
      }
      if (peek(')')) break;
      fail("expected ',' or ')' in shape");
    }
    ++pos_;  // "(3)" (no trailing comma) is accepted like numpy's "(3,)"
    return shape;
  }

 private:
  std::string printable() const {
    std::string out;
    for (char c : s_.substr(0, 200)) out.push_back(std::isprint(static_cast<unsigned char>(c)) ? c : '?');
    return out;
  }
  std::string_view s_;
  std::size_t pos_ = 0;
  const std::string& what_;
};

std::uint64_t read_le(const unsigned char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

HostArray::HostArray(DType dtype_, Shape shape_) : dtype(dtype_), shape(std::move(shape_)) {
  bytes.assign(static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype), std::byte{0});
}

TensorView HostArray::view() const { return TensorView(const_cast<std::byte*>(bytes.data()), dtype, shape); }

Header parse_header(std::string_view text, const std::string& what) {
  Parser p(text, what);
  Header h;
  bool has_descr = false, has_order = false, has_shape = false;
  p.expect('{');
  while (!p.peek('}')) {
    const std::string key = p.string_literal();
    p.expect(':');
    if (key == "descr") {
      if (has_descr) p.fail("duplicate key 'descr'");
      h.descr = p.string_literal();
      has_descr = true;
    } else if (key == "fortran_order") {
      if (has_order) p.fail("duplicate key 'fortran_order'");
      h.fortran_order = p.boolean();
      has_order = true;
    } else if (key == "shape") {
      if (has_shape) p.fail("duplicate key 'shape'");
      h.shape = p.tuple();
      has_shape = true;
    } else {
      p.fail(str_cat("unexpected key '", key, "' (expected descr, fortran_order, shape)"));
    }
    if (p.peek(',')) {
      p.expect(',');
    } else if (!p.peek('}')) {
      p.fail("expected ',' or '}'");
    }
  }
  p.expect('}');
  if (!p.at_end()) p.fail("trailing characters after the dictionary");
  if (!has_descr || !has_order || !has_shape) {
    SEQPAR_THROW(what, ": malformed .npy header: missing key(s)", has_descr ? "" : " 'descr'",
                 has_order ? "" : " 'fortran_order'", has_shape ? "" : " 'shape'");
  }
  return h;
}

DType dtype_of_descr(const std::string& descr, const std::string& what) {
  if (descr == "<f8") return DType::kFloat64;
  if (descr == "<f4") return DType::kFloat32;
  if (descr == "<i4") return DType::kInt32;
  if (descr == "<i8") return DType::kInt64;
  if (!descr.empty() && descr[0] == '>') {
    SEQPAR_THROW(what, ": element type '", descr, "' is big-endian; only little-endian files are supported");
  }
  SEQPAR_THROW(what, ": unsupported element type '", descr, "' (supported: '<f8', '<f4', '<i4', '<i8')");
}

const char* descr_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return "<f8";
    case DType::kFloat32: return "<f4";
    case DType::kInt32: return "<i4";
    case DType::kInt64: return "<i8";
    default: break;
  }
  SEQPAR_THROW("npy: no .npy element type for ", dtype_name(dtype));
}

namespace {

// Opens `path` and reads its preamble and header dictionary; on return `in` is at the first data byte, `file_size`
// holds the file's size and `data_offset` the position of the data.
Header read_preamble_and_header(std::ifstream& in, const std::string& path, std::streamoff& file_size,
                                std::size_t& data_offset) {
  in.open(path, std::ios::binary);
  SEQPAR_CHECK(in.good(), path, ": cannot open for reading (", std::strerror(errno), ")");
  in.seekg(0, std::ios::end);
  file_size = in.tellg();
  in.seekg(0, std::ios::beg);
  SEQPAR_CHECK(file_size >= 10, path, ": not a .npy file (", file_size, " bytes, shorter than the fixed preamble)");

  unsigned char pre[12] = {};
  in.read(reinterpret_cast<char*>(pre), 10);
  SEQPAR_CHECK(in.good(), path, ": read error in the preamble");
  SEQPAR_CHECK(std::memcmp(pre, kMagic, kMagicLen) == 0, path, ": not a .npy file (bad magic string)");
  const int major = pre[6], minor = pre[7];
  SEQPAR_CHECK((major == 1 || major == 2 || major == 3) && minor == 0, path, ": unsupported .npy format version ",
               major, ".", minor, " (supported: 1.0, 2.0, 3.0)");
  std::size_t header_len = 0, preamble = 10;
  if (major == 1) {
    header_len = static_cast<std::size_t>(read_le(pre + 8, 2));
  } else {
    SEQPAR_CHECK(file_size >= 12, path, ": truncated .npy preamble");
    in.read(reinterpret_cast<char*>(pre + 10), 2);
    SEQPAR_CHECK(in.good(), path, ": read error in the preamble");
    header_len = static_cast<std::size_t>(read_le(pre + 8, 4));
    preamble = 12;
  }
  SEQPAR_CHECK(header_len <= kMaxHeaderLen, path, ": .npy header length ", header_len, " exceeds the limit ",
               kMaxHeaderLen);
  SEQPAR_CHECK(static_cast<std::int64_t>(preamble + header_len) <= file_size, path, ": truncated .npy header (",
               header_len, " header bytes announced, file has ", file_size, " bytes)");
  std::string text(header_len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  SEQPAR_CHECK(in.good(), path, ": read error in the header");
  SEQPAR_CHECK(!text.empty() && text.back() == '\n', path, ": malformed .npy header: it does not end with a newline");

  data_offset = preamble + header_len;
  return parse_header(text, path);
}

}  // namespace

Header read_header(const std::string& path) {
  std::ifstream in;
  std::streamoff file_size = 0;
  std::size_t data_offset = 0;
  return read_preamble_and_header(in, path, file_size, data_offset);
}

HostArray read(const std::string& path) {
  std::ifstream in;
  std::streamoff file_size = 0;
  std::size_t data_offset = 0;
  const Header h = read_preamble_and_header(in, path, file_size, data_offset);
  const DType dtype = dtype_of_descr(h.descr, path);
  SEQPAR_CHECK(!h.fortran_order, path, ": Fortran-order arrays are not supported (write the array in C order, e.g. ",
               "numpy.ascontiguousarray)");
  // Element count and byte size without overflow.
  std::uint64_t numel = 1;
  for (std::int64_t d : h.shape) {
    if (d != 0 && numel > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d) / 8) {
      SEQPAR_THROW(path, ": shape ", shape_str(h.shape), " is too large");
    }
    numel *= static_cast<std::uint64_t>(d);
  }
  const std::uint64_t data_bytes = numel * dtype_size(dtype);
  const std::uint64_t available = static_cast<std::uint64_t>(file_size) - data_offset;
  SEQPAR_CHECK(available == data_bytes, path, ": data size mismatch: shape ", shape_str(h.shape), " of ",
               dtype_name(dtype), " needs ", data_bytes, " bytes, the file holds ", available,
               available < data_bytes ? " (truncated)" : " (trailing bytes)");

  HostArray a;
  a.dtype = dtype;
  a.shape = h.shape;
  a.bytes.resize(static_cast<std::size_t>(data_bytes));
  if (data_bytes > 0) {
    in.read(reinterpret_cast<char*>(a.bytes.data()), static_cast<std::streamsize>(data_bytes));
    SEQPAR_CHECK(in.good(), path, ": read error in the data");
  }
  return a;
}

HostArray read_expect(const std::string& path, const Shape& shape) {
  HostArray a = read(path);
  SEQPAR_CHECK(a.shape == shape, path, ": shape ", shape_str(a.shape), " does not match the expected ",
               shape_str(shape));
  return a;
}

void write(std::ostream& out, const TensorView& t, const std::string& what) {
  check_cpu(t, what.c_str());
  const bool widen = t.dtype() == DType::kBFloat16 || t.dtype() == DType::kFloat16;
  const DType file_dtype = widen ? DType::kFloat32 : t.dtype();
  std::string dict = str_cat("{'descr': '", descr_of(file_dtype), "', 'fortran_order': False, 'shape': (");
  for (std::size_t i = 0; i < t.shape().size(); ++i) {
    dict += std::to_string(t.shape()[i]);
    dict += t.shape().size() == 1 ? "," : (i + 1 < t.shape().size() ? ", " : "");
  }
  dict += "), }";
  // Pad with spaces so that the data starts at a multiple of 64 bytes, then a newline (what numpy writes).
  std::size_t total = kMagicLen + 4 + dict.size() + 1;
  const std::size_t pad = (64 - total % 64) % 64;
  dict.append(pad, ' ');
  dict.push_back('\n');
  SEQPAR_CHECK(dict.size() <= 65535, what, ": header too long for .npy version 1.0");

  const unsigned char pre[10] = {0x93,
                                 'N',
                                 'U',
                                 'M',
                                 'P',
                                 'Y',
                                 1,
                                 0,
                                 static_cast<unsigned char>(dict.size() & 0xff),
                                 static_cast<unsigned char>(dict.size() >> 8)};
  out.write(reinterpret_cast<const char*>(pre), 10);
  out.write(dict.data(), static_cast<std::streamsize>(dict.size()));
  if (widen) {
    std::vector<float> tmp(static_cast<std::size_t>(t.numel()));
    convert(t.data(), t.dtype(), tmp.data(), DType::kFloat32, tmp.size());
    out.write(reinterpret_cast<const char*>(tmp.data()), static_cast<std::streamsize>(tmp.size() * 4));
  } else if (t.nbytes() > 0) {
    out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  }
}

void write(const std::string& path, const TensorView& t) {
  check_cpu(t, path.c_str());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  SEQPAR_CHECK(out.good(), path, ": cannot open for writing (", std::strerror(errno), ")");
  write(out, t, path);
  out.flush();
  SEQPAR_CHECK(out.good(), path, ": write error");
}

}  // namespace seqpar::npy
