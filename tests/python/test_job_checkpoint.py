"""aidn.checkpoint and aidn.resume in rank processes of a job on a real
aidn-coordinator (the worker played by the test): commits the registry
takes, manifests the trainer's own code verifies, retention, resume points
verified, and a corrupted one reported invalid."""

import hashlib
import os
import subprocess
import unittest

from aidn_testing import ClusterTestCase, binary, join_generation, mlp_spec, run_rank, wait_for

WRITING = r'''
import os, aidn
for step in range(1, 21):
    aidn.report(step, loss=0.5, samples=8)
    if step %% 5 == 0:
        with aidn.checkpoint(step) as path:
            with open(os.path.join(path, "model.pt"), "wb") as f:
                f.write(os.urandom(%(size)d))
            with open(os.path.join(path, "state.txt"), "w") as f:
                f.write("step %%d\n" %% step)
try:
    with aidn.checkpoint(21) as path:
        open(os.path.join(path, "model.pt"), "wb").write(b"half")
        raise RuntimeError("out of disk")
except RuntimeError:
    pass
print("flushed", aidn.flush(30), flush=True)
''' % {"size": 200_000}

RESUMING = r'''
import aidn
r = aidn.resume()
print(r.step if r else None, r.path if r else None, flush=True)
'''


def manifest_tool(*args):
    result = subprocess.run([binary("AIDN_MANIFEST_TOOL"), *args], capture_output=True,
                            text=True, timeout=30)
    return result.stdout.strip()


class JobCheckpointTest(ClusterTestCase):
    def committed(self, job_id):
        return [c.step for c in self.client.checkpoints(job_id) if c.committed]

    def test_checkpoints_commit_verify_and_retire(self):
        directory = os.path.join(self.dir, "checkpoints")
        gen = self.start_job(mlp_spec(checkpoint_dir=directory, keep_last=2),
                             checkpoint_dir=directory)
        result = run_rank(WRITING, gen.env(0))
        self.assertRankOk(result)
        self.assertEqual(result.stdout.strip(), "flushed True", result.stderr)

        # keep_last 2: the registry ends with the newest two.
        wait_for(lambda: self.committed(gen.job_id) == [15, 20], 20,
                 "checkpoints 15 and 20 committed, the older retired")
        names = sorted(os.listdir(directory))
        self.assertIn("step-00000015", names)
        self.assertIn("step-00000020", names)
        self.assertNotIn("step-00000005", names)  # retired, and its directory gone
        self.assertNotIn("step-00000021", names)  # the block raised
        self.assertEqual([n for n in names if n.startswith(".")], [])

        for checkpoint in self.client.checkpoints(gen.job_id):
            path = os.path.join(directory, "step-%08d" % checkpoint.step)
            self.assertEqual(checkpoint.path, path)
            self.assertEqual(list(checkpoint.ranks_expected), [0])
            self.assertEqual(manifest_tool("verify", path), f"ok step {checkpoint.step}")
            with open(os.path.join(path, "MANIFEST"), "rb") as f:
                manifest = f.read()
            self.assertEqual(checkpoint.manifest_sha256, hashlib.sha256(manifest).hexdigest())
            files = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
            self.assertEqual(checkpoint.bytes, files)

    def test_resume_verifies_and_reports_a_bad_checkpoint(self):
        directory = os.path.join(self.dir, "checkpoints")
        gen = self.start_job(mlp_spec(checkpoint_dir=directory, max_restarts=3),
                             checkpoint_dir=directory)
        result = run_rank(RESUMING, gen.env(0))
        self.assertEqual(result.stdout.strip(), "None None", result.stderr)
        write = ("import os, aidn\n"
                 "for step in range(1, 11):\n"
                 "    aidn.report(step, loss=1.0)\n"
                 "with aidn.checkpoint(10) as path:\n"
                 "    open(os.path.join(path, 'model.pt'), 'wb').write(os.urandom(5000))\n"
                 "print(aidn.flush(30))\n")
        self.assertRankOk(run_rank(write, gen.env(0)))
        wait_for(lambda: self.committed(gen.job_id) == [10], 20, "checkpoint 10 committed")

        # The generation fails; the next one resumes from step 10.
        gen.exit_all(exit_code=1)
        gen2 = join_generation(self.worker, self.coordinator, gen.job_id,
                               generation_after=gen.generation, checkpoint_dir=directory)
        self.assertEqual(gen2.env(0)["AIDN_RESUME_STEP"], "10")
        path = os.path.join(directory, "step-00000010")
        result = run_rank(RESUMING, gen2.env(0))
        self.assertRankOk(result)
        self.assertEqual(result.stdout.strip(), f"10 {path}")

        # A flipped byte: the next generation's rank finds it and says so.
        with open(os.path.join(path, "model.pt"), "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
        gen2.exit_all(exit_code=1)
        gen3 = join_generation(self.worker, self.coordinator, gen.job_id,
                               generation_after=gen2.generation, checkpoint_dir=directory)
        result = run_rank(RESUMING, gen3.env(0))
        self.assertRankOk(result)
        self.assertEqual(result.stdout.strip(), "None None")
        self.assertIn("model.pt: CRC-32C", result.stderr)

        def reported():
            checkpoints = self.client.checkpoints(gen.job_id)
            return checkpoints and checkpoints[0].invalid_reason

        reason = wait_for(reported, 20, "the checkpoint marked invalid")
        self.assertIn(f"{path}: model.pt: CRC-32C", reason)


if __name__ == "__main__":
    unittest.main()
