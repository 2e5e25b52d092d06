"""Helpers shared by the end-to-end tests that read capture files."""
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
