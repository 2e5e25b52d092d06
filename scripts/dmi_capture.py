"""Read dmi capture files (docs/capture-format.md) from Python: h5py and numpy, no torch needed.

    import dmi_capture
    c = dmi_capture.open("run.h5")
    c.sites()                        # ['blocks.0.hook_resid_post', ...] in forward order
    c["resid_post", 3]               # every row of blocks.3.hook_resid_post: [rows, d_model]
    c.rows("resid_post", 3, seq=0)   # one sequence's rows in position order: [positions, d_model]
    c.rows("pattern", 1, seq=0)      # [queries, heads, attention_width]
    c.tokens(0), c.text(0)           # token ids and text of sequence 0
    c.attrs["status"]                # root attributes (strings, ints)
    c.to_torch()                     # {site: torch.Tensor}, when torch is installed

Site keys follow TransformerLens' ActivationCache: a full name
("blocks.3.hook_resid_post"), or a short name with a layer ("resid_post", 3),
("q", 0), ("normalized", 2, "ln1"); without a layer "embed", "normalized"
(ln_final) and "logits" (unembed.hook_out). bfloat16 and float16 captures
read as float32 values (exact: every 16-bit value is a float32). A capture
that is still being written (status "running") or whose writer was killed is
opened as an HDF5 SWMR reader; its tokens come from /token_log.
"""
import fnmatch
import json

import h5py
import numpy as np

__all__ = ["open", "Capture", "act_name"]

_ATTN = {"k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores"}
_MLP = {"pre", "post", "mid", "pre_linear"}
_BLOCK = {"attn_out", "mlp_out", "resid_pre", "resid_mid", "resid_post"}
_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
            "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}


def act_name(name, layer=None, layer_type=None):
    """The site name of a TransformerLens short name, as transformer_lens.utils.get_act_name
    builds it: act_name("resid_post", 3) == "blocks.3.hook_resid_post"."""
    if "." in name or name.startswith("hook_"):
        if layer is not None or layer_type is not None:
            raise KeyError(f"'{name}' is a full site name: give it alone, without a layer")
        return name
    name = _ALIASES.get(name, name)
    if layer is None:
        if name in ("embed", "pos_embed"):
            return "hook_" + name
        if name in ("normalized", "scale"):
            return "ln_final.hook_" + name
        if name in ("logits", "out", "unembed"):
            return "unembed.hook_out"
        raise KeyError(f"site '{name}' needs a layer, e.g. ('{name}', 0)")
    layer = int(layer)
    if name in _ATTN:
        return f"blocks.{layer}.attn.hook_{name}"
    if name in _MLP:
        return f"blocks.{layer}.mlp.hook_{name}"
    if name in _BLOCK:
        return f"blocks.{layer}.hook_{name}"
    if name in ("normalized", "scale"):
        if layer_type not in ("ln1", "ln2"):
            raise KeyError(f"site '{name}' with a layer needs 'ln1' or 'ln2', e.g. ('{name}', {layer}, 'ln1')")
        return f"blocks.{layer}.{layer_type}.hook_{name}"
    raise KeyError(f"unknown site name '{name}'")


def _key(args):
    """A site key given as separate arguments ("resid_post", 3) or as one (a name or a tuple)."""
    return args[0] if len(args) == 1 else tuple(args)


def _plain(v):
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()] if v.dtype.kind in "OSU" else v
    return v


def open(path):  # noqa: A001 (the module's entry point reads as dmi_capture.open)
    """Opens a capture file; raises ValueError if it is not a dmi capture."""
    return Capture(path)


