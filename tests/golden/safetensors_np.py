"""A minimal safetensors reader and writer in numpy (no moekit): the golden generators of this folder
write their files with it, and read nothing else. BF16 / F8 tensors are uint16 / uint8 bit arrays
with their safetensors dtype given explicitly."""

import json
import struct

import numpy as np

NP_DTYPES = {"F64": np.float64, "F32": np.float32, "I64": np.int64, "I32": np.int32, "I8": np.int8,
             "U8": np.uint8, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}


def write(path, tensors, metadata=None):
    """tensors: {name: (dtype, array)} in the order given."""
    header, blobs, off = {}, [], 0
    for name, (dtype, a) in tensors.items():
        a = np.ascontiguousarray(a, dtype=NP_DTYPES[dtype])
        b = a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read(path):
    """{name: (dtype, array)} and the metadata."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n:]
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = (t["dtype"], np.frombuffer(body[a:b], dtype=NP_DTYPES[t["dtype"]]).reshape(t["shape"]).copy())
    return out, meta
