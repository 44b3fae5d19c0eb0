"""The reporter's protocol against a scripted ClusterService stand-in (no
coordinator): records held until durable and resent on a new incarnation,
commits after their records, fencing, stop answers, retries."""

import threading
import time
import unittest

import grpc

from aidn import _reporter
from aidn.v1 import cluster_pb2, job_pb2

from aidn_testing import wait_for


class RpcError(grpc.RpcError):
    def __init__(self, code, details=""):
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details


class FakeCluster:
    """Answers like the coordinator, as the test scripts it: every record it
    takes is stored at once unless `store` is False."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = []  # ("metrics", [steps]) / ("commit", step) / ("progress", step)
        self.stored = set()
        self.store = True
        self.incarnation = "a"
        self.fail_metrics = []  # codes to raise on the next StreamMetrics calls
        self.stop = False
        self.retired = []
        self.metadata = None
        self.ask = (0, False)  # the checkpoint asked for: (step, go)
        self.answers = []  # (checkpoint_ack, checkpoint_missed) of each beat

    def StreamMetrics(self, requests, timeout=None, metadata=None):
        steps = []
        for request in requests:
            assert request.job_id == "job-1" and request.generation == 3 and request.rank == 1
            steps += [r.step for r in request.records]
        with self.lock:
            self.metadata = metadata
            self.calls.append(("metrics", steps))
            if self.fail_metrics:
                raise RpcError(self.fail_metrics.pop(0), "scripted")
            if self.store:
                self.stored.update(steps)
            durable = 0
            while durable + 1 in self.stored:
                durable += 1
            return cluster_pb2.StreamMetricsResponse(accepted=len(steps), durable_step=durable,
                                                     incarnation=self.incarnation)

    def CommitCheckpoint(self, request, timeout=None, metadata=None):
        with self.lock:
            self.calls.append(("commit", request.step))
            return cluster_pb2.CommitCheckpointResponse(committed=True,
                                                        retired_steps=self.retired)

    def ReportProgress(self, request, timeout=None, metadata=None):
        with self.lock:
            self.calls.append(("progress", request.step))
            self.answers.append((request.checkpoint_ack, request.checkpoint_missed))
            return cluster_pb2.ReportProgressResponse(
                stop=self.stop, reason="cancelled", incarnation=self.incarnation,
                checkpoint=cluster_pb2.CheckpointRequest(step=self.ask[0], go=self.ask[1],
                                                         reason="paused by test"))

    def ReportCheckpointInvalid(self, request, timeout=None, metadata=None):
        raise AssertionError("not expected")

    def metric_steps(self):
        with self.lock:
            return [s for kind, steps in self.calls if kind == "metrics" for s in steps]


def record(step):
    return job_pb2.MetricRecord(kind=job_pb2.MetricRecord.TRAIN, step=step, loss=1.0 / step)


class ReporterTest(unittest.TestCase):
    def make(self, fake, retire=None, beat_period=0.05):
        options = _reporter.ReporterOptions(report_period=0.05, beat_period=beat_period,
                                            rpc_timeout=2.0, confirm_period=0.02)
        reporter = _reporter.Reporter(fake, "job-1", 3, 1, "tok", options, retire=retire)
        self.addCleanup(reporter.close, 2.0)
        return reporter

    def test_records_are_batched_and_carry_the_token(self):
        fake = FakeCluster()
        reporter = self.make(fake)
        for step in range(1, 101):
            reporter.record(record(step))
        self.assertTrue(reporter.flush(5.0))
        self.assertEqual(sorted(fake.metric_steps()), list(range(1, 101)))
        self.assertLess(len([c for c in fake.calls if c[0] == "metrics"]), 10)
        self.assertEqual(fake.metadata, (("authorization", "Bearer tok"),))

    def test_unstored_records_go_again_to_a_restarted_coordinator(self):
        fake = FakeCluster()
        fake.store = False  # taken, never stored: the coordinator dies with them
        reporter = self.make(fake)
        for step in (1, 2, 3):
            reporter.record(record(step))
        wait_for(lambda: len(fake.metric_steps()) >= 3, 5, "the first send")
        self.assertFalse(reporter.flush(0.3))  # held: not durable
        with fake.lock:
            fake.store = True
            fake.incarnation = "b"  # restarted
        self.assertTrue(reporter.flush(5.0))
        self.assertEqual(fake.metric_steps().count(2), 2, fake.calls)
        self.assertEqual(fake.stored, {1, 2, 3})

    def test_a_commit_goes_after_the_records_up_to_its_step(self):
        fake = FakeCluster()
        fake.retired = [5]
        retired = []
        reporter = self.make(fake, retire=lambda d, s: retired.append((d, s)))
        for step in range(1, 11):
            reporter.record(record(step))
        reporter.commit(cluster_pb2.CommitCheckpointRequest(job_id="job-1", generation=3,
                                                            rank=1, step=10), "/ckpt")
        self.assertTrue(reporter.flush(5.0))
        commit_at = fake.calls.index(("commit", 10))
        before = [s for kind, steps in fake.calls[:commit_at] if kind == "metrics"
                  for s in steps]
        self.assertEqual(sorted(before), list(range(1, 11)))
        self.assertEqual(retired, [("/ckpt", 5)])

    def test_failed_precondition_fences_the_generation(self):
        fake = FakeCluster()
        fake.fail_metrics = [grpc.StatusCode.FAILED_PRECONDITION]
        reporter = self.make(fake)
        reporter.record(record(1))
        self.assertTrue(reporter.flush(5.0))
        self.assertTrue(reporter.fenced)
        reporter.record(record(2))
        reporter.progress(2, 1, 0)
        self.assertTrue(reporter.flush(1.0))
        time.sleep(0.2)  # a window for anything that would still be sent
        self.assertEqual(fake.calls, [("metrics", [1])])

    def test_transient_failures_are_retried(self):
        fake = FakeCluster()
        fake.fail_metrics = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
        reporter = self.make(fake)
        for step in (1, 2):
            reporter.record(record(step))
        self.assertTrue(reporter.flush(10.0))
        self.assertEqual(fake.stored, {1, 2})
        self.assertFalse(reporter.fenced)

    def test_beats_start_with_the_first_progress_and_carry_stop(self):
        fake = FakeCluster()
        reporter = self.make(fake)
        time.sleep(0.2)
        self.assertEqual([c for c in fake.calls if c[0] == "progress"], [])
        reporter.progress(7, 1, 100)
        wait_for(lambda: ("progress", 7) in fake.calls, 5, "a beat")
        self.assertIsNone(reporter.stop_reason)
        with fake.lock:
            fake.stop = True
        wait_for(lambda: reporter.stop_reason is not None, 5, "the stop")
        self.assertEqual(reporter.stop_reason, "cancelled")

    def test_a_checkpoint_ask_is_answered_and_waited_at_until_go(self):
        fake = FakeCluster()
        reporter = self.make(fake, beat_period=1.0)
        with fake.lock:
            fake.ask = (40, False)
        reporter.progress(10, 1, 100)
        wait_for(lambda: reporter.checkpoint_ask() == (40, False), 5, "the ask")
        reporter.answer_checkpoint_ask(40, missed=False)
        # The answer goes at once, not a beat period later.
        wait_for(lambda: (40, 0) in fake.answers, 0.5, "the ack")
        got = []
        waiter = threading.Thread(target=lambda: got.append(reporter.await_checkpoint_go(40, 30)))
        waiter.start()
        time.sleep(0.3)
        self.assertEqual(got, [])
        # Waiting, it beats fast (every 50 ms rather than every second).
        with fake.lock:
            beats = len(fake.answers)
        time.sleep(0.3)
        with fake.lock:
            self.assertGreaterEqual(len(fake.answers) - beats, 3)
            fake.ask = (40, True)
        waiter.join(5)
        self.assertEqual(got, [(40, True)])
        # A miss is said as such.
        reporter.answer_checkpoint_ask(55, missed=True)
        wait_for(lambda: (0, 55) in fake.answers, 0.5, "the miss")

    def test_an_ask_between_step_boundaries_is_answered_by_the_reporter(self):
        # The training thread may be blocked in a collective that waits for
        # a rank already waiting at the step: the reporter answers for it.
        fake = FakeCluster()
        reporter = self.make(fake, beat_period=0.02)
        reporter.progress(100, 1, 1000)
        self.assertEqual(reporter.at_step_boundary(100), (0, False))
        with fake.lock:
            fake.ask = (100, False)
        wait_for(lambda: (0, 100) in fake.answers, 5, "the miss")
        with fake.lock:
            fake.ask = (120, False)
        wait_for(lambda: (120, 0) in fake.answers, 5, "the ack")
        self.assertEqual(reporter.at_step_boundary(119), (120, False))
        self.assertEqual(reporter.at_step_boundary(120), (120, False))

    def test_close_gives_up_at_its_deadline(self):
        fake = FakeCluster()
        fake.store = False
        reporter = self.make(fake)
        reporter.record(record(1))
        started = time.monotonic()
        self.assertFalse(reporter.close(0.5))
        self.assertLess(time.monotonic() - started, 5.0)


if __name__ == "__main__":
    unittest.main()