class Capture:
    def __init__(self, path):
        self.path = str(path)
        try:
            self._f = h5py.File(self.path, "r")
        except OSError:
            # A file still open for writing (live run, or a killed writer) reads as an SWMR reader.
            self._f = h5py.File(self.path, "r", swmr=True)
        self.attrs = {k: _plain(v) for k, v in self._f.attrs.items()}
        if self.attrs.get("format") != "dmi-capture":
            self._f.close()
            raise ValueError(f"{self.path}: not a dmi capture (root attribute 'format' is "
                             f"{self.attrs.get('format')!r}, expected 'dmi-capture')")
        if self.attrs.get("format_version") not in (1, 2):
            self._f.close()
            raise ValueError(f"{self.path}: capture format version {self.attrs.get('format_version')} "
                             "is not one this reader knows (1, 2)")
        self._sites = sorted(self._f["sites"].keys(), key=lambda s: int(self._f["sites"][s].attrs["index"]))
        self._index = {}
        self._sequences = None

    # -- files -------------------------------------------------------------
    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        n, k = self.n_sequences, len(self._sites)
        return (f"<dmi capture {self.path}: {k} site{'' if k == 1 else 's'}, {n} sequence{'' if n == 1 else 's'}, "
                f"status {self.attrs.get('status')}>")

    # -- sites -------------------------------------------------------------
    def sites(self, pattern=None):
        """Site names in forward order; pattern is a shell glob ('blocks.*.hook_resid_post')."""
        return [s for s in self._sites if pattern is None or fnmatch.fnmatchcase(s, pattern)]

    def site(self, key):
        """The full site name a key names (see the module's docstring); KeyError if not captured."""
        if isinstance(key, tuple):
            name = act_name(*key)
        else:
            name = act_name(key)
        if name not in self._f["sites"]:
            raise KeyError(f"{self.path}: site '{name}' is not in this capture (it has: "
                           f"{', '.join(self._sites) if self._sites else 'no sites'})")
        return name

    def __contains__(self, key):
        try:
            self.site(key)
            return True
        except KeyError:
            return False

    def _group(self, key):
        return self._f["sites"][self.site(key)]

    def _read(self, dset, sel=slice(None)):
        if dset.dtype.kind == "f" and dset.dtype.itemsize < 4:
            return dset.astype(np.float32)[sel]
        out = dset[sel]
        if dset.dtype.kind == "f" and out.dtype != np.float32 and out.dtype != np.float64:
            out = out.astype(np.float32)
        return out

    def _take(self, dset, idx):
        """dset[idx] for row indices in any order (h5py reads increasing indices only)."""
        if idx.size == 0:
            return np.zeros((0,) + tuple(dset.shape[1:]), dtype=self._read(dset, slice(0, 0)).dtype)
        inc = np.sort(idx)
        lo, hi = int(inc[0]), int(inc[-1]) + 1
        # One hyperslab when the rows are dense enough, else a point selection.
        block = self._read(dset, slice(lo, hi))[inc - lo] if hi - lo <= 4 * idx.size else self._read(dset, inc)
        return block[np.searchsorted(inc, idx)]

    def _live(self, g, names=("data", "seq", "pos")):
        """The datasets of a group and the rows all of them hold (a live file extends them one after
        another). Each is refreshed and then read through the same object: in SWMR mode a dataset
        object opened before another one's refresh() has a stale chunk index."""
        ds = [g[n] for n in names]
        if self._f.swmr_mode:
            for d in ds:
                d.refresh()
        return ds, min(d.shape[0] for d in ds)

    def __getitem__(self, key):
        """Every row of a site, in file order: [rows, ...per-token shape]. seq_pos(key) says whose."""
        (data, _, _), n = self._live(self._group(key))
        return self._read(data, slice(0, n))

    def seq_pos(self, *key):
        """(seq, pos) int32 arrays: the sequence and position of each row of a site."""
        (_, seq, pos), n = self._live(self._group(_key(key)))
        return seq[:n], pos[:n]

    def _rows_of(self, key, seq):
        name = self.site(key)
        if name not in self._index:
            s, p = self.seq_pos(name)
            self._index[name] = (s, p)
        s, p = self._index[name]
        idx = np.nonzero(s == seq)[0]
        return name, idx[np.argsort(p[idx], kind="stable")], p

    def rows(self, *key, seq=0):
        """One sequence's rows of a site in position order: [positions, ...per-token shape].
        rows("blocks.3.hook_resid_post", seq=0) == rows("resid_post", 3, seq=0)."""
        name, idx, _ = self._rows_of(_key(key), seq)
        (data, _, _), _ = self._live(self._f["sites"][name])
        return self._take(data, idx)

    def positions(self, *key, seq=0):
        """The positions of rows(*key, seq=seq), ascending."""
        _, idx, p = self._rows_of(_key(key), seq)
        return p[idx]

    def topk_ids(self, seq=0):
        """Token ids of a --logits topk:K capture's rows for one sequence: [positions, K]."""
        name, idx, _ = self._rows_of("logits", seq)
        g = self._f["sites"][name]
        if "ids" not in g:
            raise KeyError(f"{self.path}: {name} holds full logits (no 'ids'); this is for --logits topk:K")
        (ids,), _ = self._live(g, ("ids",))
        return self._take(ids, idx)

    # -- sequences ---------------------------------------------------------
    def _load_sequences(self):
        if self._sequences is not None:
            return self._sequences
        sq = self._f["sequences"] if "sequences" in self._f else None
        prompts = [_plain(x) for x in sq["prompt_text"][:]] if sq is not None and "prompt_text" in sq else []
        if sq is not None and "tokens" in sq and "offsets" in sq:
            tokens, offsets = sq["tokens"][:], sq["offsets"][:]
            toks = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
            gen = [_plain(x) for x in sq["generated_text"][:]] if "generated_text" in sq else [""] * len(toks)
            reasons = [_plain(x) for x in sq["finish_reason"][:]] if "finish_reason" in sq else [""] * len(toks)
            plen = sq["prompt_lengths"][:] if "prompt_lengths" in sq else np.zeros(len(toks), np.int32)
        else:
            # A running or killed run: every token by position up to the first one missing.
            (s, p, t), n = self._live(self._f["token_log"], ("seq", "pos", "token"))
            s, p, t = s[:n], p[:n], t[:n]
            count = len(prompts) if prompts else (int(s.max()) + 1 if n else 0)
            toks = []
            for i in range(count):
                m = s == i
                by_pos = dict(zip(p[m].tolist(), t[m].tolist()))
                ids = []
                while len(ids) in by_pos:
                    ids.append(by_pos[len(ids)])
                toks.append(np.asarray(ids, dtype=np.int32))
            plen = sq["prompt_lengths"][:] if sq is not None and "prompt_lengths" in sq else np.zeros(count, np.int32)
            gen = [None] * count
            reasons = [self.attrs.get("status", "running")] * count
        if not prompts:
            prompts = [None] * len(toks)
        self._sequences = {"tokens": toks, "prompt_text": prompts, "generated_text": gen,
                           "finish_reason": reasons, "prompt_lengths": [int(x) for x in plen]}
        return self._sequences

    @property
    def n_sequences(self):
        return len(self._load_sequences()["tokens"])

    def _check_seq(self, seq):
        n = self.n_sequences
        if not 0 <= seq < n:
            raise IndexError(f"{self.path}: sequence {seq} is out of range (the capture has {n})")

    def tokens(self, seq=0):
        """Token ids of a sequence, prompt then generated: int32 [length]."""
        self._check_seq(seq)
        return self._load_sequences()["tokens"][seq]

    def prompt_length(self, seq=0):
        self._check_seq(seq)
        return self._load_sequences()["prompt_lengths"][seq]

    def text(self, seq=0):
        """A sequence's prompt followed by its generated text (a run that was never closed has no
        generated text yet: the prompt alone)."""
        self._check_seq(seq)
        s = self._load_sequences()
        return (s["prompt_text"][seq] or "") + (s["generated_text"][seq] or "")

    def finish_reason(self, seq=0):
        self._check_seq(seq)
        return self._load_sequences()["finish_reason"][seq]

    def settings(self, name):
        """A root attribute that holds JSON (sampling, timings, environment, ...), parsed."""
        return json.loads(self.attrs[name])

    # -- torch -------------------------------------------------------------
    def to_torch(self, sites=None, seq=None):
        """{site: torch.Tensor} of the given sites (default: all); with seq, that sequence's rows in
        position order, else every row in file order. Needs torch."""
        try:
            import torch
        except ImportError as e:
            raise ImportError("to_torch() needs PyTorch (import torch failed); the rest of dmi_capture "
                              "works without it") from e
        names = self._sites if sites is None else [self.site(s) for s in sites]
        out = {}
        for n in names:
            a = self[n] if seq is None else self.rows(n, seq=seq)
            out[n] = torch.from_numpy(np.ascontiguousarray(a))
        return out
