"""aidn.Client against a real aidn-coordinator, and where it finds its
address and token (aidnctl's rules) and how it reads job specs."""

import datetime
import json
import os
import tempfile
import threading
import unittest

import grpc

import aidn
from aidn import _config, _spec
from aidn.v1 import job_pb2

from aidn_testing import (ClusterTestCase, mlp_spec, join_generation, run_rank, start_rank,
                          wait_for)

Job = job_pb2.Job


class ClientTest(ClusterTestCase):
    def test_submit_from_a_dict_yaml_and_json(self):
        job = self.client.submit(dict(mlp_spec(), labels={"team": "py"}))
        self.assertTrue(job.id)
        self.assertEqual(job.spec.model.name, "mlp")
        self.assertEqual(job.spec.timeouts.restart_backoff.ToMilliseconds(), 100)

        yaml_path = os.path.join(self.dir, "job.yaml")
        with open(yaml_path, "w") as f:
            f.write("name: 123\nworld_size: 1\ndevice: CPU\nmodel:\n  name: mlp\n"
                    "optimizer:\n  name: sgd\n  lr: 1e-3\n"
                    "timeouts:\n  rendezvous: 1m30s\nlabels:\n  team: yaml\n")
        from_yaml = self.client.submit(yaml_path)
        self.assertEqual(from_yaml.spec.name, "123")
        self.assertAlmostEqual(from_yaml.spec.optimizer.lr, 1e-3)
        self.assertEqual(from_yaml.spec.timeouts.rendezvous.seconds, 90)

        json_path = os.path.join(self.dir, "job.json")
        with open(json_path, "w") as f:
            json.dump(mlp_spec(), f)
        from_json = self.client.submit(json_path)

        ids = {j.id for j in self.client.list()}
        self.assertLessEqual({job.id, from_yaml.id, from_json.id}, ids)
        self.assertEqual([j.id for j in self.client.list(labels={"team": "yaml"})],
                         [from_yaml.id])
        self.assertEqual(len(self.client.list(limit=2)), 2)
        self.assertEqual(self.client.get(from_json.id).id, from_json.id)

    def test_a_pause_reaches_the_program_as_a_checkpoint_it_is_asked_for(self):
        directory = os.path.join(self.dir, "checkpoints")
        job = self.client.submit(mlp_spec(checkpoint_dir=directory))
        gen = join_generation(self.worker, self.coordinator, job.id, checkpoint_dir=directory)
        wait_for(lambda: self.client.get(job.id).state == Job.RUNNING, 20, "RUNNING")
        code = ("import os, time, aidn\n"
                "step = 0\n"
                "while not aidn.should_stop() and step < 100000:\n"
                "    step += 1\n"
                "    aidn.report(step, loss=1.0, samples=1, step_seconds=0.01)\n"
                "    if aidn.should_checkpoint(step):\n"
                "        with aidn.checkpoint(step) as path:\n"
                "            open(os.path.join(path, 'w.pt'), 'w').write('w')\n"
                "        print('checkpoint', step, flush=True)\n"
                "    time.sleep(0.01)\n"
                "print('stopped at', step, flush=True)\n"
                "aidn.flush(30)\n")
        rank = start_rank(code, gen.env(0))
        self.addCleanup(rank.kill)
        wait_for(lambda: self.client.get(job.id).last_step >= 5, 30, "training")
        pausing = self.client.pause(job.id, "test")
        self.assertEqual(pausing.pausing.reason, "test")
        wait_for(lambda: self.client.get(job.id).state == Job.PAUSED, 60, "PAUSED")
        out, err = rank.communicate(timeout=60)
        paused = self.client.get(job.id)
        self.assertIn(f"checkpoint {paused.last_checkpoint_step}\n", out, err)
        self.assertEqual(out.count("checkpoint "), 1, out)
        self.assertEqual(paused.restarts, 0)
        resumed = self.client.resume(job.id)
        self.assertIn(resumed.state, (Job.PENDING, Job.SCHEDULED))
        with self.assertRaises(aidn.ClientError) as again:
            self.client.resume(job.id)
        self.assertEqual(again.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_refusals_raise_client_error(self):
        with self.assertRaises(aidn.ClientError) as caught:
            self.client.submit(dict(mlp_spec(), world_size=0))
        self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("world_size", str(caught.exception))
        with self.assertRaises(ValueError) as unknown:
            self.client.submit(dict(mlp_spec(), wrold_size=2))
        self.assertIn("wrold_size", str(unknown.exception))
        with self.assertRaises(aidn.ClientError) as missing:
            self.client.get("no-such-job")
        self.assertEqual(missing.exception.code, grpc.StatusCode.NOT_FOUND)
        with aidn.Client(self.coordinator.address, token="wrong",
                         tls_ca=self.coordinator.ca_file) as stranger:
            with self.assertRaises(aidn.ClientError) as denied:
                stranger.list()
        self.assertEqual(denied.exception.code, grpc.StatusCode.UNAUTHENTICATED)

    def test_a_job_seen_through_every_call(self):
        directory = os.path.join(self.dir, "checkpoints")
        job = self.client.submit(mlp_spec(checkpoint_dir=directory))
        gen = join_generation(self.worker, self.coordinator, job.id, checkpoint_dir=directory)
        wait_for(lambda: self.client.get(job.id).state == Job.RUNNING, 20, "RUNNING")
        self.assertEqual([j.id for j in self.client.list(states=["running"])], [job.id])
        self.assertEqual(self.client.list(states=[Job.PENDING]), [])
        self.assertEqual([w.info.id for w in self.client.workers()], [self.worker.id])

        watched = []
        code = ("import os, aidn\n"
                "for step in range(1, 6):\n"
                "    aidn.report(step, loss=1.0 / step, samples=32)\n"
                "with aidn.checkpoint(5) as path:\n"
                "    open(os.path.join(path, 'model.pt'), 'w').write('w')\n"
                "print(aidn.flush(30))\n")
        self.assertRankOk(run_rank(code, gen.env(0)))
        wait_for(lambda: [c.committed for c in self.client.checkpoints(job.id)] == [True], 20,
                 "the checkpoint committed")
        self.assertEqual([s.step for s in self.client.metrics(job.id)], [1, 2, 3, 4, 5])
        self.assertEqual([s.step for s in self.client.metrics(job.id, from_step=2, to_step=3)],
                         [2, 3])

        cancelled = self.client.cancel(job.id, "done here")
        self.assertEqual(cancelled.state, Job.CANCELLED)
        for item in self.client.watch(job.id, timeout=30):
            watched.append(item)
        self.assertIsInstance(watched[0], job_pb2.Job)
        self.assertEqual(watched[0].state, Job.CANCELLED)
        self.assertIn(5, [i.step for i in watched if isinstance(i, job_pb2.StepMetrics)])
        types = [e.type for e in self.client.events(job.id)]
        for expected in ("job.submitted", "job.running", "checkpoint.committed",
                         "job.cancelled"):
            self.assertIn(expected, types)
        self.assertEqual(self.client.wait(job.id, timeout=5).state, Job.CANCELLED)

        described = self.client.describe(job.id)
        self.assertEqual(described["job"]["state"], "CANCELLED")
        self.assertEqual(described["checkpoints"][0]["step"], "5")
        self.assertTrue(described["events"])
        json.dumps(described)

    def test_an_admin_cordons_drains_and_uncordons_a_worker(self):
        w = self.worker.id
        cordoned = self.client.cordon(w, "disk swap")
        self.assertEqual(cordoned.scheduling, job_pb2.Worker.CORDONED)
        self.assertTrue(cordoned.scheduling_reason.endswith(": disk swap"))
        self.assertEqual(self.client.drain(w).scheduling, job_pb2.Worker.DRAINING)
        self.assertEqual([x.scheduling for x in self.client.workers()], [job_pb2.Worker.DRAINING])
        self.assertEqual(self.client.uncordon(w).scheduling, job_pb2.Worker.SCHEDULABLE)
        types = [e.type for e in self.client.events() if e.worker_id == w]
        for expected in ("worker.cordoned", "worker.draining", "worker.uncordoned"):
            self.assertIn(expected, types)
        with self.assertRaises(aidn.ClientError) as alive:
            self.client.remove_worker(w)
        self.assertEqual(alive.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(aidn.ClientError) as unknown:
            self.client.cordon("no-such-worker")
        self.assertEqual(unknown.exception.code, grpc.StatusCode.NOT_FOUND)


def texts(lines):
    return [line.text for line in lines]


class LogsTest(ClusterTestCase):
    """Client.logs over lines the worker ships (ShipLogs through the stubs)."""

    def test_read_filter_tail_generations_and_follow(self):
        gen = self.start_job(mlp_spec(world_size=2, max_restarts=1))
        job_id, ship = gen.job_id, self.worker.ship_logs
        ship(job_id, 1, 0, ["a0", "a1"])
        ship(job_id, 1, 1, ["b0", b"b1 \xff"])
        ship(job_id, 1, 0, ["a2"], first_seq=2)

        lines = list(self.client.logs(job_id))
        self.assertEqual([(l.generation, l.rank, l.seq, l.text) for l in lines],
                         [(1, 0, 0, "a0"), (1, 0, 1, "a1"), (1, 1, 0, "b0"),
                          (1, 1, 1, "b1 \ufffd"), (1, 0, 2, "a2")])
        self.assertEqual(lines[1].time,
                         datetime.datetime.fromtimestamp(1001, datetime.timezone.utc))
        self.assertEqual(texts(self.client.logs(job_id, rank=1)), ["b0", "b1 \ufffd"])
        self.assertEqual(texts(self.client.logs(job_id, tail=2)), ["b1 \ufffd", "a2"])
        self.assertEqual(texts(self.client.logs(job_id, rank=0, tail=2)), ["a1", "a2"])
        self.assertEqual(self.client.logs(job_id).dropped_lines, 0)

        with self.assertRaises(aidn.ClientError) as missing:
            list(self.client.logs("no-such-job"))
        self.assertEqual(missing.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(aidn.ClientError) as negative:
            list(self.client.logs(job_id, tail=-1))
        self.assertEqual(negative.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("tail", negative.exception.details)

        # The generation fails; the next one's lines are the default.
        gen.exit_all(exit_code=1)
        gen2 = join_generation(self.worker, self.coordinator, job_id,
                               generation_after=gen.generation)
        self.assertEqual(gen2.generation, 2)
        ship(job_id, 2, 0, ["c0"])
        self.assertEqual(texts(self.client.logs(job_id)), ["c0"])
        self.assertEqual(texts(self.client.logs(job_id, generation=1, rank=1)),
                         ["b0", "b1 \ufffd"])
        self.assertEqual([(l.generation, l.text) for l in
                          self.client.logs(job_id, all_generations=True, tail=3)],
                         [(1, "b1 \ufffd"), (1, "a2"), (2, "c0")])

        # Leaving a follower early cancels its stream.
        with self.client.logs(job_id, follow=True) as early:
            self.assertEqual(next(early).text, "c0")
        self.assertEqual(list(early), [])

        # A follower gets what arrives while it reads, and ends once the job
        # has ended and every rank's output is in.
        stream = self.client.logs(job_id, follow=True, timeout=60)
        followed, errors = [], []

        def follow():
            try:
                for line in stream:
                    followed.append((line.rank, line.text))
            except Exception as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        wait_for(lambda: followed == [(0, "c0")], 20, "the follower's first line")
        ship(job_id, 2, 1, ["d0"])
        wait_for(lambda: len(followed) == 2, 20, "a line shipped while following")
        ship(job_id, 2, 0, ["c1"], first_seq=1, complete=True)
        ship(job_id, 2, 1, [], first_seq=1, complete=True)
        self.client.cancel(job_id, "done here")
        reader.join(timeout=30)
        self.assertFalse(reader.is_alive(), "the follower did not end with the job")
        self.assertEqual(errors, [])
        self.assertEqual(followed, [(0, "c0"), (1, "d0"), (0, "c1")])


class DroppedLogsTest(ClusterTestCase):
    # 640 bytes a job: past it the coordinator drops the oldest lines until
    # the job is within 630 (max - max/64).
    coordinator_args = ("--max-log-bytes-per-job=640",)

    def test_dropped_lines_are_counted(self):
        gen = self.start_job(mlp_spec())
        # Ten lines of 100 bytes each (99 characters and the newline).
        self.worker.ship_logs(gen.job_id, 1, 0, ["%02d" % n + "x" * 97 for n in range(10)])
        stream = self.client.logs(gen.job_id)
        self.assertEqual(stream.dropped_lines, 0)  # nothing read yet
        seqs = [line.seq for line in stream]
        self.assertEqual((stream.dropped_lines, stream.dropped_bytes), (4, 400))
        self.assertEqual(seqs, list(range(4, 10)))


class ConnectionTest(unittest.TestCase):
    def setUp(self):
        self.home = tempfile.mkdtemp(prefix="aidn-home-")
        self.config = os.path.join(self.home, ".config", "aidn", "config")
        os.makedirs(os.path.dirname(self.config))

    def tearDown(self):
        import shutil
        shutil.rmtree(self.home, ignore_errors=True)

    def write(self, text):
        with open(self.config, "w") as f:
            f.write(text)

    def test_arguments_then_environment_then_config_then_defaults(self):
        env = {"HOME": self.home}
        self.assertEqual(_config.resolve(environ=env), _config.Connection("127.0.0.1:7070", ""))
        self.write("addr: coord.example\ntoken: from-file\n")
        self.assertEqual(_config.resolve(environ=env),
                         _config.Connection("coord.example:7070", "from-file"))
        env.update(AIDN_ADDR="env-host:9000", AIDN_TOKEN="from-env")
        self.assertEqual(_config.resolve(environ=env),
                         _config.Connection("env-host:9000", "from-env"))
        self.assertEqual(_config.resolve("arg-host:1", "from-arg", environ=env),
                         _config.Connection("arg-host:1", "from-arg"))
        env.update(AIDN_ADDR="", AIDN_TOKEN="")  # empty counts as unset
        self.assertEqual(_config.resolve(environ=env).token, "from-file")

    def test_tls_settings_follow_aidnctls_rules(self):
        env = {"HOME": self.home}
        self.assertEqual(_config.resolve(environ=env).tls_ca, "")
        self.assertFalse(_config.resolve(environ=env).insecure)
        self.write("tls_ca: ca.pem\n")
        self.assertEqual(_config.resolve(environ=env).tls_ca,
                         os.path.join(os.path.dirname(self.config), "ca.pem"))
        self.write("insecure: true\n")
        self.assertTrue(_config.resolve(environ=env).insecure)
        env.update(AIDN_TLS_CA="/etc/aidn/ca.pem")
        self.assertEqual(_config.resolve(environ=env).tls_ca, "/etc/aidn/ca.pem")
        self.assertFalse(_config.resolve(environ=env).insecure)
        self.assertTrue(_config.resolve(environ=env, insecure=True).insecure)
        self.assertEqual(_config.resolve(environ=env, insecure=True).tls_ca, "")

    def test_token_file_beside_the_config(self):
        with open(os.path.join(os.path.dirname(self.config), "token"), "w") as f:
            f.write("  secret\n")
        self.write("token_file: token\n")
        self.assertEqual(_config.resolve(environ={"HOME": self.home}).token, "secret")

    def test_bad_config_files_name_the_problem(self):
        for text, words in (("adr: x\n", 'unknown key "adr"'),
                            ("token: a\ntoken_file: b\n", "either token or token_file"),
                            ("token_file: missing\n", "token_file: cannot read")):
            with self.subTest(text=text):
                self.write(text)
                with self.assertRaises(ValueError) as caught:
                    _config.resolve(environ={"HOME": self.home})
                self.assertIn(words, str(caught.exception))
                self.assertIn(self.config, str(caught.exception))


class SpecTest(unittest.TestCase):
    def test_the_forms_aidnctl_takes(self):
        spec = _spec.spec_from_dict({
            "name": 7, "device": "gpu", "strategy": "ddp", "world_size": 2,
            "model": {"name": "cnn"},
            "timeouts": {"rendezvous": "1h30m", "progress": "250ms", "worker": 10},
            "command": {"argv": ["python3", "train.py"], "env": {"A": 1}, "store": "rank0"},
            "labels": {"n": 3},
        })
        self.assertEqual(spec.name, "7")
        self.assertEqual(spec.device, job_pb2.JobSpec.GPU)
        self.assertEqual(spec.timeouts.rendezvous.seconds, 5400)
        self.assertEqual(spec.timeouts.progress.nanos, 250_000_000)
        self.assertEqual(spec.timeouts.worker.seconds, 10)
        self.assertEqual(spec.command.env["A"], "1")
        self.assertEqual(spec.command.store, job_pb2.CommandSpec.RANK0)
        self.assertEqual(spec.labels["n"], "3")

    def test_the_example_job_specs_parse(self):
        examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples", "pytorch-ddp")
        for name, script in (("job.yaml", "train.py"), ("job-aidn.yaml", "train_aidn.py")):
            with self.subTest(name=name):
                spec = _spec.load_spec(os.path.join(examples, name))
                self.assertEqual(spec.world_size, 2)
                self.assertEqual(os.path.basename(spec.command.argv[1]), script)
                self.assertTrue(os.path.exists(os.path.join(examples, script)))

    def test_unknown_fields_are_named(self):
        with self.assertRaises(ValueError) as caught:
            _spec.spec_from_dict({"model": {"nmae": "mlp"}})
        self.assertIn("nmae", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            _spec.parse_spec("{\"world_size\": }", "job.json")
        self.assertIn("job.json: line 1", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
