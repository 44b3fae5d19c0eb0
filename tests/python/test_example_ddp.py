"""examples/pytorch-ddp/train_aidn.py as a two-rank job on a real
aidn-coordinator (the test plays the worker: it starts the ranks with the
AIDN_* and torchrun variables): every step of both ranks stored, checkpoints
committed, and the next generation resumes from the newest one."""

import os
import socket
import subprocess
import sys
import unittest

from aidn.v1 import job_pb2

from aidn_testing import ClusterTestCase, join_generation, mlp_spec, wait_for

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                       "pytorch-ddp", "train_aidn.py")
DATA = "/usr/share/datasets/fashion-mnist"


def have_torch():
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipUnless(os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte.gz")),
                     "dataset-fashion-mnist is not installed")
@unittest.skipUnless(have_torch(), "python3-torch is not installed")
class ExampleDdpTest(ClusterTestCase):
    def run_ranks(self, gen, max_steps):
        port = str(free_port())
        processes = []
        for rank in range(2):
            env = dict(os.environ, **gen.env(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            processes.append(subprocess.Popen(
                [sys.executable, EXAMPLE, "--max-steps", str(max_steps), "--checkpoint-every",
                 "20", "--log-every", "10"], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        outputs = []
        for p in processes:
            try:
                out, _ = p.communicate(timeout=120)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            outputs.append(out)
            self.assertEqual(p.returncode, 0, out)
        return outputs

    def test_train_checkpoint_and_resume(self):
        directory = os.path.join(self.dir, "checkpoints")
        gen = self.start_job(mlp_spec(world_size=2, checkpoint_dir=directory, max_restarts=2),
                             checkpoint_dir=directory)
        outputs = self.run_ranks(gen, 30)
        digests = [out.strip().split("\n")[-1].split("weights ")[-1] for out in outputs]
        self.assertEqual(digests[0], digests[1], outputs)

        def committed():
            return [c.step for c in self.client.checkpoints(gen.job_id) if c.committed]

        wait_for(lambda: committed() == [20, 30], 20, "checkpoints 20 and 30 committed")
        steps = self.client.metrics(gen.job_id)
        train = [s for s in steps if s.kind == job_pb2.MetricRecord.TRAIN]
        self.assertEqual([s.step for s in train], list(range(1, 31)))
        self.assertTrue(all(s.ranks_reported == 2 and s.samples == 128 for s in train))
        evals = [s for s in steps if s.kind == job_pb2.MetricRecord.EVAL]
        self.assertEqual([s.step for s in evals], [30])
        self.assertGreater(evals[0].test_accuracy, 0.3)

        # The generation fails; the next one resumes from step 30 and goes on.
        gen.exit_all(exit_code=1)
        gen2 = join_generation(self.worker, self.coordinator, gen.job_id,
                               generation_after=gen.generation, checkpoint_dir=directory)
        outputs = self.run_ranks(gen2, 40)
        self.assertIn("at step 30", outputs[0])
        train = [s for s in self.client.metrics(gen.job_id)
                 if s.kind == job_pb2.MetricRecord.TRAIN]
        self.assertEqual([s.step for s in train], list(range(1, 41)))
        self.assertEqual({s.generation for s in train if s.step > 30}, {gen2.generation})
        wait_for(lambda: committed()[-1:] == [40], 20, "checkpoint 40 committed")


if __name__ == "__main__":
    unittest.main()
