"""Checkpoint manifests, byte for byte as the C++ trainer writes and checks
them (common/checkpoint_manifest.{h,cc}).

A checkpoint is one directory per step, <dir>/step-00000040, whose file
MANIFEST (written last) names every other file with its size and CRC-32C:

    aidn-checkpoint 1
    step 40
    file model.safetensors 1086784 3f1a09c2
    file state.txt 215 0c44e2a1

A directory whose manifest is missing, unreadable or disagrees with any file
is not a checkpoint. The coordinator's registry holds the SHA-256 of the
manifest's text with each commit.
"""

import dataclasses
import errno
import hashlib
import os
import re
from typing import List

MANIFEST_NAME = "MANIFEST"
_HEADER = "aidn-checkpoint 1"
_MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 1 << 20

try:  # Debian's python3-crc32c: SSE4.2, about 1 GB/s
    from crc32c import crc32c as _crc32c_fast
except ImportError:  # pragma: no cover - depends on the machine
    _crc32c_fast = None


def _make_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # reflected Castagnoli
        table.append(c)
    return table


_TABLE = _make_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data`, extending `crc` (0 to start): the iSCSI / ext4
    checksum, crc32c(b"123456789") == 0xE3069283."""
    if _crc32c_fast is not None:
        return _crc32c_fast(data, crc)
    table = _TABLE
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


class CheckpointInvalid(ValueError):
    """A checkpoint directory fails verification; the message names the file
    and what is wrong ("model.pt: 1024 bytes, the manifest says 1086784")."""


@dataclasses.dataclass
class ManifestEntry:
    name: str
    bytes: int
    crc32c: int


@dataclasses.dataclass
class Manifest:
    step: int
    files: List[ManifestEntry]


def checkpoint_dir_name(step: int) -> str:
    """"step-00000040"."""
    return "step-%08d" % step


def format_manifest(manifest: Manifest) -> str:
    lines = [_HEADER, f"step {manifest.step}"]
    lines += [f"file {f.name} {f.bytes} {f.crc32c:08x}" for f in manifest.files]
    return "\n".join(lines) + "\n"


def plain_name(name: str) -> bool:
    """A name a manifest may hold: no '/', no leading '.', no spaces or
    control characters, at most 255 bytes."""
    if not name or len(name.encode()) > 255 or name[0] == ".":
        return False
    return all(c != "/" and ord(c) > 0x20 and ord(c) != 0x7F for c in name)


_INTEGER = re.compile(r"[+-]?[0-9]+")
_HEX8 = re.compile(r"[0-9a-fA-F]{8}")


def _bad(line: int, what: str) -> CheckpointInvalid:
    return CheckpointInvalid(f"{MANIFEST_NAME} line {line}: {what}")


def parse_manifest(text: str) -> Manifest:
    """Strict: the header line, one step line, at least one file line, plain
    file names, no duplicates. CheckpointInvalid otherwise."""
    if not text or not text.endswith("\n"):
        raise CheckpointInvalid(f"{MANIFEST_NAME}: truncated (no final newline)")
    lines = text[:-1].split("\n")
    if lines[0] != _HEADER:
        raise _bad(1, f'expected "{_HEADER}"')
    step = None
    files = []
    names = set()
    for i, line in enumerate(lines[1:], start=2):
        f = line.split(" ")
        if f[0] == "step" and len(f) == 2 and step is None:
            if not _INTEGER.fullmatch(f[1]) or int(f[1]) < 0:
                raise _bad(i, "bad step")
            step = int(f[1])
        elif f[0] == "file" and len(f) == 4 and step is not None:
            name = f[1]
            if not plain_name(name):
                raise _bad(i, "bad file name")
            if name in names:
                raise _bad(i, "file named twice")
            names.add(name)
            if not _INTEGER.fullmatch(f[2]) or int(f[2]) < 0:
                raise _bad(i, "bad size")
            if not _HEX8.fullmatch(f[3]):
                raise _bad(i, "bad checksum")
            files.append(ManifestEntry(name, int(f[2]), int(f[3], 16)))
        else:
            raise _bad(i, "unexpected line")
    if step is None:
        raise CheckpointInvalid(f"{MANIFEST_NAME}: no step line")
    if not files:
        raise CheckpointInvalid(f"{MANIFEST_NAME}: names no files")
    return Manifest(step, files)


def checksum_file(path: str):
    """(bytes, CRC-32C) of the whole file."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return size, crc
            crc = crc32c(chunk, crc)
            size += len(chunk)


def verify_checkpoint_dir(path: str) -> Manifest:
    """Reads path/MANIFEST and checks every file it names: present, of the
    size and CRC-32C recorded. CheckpointInvalid naming the file and what is
    wrong, or FileNotFoundError when the directory or its manifest is
    missing."""
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    if not os.path.isdir(path):
        raise CheckpointInvalid(f"{path}: not a directory")
    manifest_path = os.path.join(path, MANIFEST_NAME)
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{MANIFEST_NAME} in {path}: "
                                f"{os.strerror(errno.ENOENT)}") from None
    except OSError as e:
        raise CheckpointInvalid(f"{MANIFEST_NAME} in {path}: {e.strerror}") from None
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise CheckpointInvalid(f"{MANIFEST_NAME}: over 1 MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointInvalid(f"{MANIFEST_NAME}: not UTF-8 text") from None
    manifest = parse_manifest(text)
    for entry in manifest.files:
        try:
            size, crc = checksum_file(os.path.join(path, entry.name))
        except FileNotFoundError:
            raise CheckpointInvalid(f"{entry.name}: missing") from None
        except OSError as e:
            raise CheckpointInvalid(f"{entry.name}: {e.strerror}") from None
        if size != entry.bytes:
            raise CheckpointInvalid(
                f"{entry.name}: {size} bytes, the manifest says {entry.bytes}")
        if crc != entry.crc32c:
            raise CheckpointInvalid(
                f"{entry.name}: CRC-32C {crc:08x}, the manifest says {entry.crc32c:08x}")
    return manifest


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
