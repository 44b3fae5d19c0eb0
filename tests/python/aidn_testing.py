"""Real processes on loopback for the Python client's tests: an
aidn-coordinator on an ephemeral port with its own state directory, a worker
played through the Python stubs (register, heartbeat on a thread, rendezvous
for its ranks), and rank processes run with the AIDN_* environment a worker
gives them. The binaries come from the environment ctest sets:
AIDN_COORDINATOR_BIN, AIDN_MANIFEST_TOOL; PYTHONPATH holds the built package.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc

from aidn import _rpc
from aidn.v1 import cluster_pb2, cluster_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc, job_pb2

START_TIMEOUT = 30.0  # generous: builds and other tests share the cores
HEARTBEAT_EVERY = 0.2


def wait_for(predicate, timeout, what="condition", interval=0.05):
    """Polls `predicate` until it returns something true; AssertionError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_addr_file(path):
    """The host:port a coordinator wrote with --addr-file, or "" until it
    has written the whole line."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    return text.strip() if text.endswith("\n") else ""


def binary(name):
    path = os.environ.get(name, "")
    if not path or not os.access(path, os.X_OK):
        raise unittest.SkipTest(f"{name} is not set to a built binary")
    return path


class Coordinator:
    """An aidn-coordinator process with its own state directory."""

    def __init__(self, state_dir, args=()):
        self.binary = binary("AIDN_COORDINATOR_BIN")
        self.state_dir = state_dir
        self.args = list(args)
        self.process = None
        self.address = ""
        self.admin_token = ""
        self.worker_token = ""
        self._starts = 0

    def start(self, address="127.0.0.1:0"):
        os.makedirs(self.state_dir, exist_ok=True)
        addr_file = os.path.join(self.state_dir, "coordinator.addr")
        if os.path.exists(addr_file):
            os.remove(addr_file)
        self._starts += 1
        log = open(os.path.join(self.state_dir, f"coordinator.{self._starts}.log"), "wb")
        argv = [self.binary, f"--listen={address}", f"--state-dir={self.state_dir}",
                f"--addr-file={addr_file}", "--metrics-addr=",
                f"--heartbeat-interval={int(HEARTBEAT_EVERY * 1000)}ms",
                "--tick-interval=50ms", "--worker-timeout=5s"] + self.args
        self.process = subprocess.Popen(argv, stdout=log, stderr=log)
        log.close()

        def ready():
            if self.process.poll() is not None:
                raise AssertionError(f"the coordinator exited with {self.process.returncode}:\n"
                                     + self.log_tail())
            try:
                with open(addr_file) as f:
                    text = f.read()
                with open(os.path.join(self.state_dir, "admin.token")) as f:
                    admin = f.read().strip()
                with open(os.path.join(self.state_dir, "worker.token")) as f:
                    worker = f.read().strip()
            except FileNotFoundError:
                return False
            if not text.endswith("\n") or not admin or not worker:
                return False
            self.address, self.admin_token, self.worker_token = text.strip(), admin, worker
            return True

        wait_for(ready, START_TIMEOUT, "the coordinator's address file")
        channel = _rpc.make_channel(self.address, self.ca_file)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)

        def serving():
            try:
                stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=2,
                                 metadata=_rpc.metadata(self.admin_token))
                return True
            except grpc.RpcError:
                return False

        wait_for(serving, START_TIMEOUT, "the coordinator to answer")
        channel.close()

    @property
    def ca_file(self):
        """The CA the coordinator made in its state directory (TLS)."""
        return os.path.join(self.state_dir, "tls", "ca.pem")

    def kill(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=START_TIMEOUT)

    def restart(self):
        """kill -9 and start again on the same address and state."""
        address = self.address
        self.kill()
        self.start(address)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, size=4000):
        text = ""
        for n in range(1, self._starts + 1):
            path = os.path.join(self.state_dir, f"coordinator.{n}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f"--- coordinator.{n}.log\n" + f.read()[-size:]
        return text


class FakeWorker:
    """A worker daemon stand-in: registers, heartbeats every 200 ms on a
    thread, re-registers on NOT_FOUND, keeps the assignments of its last
    heartbeat, and reports as running every assigned rank not marked exited."""

    def __init__(self, address, token, tls_ca, worker_id="pyworker", cpu_slots=4):
        self.id = worker_id
        self._token = token
        self._slots = cpu_slots
        self._channel = _rpc.make_channel(address, tls_ca)
        self.stub = cluster_pb2_grpc.ClusterServiceStub(self._channel)
        self._lock = threading.Lock()
        self._assignments = []
        self._exited = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        self.register()
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._channel.close()

    def register(self):
        info = job_pb2.WorkerInfo(id=self.id, hostname=f"host-{self.id}", address="127.0.0.1",
                                  cpu_slots=self._slots, version="python-test",
                                  runs_commands=True)
        request = cluster_pb2.RegisterWorkerRequest(info=info, trainers=self._running())
        self.stub.RegisterWorker(request, timeout=5, metadata=_rpc.metadata(self._token))

    def assignments(self, job_id, generation=None):
        with self._lock:
            return [a for a in self._assignments if a.job_id == job_id and
                    (generation is None or a.generation == generation)]

    def mark_exited(self, assignment, exit_code=0):
        """The rank ended: ReportTrainerExit, and stop listing it."""
        with self._lock:
            self._exited.add((assignment.job_id, assignment.generation, assignment.rank))
        request = cluster_pb2.ReportTrainerExitRequest(
            worker_id=self.id, job_id=assignment.job_id, generation=assignment.generation,
            rank=assignment.rank, exit_code=exit_code)
        self.stub.ReportTrainerExit(request, timeout=5, metadata=_rpc.metadata(self._token))

    def ship_logs(self, job_id, generation, rank, lines, first_seq=0, complete=False):
        """ShipLogs one chunk of a rank's output: `lines` (bytes or str),
        numbered from `first_seq`, read at 1000 s + seq after the epoch."""
        chunk = cluster_pb2.LogChunk(job_id=job_id, generation=generation, rank=rank,
                                     complete=complete)
        for seq, text in enumerate(lines, first_seq):
            line = chunk.lines.add(seq=seq, text=text if isinstance(text, bytes) else
                                   text.encode())
            line.time.FromSeconds(1000 + seq)
        request = cluster_pb2.ShipLogsRequest(worker_id=self.id, chunks=[chunk])
        self.stub.ShipLogs(request, timeout=5, metadata=_rpc.metadata(self._token))

    def _running(self):
        with self._lock:
            return [cluster_pb2.TrainerStatus(job_id=a.job_id, generation=a.generation,
                                              rank=a.rank, pid=40000 + a.rank)
                    for a in self._assignments
                    if (a.job_id, a.generation, a.rank) not in self._exited]

    def _loop(self):
        while not self._stop.is_set():
            request = cluster_pb2.HeartbeatRequest(worker_id=self.id, trainers=self._running())
            try:
                response = self.stub.Heartbeat(request, timeout=3,
                                               metadata=_rpc.metadata(self._token))
                with self._lock:
                    self._assignments = list(response.assignments)
            except grpc.RpcError as e:
                if _rpc.code_of(e) == grpc.StatusCode.NOT_FOUND:
                    try:
                        self.register()
                    except grpc.RpcError:
                        pass
            # A heartbeat timer, not a wait for a state.
            self._stop.wait(HEARTBEAT_EVERY)


def mlp_spec(world_size=1, checkpoint_dir="", keep_last=0, max_restarts=None):
    """A built-in job (its ranks are played by the test)."""
    spec = {"name": "pyclient-test", "world_size": world_size, "device": "cpu",
            "model": {"name": "mlp"}, "epochs": 1,
            "timeouts": {"restart_backoff": "100ms"}}
    if checkpoint_dir:
        spec["checkpoint"] = {"dir": checkpoint_dir, "every_steps": 5}
        if keep_last:
            spec["checkpoint"]["keep_last"] = keep_last
    if max_restarts is not None:
        spec["max_restarts"] = max_restarts
    return spec


class Generation:
    """The ranks of one generation of a job, joined, as the worker would
    start them."""

    def __init__(self, worker, coordinator, assignments, joins, checkpoint_dir):
        self.worker = worker
        self.coordinator = coordinator
        self.assignments = sorted(assignments, key=lambda a: a.rank)
        self.joins = joins
        self.job_id = self.assignments[0].job_id
        self.generation = self.assignments[0].generation
        self.checkpoint_dir = checkpoint_dir

    def env(self, rank=0):
        """The AIDN_* environment of `rank` (and torchrun's basic variables)."""
        a = self.assignments[rank]
        env = {
            "AIDN_COORDINATOR": self.coordinator.address,
            "AIDN_TLS_CA": self.coordinator.ca_file,
            "AIDN_TRAINER_TOKEN": a.trainer_token,
            "AIDN_JOB_ID": a.job_id,
            "AIDN_GENERATION": str(a.generation),
            "AIDN_RANK": str(a.rank),
            "AIDN_WORLD_SIZE": str(a.world_size),
            "AIDN_WORKER_ID": self.worker.id,
            "RANK": str(a.rank),
            "WORLD_SIZE": str(a.world_size),
        }
        if self.checkpoint_dir:
            env["AIDN_CHECKPOINT_DIR"] = self.checkpoint_dir
        resume = self.joins[rank].resume_from
        if self.joins[rank].HasField("resume_from"):
            env["AIDN_RESUME_STEP"] = str(resume.step)
            env["AIDN_RESUME_PATH"] = os.path.join(self.checkpoint_dir,
                                                   "step-%08d" % resume.step)
        return env

    def exit_all(self, exit_code=0):
        for a in self.assignments:
            self.worker.mark_exited(a, exit_code)


def join_generation(worker, coordinator, job_id, generation_after=0, checkpoint_dir="",
                    timeout=20.0):
    """Waits for the worker's assignments of a generation newer than
    `generation_after`, then joins the rendezvous for all its ranks."""
    def assigned():
        newest = [a for a in worker.assignments(job_id) if a.generation > generation_after]
        if not newest:
            return None
        generation = max(a.generation for a in newest)
        ranks = [a for a in newest if a.generation == generation]
        return ranks if len(ranks) == ranks[0].world_size else None

    assignments = wait_for(assigned, timeout, f"the assignments of job {job_id}")
    results = [None] * len(assignments)

    def join(a):
        request = cluster_pb2.JoinRendezvousRequest(
            job_id=a.job_id, generation=a.generation, rank=a.rank, worker_id=worker.id,
            address=f"127.0.0.1:{29500 + a.rank}")
        results[a.rank] = worker.stub.JoinRendezvous(
            request, timeout=timeout, metadata=_rpc.metadata(a.trainer_token))

    threads = [threading.Thread(target=join, args=(a,)) for a in assignments]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in results):
        raise AssertionError("a rank's JoinRendezvous failed")
    return Generation(worker, coordinator, assignments, results, checkpoint_dir)


