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
