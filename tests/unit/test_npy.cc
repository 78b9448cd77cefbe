// The .npy reader/writer of benchmarks/: C++ round trips for every supported dtype and rank, hand-made malformed
// files (each must be a clear Error, never a crash), and interoperability with numpy when /usr/bin/python3 has it.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "benchmarks/npy.h"
#include "runtime/error.h"

namespace seqpar {
namespace {

namespace fs = std::filesystem;

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("seqpar_test_npy_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes raw bytes: magic, version, header length (v1: 2 bytes, v2: 4 bytes), header text, data.
  std::string write_raw(const std::string& name, const std::string& header, const std::string& data = "", int major = 1,
                        const char* magic = "\x93NUMPY") const {
    std::string bytes(magic, 6);
    bytes.push_back(static_cast<char>(major));
    bytes.push_back(0);
    const std::size_t n = header.size();
    bytes.push_back(static_cast<char>(n & 0xff));
    bytes.push_back(static_cast<char>((n >> 8) & 0xff));
    if (major >= 2) {
      bytes.push_back(static_cast<char>((n >> 16) & 0xff));
      bytes.push_back(static_cast<char>((n >> 24) & 0xff));
    }
    bytes += header;
    bytes += data;
    const std::string p = path(name);
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

  // Expects npy::read(p) to throw an Error whose message contains `needle`.
  void expect_error(const std::string& p, const std::string& needle) const {
    try {
      npy::read(p);
      ADD_FAILURE() << p << ": expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(needle), std::string::npos) << "message: " << e.message();
    }
  }

  fs::path dir_;
};

template <typename T>
npy::HostArray make_array(DType dtype, const Shape& shape) {
  npy::HostArray a(dtype, shape);
  T* p = reinterpret_cast<T*>(a.bytes.data());
  for (std::int64_t i = 0; i < a.numel(); ++i) p[i] = static_cast<T>(i * 3 - 7) / static_cast<T>(2);
  return a;
}

TEST_F(NpyTest, RoundTripEveryDtypeAndRank) {
  const std::vector<Shape> shapes = {{}, {0}, {5}, {2, 3}, {2, 3, 4, 5}, {1, 0, 3}};
  for (const Shape& shape : shapes) {
    const npy::HostArray arrays[] = {
        make_array<float>(DType::kFloat32, shape), make_array<double>(DType::kFloat64, shape),
        make_array<std::int32_t>(DType::kInt32, shape), make_array<std::int64_t>(DType::kInt64, shape)};
    for (const npy::HostArray& a : arrays) {
      const std::string p = path(std::string("rt_") + dtype_name(a.dtype) + ".npy");
      npy::write(p, a.view());
      const npy::HostArray b = npy::read(p);
      EXPECT_EQ(b.dtype, a.dtype) << shape_str(shape);
      EXPECT_EQ(b.shape, a.shape) << shape_str(shape);
      EXPECT_EQ(b.bytes, a.bytes) << shape_str(shape) << " " << dtype_name(a.dtype);
      EXPECT_EQ(fs::file_size(p) % 64, a.bytes.size() % 64) << "data should start at a multiple of 64 bytes";
    }
  }
}

TEST_F(NpyTest, SixteenBitIsWrittenAsFp32) {
  npy::HostArray a(DType::kBFloat16, {3});
  bf16* p = reinterpret_cast<bf16*>(a.bytes.data());
  p[0] = bf16(1.5f);
  p[1] = bf16(-2.0f);
  p[2] = bf16(0.25f);
  npy::write(path("bf16.npy"), a.view());
  const npy::HostArray b = npy::read(path("bf16.npy"));
  ASSERT_EQ(b.dtype, DType::kFloat32);
  const float* f = reinterpret_cast<const float*>(b.bytes.data());
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 0.25f);
}

TEST_F(NpyTest, AcceptsVersion2AndNumpySpellings) {
  const std::string data(4 * 6, '\0');
  EXPECT_EQ(
      npy::read(write_raw("v2.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n", data, 2)).shape,
      (Shape{2, 3}));
  EXPECT_EQ(npy::read(write_raw("dq.npy", "{\"shape\": (6,), \"descr\": \"<f4\", \"fortran_order\": False}   \n", data))
                .shape,
            (Shape{6}));
  EXPECT_EQ(npy::read(write_raw("scalar.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (), }\n",
                                std::string(8, '\0')))
                .shape,
            (Shape{}));
}

TEST_F(NpyTest, MalformedFilesAreClearErrors) {
  const std::string ok_data(4 * 6, '\0');
  expect_error(path("missing.npy"), "cannot open");
  expect_error(write_raw("magic.npy", "{}\n", "", 1, "\x93NUMPZ"), "bad magic");
  {
    const std::string p = path("short.npy");
    std::ofstream(p, std::ios::binary) << "\x93NU";
    expect_error(p, "not a .npy file");
  }
  expect_error(write_raw("version.npy", "{}\n", "", 4), "unsupported .npy format version 4.0");
  {
    // Announces a 200-byte header but the file ends before it.
    std::string bytes("\x93NUMPY\x01\x00\xc8\x00{'descr'", 17);
    std::ofstream(path("trunc_header.npy"), std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    expect_error(path("trunc_header.npy"), "truncated .npy header");
  }
  expect_error(write_raw("nonl.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", ok_data),
               "does not end with a newline");
  expect_error(write_raw("nokey.npy", "{'descr': '<f4', 'shape': (2, 3), }\n", ok_data), "'fortran_order'");
  expect_error(
      write_raw("dupkey.npy", "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}\n", ok_data),
      "duplicate key 'descr'");
  expect_error(write_raw("extra.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}\n", ok_data),
               "unexpected key 'x'");
  expect_error(write_raw("fortran.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }\n", ok_data),
               "Fortran-order");
  expect_error(write_raw("bigendian.npy", "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }\n", ok_data),
               "big-endian");
  expect_error(write_raw("f2.npy", "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3), }\n", ok_data),
               "unsupported element type '<f2'");
  expect_error(write_raw("object.npy", "{'descr': '|O', 'fortran_order': False, 'shape': (2, 3), }\n", ok_data),
               "unsupported element type '|O'");
  expect_error(write_raw("negshape.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }\n", ok_data),
               "non-negative integer");
  expect_error(write_raw("badtuple.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }\n", ok_data),
               "expected '('");
  expect_error(write_raw("unterminated.npy", "{'descr': '<f4, 'fortran_order': False}\n", ok_data),
               "expected ',' or '}'");
  expect_error(write_raw("bool.npy", "{'descr': '<f4', 'fortran_order': false, 'shape': (6,)}\n", ok_data),
               "expected True or False");
  expect_error(write_raw("trailing.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (6,)} x\n", ok_data),
               "trailing characters");
  expect_error(write_raw("overflow.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}\n",
                         ok_data),
               "integer overflow");
  expect_error(
      write_raw("huge.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296)}\n", ok_data),
      "too large");
  expect_error(write_raw("truncdata.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }\n", ok_data),
               "(truncated)");
  expect_error(write_raw("extradata.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }\n", ok_data),
               "(trailing bytes)");
}

TEST_F(NpyTest, ReadExpectNamesTheShapes) {
  npy::write(path("q.npy"), make_array<float>(DType::kFloat32, {2, 3}).view());
  try {
    npy::read_expect(path("q.npy"), {2, 4});
    ADD_FAILURE() << "expected a shape mismatch error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("[2, 3] does not match the expected [2, 4]"), std::string::npos) << e.message();
  }
}

// numpy interoperability: numpy reads what we write, we read what numpy writes (also Fortran order is refused).
TEST_F(NpyTest, InteroperatesWithNumpy) {
  const char* python = "/usr/bin/python3";
  if (!fs::exists(python) || std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "numpy is not available to /usr/bin/python3 (scripts/install_deps.sh installs it)";
  }
  npy::write(path("from_cpp.npy"), make_array<float>(DType::kFloat32, {2, 3, 4}).view());
  npy::write(path("from_cpp_i8.npy"), make_array<std::int64_t>(DType::kInt64, {5}).view());
  const std::string d = dir_.string();
  const std::string script =
      "import numpy as np, sys\n"
      "d = sys.argv[1]\n"
      "a = np.load(d + '/from_cpp.npy')\n"
      "assert a.dtype == np.float32 and a.shape == (2, 3, 4), (a.dtype, a.shape)\n"
      "assert np.array_equal(a.ravel(), (np.arange(24) * 3 - 7) / np.float32(2)), a.ravel()\n"
      "b = np.load(d + '/from_cpp_i8.npy')\n"
      "assert b.dtype == np.int64 and np.array_equal(b, np.fix((np.arange(5) * 3 - 7) / 2)), b\n"
      "np.save(d + '/from_np.npy', np.arange(30, dtype=np.float64).reshape(2, 3, 5) / 4)\n"
      "np.save(d + '/from_np_f4.npy', np.float32(2.5))\n"
      "np.save(d + '/fortran.npy', np.asfortranarray(np.ones((3, 4), np.float32)))\n"
      "np.save(d + '/f2.npy', np.ones(3, np.float16))\n";
  { std::ofstream(path("check.py")) << script; }
  ASSERT_EQ(std::system((std::string(python) + " " + path("check.py") + " " + d).c_str()), 0)
      << "numpy could not read or write the files";
  const npy::HostArray a = npy::read(path("from_np.npy"));
  ASSERT_EQ(a.dtype, DType::kFloat64);
  ASSERT_EQ(a.shape, (Shape{2, 3, 5}));
  const double* p = reinterpret_cast<const double*>(a.bytes.data());
  for (int i = 0; i < 30; ++i) EXPECT_EQ(p[i], i / 4.0);
  const npy::HostArray s = npy::read(path("from_np_f4.npy"));
  EXPECT_EQ(s.shape, Shape{});
  EXPECT_EQ(*reinterpret_cast<const float*>(s.bytes.data()), 2.5f);
  expect_error(path("fortran.npy"), "Fortran-order");
  expect_error(path("f2.npy"), "unsupported element type '<f2'");
}

}  // namespace
}  // namespace seqpar
