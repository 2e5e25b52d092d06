#include "analysis/png.h"

#include <ATen/ATen.h>
#include <png.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/error.h"

namespace dmi::analysis {

namespace {
// Five anchors of matplotlib's viridis (sequential) or coolwarm (diverging),
// interpolated linearly.
void colour(double v, Colormap map, std::uint8_t* rgb) {
  static const double viridis[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  static const double coolwarm[5][3] = {{59, 76, 192}, {141, 176, 254}, {221, 221, 221}, {244, 154, 123}, {180, 4, 38}};
  const auto& k = map == Colormap::sequential ? viridis : coolwarm;
  if (map == Colormap::diverging) v = (v + 1.0) / 2.0;
  if (!std::isfinite(v)) {
    rgb[0] = rgb[1] = rgb[2] = 0;
    return;
  }
  v = std::min(1.0, std::max(0.0, v)) * 4.0;
  const int i = std::min(3, static_cast<int>(v));
  const double t = v - i;
  for (int c = 0; c < 3; ++c) rgb[c] = static_cast<std::uint8_t>(std::lround(k[i][c] + t * (k[i + 1][c] - k[i][c])));
}
}  // namespace

void write_heatmap_png(const std::string& path, const at::Tensor& m, int cell, Colormap map) {
  at::Tensor x = m.to(at::kFloat).contiguous();
  const int rows = static_cast<int>(x.size(0)), cols = static_cast<int>(x.size(1));
  const int w = cols * cell, h = rows * cell;
  FILE* fp = std::fopen(path.c_str(), "wb");
  DMI_CHECK(fp, "{}: cannot write PNG", path);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(fp);
    DMI_FAIL("{}: writing PNG failed", path);
  }
  png_init_io(png, fp);
  png_set_IHDR(png, info, w, h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  const float* p = x.data_ptr<float>();
  std::vector<std::uint8_t> line(static_cast<std::size_t>(w) * 3);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      std::uint8_t rgb[3];
      colour(p[r * cols + c], map, rgb);
      for (int k = 0; k < cell; ++k) std::copy(rgb, rgb + 3, &line[(c * cell + k) * 3]);
    }
    for (int k = 0; k < cell; ++k) png_write_row(png, line.data());
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  DMI_CHECK(std::fclose(fp) == 0, "{}: writing PNG failed (disk full?)", path);
}

}  // namespace dmi::analysis
