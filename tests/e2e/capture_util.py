"""Helpers shared by the end-to-end tests that read capture files."""
import h5py
import numpy as np


def rows_by_key(f, site):
    """{(seq, pos): row as float32} of a site in an open h5py capture file."""
    g = f["sites"][site]
    seq, pos = g["seq"][:], g["pos"][:]
    data = g["data"][:].astype(np.float32)
    return {(int(s), int(p)): data[i] for i, (s, p) in enumerate(zip(seq, pos))}


def rel_err(a, b):
    """max |a - b| / max |b| over finite entries; inf patterns must agree."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb]):
        return float("inf")
    if not fa.any():
        return 0.0
    scale = max(np.abs(b[fb]).max(), 1e-30)
    return float(np.abs(a[fa] - b[fb]).max() / scale)


def reference_row(name, ref_rows, pos, width):
    """The reference's row at pos as a capture stores it: attention rows
    (scores, pattern) widened to the file's attention_width, keys past pos
    -inf (scores) or 0 (pattern)."""
    r = ref_rows[pos]
    if name.endswith("hook_attn_scores") or name.endswith("hook_pattern"):
        out = np.full((r.shape[0], width), -np.inf if name.endswith("scores") else 0.0, dtype=np.float32)
        out[:, : pos + 1] = r[:, : pos + 1]
        return out
    return r


def keyed_rows(path):
    """{site: {(seq, pos): (data row, ids row or None)}} read with h5py."""
    out = {}
    with h5py.File(path, "r") as f:
        for site, g in f["sites"].items():
            data, seq, pos = g["data"][:], g["seq"][:], g["pos"][:]
            ids = g["ids"][:] if "ids" in g else None
            out[site] = {(int(s), int(p)): (data[i], None if ids is None else ids[i])
                         for i, (s, p) in enumerate(zip(seq, pos))}
    return out


def sequence_record(path):
    with h5py.File(path, "r") as f:
        g = f["sequences"]
        return {k: g[k][:] for k in ("tokens", "offsets", "prompt_lengths", "prompt_text", "generated_text",
                                     "finish_reason")}


def compare_captures(a_path, b_path, bitwise=True, rtol=1e-5):
    """The same sites, (seq, pos) rows and tokens; values bit-identical or
    within rtol of the largest magnitude. Returns (rows, max relative error)."""
    a, b = keyed_rows(a_path), keyed_rows(b_path)
    if a.keys() != b.keys():
        raise AssertionError(f"{a_path} and {b_path} have different sites: {sorted(a)} vs {sorted(b)}")
    n, worst = 0, 0.0
    for site in a:
        if a[site].keys() != b[site].keys():
            raise AssertionError(f"{site}: rows differ: {sorted(set(a[site]) ^ set(b[site]))[:5]}")
        for key, (x, xi) in a[site].items():
            y, yi = b[site][key]
            if xi is not None and not np.array_equal(xi, yi):
                raise AssertionError(f"{site} {key}: top-k ids differ")
            if bitwise:
                if x.tobytes() != y.tobytes():
                    raise AssertionError(f"{site} {key}: values differ ({a_path} vs {b_path})")
            else:
                fin = np.isfinite(y)
                if not np.array_equal(np.isfinite(x), fin) or not np.array_equal(x[~fin], y[~fin]):
                    raise AssertionError(f"{site} {key}: inf/nan pattern differs")
                scale = max(float(np.abs(y[fin]).max()) if fin.any() else 0.0, 1e-30)
                err = float(np.abs(x[fin] - y[fin]).max() / scale) if fin.any() else 0.0
                worst = max(worst, err)
                if err > rtol:
                    raise AssertionError(f"{site} {key}: relative error {err:.3g} > {rtol}")
            n += 1
    sa, sb = sequence_record(a_path), sequence_record(b_path)
    for k in sa:
        if not np.array_equal(sa[k], sb[k]):
            raise AssertionError(f"/sequences/{k} differs between {a_path} and {b_path}")
    return n, worst


# matplotlib's viridis and coolwarm at 0, 1/4, 1/2, 3/4 and 1, interpolated
# linearly: the colour maps of dmi's heatmaps (lib/analysis/heatmap.cpp).
_ANCHORS = {"sequential": [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)],
            "diverging": [(59, 76, 192), (141, 176, 254), (221, 221, 221), (244, 154, 123), (180, 4, 38)]}


def heatmap_colour(v, cmap):
    if not np.isfinite(v):
        return (0, 0, 0)
    if cmap == "diverging":
        v = (v + 1) / 2
    v = min(1.0, max(0.0, float(v))) * 4
    i = min(3, int(v))
    t = v - i
    a, b = _ANCHORS[cmap][i], _ANCHORS[cmap][i + 1]
    return tuple(int(np.floor(a[c] + t * (b[c] - a[c]) + 0.5)) for c in range(3))


def check_heatmap(path, geo, values, cmap, texts):
    """A labelled heatmap (PNG or SVG) as dmi writes it: its size and grid
    geometry as reported, every cell's colour equal to the colour map of
    `values` (read independently, e.g. with h5py), text in the margins, and
    (SVG) the expected strings among its text elements. Returns an error
    string, or None."""
    rows, cols = values.shape
    x0, y0, cell = geo["grid_x"], geo["grid_y"], geo["cell"]
    if path.endswith(".png"):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        img = np.rint(plt.imread(path)[:, :, :3] * 255).astype(int)
        if img.shape[:2] != (geo["height"], geo["width"]):
            return f"{path}: {img.shape[1]}x{img.shape[0]}, reported {geo['width']}x{geo['height']}"
        for r in range(rows):
            for c in range(cols):
                got = tuple(img[y0 + r * cell + cell // 2, x0 + c * cell + cell // 2])
                want = heatmap_colour(values[r, c], cmap)
                if max(abs(g - w) for g, w in zip(got, want)) > 1:
                    return f"{path}: cell ({r}, {c}) is {got}, want {want} for value {values[r, c]}"
        # Text is dark ink on white: in the title band, left of the grid (row
        # labels) and below it (column labels).
        for name, band in (("title", img[:y0, :]), ("row labels", img[y0:y0 + rows * cell, :x0]),
                           ("column labels", img[y0 + rows * cell + 2:, x0:x0 + cols * cell])):
            if not (band.max(axis=2) < 100).any():
                return f"{path}: no text in the {name}"
        return None
    import xml.etree.ElementTree as ET
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    if (int(root.get("width")), int(root.get("height"))) != (geo["width"], geo["height"]):
        return f"{path}: size {root.get('width')}x{root.get('height')}"
    fills = {(int(e.get("x")), int(e.get("y"))): e.get("fill") for e in root.iter(ns + "rect")
             if int(e.get("width")) == cell and int(e.get("height")) == cell}
    for r in range(rows):
        for c in range(cols):
            want = "#%02x%02x%02x" % heatmap_colour(values[r, c], cmap)
            got = fills.get((x0 + c * cell, y0 + r * cell))
            if got != want:
                return f"{path}: cell ({r}, {c}) fill {got}, want {want}"
    strings = [e.text or "" for e in root.iter(ns + "text")]
    for t in texts:
        if not any(t in s for s in strings):
            return f"{path}: no text containing {t!r} (has {strings[:8]}...)"
    return None
