// Labelled heatmaps: attention patterns (dmi-inspect attention --png/--svg)
// and patching sweeps (dmi-patch --png/--svg). Labels on both axes (token
// strings, shortened), a colour bar with its scale and a title. PNG text is
// rendered with FreeType from a Debian font (fonts-dejavu-core); SVG keeps
// the text as text (selectable, searchable) with the same layout.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmi::analysis {

enum class Colormap {
  sequential,  // [0, 1], viridis-like (attention probabilities)
  diverging,   // [-1, 1], blue - white - red (signed effects: patching)
};

struct Heatmap {
  at::Tensor values;  // [rows, cols]; NaN/inf drawn black
  std::vector<std::string> row_labels, col_labels;  // one per row/column (see axis_label); empty: indices
  std::string title, subtitle;
  std::string row_axis, col_axis, value_name;  // "query", "key", "attention weight"
  Colormap map = Colormap::sequential;
};

// The RGB colour of v on the map (values clipped to its range).
void heatmap_colour(double v, Colormap map, std::uint8_t rgb[3]);

// A token as an axis label: spaces shown as "·", control characters and
// newlines escaped (\n, \t, \xNN), at most max_chars characters (UTF-8
// aware), longer ones cut with "…".
std::string axis_label(const std::string& token, std::size_t max_chars = 12);

// Where the picture put things (pixels): its size, the grid's top-left
// corner and cell size, and which labels it drew (every stride-th).
struct HeatmapGeometry {
  int width = 0, height = 0, grid_x = 0, grid_y = 0, cell = 0, label_stride = 1;
};

// Writes h as PNG or SVG, chosen by the path's extension (.png, .svg).
// Errors name the file (and the font when none is found: DMI_FONT names a
// .ttf to use instead of DejaVu Sans).
HeatmapGeometry write_heatmap(const std::string& path, const Heatmap& h);

}  // namespace dmi::analysis
