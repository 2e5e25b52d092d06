"""An independent GGUF v3 writer for llama.cpp control vectors, from the GGUF
specification (header, key/value metadata, tensor infos, aligned F32 data),
not from dmi's code: the tests' reference for dmi's GGUF reader and writer,
and the fuzz seeds' source."""
import struct

import numpy as np


def gguf_control_vector(vectors, alignment=32, model_hint="test"):
    """{layer: 1-D float array} -> the bytes of a GGUF control vector."""
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    kv = [("general.architecture", 8, s("controlvector")), ("controlvector.model_hint", 8, s(model_hint)),
          ("controlvector.layer_count", 5, struct.pack("<i", len(vectors))),
          ("general.alignment", 4, struct.pack("<I", alignment))]
    out = b"GGUF" + struct.pack("<IQQ", 3, len(vectors), len(kv))
    for k, t, v in kv:
        out += s(k) + struct.pack("<I", t) + v
    blobs, off = [], 0
    for layer, v in sorted(vectors.items()):
        v = np.asarray(v, np.float32)
        out += s(f"direction.{layer}") + struct.pack("<I", 1) + struct.pack("<Q", v.size) + struct.pack("<IQ", 0, off)
        blob = v.tobytes()
        blob += b"\0" * ((alignment - len(blob) % alignment) % alignment)
        blobs.append(blob)
        off += len(blob)
    out += b"\0" * ((alignment - len(out) % alignment) % alignment)
    return out + b"".join(blobs)
