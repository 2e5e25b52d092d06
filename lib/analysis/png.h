// Heatmap images (libpng) for attention patterns.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace dmi::analysis {

// Writes m [rows, cols] (values in [0, 1]; NaN/inf drawn black) as an RGB
// PNG, each cell `cell` pixels square, with a perceptual (viridis-like) map.
void write_heatmap_png(const std::string& path, const at::Tensor& m, int cell);

}  // namespace dmi::analysis
