"""aidn.report, flush and should_stop in rank processes of a job on a real
aidn-coordinator (the worker played by the test): every step arrives across
a coordinator restart, a cancel and a fenced generation stop the rank."""

import unittest

from aidn.v1 import job_pb2

from aidn_testing import ClusterTestCase, mlp_spec, join_generation, run_rank, wait_for

STEPS = 150

REPORTING = r'''
import time, aidn
for step in range(1, %(steps)d + 1):
    aidn.report(step, loss=1.0 / step, samples=64, epoch=1 + (step - 1) // 100,
                total_steps=%(steps)d, lr=0.1, step_seconds=0.02)
    if step %% 100 == 0 or step == %(steps)d:
        aidn.report(step, test_loss=2.0 / step, test_accuracy=0.5)
    if step == 1:
        print("running", flush=True)
    time.sleep(0.02)
print("flushed", aidn.flush(30), flush=True)
''' % {"steps": STEPS}

UNTIL_STOPPED = r'''
import time, aidn
step = 0
while not aidn.should_stop():
    step += 1
    aidn.report(step, loss=1.0)
    if step == 1:
        print("running", flush=True)
    time.sleep(0.02)
print("stopped", flush=True)
'''


class JobMetricsTest(ClusterTestCase):
    def test_every_step_arrives_across_a_coordinator_restart(self):
        gen = self.start_job(mlp_spec())
        rank = self.start_rank(REPORTING, gen.env(0))
        self.assertEqual(rank.stdout.readline().strip(), "running")
        # Some steps stored, the rank still reporting: kill -9 and start again.
        wait_for(lambda: len(self.client.metrics(gen.job_id)) >= 10, 20, "stored steps")
        self.coordinator.restart()
        out, err = rank.communicate(timeout=60)
        self.assertEqual(rank.returncode, 0, err)
        self.assertEqual(out.strip(), "flushed True", err)

        steps = self.client.metrics(gen.job_id)
        train = [s for s in steps if s.kind == job_pb2.MetricRecord.TRAIN]
        evals = [s for s in steps if s.kind == job_pb2.MetricRecord.EVAL]
        self.assertEqual([s.step for s in train], list(range(1, STEPS + 1)))
        for s in train:
            self.assertAlmostEqual(s.loss, 1.0 / s.step)
            self.assertEqual(s.samples, 64)
            self.assertEqual(s.epoch, 1 + (s.step - 1) // 100)
            self.assertAlmostEqual(s.lr, 0.1)
        self.assertEqual([s.step for s in evals], [100, STEPS])
        self.assertAlmostEqual(evals[0].test_loss, 0.02)
        self.assertAlmostEqual(evals[1].test_accuracy, 0.5)
        job = self.client.get(gen.job_id)
        self.assertEqual(job.last_step, STEPS)
        self.assertEqual(job.total_steps, STEPS)

    def test_a_cancel_reaches_should_stop(self):
        gen = self.start_job(mlp_spec())
        rank = self.start_rank(UNTIL_STOPPED, gen.env(0))
        self.assertEqual(rank.stdout.readline().strip(), "running")
        wait_for(lambda: self.client.get(gen.job_id).last_step > 0, 20, "a beat")
        self.client.cancel(gen.job_id, "enough")
        out, err = rank.communicate(timeout=30)
        self.assertEqual(rank.returncode, 0, err)
        self.assertEqual(out.strip(), "stopped", err)

    def test_a_fenced_generation_stops_sending(self):
        gen = self.start_job(mlp_spec(max_restarts=2))
        # The generation fails (the worker says rank 0 died); the next one runs.
        gen.exit_all(exit_code=1)
        gen2 = join_generation(self.worker, self.coordinator, gen.job_id,
                               generation_after=gen.generation)
        self.assertGreater(gen2.generation, gen.generation)
        late = ("import aidn\n"
                "aidn.report(1, loss=1.0)\n"
                "print(aidn.flush(20), aidn.should_stop())\n")
        result = run_rank(late, gen.env(0))
        self.assertRankOk(result)
        self.assertEqual(result.stdout.strip(), "True True", result.stderr)
        self.assertIn("ended this generation", result.stderr)
        # Nothing of the old generation was taken.
        self.assertEqual(self.client.metrics(gen.job_id), [])
        result = run_rank(late, gen2.env(0))
        self.assertRankOk(result)
        self.assertEqual(result.stdout.strip(), "True False", result.stderr)
        self.assertEqual([s.generation for s in self.client.metrics(gen.job_id)],
                         [gen2.generation])


if __name__ == "__main__":
    unittest.main()
