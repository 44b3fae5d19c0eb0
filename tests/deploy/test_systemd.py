"""The systemd units and flag files under deploy/systemd: systemd-analyze
verifies the units (with ExecStart pointed at the built binaries) and rates
their hardening, and the shipped flag files start a coordinator and a worker
that joins it, as the units would on a one-node install."""

import os
import shutil
import subprocess
import tempfile
import unittest

import aidn
from aidn.v1 import job_pb2
from aidn_testing import START_TIMEOUT, binary, read_addr_file, wait_for

SOURCE = os.environ.get("AIDN_SOURCE_DIR", "")
UNITS = {"aidn-coordinator": "AIDN_COORDINATOR_BIN", "aidn-worker": "AIDN_WORKER_BIN"}
# systemd-analyze security's exposure score, 0 (locked down) to 10: the
# coordinator needs nothing but its state dir and sockets; the worker runs
# users' programs, GPUs and JITs, so it keeps devices and W+X memory.
MAX_EXPOSURE = {"aidn-coordinator": 2.0, "aidn-worker": 4.0}


def configure(unit, bin_path, out_dir):
    """The unit as cmake --install lays it out, ExecStart on `bin_path`."""
    with open(os.path.join(SOURCE, "deploy", "systemd", unit + ".service.in")) as f:
        text = f.read()
    text = text.replace(f"@AIDN_BIN_DIR@/{unit}", bin_path)
    for key, value in {"@AIDN_CONF_DIR@": "/etc/aidn", "@AIDN_DOC_DIR@": "/usr/share/doc/aidn",
                       "@AIDN_STATE_DIR@": "/var/lib/aidn"}.items():
        text = text.replace(key, value)
    assert "@AIDN_" not in text, f"{unit}: an unsubstituted @AIDN_...@ is left"
    path = os.path.join(out_dir, unit + ".service")
    with open(path, "w") as f:
        f.write(text)
    return path


class SystemdUnitsTest(unittest.TestCase):
    def setUp(self):
        if not SOURCE:
            self.skipTest("AIDN_SOURCE_DIR is not set")
        if shutil.which("systemd-analyze") is None:
            self.skipTest("systemd-analyze is missing (Debian's systemd package)")
        self.dir = tempfile.mkdtemp(prefix="aidn-systemd-test.")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def test_units_verify_cleanly(self):
        units = [configure(u, binary(env), self.dir) for u, env in UNITS.items()]
        result = subprocess.run(["systemd-analyze", "verify", "--man=no"] + units,
                                capture_output=True, text=True, timeout=60)
        # verify exits 0 on unknown keys and bad values, but says so.
        self.assertEqual((result.returncode, result.stdout + result.stderr), (0, ""))

    def test_a_misspelt_key_is_caught(self):
        unit = configure("aidn-coordinator", binary("AIDN_COORDINATOR_BIN"), self.dir)
        with open(unit) as f:
            text = f.read()
        with open(unit, "w") as f:
            f.write(text.replace("ProtectSystem=strict", "ProtectSystm=strict"))
        result = subprocess.run(["systemd-analyze", "verify", "--man=no", unit],
                                capture_output=True, text=True, timeout=60)
        self.assertIn("Unknown key 'ProtectSystm'", result.stderr)

    def test_hardening_scores(self):
        for unit, env in UNITS.items():
            path = configure(unit, binary(env), self.dir)
            result = subprocess.run(
                ["systemd-analyze", "security", "--offline=yes", "--no-pager",
                 f"--threshold={int(MAX_EXPOSURE[unit] * 10)}", path],
                capture_output=True, text=True, timeout=60)
            summary = [line for line in result.stdout.splitlines() if "Overall exposure" in line]
            self.assertEqual(result.returncode, 0, f"{unit}: {summary or result.stderr}")


class FlagFilesTest(unittest.TestCase):
    """coordinator.flags and worker.flags as shipped, with only the paths and
    ports a test must own overridden after them (later flags win)."""

    def setUp(self):
        if not SOURCE:
            self.skipTest("AIDN_SOURCE_DIR is not set")
        self.dir = tempfile.mkdtemp(prefix="aidn-flags-test.")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.processes = []
        self.addCleanup(self.stop_all)

    def stop_all(self):
        for p in reversed(self.processes):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def start(self, argv, name):
        log = open(os.path.join(self.dir, name + ".log"), "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=log)
        log.close()
        self.processes.append(p)
        return p

    def log(self, name):
        with open(os.path.join(self.dir, name + ".log"), errors="replace") as f:
            return f.read()[-4000:]

    def test_a_one_node_install_runs_a_job(self):
        flags = os.path.join(SOURCE, "deploy", "systemd")
        state = os.path.join(self.dir, "coordinator")
        addr_file = os.path.join(self.dir, "coordinator.addr")
        coordinator = self.start(
            [binary("AIDN_COORDINATOR_BIN"), f"--flagfile={flags}/coordinator.flags",
             f"--state_dir={state}", "--listen=127.0.0.1:0", f"--addr_file={addr_file}",
             "--metrics_addr=", "--web_addr="], "coordinator")

        def address():
            self.assertIsNone(coordinator.poll(), self.log("coordinator"))
            return read_addr_file(addr_file)

        addr = wait_for(address, START_TIMEOUT, "the coordinator's address file")
        work = os.path.join(self.dir, "worker")
        worker = self.start(
            [binary("AIDN_WORKER_BIN"), f"--flagfile={flags}/worker.flags",
             f"--coordinator={addr}", f"--tls_ca={state}/tls/ca.pem",
             f"--token_file={state}/worker.token", f"--work_dir={work}/work",
             f"--checkpoint_root={work}/checkpoints", f"--cache_dir={work}/cache",
             f"--allowed_paths=/usr/share,{work}", "--metrics_addr=", "--worker_id=node-1"],
            "worker")
        with open(os.path.join(state, "admin.token")) as f:
            token = f.read().strip()
        client = aidn.Client(address=addr, token=token, tls_ca=f"{state}/tls/ca.pem")

        def registered():
            self.assertIsNone(worker.poll(), self.log("worker"))
            return [w for w in client.workers() if w.info.id == "node-1"]

        wait_for(registered, START_TIMEOUT, "the worker to register")
        # Fashion-MNIST from Debian's package, under the flags' /usr/share.
        job = client.submit({"name": "flags", "world_size": 1, "device": "cpu",
                             "model": {"name": "mlp", "hidden_sizes": [16]},
                             "optimizer": {"name": "sgd", "lr": 0.1},
                             "batch_size": 32, "max_steps": 20})
        final = client.wait(job.id, timeout=120, poll=0.2)
        self.assertEqual(job_pb2.Job.State.Name(final.state), "SUCCEEDED",
                         self.log("worker") + self.log("coordinator"))


if __name__ == "__main__":
    unittest.main()
