#include "sink/result_file.h"

#include <ATen/ATen.h>
#include <hdf5.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace dmi::sink {

namespace {

hid_t text_type() {
  hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  H5Tset_cset(type, H5T_CSET_UTF8);
  return type;
}

// Creates the groups above path ("/a/b/c": /a and /a/b) when missing.
void make_parents(hid_t file, const std::string& path, const std::string& file_path) {
  for (std::size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1)) {
    const std::string g = path.substr(0, slash);
    if (H5Lexists(file, g.c_str(), H5P_DEFAULT) > 0) continue;
    hid_t id = H5Gcreate2(file, g.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    DMI_CHECK(id >= 0, "{}: cannot create group {} (disk full?)", file_path, g);
    H5Gclose(id);
  }
}

// A scalar attribute of `object` (text, float64 or int64).
void scalar_attr(hid_t file, const std::string& object, const std::string& name, hid_t file_type, hid_t mem_type,
                 const void* value, const std::string& file_path) {
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate_by_name(file, object.c_str(), name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT,
                              H5P_DEFAULT);
  const herr_t rc = a < 0 ? -1 : H5Awrite(a, mem_type, value);
  if (a >= 0) H5Aclose(a);
  H5Sclose(space);
  DMI_CHECK(rc >= 0, "{}: cannot write attribute {} of {} (disk full?)", file_path, name, object);
}

void text_attr(hid_t file, const std::string& object, const std::string& name, const std::string& text,
               const std::string& file_path) {
  hid_t type = text_type();
  const char* p = text.c_str();
  try {
    scalar_attr(file, object, name, type, type, &p, file_path);
  } catch (...) {
    H5Tclose(type);
    throw;
  }
  H5Tclose(type);
}

// An array dataset at path (parents created): float64 values, stored as
// float64 or (integer) int64.
void array_dataset(hid_t file, const std::string& path, const std::vector<std::int64_t>& shape,
                   const double* values, bool integer, const std::string& file_path) {
  make_parents(file, path, file_path);
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  std::vector<std::int64_t> ints;
  if (integer) ints.assign(values, values + n);
  hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t d = H5Dcreate2(file, path.c_str(), integer ? H5T_STD_I64LE : H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT,
                       H5P_DEFAULT);
  herr_t rc = d < 0 ? -1 : 0;
  if (d >= 0 && n > 0)
    rc = integer ? H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, ints.data())
                 : H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values);
  if (d >= 0) H5Dclose(d);
  H5Sclose(space);
  DMI_CHECK(rc >= 0, "{}: cannot write dataset {} (disk full?)", file_path, path);
}

}  // namespace

void write_result_table(std::int64_t file, const ResultTable& t, const std::string& path) {
  const std::string group = "/" + t.group;
  make_parents(file, group + "/", path);
  for (const auto& [name, value] : t.attrs) text_attr(file, group, name, value, path);
  for (const auto& c : t.columns) array_dataset(file, group + "/" + c.name, c.shape, c.values.data(), c.integer, path);
}

ResultFile::ResultFile(const std::string& path, bool overwrite) : path_(path), partial_(path + ".partial") {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    DMI_CHECK(!S_ISDIR(st.st_mode), "{} is a directory", path);
    DMI_CHECK(overwrite, "{} exists; pass --overwrite to replace it", path);
  }
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors become dmi::Error
  hid_t f = H5Fcreate(partial_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  DMI_CHECK(f >= 0, "{}: cannot create the file: {}", partial_, std::strerror(errno));
  file_ = f;
}

ResultFile::~ResultFile() {
  if (file_ < 0) return;
  H5Fclose(static_cast<hid_t>(file_));
  std::remove(partial_.c_str());
}

void ResultFile::attr(const std::string& object, const std::string& name, const std::string& text) {
  text_attr(file_, object, name, text, partial_);
}

void ResultFile::attr(const std::string& object, const std::string& name, double value) {
  scalar_attr(file_, object, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value, partial_);
}

void ResultFile::attr(const std::string& object, const std::string& name, std::int64_t value) {
  scalar_attr(file_, object, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value, partial_);
}

void ResultFile::dataset(const std::string& path, const at::Tensor& t) {
  const at::Tensor x = t.to(at::kDouble).contiguous();
  array_dataset(file_, path, std::vector<std::int64_t>(x.sizes().begin(), x.sizes().end()), x.data_ptr<double>(),
                false, partial_);
}

void ResultFile::strings(const std::string& path, const std::vector<std::string>& values) {
  make_parents(file_, path, partial_);
  std::vector<const char*> ptrs;
  for (const auto& s : values) ptrs.push_back(s.c_str());
  hsize_t n = ptrs.size();
  hid_t type = text_type(), space = H5Screate_simple(1, &n, nullptr);
  hid_t d = H5Dcreate2(file_, path.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  const herr_t rc = d < 0 ? -1 : (n ? H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) : 0);
  if (d >= 0) H5Dclose(d);
  H5Sclose(space);
  H5Tclose(type);
  DMI_CHECK(rc >= 0, "{}: cannot write dataset {} (disk full?)", partial_, path);
}

void ResultFile::close() {
  const hid_t f = static_cast<hid_t>(file_);
  file_ = -1;
  const bool ok = H5Fflush(f, H5F_SCOPE_GLOBAL) >= 0;
  const bool closed = H5Fclose(f) >= 0;
  if (!ok || !closed) {
    std::remove(partial_.c_str());
    DMI_FAIL("{}: writing the file failed (disk full?)", partial_);
  }
  if (std::rename(partial_.c_str(), path_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(partial_.c_str());
    DMI_FAIL("{}: cannot rename {} into place: {}", path_, partial_, why);
  }
}

}  // namespace dmi::sink
