"""The process's view of its job: the environment read once, the channel and
the reporter made on first use, and the one-time warnings."""

import atexit
import logging
import os
import threading
from typing import Optional

from . import _env

log = logging.getLogger("aidn")

# What interpreter exit waits, at most, for records and commits to be stored.
EXIT_FLUSH_SECONDS = 5.0


class Job:
    """One rank's connection to the coordinator, or the lack of one."""

    def __init__(self):
        self.env: Optional[_env.JobEnv] = _env.job_env()
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._channel = None
        self._stub = None
        self._reporter = None
        self._warned = set()
        # Sticky between reports: a report without them keeps the last ones.
        self.epoch = 0
        self.total_steps = 0
        self.last_step = -1

    def warn_once(self, key: str, message: str, *args) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message, *args)

    def warn_not_under_aidn(self, what: str) -> None:
        self.warn_once("not-under-aidn",
                       "aidn: not running under aidn (AIDN_COORDINATOR or AIDN_JOB_ID unset): "
                       "%s and the other job calls do nothing", what)

    def stub(self):
        """The ClusterService stub (under aidn only)."""
        with self._lock:
            if self._stub is None:
                from . import _rpc
                from .v1 import cluster_pb2_grpc
                self._channel = _rpc.make_channel(self.env.coordinator, self.env.tls_ca,
                                                  self.env.insecure)
                self._stub = cluster_pb2_grpc.ClusterServiceStub(self._channel)
            return self._stub

    def reporter(self):
        """The reporter, started on first use (under aidn only)."""
        stub = self.stub()
        with self._lock:
            if self._reporter is None:
                from . import _checkpoint, _reporter
                env = self.env
                self._reporter = _reporter.Reporter(
                    stub, env.job_id, env.generation, env.rank, env.token,
                    retire=_checkpoint.remove_retired)
                atexit.register(self._close_at_exit)
            return self._reporter

    def reporter_if_started(self):
        with self._lock:
            return self._reporter

    def _close_at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        reporter = self.reporter_if_started()
        if reporter is not None and not reporter.close(EXIT_FLUSH_SECONDS):
            log.warning("aidn: metric records or checkpoint commits were still unconfirmed "
                        "after %.0f s at exit", EXIT_FLUSH_SECONDS)


_job: Optional[Job] = None
_job_lock = threading.Lock()


def current() -> Job:
    """This process's Job (a forked child gets one of its own)."""
    global _job
    with _job_lock:
        if _job is None or _job.pid != os.getpid():
            _job = Job()
        return _job

