"""A rank's line to the coordinator while it trains: metric records
(batched), checkpoint commits and progress beats, sent from a thread of its
own so that training never waits on the coordinator. The same protocol as
the C++ trainer's reporter (worker/trainer/reporter.{h,cc}):

- Records go once a second on one StreamMetrics call. They stay held until
  the coordinator says they are in its database (durable_step); all those not
  yet there are sent again when it restarted (a new incarnation), so a
  coordinator crash loses no step.
- A commit goes at once, but only after every record up to its step was
  sent: the coordinator makes a checkpoint a resume point only once the
  metrics it covers are stored.
- Progress beats (hang detection) go every second from the first report on;
  the first goes at once.
- What cannot be sent is kept (bounded: the oldest go, counted) and retried
  with exponential backoff.
- FAILED_PRECONDITION from any call means the generation is over, and so
  does UNAUTHENTICATED (a job's trainer token dies with the job): nothing
  more is sent, and `fenced` is set.
- flush() and close() send what is left within a deadline and wait until
  the coordinator says every record sent is stored.

Thread-safe.
"""

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, List, Optional

import grpc

from . import _rpc
from .v1 import cluster_pb2, job_pb2

log = logging.getLogger("aidn")

# Answers to a trainer call that mean the generation is over: another
# generation (or the job's end) fenced it off, or the job ended and its
# trainer token was revoked with it.
_OVER = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED})

# Records per StreamMetrics message, and per call.
_BATCH = 512
_MAX_PER_CALL = 16 * _BATCH


@dataclasses.dataclass
class ReporterOptions:
    # Records go this often: each call costs the coordinator far more than
    # its records do, and beats, which drive hang detection, go on their own.
    report_period: float = 1.0
    beat_period: float = 1.0
    # While a rank waits at a checkpoint step it was asked for, for the
    # others to agree: beats this often.
    fast_beat_period: float = 0.05
    # Each call's deadline (shortened to what is left while closing).
    rpc_timeout: float = 10.0
    # Records held (unsent, and sent but not yet stored) before the oldest go.
    max_records: int = 100_000
    max_commits: int = 1024
    # While flushing, how often to ask whether the records sent are stored.
    confirm_period: float = 0.1


@dataclasses.dataclass
class _Work:
    batch: List[job_pb2.MetricRecord]
    commit: bool = False
    confirm: bool = False
    beat: bool = False
    step: int = 0
    epoch: int = 0
    total: int = 0
    ack: int = 0
    missed: int = 0
    timeout: float = 10.0


