// Hugging Face tokenizer.json: BPE models with the byte-level pipeline
// (GPT-2, Llama 3, Qwen2/3) and the SentencePiece-style pipeline (Llama 2,
// Mistral: Prepend/Replace "▁", byte fallback). Encoding matches the
// `tokenizers` library; decoding is its inverse.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dmi::io {

class Tokenizer {
 public:
  // Throws dmi::Error naming the file and the field at fault.
  static Tokenizer load(const std::string& path);
  static Tokenizer parse(const std::string& json_text, const std::string& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // text must be valid UTF-8. add_special_tokens applies the post-processor's
  // template (e.g. Llama's BOS), as Hugging Face does by default.
  std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Invalid UTF-8 produced by partial byte tokens becomes U+FFFD; ids the
  // tokenizer has no token for (padding rows of the embedding) are skipped.
  std::string decode(const std::vector<std::int32_t>& ids, bool skip_special_tokens = false) const;

  std::int64_t vocab_size() const;  // highest id + 1
  std::optional<std::int32_t> token_to_id(const std::string& token) const;
  const std::string& id_to_token(std::int32_t id) const;  // raw vocabulary string
  bool is_special(std::int32_t id) const;
  const std::string& path() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True when s is well-formed UTF-8.
bool valid_utf8(std::string_view s);

}  // namespace dmi::io
