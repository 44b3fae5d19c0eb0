"""deploy/slurm under a real Slurm: a one-node cluster (munged, slurmctld and
slurmd from Debian's slurm-wlm, configuration written here, everything on
loopback, stopped at the end) runs aidn.sbatch and pytorch-ddp.sbatch with
sbatch --wait, whose exit status is the aidn job's; and the time-limit
warning: the job pauses, the allocation is requeued, and the requeued one
resumes it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import unittest

from aidn_testing import START_TIMEOUT, binary, wait_for

SOURCE = os.environ.get("AIDN_SOURCE_DIR", "")
SLURM_TOOLS = ["munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel",
               "squeue"]
JOB_TIMEOUT = 240


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aidn_processes(needle):
    """PIDs of live processes whose command line mentions `needle`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


class SlurmCluster:
    """munged + slurmctld + slurmd in the foreground, as children."""

    def __init__(self, root):
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.processes = []
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def start(self):
        # munged wants every directory up to its socket searchable by all.
        os.chmod(self.root, 0o755)
        for d in ("munge", "sock", "ctld", "spool"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.chmod(os.path.join(self.root, "munge"), 0o700)
        os.chmod(os.path.join(self.root, "sock"), 0o755)
        key = os.path.join(self.root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = os.path.join(self.root, "sock", "munge.sock")
        self.spawn("munged", ["munged", "--foreground", f"--socket={sock}", f"--key-file={key}",
                              f"--pid-file={self.root}/munge/munged.pid",
                              f"--log-file={self.root}/munge/munged.log",
                              f"--seed-file={self.root}/munge/munged.seed"])
        wait_for(lambda: os.path.exists(sock), START_TIMEOUT, "munged's socket")

        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=aidntest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
# cred_expire: how long Slurm holds a requeued job (default 120 s).
AuthInfo=socket={sock},cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root}/ctld
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=aidn Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self.spawn("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        self.spawn("slurmd", ["slurmd", "-D", "-f", self.conf])

        def idle():
            for p, name in self.processes:
                if p.poll() is not None:
                    raise AssertionError(f"{name} exited with {p.returncode}:\n{self.logs()}")
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env,
                               capture_output=True, text=True, timeout=30)
            return r.returncode == 0 and r.stdout.strip() == "idle"

        wait_for(idle, 60, "the Slurm node to be idle", interval=0.3)
        self.cpus = cpus

    def spawn(self, name, argv):
        log = open(os.path.join(self.root, name + ".out"), "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=log, env=self.env)
        log.close()
        self.processes.append((p, name))

    def stop(self):
        # Jobs outlive a stopped slurmd (Slurm keeps them running across
        # daemon restarts): end them first.
        if self.processes:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env,
                           capture_output=True, timeout=60)

            def no_jobs():
                r = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True,
                                   text=True, timeout=30)
                return r.returncode != 0 or not r.stdout.strip()

            try:
                wait_for(no_jobs, 60, "the cancelled jobs to end", interval=0.5)
            except AssertionError:
                pass  # the daemons go anyway; assert_nothing_left has said what stayed
        for p, _ in reversed(self.processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _ in reversed(self.processes):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self):
        text = ""
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out", "munged.out"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f"--- {name}\n{f.read()[-3000:]}"
        return text


class SlurmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not SOURCE:
            raise unittest.SkipTest("AIDN_SOURCE_DIR is not set")
        missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
        if missing:
            raise unittest.SkipTest(f"Slurm is not installed ({', '.join(missing)} missing): "
                                    "apt-get install slurm-wlm munge")
        if os.geteuid() != 0:
            raise unittest.SkipTest("slurmd needs root to start jobs")
        cls.binaries = {"AIDN_COORDINATOR": binary("AIDN_COORDINATOR_BIN"),
                        "AIDN_WORKER": binary("AIDN_WORKER_BIN"),
                        "AIDNCTL": binary("AIDN_AIDNCTL_BIN")}
        cls.root = tempfile.mkdtemp(prefix="aidn-slurm-test.")
        cls.cluster = SlurmCluster(cls.root)
        try:
            cls.cluster.start()
        except BaseException:
            cls.cluster.stop()
            shutil.rmtree(cls.root, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        shutil.rmtree(cls.root, ignore_errors=True)

    def sbatch(self, name, script, args, cpus, extra_env=None, wait=True):
        """sbatch --wait of `script`; (exit status, its output, state dir).
        Without `wait`: (Slurm job id, output file, state dir) at once."""
        work = os.path.join(self.root, name)
        # Command ranks run as nobody here: they write their checkpoints
        # under the state directory's checkpoints/.
        os.makedirs(os.path.join(work, "state", "checkpoints"))
        os.chmod(os.path.join(work, "state", "checkpoints"), 0o1777)
        os.makedirs(os.path.join(work, "tmp"))
        env = dict(self.cluster.env, **self.binaries, AIDN_STATE_DIR=f"{work}/state",
                   AIDN_ADVERTISE_HOST="127.0.0.1", AIDN_NODE_ADDRESS="127.0.0.1",
                   AIDN_DEPLOY_DIR=f"{SOURCE}/deploy",
                   # Debian's python3 (with python3-torch) for "python3" in
                   # command jobs, whatever this shell's PATH puts first.
                   PATH="/usr/sbin:/usr/bin:/sbin:/bin", TMPDIR=f"{work}/tmp",
                   # The workers run as root here (slurmd runs root's jobs as
                   # root); command jobs then need a user of their own.
                   AIDN_WORKER_ARGS="--command-user=nobody", **(extra_env or {}))
        out = os.path.join(work, "slurm.out")
        argv = ["sbatch", f"--ntasks={cpus}", "--cpus-per-task=1", "--time=10", f"--output={out}",
                "--open-mode=append", f"--chdir={work}",
                os.path.join(SOURCE, "deploy", "slurm", script)] + args
        if not wait:
            result = subprocess.run(argv[:1] + ["--parsable"] + argv[1:], env=env, check=True,
                                    capture_output=True, text=True, timeout=60)
            return result.stdout.strip().split(";")[0], out, f"{work}/state"
        result = subprocess.run(argv[:1] + ["--wait"] + argv[1:], env=env, capture_output=True,
                                text=True, timeout=JOB_TIMEOUT)
        with open(out, errors="replace") if os.path.exists(out) else open(os.devnull) as f:
            output = f.read()
        return result.returncode, output + result.stderr, f"{work}/state"

    def explain(self, output, state):
        text = output
        for name in ("workers.log", "coordinator.log"):
            path = os.path.join(state, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f"\n--- {name}\n" + f.read()[-3000:]
        return text + "\n" + self.cluster.logs()

    def assert_nothing_left(self, state):
        wait_for(lambda: not aidn_processes(state), 30,
                 "the allocation's workers and trainers to be gone")
        tmp = os.path.join(os.path.dirname(state), "tmp")
        wait_for(lambda: not os.listdir(tmp), 30, "the workers' scratch directories to go")

    def write_spec(self, name, text):
        path = os.path.join(self.root, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_a_job_runs_in_an_allocation_and_its_status_is_the_exit_status(self):
        spec = self.write_spec("mlp.yaml", """name: slurm-mlp
world_size: 2
device: cpu
model: {name: mlp, hidden_sizes: [32]}
optimizer: {name: sgd, lr: 0.05}
batch_size: 32
max_steps: 40
""")
        status, output, state = self.sbatch("mlp", "aidn.sbatch", [spec], cpus=2)
        self.assertEqual(status, 0, self.explain(output, state))
        self.assertIn("SUCCEEDED", output, self.explain(output, state))
        self.assert_nothing_left(state)

    def test_a_failed_job_fails_the_allocation(self):
        spec = self.write_spec("fails.yaml", """name: slurm-fails
world_size: 1
device: cpu
max_restarts: 0
command:
  argv: [/bin/sh, -c, "echo giving up; exit 3"]
""")
        status, output, state = self.sbatch("fails", "aidn.sbatch", [spec], cpus=1)
        self.assertNotEqual(status, 0, self.explain(output, state))
        self.assertIn("FAILED", output, self.explain(output, state))
        self.assert_nothing_left(state)

    def test_the_pytorch_ddp_example(self):
        r = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True)
        if r.returncode != 0:
            self.skipTest("/usr/bin/python3 cannot import torch (python3-torch)")
        if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
            self.skipTest("dataset-fashion-mnist is not installed")
        status, output, state = self.sbatch(
            "pytorch", "pytorch-ddp.sbatch", [], cpus=2,
            extra_env={"AIDN_EXAMPLE_DIR": f"{SOURCE}/examples/pytorch-ddp", "EPOCHS": "1", "MAX_STEPS": "60",
                       "AIDN_ALLOWED_PATHS": f"/usr/share,{SOURCE},{self.root}"})
        self.assertEqual(status, 0, self.explain(output, state))
        self.assertIn("SUCCEEDED", output, self.explain(output, state))
        self.assert_nothing_left(state)


    def test_the_time_limit_warning_pauses_the_job_and_the_requeued_allocation_resumes_it(self):
        spec = self.write_spec("long.yaml", """name: slurm-pause
world_size: 2
device: cpu
model: {name: mlp, hidden_sizes: [64]}
optimizer: {name: adamw, lr: 0.001}
batch_size: 32
max_steps: 40000
checkpoint: {dir: runs}
""")
        slurm_job, out, state = self.sbatch("pause", "aidn.sbatch", [spec], cpus=2, wait=False)

        def job():
            """The aidn job as the coordinator of the allocation says, {} when
            there is none."""
            try:
                with open(os.path.join(state, "coordinator.addr")) as f:
                    port = f.read().strip().rsplit(":", 1)[1]
                with open(os.path.join(state, "coordinator", "admin.token")) as f:
                    token = f.read().strip()
                with open(os.path.join(state, "aidn-job-id")) as f:
                    job_id = f.read().strip()
            except (OSError, IndexError):
                return {}
            env = dict(os.environ, AIDN_ADDR=f"127.0.0.1:{port}", AIDN_TOKEN=token,
                       AIDN_TLS_CA=os.path.join(state, "coordinator", "tls", "ca.pem"))
            r = subprocess.run([self.binaries["AIDNCTL"], "-o", "json", "describe", job_id],
                               env=env, capture_output=True, text=True, timeout=30)
            return json.loads(r.stdout) if r.returncode == 0 else {}

        def slurm_state():
            r = subprocess.run(["scontrol", "-o", "show", "job", slurm_job], capture_output=True,
                               text=True, env=self.cluster.env)
            return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

        def output():
            with open(out, errors="replace") as f:
                return f.read()

        wait_for(lambda: int(job().get("last_step", 0)) >= 500, 120, "the aidn job to train")
        # What Slurm sends the batch shell at --signal=B:USR1@120.
        subprocess.run(["scancel", "--signal=USR1", "--batch", slurm_job], env=self.cluster.env,
                       check=True)
        wait_for(lambda: "paused job-1 at checkpoint step" in output(), 120,
                 "the aidn job to pause")
        wait_for(lambda: slurm_state().get("JobState") == "COMPLETED", JOB_TIMEOUT,
                 "the requeued allocation to finish the job")
        text = output()
        self.assertEqual(slurm_state().get("Restarts"), "1", self.explain(text, state))
        self.assertEqual(slurm_state().get("ExitCode"), "0:0", self.explain(text, state))
        paused_at = text.split("paused job-1 at checkpoint step ", 1)[1].split()[0]
        self.assertIn("every rank checkpoints at step " + paused_at + " to pause", text)
        # The requeued allocation went on from the pause's checkpoint, and
        # the job counted no restart.
        self.assertIn("resumed job-1: continues from checkpoint step " + paused_at, text)
        self.assertIn("job.resumed  resumed from step " + paused_at, text)
        self.assertNotIn("job.restarting", text)
        self.assertIn("job job-1 SUCCEEDED", text, self.explain(text, state))
        self.assert_nothing_left(state)

if __name__ == "__main__":
    unittest.main()
