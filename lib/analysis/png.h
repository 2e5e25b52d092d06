// Heatmap images (libpng): attention patterns, patching sweeps.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace dmi::analysis {

enum class Colormap {
  sequential,  // [0, 1], viridis-like (attention probabilities)
  diverging,   // [-1, 1], blue - white - red (signed effects: patching)
};

// Writes m [rows, cols] (values clipped to the map's range; NaN/inf drawn
// black) as an RGB PNG, each cell `cell` pixels square.
void write_heatmap_png(const std::string& path, const at::Tensor& m, int cell,
                       Colormap map = Colormap::sequential);

}  // namespace dmi::analysis