class Reporter:
    """Sends one rank's records, commits and beats (see the module doc)."""

    def __init__(self, stub, job_id: str, generation: int, rank: int, token: str,
                 options: Optional[ReporterOptions] = None,
                 retire: Optional[Callable[[str, int], None]] = None):
        """`stub`: a ClusterServiceStub. `retire(dir, step)` is called on the
        reporter's thread for each checkpoint the job's retention dropped."""
        self._stub = stub
        self._job_id = job_id
        self._generation = generation
        self._rank = rank
        self._metadata = _rpc.metadata(token)
        self._options = options or ReporterOptions()
        self._retire = retire
        self._cv = threading.Condition(threading.Lock())
        self._records = collections.deque()
        self._unacked = collections.deque()  # sent, not yet reported stored
        self._commits = collections.deque()  # (request, checkpoint dir)
        self._incarnation = ""
        self._dropped = 0
        self._dropped_commits = 0
        self._progress_step = -1
        self._progress_epoch = 0
        self._total_steps = 0
        self._first_beat = False
        now = time.monotonic()
        self._next_send = now + self._options.report_period
        self._next_beat = now
        self._next_confirm = now
        self._retry_at = now
        self._flushing = 0
        self._closing = False
        self._close_deadline = float("inf")
        self._done = False
        self._fenced = False
        self._fence_reason = ""
        self._stop_reason = None
        # The coordinator's newest checkpoint ask (step, go), this rank's
        # answer, and whether it waits for go (fast beats).
        self._ask = (0, False)
        self._ask_ack = 0
        self._ask_missed = 0
        # The ask step last answered, and the last step boundary the
        # training thread checked at (-1: none yet).
        self._ask_answered = 0
        self._boundary = -1
        self._awaiting_go = False
        self._beat_now = False
        self._thread = threading.Thread(target=self._loop, name="aidn-reporter", daemon=True)
        self._thread.start()

    # -- what the training thread calls ------------------------------------

    def record(self, record: job_pb2.MetricRecord) -> None:
        with self._cv:
            if self._fenced or self._closing:
                return
            if len(self._records) + len(self._unacked) >= self._options.max_records:
                # Sent but unconfirmed ones go first: they most likely arrived.
                if self._unacked:
                    self._unacked.popleft()
                else:
                    self._records.popleft()
                    self._dropped += 1
            self._records.append(record)

    def commit(self, request: cluster_pb2.CommitCheckpointRequest, directory: str) -> None:
        """Queues a commit; commits go in order, each after the records up to
        its step, and are retried until the coordinator answers."""
        with self._cv:
            if self._fenced:
                return
            if len(self._commits) >= self._options.max_commits:
                self._commits.popleft()
                self._dropped_commits += 1
            self._commits.append((request, directory))
            self._cv.notify_all()

    def progress(self, step: int, epoch: int, total_steps: int) -> None:
        with self._cv:
            first = self._progress_step < 0
            self._progress_step = step
            self._progress_epoch = epoch
            self._total_steps = total_steps
            if first:
                # Until every rank beat once the coordinator counts the
                # generation as still setting up.
                self._first_beat = True
                self._cv.notify_all()

    def checkpoint_ask(self):
        """(step, go) of the checkpoint the coordinator asks for outside the
        program's schedule (a pause); step 0 when none."""
        with self._cv:
            return self._ask

    def at_step_boundary(self, step: int):
        """The training thread after step `step`, where it checks for an
        ask: returns (step, go), the ask answered if it was not. From then
        on the reporter's thread answers an ask as it arrives, since the
        training thread may be blocked in a collective that waits for a rank
        already waiting at the step: ack when the training thread has not yet
        passed the step's boundary (it will see the ask there: both take the
        same lock), missed when it has."""
        with self._cv:
            self._boundary = step
            ask_step = self._ask[0]
            if ask_step and ask_step != self._ask_answered:
                if step > ask_step:
                    log.info("aidn: already past the checkpoint step asked for (%d; at %d)",
                             ask_step, step)
                self._answer_locked(ask_step, missed=step > ask_step)
            return self._ask

    def answer_checkpoint_ask(self, step: int, missed: bool) -> None:
        """This rank will wait at `step` (or was already past it): sent with
        every beat from the next one, which goes at once."""
        with self._cv:
            self._answer_locked(step, missed)

    def _answer_locked(self, step: int, missed: bool) -> None:
        self._ask_answered = step
        self._ask_ack = 0 if missed else step
        self._ask_missed = step if missed else 0
        self._beat_now = True
        self._cv.notify_all()

    def await_checkpoint_go(self, step: int, timeout: float):
        """At the acked step: beats fast until go, another step, the end of
        the generation, or `timeout`. Returns the ask then."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._awaiting_go = True
            self._beat_now = True
            self._cv.notify_all()
            try:
                while (self._ask == (step, False) and not self._superseded() and
                       not self._done):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
            finally:
                self._awaiting_go = False
            return self._ask

    @property
    def fenced(self) -> bool:
        return self._fenced

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the coordinator said stop (a progress answer), or None."""
        return self._stop_reason

    def flush(self, timeout: float) -> bool:
        """Sends everything held now and waits until the coordinator says it
        is stored (records) or answered (commits). True when done within
        `timeout`; also True when the generation is over (nothing is wanted
        any more)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                while not self._all_stored():
                    left = deadline - time.monotonic()
                    if left <= 0 or self._done:
                        break
                    self._cv.wait(left)
                return self._all_stored()
            finally:
                self._flushing -= 1

    def close(self, timeout: float) -> bool:
        """Sends what is left within `timeout` and stops the thread once every
        record sent is stored. True when everything was."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            self._closing = True
            self._close_deadline = min(self._close_deadline, deadline)
            self._cv.notify_all()
            while not self._done:
                left = deadline + 0.1 - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            stored = self._all_stored()
            done = self._done
        if done and self._thread is not threading.current_thread():
            self._thread.join()
        if self._dropped:
            log.warning("aidn: %d metric records dropped while the coordinator was away",
                        self._dropped)
        if self._dropped_commits:
            log.warning("aidn: %d checkpoint commits dropped while the coordinator was away",
                        self._dropped_commits)
        return stored

    # -- the thread ---------------------------------------------------------

    def _superseded(self) -> bool:
        return self._fenced or self._stop_reason is not None

    def _all_stored(self) -> bool:
        return (not self._records and not self._commits and
                (not self._unacked or self._superseded()))

    def _take_due(self, now: float):
        """What is due now, or (None, when to look again)."""
        o = self._options
        urgent = self._closing or self._flushing > 0
        may_send = now >= self._retry_at
        commit = bool(self._commits)
        records_due = may_send and bool(self._records) and (
            urgent or commit or now >= self._next_send)
        beat = (not self._fenced and self._progress_step >= 0 and
                (self._first_beat or self._beat_now or now >= self._next_beat))
        unconfirmed = (urgent and not self._records and not commit and bool(self._unacked)
                       and not self._superseded())
        confirm = unconfirmed and may_send and now >= self._next_confirm
        if not (records_due or (may_send and commit) or beat or confirm):
            wake = self._next_send
            if self._progress_step >= 0 and not self._fenced:
                wake = min(wake, self._next_beat)
            if commit or (urgent and self._records):
                wake = min(wake, self._retry_at)
            if unconfirmed:
                wake = min(wake, max(self._next_confirm, self._retry_at))
            if self._closing:
                wake = min(wake, self._close_deadline)
            if now >= self._next_send:
                self._next_send = now + o.report_period  # nothing to send
            return None, wake
        work = _Work(batch=[])
        if records_due:
            while self._records and len(work.batch) < _MAX_PER_CALL:
                work.batch.append(self._records.popleft())
            # A backlog (after an outage) goes call after call.
            self._next_send = now if self._records else now + o.report_period
        work.commit = may_send and commit
        work.confirm = confirm
        if confirm:
            self._next_confirm = now + o.confirm_period
        work.beat = beat
        self._first_beat = False
        if beat:
            self._beat_now = False
        work.ack = self._ask_ack
        work.missed = self._ask_missed
        work.step = self._progress_step
        work.epoch = self._progress_epoch
        work.total = self._total_steps
        work.timeout = o.rpc_timeout
        if self._closing:
            work.timeout = min(o.rpc_timeout, max(0.001, self._close_deadline - now))
        return work, None

    def _loop(self) -> None:
        backoff = _rpc.Backoff()
        try:
            while True:
                with self._cv:
                    while True:
                        now = time.monotonic()
                        if self._closing and (self._all_stored() or now >= self._close_deadline):
                            return
                        work, wake = self._take_due(now)
                        if work is not None:
                            break
                        self._cv.wait(max(0.0, wake - now))
                failed = self._run(work)
                with self._cv:
                    if work.beat:
                        self._next_beat = time.monotonic() + (
                            self._options.fast_beat_period if self._awaiting_go
                            else self._options.beat_period)
                    if failed:
                        self._retry_at = time.monotonic() + backoff.next()
                    elif work.batch or work.commit or work.confirm:
                        backoff.reset()
                    self._cv.notify_all()
        except Exception:  # noqa: BLE001 - a bug here must not end training
            log.exception("aidn: the reporter thread failed; nothing more is sent")
        finally:
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def _run(self, work: _Work) -> bool:
        """Does one round of work; True when a send failed (retry later)."""
        failed = False
        # An empty call asks "stored yet?": its answer carries the durable
        # step and the incarnation.
        if work.confirm and not self._send([], work.timeout):
            failed = True
        if work.batch and not self._send(work.batch, work.timeout):
            with self._cv:
                self._records.extendleft(reversed(work.batch))  # in front, in order
            failed = True
        # Records first: a commit goes once none up to its step waits.
        if not failed and work.commit and not self._send_commit_if_due(work.timeout):
            failed = True
        if work.beat:
            self._send_progress(work)
        return failed

    def _fence(self, details: str) -> None:
        with self._cv:
            if self._fenced:
                return
            self._fenced = True
            self._fence_reason = details
            self._records.clear()
            self._commits.clear()
            self._unacked.clear()
            self._cv.notify_all()
        log.warning("aidn: the coordinator ended this generation (%s); nothing more is sent",
                    details or "no reason given")

    def _requests(self, batch):
        # At least one message, so that an empty call still names the job.
        first = 0
        while True:
            request = cluster_pb2.StreamMetricsRequest(
                job_id=self._job_id, generation=self._generation, rank=self._rank)
            request.records.extend(batch[first:first + _BATCH])
            yield request
            first += _BATCH
            if first >= len(batch):
                return

    def _send(self, batch, timeout: float) -> bool:
        """Sends a batch of records: True when done with it (sent, or nobody
        wants it any more)."""
        try:
            response = self._stub.StreamMetrics(self._requests(batch), timeout=timeout,
                                                metadata=self._metadata)
        except grpc.RpcError as e:
            code = _rpc.code_of(e)
            if code in _OVER:
                self._fence(_rpc.details_of(e))
                return True
            if code in _rpc.TRANSIENT:
                return False
            log.error("aidn: metric records refused (%s: %s); %d dropped", code.name,
                      _rpc.details_of(e), len(batch))
            return True
        with self._cv:
            self._unacked.extend(batch)
            self._seen_incarnation(response.incarnation)
            durable = response.durable_step
            if self._unacked and self._unacked[0].step <= durable:
                self._unacked = collections.deque(r for r in self._unacked if r.step > durable)
            self._cv.notify_all()
        return True

    def _seen_incarnation(self, incarnation: str) -> None:
        # A new incarnation is a restarted coordinator: whatever it had not
        # stored is gone, so every unconfirmed record goes again (it ignores
        # the ones it has). Called with the lock held.
        if not incarnation:
            return
        if self._incarnation and incarnation != self._incarnation:
            log.info("aidn: the coordinator restarted; sending %d unconfirmed metric records again",
                     len(self._unacked))
            self._records.extendleft(reversed(self._unacked))
            self._unacked.clear()
        self._incarnation = incarnation

    def _send_commit_if_due(self, timeout: float) -> bool:
        with self._cv:
            if not self._commits:
                return True
            request, directory = self._commits[0]
            if any(r.step <= request.step for r in self._records):
                return True  # the next batch takes them first
        try:
            response = self._stub.CommitCheckpoint(request, timeout=timeout,
                                                   metadata=self._metadata)
        except grpc.RpcError as e:
            code = _rpc.code_of(e)
            if code in _rpc.TRANSIENT:
                return False
            if code in _OVER:
                self._fence(_rpc.details_of(e))
                return True
            log.error("aidn: checkpoint commit of step %d refused: %s: %s", request.step,
                      code.name, _rpc.details_of(e))
            response = None
        if response is not None:
            log.info("aidn: checkpoint of step %d reported (%s)", request.step,
                     "committed" if response.committed else "awaiting the other ranks or metrics")
            for step in response.retired_steps:
                if self._retire is not None:
                    self._retire(directory, step)
        # Done with only now, so that a flush returns after the retired
        # directories are gone.
        with self._cv:
            if self._commits and self._commits[0][0] is request:
                self._commits.popleft()
            self._cv.notify_all()
        return True

    def _send_progress(self, work: _Work) -> None:
        request = cluster_pb2.ReportProgressRequest(
            job_id=self._job_id, generation=self._generation, rank=self._rank, step=work.step,
            epoch=work.epoch, total_steps=work.total, checkpoint_ack=work.ack,
            checkpoint_missed=work.missed)
        try:
            response = self._stub.ReportProgress(request, timeout=work.timeout,
                                                 metadata=self._metadata)
        except grpc.RpcError as e:
            if _rpc.code_of(e) in _OVER:
                self._fence(_rpc.details_of(e))
            return
        with self._cv:
            if response.stop and self._stop_reason is None:
                self._stop_reason = response.reason or "stopped by the coordinator"
                log.warning("aidn: the coordinator says stop: %s", self._stop_reason)
            self._seen_incarnation(response.incarnation)
            ask = (response.checkpoint.step, response.checkpoint.go)
            if ask != self._ask:
                if ask[0] not in (0, self._ask[0]):
                    log.info("aidn: the coordinator asks for a checkpoint at step %d (%s)",
                             ask[0], response.checkpoint.reason)
                self._ask = ask
                # Answered here, not by the training thread, which may wait
                # in a collective for a rank already waiting at the step.
                if ask[0] and ask[0] != self._ask_answered and self._boundary >= 0:
                    if self._boundary >= ask[0]:
                        log.info("aidn: already past the checkpoint step asked for (%d; at %d)",
                                 ask[0], self._boundary)
                    self._answer_locked(ask[0], missed=self._boundary >= ask[0])
            self._cv.notify_all()
