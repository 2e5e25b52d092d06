// Steering vectors made from and measured against captures
// (dmi-inspect steer-vector make / show).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/vectors.h"

namespace dmi::analysis {

struct MakeVectorOptions {
  std::string pos_file, neg_file;  // captures of the positive and negative prompts, paired by sequence index
  std::string site = "resid_post"; // residual-shaped short name
  std::string layers = "all";      // "0-3,10" or all
  std::string select = "last-prompt";  // last-prompt | last | all | pos:K
  std::string method = "mean-diff";    // mean-diff | pca-diff | pca-center
  bool normalize = false;
};

// One direction per layer:
//   mean-diff   mean over pairs of (pos - neg) (CAA);
//   pca-diff    first principal component of the centred paired differences,
//               signed so that positives project higher in most pairs (repeng);
//   pca-center  first eigenvector of the uncentred second moment of the
//               differences, D^T D (llama.cpp's cvector-generator), signed the
//               same way.
// Errors name the file, the site or the sequence at fault.
io::SteeringVectors make_steering_vector(const MakeVectorOptions& o);

struct VectorLayerInfo {
  int layer = 0;
  double norm = 0;
  std::optional<double> cos_prev;   // with layer - 1's direction
  std::optional<double> mean_h_norm;  // mean ||h|| at the site in a capture
  std::optional<double> ratio;        // scale * ||v|| / mean ||h||
};

// Per layer ||v||, the cosine with the previous layer, and with a capture
// the mean ||h|| at the vector's site and scale * ||v|| / ||h||.
std::vector<VectorLayerInfo> describe_steering_vector(const io::SteeringVectors& v, const std::string& capture,
                                                      const std::string& site, double scale);

}  // namespace dmi::analysis
