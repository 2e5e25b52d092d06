#!/usr/bin/python3
"""The eager baseline that dmi's engine is benchmarked against
(scripts/hf_eager_bench.py) computes the model: its KV-cached, left-padded,
batched greedy decode gives the tokens of scripts/dmi_reference.py's full
recomputation, one sequence at a time, for every test architecture; and the
script runs end to end, printing one JSON line per batch size.

  eager_baseline_test.py TEST_MODELS
"""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dmi_reference as ref  # noqa: E402
import hf_eager_bench as hb  # noqa: E402

models = sys.argv[1]
PROMPTS = [[5, 17, 42, 99, 3, 7], [9, 8, 7], [200]]
STEPS = 5


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


for name in sorted(os.listdir(models)):
    path = os.path.join(models, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        continue
    m = hb.EagerModel(path, torch.float32)
    config, tensors = ref.load_model_dir(path)
    cfg = ref.Config(config)
    B, L = len(PROMPTS), max(len(p) for p in PROMPTS)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    cache, cache_position, got = hb.DynamicCache(), torch.arange(L), [[] for _ in PROMPTS]
    with torch.inference_mode():
        for _ in range(STEPS):
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -ids.shape[1]:]
            nxt = m.forward(ids, pos, mask, cache, cache_position)[:, -1].argmax(-1)
            for b in range(B):
                got[b].append(int(nxt[b]))
            ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=-1)
            cache_position = cache_position[-1:] + 1
    for b, p in enumerate(PROMPTS):
        want, _ = ref.greedy(cfg, tensors, p, STEPS)
        if got[b] != want:
            fail(f"{name} prompt {b}: eager baseline {got[b]}, reference {want}")
    print(f"{name}: batched eager greedy tokens equal the reference's")

r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "hf_eager_bench.py"),
                    os.path.join(models, "qwen3-untied-f32"), "--dtype", "float32", "--batch-sizes", "1,2",
                    "--prompt-len", "4", "--new-tokens", "3", "--threads", "1"], capture_output=True, text=True)
if r.returncode != 0:
    fail(f"hf_eager_bench.py exited {r.returncode}: {r.stderr}")
lines = [json.loads(x) for x in r.stdout.splitlines()]
if [x["batch"] for x in lines] != [1, 2] or not all(x["decode_tps"] > 0 and x["prefill_tps"] > 0 for x in lines):
    fail(f"unexpected output: {r.stdout}")
print("ok")
