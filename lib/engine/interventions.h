// --steer, --ablate and --patch: parsing the flags, reading the vector and
// reference files, and resolving them against a model and its prompts into
// hooks::Intervention (hooks/intervene.h). docs/steering.md documents the
// grammar.
//
//   --steer FILE[,scale=A][,layers=L][,pos=P][,mode=add|normadd|set|ablate][,site=S][,target=C]
//   --ablate SITE[,heads=H][,pos=P]=zero|mean:REF.h5|posmean:REF.h5|resample:REF.h5[:SEQ]
//   --patch SRC.h5[,site=S][,heads=H][,pos=P][,src-seq=N][,src-pos=N]
//
// Values may contain commas (pos=1,4,9; layers=0-3,10; heads=0,2): an item
// without '=' continues the previous one.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "hooks/intervene.h"
#include "hooks/selection.h"
#include "io/config.h"
#include "io/fingerprint.h"
#include "io/tokenizer.h"

namespace dmi::engine {

struct InterventionRequest {
  std::string kind;  // steer | ablate | patch
  std::string spec;  // the flag's value
  std::optional<std::set<std::int32_t>> only_seqs;  // per-row (a prompts file's "steer")
};

// Checks a request's grammar without reading files (for early errors).
void check_intervention_syntax(const InterventionRequest& r);

struct ResolvedInterventions {
  std::vector<hooks::Intervention> list;
  std::string record_json;  // the capture's "interventions" attribute
};

struct ModelView {
  const io::ModelConfig& config;
  const hooks::SiteSpace& space;
  const io::Tokenizer& tokenizer;
  const io::Fingerprint& fingerprint;  // may be empty (then REF files are checked by config)
};

// Reads the files and resolves every request, in order. prompts: each
// sequence's prompt ids (after:TEXT positions, prompt lengths). Errors name
// the flag, the file and the tensor or row at fault.
ResolvedInterventions resolve_interventions(const std::vector<InterventionRequest>& requests, const ModelView& model,
                                            const std::vector<std::vector<std::int32_t>>& prompts);

// The requests recorded in a capture's "interventions" attribute, with the
// files' hashes checked (a changed file is an error naming it unless
// allow_changed).
std::vector<InterventionRequest> recorded_interventions(const std::string& json_text, const std::string& capture_path,
                                                        bool allow_changed);

}  // namespace dmi::engine