def run_rank(code, env, timeout=60.0, **kwargs):
    """Runs `code` with /usr/bin/python3 (this interpreter) as a rank
    process: the test's environment plus `env`. CompletedProcess."""
    full = dict(os.environ)
    full.update(env)
    full["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def start_rank(code, env, **kwargs):
    full = dict(os.environ)
    full.update(env)
    full["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def no_aidn_env():
    """The environment with every AIDN_* variable removed."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AIDN_")}


class ClusterTestCase(unittest.TestCase):
    """A coordinator and a fake worker per test, in a temporary directory that
    is kept (and the coordinator's log printed) when the test fails."""

    coordinator_args = ()

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="aidn-pytest-")
        self.coordinator = Coordinator(os.path.join(self.dir, "state"), self.coordinator_args)
        self.coordinator.start()
        self.worker = FakeWorker(self.coordinator.address, self.coordinator.worker_token,
                                 self.coordinator.ca_file)
        self.worker.start()
        from aidn import Client
        self.client = Client(self.coordinator.address, self.coordinator.admin_token,
                             tls_ca=self.coordinator.ca_file)

    def tearDown(self):
        self.client.close()
        self.worker.stop()
        self.coordinator.stop()
        if not getattr(getattr(self, "_outcome", None), "success", True):
            sys.stderr.write(f"kept {self.dir}\n{self.coordinator.log_tail()}\n")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def start_rank(self, code, env):
        """start_rank(), killed (if still running) and reaped after the test."""
        process = start_rank(code, env)

        def reap():
            if process.poll() is None:
                process.kill()
            process.communicate()

        self.addCleanup(reap)
        return process

    def start_job(self, spec, checkpoint_dir=""):
        job = self.client.submit(spec)
        generation = join_generation(self.worker, self.coordinator, job.id,
                                     checkpoint_dir=checkpoint_dir)
        wait_for(lambda: self.client.get(job.id).state == job_pb2.Job.RUNNING, 20,
                 f"job {job.id} RUNNING")
        return generation

    def assertRankOk(self, result):
        self.assertEqual(result.returncode, 0,
                         f"rank exited {result.returncode}\n--- stdout\n{result.stdout}"
                         f"\n--- stderr\n{result.stderr}")
