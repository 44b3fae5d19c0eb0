"""Checkpoint manifests: the Python client's against the trainer's own C++
code (checkpoint_manifest_tool): the same text for the same files, each
side accepts what the other wrote, and both find the same faults."""

import hashlib
import os
import shutil
import subprocess
import tempfile
import unittest

from aidn import _manifest
from aidn._manifest import CheckpointInvalid, crc32c, parse_manifest, verify_checkpoint_dir

from aidn_testing import binary


def tool(*args):
    result = subprocess.run([binary("AIDN_MANIFEST_TOOL"), *args], capture_output=True,
                            text=True, timeout=30)
    return result.returncode, result.stdout.strip()


def python_verdict(path):
    try:
        return 0, f"ok step {verify_checkpoint_dir(path).step}"
    except CheckpointInvalid as e:
        return 1, str(e)


class ManifestTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="aidn-manifest-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.files = {"model.pt": os.urandom(300_001), "optimizer.pt": os.urandom(77),
                      "state.txt": b"step 40\n", "empty.bin": b""}
        for name, data in self.files.items():
            with open(os.path.join(self.dir, name), "wb") as f:
                f.write(data)

    def python_manifest(self, step):
        entries = []
        for name in sorted(self.files):
            size, crc = _manifest.checksum_file(os.path.join(self.dir, name))
            entries.append(_manifest.ManifestEntry(name, size, crc))
        return _manifest.format_manifest(_manifest.Manifest(step, entries))

    def test_crc32c_check_values(self):
        self.assertEqual(crc32c(b"123456789"), 0xE3069283)
        self.assertEqual(crc32c(b""), 0)
        self.assertEqual(crc32c(bytes(32)), 0x8A9136AA)
        self.assertEqual(crc32c(b"\xff" * 32), 0x62A8AB43)
        self.assertEqual(crc32c(b"6789", crc32c(b"12345")), 0xE3069283)

    def test_the_same_text_as_the_trainer_writes(self):
        self.assertEqual(tool("write", self.dir, "40"), (0, ""))
        with open(os.path.join(self.dir, "MANIFEST")) as f:
            cpp = f.read()
        self.assertEqual(self.python_manifest(40), cpp)
        self.assertEqual(python_verdict(self.dir), (0, "ok step 40"))

    def test_the_trainer_accepts_what_python_writes(self):
        text = self.python_manifest(7)
        with open(os.path.join(self.dir, "MANIFEST"), "w") as f:
            f.write(text)
        self.assertEqual(tool("verify", self.dir), (0, "ok step 7"))
        self.assertEqual(tool("sha256", os.path.join(self.dir, "MANIFEST"))[1],
                         _manifest.sha256_hex(text))
        self.assertEqual(_manifest.sha256_hex(text), hashlib.sha256(text.encode()).hexdigest())

    def test_both_name_the_same_fault(self):
        def damage(change):
            tool("write", self.dir, "40")
            change()
            cpp, py = tool("verify", self.dir), python_verdict(self.dir)
            self.assertEqual(cpp[0], 1)
            self.assertEqual(py, cpp)
            return py[1]

        model = os.path.join(self.dir, "model.pt")

        def truncate():
            with open(model, "r+b") as f:
                f.truncate(1024)

        def flip():
            with open(model, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 1]))

        self.assertEqual(damage(truncate), "model.pt: 1024 bytes, the manifest says 300001")
        with open(model, "wb") as f:
            f.write(self.files["model.pt"])
        self.assertRegex(damage(flip), r"^model\.pt: CRC-32C [0-9a-f]{8}, the manifest says "
                                       r"[0-9a-f]{8}$")
        self.assertEqual(damage(lambda: os.remove(os.path.join(self.dir, "state.txt"))),
                         "state.txt: missing")

    def test_malformed_manifests_are_refused(self):
        good = "aidn-checkpoint 1\nstep 3\nfile a 1 0000000f\n"
        self.assertEqual(parse_manifest(good).step, 3)
        cases = {
            good[:-1]: "MANIFEST: truncated (no final newline)",
            "aidn-checkpoint 2\nstep 3\nfile a 1 0000000f\n": 'MANIFEST line 1: expected "aidn-checkpoint 1"',
            "aidn-checkpoint 1\nstep -3\nfile a 1 0000000f\n": "MANIFEST line 2: bad step",
            "aidn-checkpoint 1\nfile a 1 0000000f\n": "MANIFEST line 2: unexpected line",
            "aidn-checkpoint 1\nstep 3\nfile .a 1 0000000f\n": "MANIFEST line 3: bad file name",
            "aidn-checkpoint 1\nstep 3\nfile a 1 0000000f\nfile a 1 0000000f\n": "MANIFEST line 4: file named twice",
            "aidn-checkpoint 1\nstep 3\nfile a x 0000000f\n": "MANIFEST line 3: bad size",
            "aidn-checkpoint 1\nstep 3\nfile a 1 f\n": "MANIFEST line 3: bad checksum",
            "aidn-checkpoint 1\nstep 3\n": "MANIFEST: names no files",
        }
        for text, message in cases.items():
            with self.subTest(text=text):
                with self.assertRaises(CheckpointInvalid) as caught:
                    parse_manifest(text)
                self.assertEqual(str(caught.exception), message)
                # The trainer refuses the same text with the same words.
                with open(os.path.join(self.dir, "MANIFEST"), "w") as f:
                    f.write(text)
                self.assertEqual(tool("verify", self.dir), (1, message))

    def test_a_missing_directory_or_manifest_is_not_found(self):
        with self.assertRaises(FileNotFoundError):
            verify_checkpoint_dir(os.path.join(self.dir, "nothing"))
        with self.assertRaises(FileNotFoundError):
            verify_checkpoint_dir(self.dir)


if __name__ == "__main__":
    unittest.main()
