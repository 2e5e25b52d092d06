// Structure-aware HDF5 inputs: the fuzz input chooses groups, attributes and
// datasets (names, types, shapes, values), written with HDF5's own API. dmi's
// readers then meet every shape of file HDF5 can express, while HDF5's byte
// parser is not what is fuzzed (it is not dmi's: byte-mutated files can make
// HDF5 1.10.8 itself loop, see README.md).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmi::fuzz {

class H5Builder {
 public:
  H5Builder(FuzzedDataProvider& in, const std::string& path) : in_(in) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_libver_bounds(fapl, in_.ConsumeBool() ? H5F_LIBVER_LATEST : H5F_LIBVER_EARLIEST, H5F_LIBVER_LATEST);
    file_ = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    H5Pclose(fapl);
  }
  ~H5Builder() { close(); }
  void close() {
    if (file_ >= 0) H5Fclose(file_);
    file_ = -1;
  }
  hid_t file() const { return file_; }

  hid_t group(hid_t loc, const std::string& name) {
    hid_t g = H5Gcreate2(loc, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    return g < 0 ? H5Gopen2(loc, name.c_str(), H5P_DEFAULT) : g;
  }

  // A string attribute (variable or fixed length), an integer one, or an
  // attribute of another type under the same name.
  void text_attr(hid_t loc, const std::string& name, const std::string& value) {
    const int kind = in_.ConsumeIntegralInRange(0, 9);
    hid_t space = H5Screate(H5S_SCALAR);
    if (kind <= 6) {
      hid_t t = H5Tcopy(H5T_C_S1);
      const bool vlen = kind <= 4;
      H5Tset_size(t, vlen ? H5T_VARIABLE : std::max<std::size_t>(value.size(), 1));
      hid_t a = H5Acreate2(loc, name.c_str(), t, space, H5P_DEFAULT, H5P_DEFAULT);
      if (vlen) {
        const char* p = value.c_str();
        H5Awrite(a, t, &p);
      } else {
        std::string v = value;
        v.resize(std::max<std::size_t>(value.size(), 1));
        H5Awrite(a, t, v.data());
      }
      H5Aclose(a);
      H5Tclose(t);
    } else {
      const std::int64_t v = in_.ConsumeIntegral<std::int64_t>();
      hid_t a = H5Acreate2(loc, name.c_str(), kind == 9 ? H5T_IEEE_F64LE : H5T_STD_I64LE, space, H5P_DEFAULT,
                           H5P_DEFAULT);
      H5Awrite(a, H5T_NATIVE_INT64, &v);
      H5Aclose(a);
    }
    H5Sclose(space);
  }
  void int_attr(hid_t loc, const std::string& name, std::int64_t value) {
    if (in_.ConsumeIntegralInRange(0, 9) == 0) return text_attr(loc, name, std::to_string(value));
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(loc, name.c_str(), H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &value);
    H5Aclose(a);
    H5Sclose(space);
  }
  // A value the reader expects (with probability 3/4), or anything.
  std::int64_t pick_int(std::int64_t expected) {
    return in_.ConsumeIntegralInRange(0, 3) ? expected : in_.ConsumeIntegral<std::int64_t>();
  }
  std::string pick_text(const std::vector<std::string>& expected) {
    if (in_.ConsumeIntegralInRange(0, 3)) return expected[in_.ConsumeIntegralInRange<std::size_t>(0, expected.size() - 1)];
    return in_.ConsumeRandomLengthString(64);
  }

  // A dataset of small random shape and type: int32 / int64 / float32 /
  // float64 / a 16-bit float, extendible and chunked or contiguous.
  void dataset(hid_t loc, const std::string& name, int rank_hint, std::size_t rows_hint) {
    const int rank = in_.ConsumeIntegralInRange(0, 3) ? rank_hint : in_.ConsumeIntegralInRange(0, 3);
    std::vector<hsize_t> dims(rank);
    for (int i = 0; i < rank; ++i)
      dims[i] = i == 0 && in_.ConsumeIntegralInRange(0, 3) ? rows_hint : in_.ConsumeIntegralInRange<hsize_t>(0, 9);
    std::size_t n = 1;
    for (auto d : dims) n *= d;
    hid_t type;
    switch (in_.ConsumeIntegralInRange(0, 5)) {
      case 0: type = H5Tcopy(H5T_STD_I64LE); break;
      case 1: type = H5Tcopy(H5T_IEEE_F32LE); break;
      case 2: type = H5Tcopy(H5T_IEEE_F64LE); break;
      case 3:
        type = H5Tcopy(H5T_IEEE_F32LE);  // bfloat16, as dmi writes it
        H5Tset_fields(type, 15, 7, 8, 0, 7);
        H5Tset_offset(type, 0);
        H5Tset_precision(type, 16);
        H5Tset_size(type, 2);
        H5Tset_ebias(type, 127);
        break;
      default: type = H5Tcopy(H5T_STD_I32LE);
    }
    std::vector<hsize_t> maxdims(dims.begin(), dims.end());
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (rank > 0 && in_.ConsumeBool()) {
      maxdims[0] = H5S_UNLIMITED;
      std::vector<hsize_t> chunk(dims.begin(), dims.end());
      for (auto& c : chunk) c = std::max<hsize_t>(c, 1);
      chunk[0] = in_.ConsumeIntegralInRange<hsize_t>(1, 4);
      H5Pset_chunk(dcpl, rank, chunk.data());
    }
    hid_t space = rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(rank, dims.data(), maxdims.data());
    hid_t d = H5Dcreate2(loc, name.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (d >= 0 && n > 0) {
      std::vector<std::int64_t> v(n);
      for (auto& x : v) x = in_.ConsumeIntegralInRange<std::int64_t>(-2, 12);
      H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    }
    if (d >= 0) H5Dclose(d);
    H5Sclose(space);
    H5Pclose(dcpl);
    H5Tclose(type);
  }
  void strings(hid_t loc, const std::string& name, std::size_t n) {
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    std::vector<std::string> v(n);
    std::vector<const char*> p(n);
    for (std::size_t i = 0; i < n; ++i) {
      v[i] = in_.ConsumeRandomLengthString(16);
      p[i] = v[i].c_str();
    }
    hsize_t dims = n;
    hid_t space = H5Screate_simple(1, &dims, nullptr);
    hid_t d = H5Dcreate2(loc, name.c_str(), t, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (d >= 0 && n) H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, p.data());
    if (d >= 0) H5Dclose(d);
    H5Sclose(space);
    H5Tclose(t);
  }

 private:
  FuzzedDataProvider& in_;
  hid_t file_ = -1;
};

}  // namespace dmi::fuzz
