#!/usr/bin/python3
"""dmi-inspect RUN.h5 report in a real browser (Debian's chromium, headless,
started here): a screenshot that is not blank, the DOM's token count,
attention values and hover details equal to h5py's reading of the file, and
no request leaving the page, checked with a local HTTP server that must see
nothing, even from a report with a planted image and fetch().

  report_test.py BIN_DIR TEST_MODELS
"""
import html.parser
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_util import keyed_rows  # noqa: E402

bin_dir, models = sys.argv[1], sys.argv[2]
MODEL = os.path.join(models, "qwen3-untied-f32")
tmp = tempfile.mkdtemp(prefix="dmi-report-")
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def tool(name, *args, expect_rc=0):
    r = subprocess.run([os.path.join(bin_dir, name), *args], capture_output=True, text=True, timeout=600)
    if r.returncode != expect_rc:
        fail(f"{name} {' '.join(args)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def browser(*args, proxy_port):
    """Headless chromium with every connection sent to our proxy port (a
    request that escaped the page would reach the test's server)."""
    if not BROWSER:
        fail("chromium is not installed (scripts/setup.sh --with-tests installs it)")
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-pings",
           "--disable-domain-reliability", "--disable-client-side-phishing-detection", "--disable-default-apps",
           f"--user-data-dir={os.path.join(tmp, 'profile')}", f"--proxy-server=http://127.0.0.1:{proxy_port}",
           "--proxy-bypass-list=<-loopback>", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        fail(f"chromium {' '.join(args)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return r


class Hits(http.server.BaseHTTPRequestHandler):
    seen = []

    def do_GET(self):  # noqa: N802
        Hits.seen.append(self.path)
        self.send_response(200)
        self.end_headers()

    do_POST = do_CONNECT = do_GET  # noqa: N815

    def log_message(self, *a):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hits)
port = server.server_address[1]
threading.Thread(target=server.serve_forever, daemon=True).start()

cap = os.path.join(tmp, "run.h5")
tool("dmi-run", "-q", "--model", MODEL, "--prompt", "The cat sat on the mat", "--prompt", "Hello there",
     "-n", "6", "--hooks", "pattern,resid_post,logits", "-o", cap)
page = os.path.join(tmp, "run.html")
res = json.loads(tool("dmi-inspect", cap, "report", "-o", page, "--json").stdout)
text = open(page, encoding="utf-8").read()
# Self-contained: the policy first, nothing fetched by address.
head = text[: text.index("</head>")]
if 'http-equiv="Content-Security-Policy" content="default-src \'none\';' not in head or \
        head.index("Content-Security-Policy") > head.index("<title>"):
    fail("no Content-Security-Policy forbidding requests before anything else")
for attr in (" src=", " href=", "@import", "url("):
    if attr in text:
        fail(f"the page refers to something outside itself ({attr!r})")
print(f"ok: report of a small capture: {res['bytes']} bytes, {res['sequences']} sequences, "
      f"{res['attention_maps']} attention maps, CSP in place, no external references")

# A screenshot: the expected size, and not blank.
shot = os.path.join(tmp, "shot.png")
browser("--window-size=1200,900", f"--screenshot={shot}", "file://" + page + "#seq=0&layer=1&head=2",
        proxy_port=port)
import matplotlib  # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
img = np.rint(plt.imread(shot)[:, :, :3] * 255).astype(int)
colours = len({tuple(p) for p in img.reshape(-1, 3)[:: 7]})
if img.shape[:2] != (900, 1200) or colours < 50 or (img.max(axis=2) < 100).sum() < 2000:
    fail(f"screenshot {img.shape[1]}x{img.shape[0]} with {colours} colours: blank or wrong size")
print(f"ok: screenshot 1200x900, {colours} distinct colours")


class Dom(html.parser.HTMLParser):
    """Token spans, heatmap cells and the details box of the rendered page."""

    def __init__(self):
        super().__init__()
        self.tokens, self.cells, self.svg, self.tip, self.in_tip = 0, {}, {}, [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "tok" in (a.get("class") or "").split() and "data-pos" in a:
            self.tokens += 1
        if tag == "rect" and "data-q" in a:
            self.cells[(int(a["data-q"]), int(a["data-k"]))] = float(a["data-v"])
        if tag == "svg" and a.get("id") == "pattern":
            self.svg = a
        if tag == "div" and a.get("id") == "tip":
            self.in_tip = 1
        elif self.in_tip and tag == "div":
            self.in_tip += 1

    def handle_endtag(self, tag):
        if self.in_tip and tag == "div":
            self.in_tip -= 1

    def handle_data(self, data):
        if self.in_tip:
            self.tip.append(data)


SEQ, LAYER, HEAD, POS = 1, 1, 2, 3
dom = browser("--dump-dom", "file://" + page + f"#seq={SEQ}&layer={LAYER}&head={HEAD}&pos={POS}",
              proxy_port=port).stdout
d = Dom()
d.feed(dom)
with h5py.File(cap, "r") as f:
    off = f["sequences/offsets"][:]
    n_tokens = int(off[SEQ + 1] - off[SEQ])
    logits = f["sites/unembed.hook_out"]
    lrow = [i for i, (s, p) in enumerate(zip(logits["seq"][:], logits["pos"][:])) if s == SEQ and p == POS][0]
    top1 = int(np.argmax(logits["data"][lrow]))
rows = keyed_rows(cap)
pattern = rows[f"blocks.{LAYER}.attn.hook_pattern"]
resid = rows["blocks.0.hook_resid_post"]
if d.tokens != n_tokens:
    fail(f"the page shows {d.tokens} tokens of sequence {SEQ}, the file has {n_tokens}")
if d.svg.get("data-layer") != str(LAYER) or d.svg.get("data-head") != str(HEAD) or d.svg.get("data-seq") != str(SEQ):
    fail(f"the heatmap shows {d.svg}, asked for layer {LAYER} head {HEAD} sequence {SEQ}")
want = {(q, k): float(v[0][HEAD, k]) for (s, q), v in pattern.items() if s == SEQ for k in range(n_tokens - 1)}
if set(d.cells) != set(want):
    fail(f"heatmap cells {sorted(d.cells)[:5]}... vs the file's {sorted(want)[:5]}...")
worst = max(abs(d.cells[k] - want[k]) for k in want)
if worst > 6e-5:
    fail(f"attention values in the page differ from h5py's by {worst}")
tip = "".join(d.tip)
norm0 = float(np.linalg.norm(resid[(SEQ, POS)][0].astype(np.float64)))
if f"{norm0:.3f}" not in tip or "next token" not in tip or f"#{top1}" not in tip:
    fail(f"details of token {POS}: {tip!r}; want the residual norm {norm0:.3f} and next token #{top1}")
print(f"ok: DOM: {d.tokens} tokens, {len(d.cells)} attention cells of layer {LAYER} head {HEAD} within {worst:.1e} "
      f"of h5py, token {POS}'s details show its residual norm {norm0:.3f} and top next token id {top1}")

# The policy is what stops requests: a report with a planted image and fetch()
# to our server still sends nothing.
planted = os.path.join(tmp, "planted.html")
evil = (f'<img src="http://127.0.0.1:{port}/img.png"><script>fetch("http://127.0.0.1:{port}/fetch")'
        '.catch(() => {})</script>')
with open(planted, "w", encoding="utf-8") as f:
    f.write(text.replace("<body>", "<body>" + evil, 1))
browser("--dump-dom", "--virtual-time-budget=3000", "file://" + planted, proxy_port=port)
browser("--dump-dom", "--virtual-time-budget=3000", "file://" + page, proxy_port=port)


def from_pages():
    """Requests the proxy saw, less chromium's own (component updates,
    accounts, clock: *.google.com, *.googleapis.com), which no page makes."""
    own = ("google.com", "googleapis.com", "gstatic.com")
    hosts = [(t, t.split("//")[-1].split("/")[0].split(":")[0]) for t in Hits.seen]
    return [t for t, h in hosts if not any(h == d or h.endswith("." + d) for d in own)]


if from_pages():
    fail(f"requests left the page: {from_pages()}")
# Control: without the policy the planted request does reach the server.
control = os.path.join(tmp, "control.html")
with open(control, "w", encoding="utf-8") as f:
    f.write(f'<html><body><img src="http://127.0.0.1:{port}/control.png"></body></html>')
browser("--dump-dom", "--virtual-time-budget=3000", "file://" + control, proxy_port=port)
if not any(t.endswith("/control.png") for t in from_pages()):
    fail(f"the control page's request did not reach the server ({Hits.seen}): the check cannot see requests")
print("ok: no request left the report (planted image and fetch blocked); a page without the policy does send one")

# The size cap: a tiny cap leaves attention out and says so.
small = os.path.join(tmp, "small.html")
r = json.loads(tool("dmi-inspect", cap, "report", "-o", small, "--max-mb", "0.02", "--json").stdout)
if not r["left_out"] or os.path.getsize(small) > 0.02e6 + 40_000:
    fail(f"--max-mb 0.02: {r}, {os.path.getsize(small)} bytes")
if "size cap" not in open(small, encoding="utf-8").read():
    fail("the capped page does not say what it left out")
tool("dmi-inspect", cap, "report", "-o", small, "--layers", "7", expect_rc=2)
print(f"ok: --max-mb 0.02 gives {os.path.getsize(small)} bytes and lists what it left out")
server.shutdown()
shutil.rmtree(tmp, ignore_errors=True)
print("PASS")
