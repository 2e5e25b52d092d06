// HDF5 helpers shared by the capture writer, reader and merger (internal to
// sink/): handles closed at scope exit, attributes, 1-D datasets, the file
// access properties of every capture, and the /sequences record.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "sink/sink.h"

namespace dmi::sink::h5 {

// Closes an HDF5 handle at scope exit.
struct H5Handle {
  hid_t id;
  herr_t (*close)(hid_t);
  ~H5Handle() {
    if (id >= 0) close(id);
  }
};

inline std::string read_text_attr(hid_t loc, const std::string& name) {
  if (H5Aexists(loc, name.c_str()) <= 0) return "";
  H5Handle a{H5Aopen(loc, name.c_str(), H5P_DEFAULT), H5Aclose};
  H5Handle t{H5Aget_type(a.id), H5Tclose};
  if (H5Tget_class(t.id) != H5T_STRING) return "";
  if (H5Tis_variable_str(t.id) > 0) {
    H5Handle mt{H5Tcopy(H5T_C_S1), H5Tclose};
    H5Tset_size(mt.id, H5T_VARIABLE);
    H5Tset_cset(mt.id, H5Tget_cset(t.id));
    char* p = nullptr;
    if (H5Aread(a.id, mt.id, &p) < 0 || !p) return "";
    std::string s(p);
    H5free_memory(p);
    return s;
  }
  std::string s(H5Tget_size(t.id), '\0');
  H5Aread(a.id, t.id, s.data());
  return s.substr(0, s.find('\0'));
}

inline std::optional<std::int64_t> read_int_attr(hid_t loc, const std::string& name) {
  if (H5Aexists(loc, name.c_str()) <= 0) return std::nullopt;
  H5Handle a{H5Aopen(loc, name.c_str(), H5P_DEFAULT), H5Aclose};
  H5Handle t{H5Aget_type(a.id), H5Tclose};
  H5Handle s{H5Aget_space(a.id), H5Sclose};
  if (H5Tget_class(t.id) != H5T_INTEGER || H5Sget_simple_extent_npoints(s.id) != 1) return std::nullopt;
  std::int64_t v = 0;
  if (H5Aread(a.id, H5T_NATIVE_INT64, &v) < 0) return std::nullopt;
  return v;
}

inline std::vector<hsize_t> dims_of(hid_t dset) {
  H5Handle s{H5Dget_space(dset), H5Sclose};
  int rank = H5Sget_simple_extent_ndims(s.id);
  std::vector<hsize_t> d(std::max(rank, 0));
  H5Sget_simple_extent_dims(s.id, d.data(), nullptr);
  return d;
}

// HDF5's own account of the last failure on this thread: the error stack's
// messages from the outermost call inwards ("unable to start SWMR writing:
// unable to lock the file: ..."), or "" when the stack is empty. HDF5 errors
// reach the user through dmi::Error, so this is what names the cause.
inline std::string error_stack_text() {
  std::string out;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* data) -> herr_t {
        auto& s = *static_cast<std::string*>(data);
        if (e->desc && *e->desc) {
          if (!s.empty()) s += ": ";
          s += e->desc;
        }
        return 0;
      },
      &out);
  return out;
}

#define H5_CHECK(expr, ...)                         \
  do {                                              \
    if ((expr) < 0) DMI_FAIL(__VA_ARGS__);          \
  } while (0)

inline void set_attr_text(hid_t loc, const std::string& name, const std::string& value) {
  if (H5Aexists(loc, name.c_str()) > 0) H5Adelete(loc, name.c_str());
  hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  H5Tset_cset(type, H5T_CSET_UTF8);
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(loc, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT);
  const char* p = value.c_str();
  herr_t rc = a < 0 ? -1 : H5Awrite(a, type, &p);
  if (a >= 0) H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
  H5_CHECK(rc, "cannot write attribute '{}' to the capture file", name);
}

inline void set_attr_int(hid_t loc, const std::string& name, std::int64_t value) {
  if (H5Aexists(loc, name.c_str()) > 0) H5Adelete(loc, name.c_str());
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(loc, name.c_str(), H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_INT64, &value);
  if (a >= 0) H5Aclose(a);
  H5Sclose(space);
  H5_CHECK(rc, "cannot write attribute '{}' to the capture file", name);
}

inline void set_attr_ints(hid_t loc, const std::string& name, const std::vector<std::int64_t>& v) {
  if (H5Aexists(loc, name.c_str()) > 0) H5Adelete(loc, name.c_str());
  hsize_t n = v.size();
  hid_t space = H5Screate_simple(1, &n, nullptr);
  hid_t a = H5Acreate2(loc, name.c_str(), H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_INT64, v.data());
  if (a >= 0) H5Aclose(a);
  H5Sclose(space);
  H5_CHECK(rc, "cannot write attribute '{}' to the capture file", name);
}

// A 1-D dataset written in one go.
template <typename T>
inline void write_vector(hid_t loc, const std::string& name, hid_t file_type, hid_t mem_type, const std::vector<T>& v) {
  hsize_t n = v.size();
  hid_t space = H5Screate_simple(1, &n, nullptr);
  hid_t d = H5Dcreate2(loc, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = d < 0 ? -1 : (n ? H5Dwrite(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) : 0);
  if (d >= 0) H5Dclose(d);
  H5Sclose(space);
  H5_CHECK(rc, "cannot write dataset '{}' to the capture file", name);
}

inline void write_strings(hid_t loc, const std::string& name, const std::vector<std::string>& v) {
  hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  H5Tset_cset(type, H5T_CSET_UTF8);
  std::vector<const char*> ptrs;
  for (const auto& s : v) ptrs.push_back(s.c_str());
  write_vector(loc, name, type, type, ptrs);
  H5Tclose(type);
}

// The file access properties of every capture: the latest format (HDF5
// 1.10), which SWMR writing and reading need.
inline hid_t latest_fapl() {
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
  return fapl;
}

// /sequences: what each prompt became (written at close, by recovery and by
// merge). Datasets already there (the prompts, written at creation) are
// replaced.
void write_sequences(hid_t file, const std::vector<SequenceInfo>& seqs, const std::string& path);

}  // namespace dmi::sink::h5
