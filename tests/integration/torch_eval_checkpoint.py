#!/usr/bin/python3
"""Loads an aidn checkpoint's model.safetensors into PyTorch and evaluates it.

Usage:
  torch_eval_checkpoint.py MODEL_SAFETENSORS MODEL [HIDDEN ...] DATASET_DIR
      [--mean M] [--std S]

MODEL is "mlp" (HIDDEN: its hidden widths, e.g. 128 64) or "cnn" (no HIDDEN).
The file is parsed by the published safetensors layout, without the
safetensors package (python3-safetensors is not packaged in Debian): an 8-byte
little-endian header length N, N bytes of a JSON header naming each tensor's
dtype, shape and byte range (relative to the end of the header), then the raw
little-endian data. The tensors are loaded with load_state_dict(strict=True)
into the torch.nn.Sequential aidn's model mirrors, which is evaluated on the
Fashion-MNIST test split (t10k-*.gz in DATASET_DIR, gzip'd IDX), normalised as
aidn's data loader does.

Prints, for the caller to check:
  tensor NAME DTYPE [D0, D1, ...]      one line per tensor, in file order
  tensors COUNT
  correct C / TOTAL
  accuracy C/TOTAL as a decimal
Exits non-zero, saying why, if the file or the dataset is malformed.
"""

import argparse
import gzip
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn

# aidn's kFashionMnistMean / kFashionMnistStd (worker/engine/data.h); the test
# passes them explicitly so the two cannot drift apart.
DEFAULT_MEAN = 0.2860
DEFAULT_STD = 0.3530
# The reference implementation refuses headers larger than this.
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPES = {"F32": np.dtype("<f4")}


def fail(message):
    sys.exit(f"torch_eval_checkpoint: {message}")


def read_safetensors(path):
    """Name -> float32 torch tensor, in file order, and the metadata dict."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail(f"{path}: {len(blob)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        fail(f"{path}: header length {n} does not fit a {len(blob)}-byte file")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{path}: the header is not UTF-8 JSON: {e}")
    if not isinstance(header, dict):
        fail(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    data = memoryview(blob)[8 + n:]
    tensors, ranges = {}, []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            fail(f"{path}: tensor {name!r}: want exactly dtype, shape, data_offsets; got {info}")
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            fail(f"{path}: tensor {name!r}: dtype {info['dtype']} (aidn writes only F32)")
        shape = info["shape"]
        begin, end = info["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(data) or end - begin != count * dtype.itemsize:
            fail(f"{path}: tensor {name!r}: bytes [{begin}, {end}) do not hold shape {shape} "
                 f"within {len(data)} bytes of data")
        ranges.append((begin, end))
        array = np.frombuffer(data[begin:end], dtype=dtype).astype(np.float32).reshape(shape)
        tensors[name] = (info["dtype"], shape, torch.from_numpy(array.copy()))
    # As the reference implementation: the ranges tile the data exactly.
    position = 0
    for begin, end in sorted(ranges):
        if begin != position:
            fail(f"{path}: the tensor data has a gap or an overlap at byte {position}")
        position = end
    if position != len(data):
        fail(f"{path}: {len(data) - position} bytes after the last tensor")
    return tensors, metadata


def build(model, hidden):
    """The torch.nn.Sequential whose parameter names aidn's model uses."""
    if model == "mlp":
        layers, width = [nn.Flatten()], 28 * 28
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, 10))
    if hidden:
        fail("the cnn takes no hidden sizes")
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def read_idx(path, magic):
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e}")
    dims = magic & 0xFF
    if len(raw) < 4 + 4 * dims or struct.unpack(">I", raw[:4])[0] != magic:
        fail(f"{path}: not an IDX file with magic {magic:#010x}")
    shape = struct.unpack(">%dI" % dims, raw[4:4 + 4 * dims])
    items = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if items.size != int(np.prod(shape)):
        fail(f"{path}: {items.size} bytes of data for shape {shape}")
    return items.reshape(shape)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("safetensors")
    p.add_argument("model", choices=["mlp", "cnn"])
    p.add_argument("rest", nargs="+", metavar="[HIDDEN ...] DATASET_DIR")
    p.add_argument("--mean", type=float, default=DEFAULT_MEAN)
    p.add_argument("--std", type=float, default=DEFAULT_STD)
    args = p.parse_args()
    try:
        hidden = [int(h) for h in args.rest[:-1]]
    except ValueError:
        fail(f"hidden sizes must be integers, got {args.rest[:-1]}")
    data_dir = args.rest[-1]

    tensors, _ = read_safetensors(args.safetensors)
    for name, (dtype, shape, _) in tensors.items():
        print(f"tensor {name} {dtype} {list(shape)}")
    print(f"tensors {len(tensors)}")

    model = build(args.model, hidden)
    # strict: every parameter of the torch model is in the file with its
    # shape, and the file holds nothing else.
    model.load_state_dict({name: t for name, (_, _, t) in tensors.items()}, strict=True)
    model.eval()

    images = read_idx(os.path.join(data_dir, "t10k-images-idx3-ubyte.gz"), 0x803)
    labels = torch.from_numpy(read_idx(os.path.join(data_dir, "t10k-labels-idx1-ubyte.gz"),
                                       0x801).astype(np.int64))
    if images.shape[0] != labels.shape[0]:
        fail(f"{images.shape[0]} test images but {labels.shape[0]} labels")
    # torchvision's ToTensor + Normalize, in float32 as aidn computes it: a
    # table of (b / 255 - mean) / std for each byte value b.
    table = ((np.arange(256, dtype=np.float32) / np.float32(255) - np.float32(args.mean)) /
             np.float32(args.std)).astype(np.float32)
    x = torch.from_numpy(table[images]).reshape(-1, 1, images.shape[1], images.shape[2])

    correct = 0
    with torch.no_grad():
        for begin in range(0, x.shape[0], 1000):
            logits = model(x[begin:begin + 1000])
            correct += int((logits.argmax(dim=1) == labels[begin:begin + 1000]).sum())
    total = x.shape[0]
    print(f"correct {correct} / {total}")
    print(f"accuracy {correct / total:.6f}")


if __name__ == "__main__":
    main()
