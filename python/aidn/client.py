"""aidn.Client: the coordinator's CoordinatorService from Python, with
aidnctl's address and token (see _config for where they come from).

    client = aidn.Client()
    job = client.submit("examples/pytorch-ddp/job.yaml")
    for item in client.watch(job.id):
        print(item)
    print(client.metrics(job.id)[-1].loss)
    for line in client.logs(job.id, follow=True):
        print(f"[rank {line.rank}] {line.text}")

Answers are the API's protobuf messages (aidn.v1.job_pb2.Job, StepMetrics,
Checkpoint, Event, Worker), except logs(), which gives LogLine tuples;
describe() gives plain dicts. A refused call raises ClientError with the
gRPC status code and the coordinator's message.
"""

import datetime
import os
import time
from typing import (Any, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional,
                    Union)

import grpc
from google.protobuf import json_format

from . import _config, _rpc, _spec
from .v1 import coordinator_pb2, coordinator_pb2_grpc, job_pb2

_ENDED = (job_pb2.Job.SUCCEEDED, job_pb2.Job.FAILED, job_pb2.Job.CANCELLED)


class ClientError(RuntimeError):
    """A call the coordinator refused or could not answer."""

    def __init__(self, call: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{call}: {code.name}: {details}")
        self.call = call
        self.code = code
        self.details = details


def _state(state: Union[str, int]) -> int:
    if isinstance(state, str):
        try:
            return job_pb2.Job.State.Value(state.upper())
        except ValueError:
            names = ", ".join(n.lower() for n in job_pb2.Job.State.keys()[1:])
            raise ValueError(f"unknown job state {state!r} (known: {names})") from None
    return int(state)


def _dict(message) -> Dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


class LogLine(NamedTuple):
    """One line a rank printed (stdout and stderr together), without its
    newline."""
    generation: int
    rank: int
    # The line's number in its rank's output in that generation, from 0.
    seq: int
    # The bytes decoded as UTF-8; bytes that are not become U+FFFD.
    text: str
    # When the worker read it (UTC).
    time: datetime.datetime


class LogStream:
    """The iterator Client.logs() returns: LogLine after LogLine, in the order
    they reached the coordinator (per rank, in the order printed).

    `dropped_lines` and `dropped_bytes`: how many of the job's oldest lines
    (and their bytes) the coordinator had dropped to keep within its per-job
    bound, as of the last answer read (0 until one says otherwise). close()
    (or leaving a `with` block) cancels the stream; so does reading it to
    the end. Not thread-safe."""

    def __init__(self, stream):
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self._stream = stream
        self._lines = self._read()

    def __iter__(self) -> "LogStream":
        return self

    def __next__(self) -> LogLine:
        return next(self._lines)

    def close(self) -> None:
        self._lines.close()
        self._stream.cancel()

    def __enter__(self) -> "LogStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> Iterator[LogLine]:
        try:
            for response in self._stream:
                if response.dropped_lines > self.dropped_lines:
                    self.dropped_lines = response.dropped_lines
                    self.dropped_bytes = response.dropped_bytes
                for entry in response.lines:
                    yield LogLine(entry.generation, entry.rank, entry.seq,
                                  entry.text.decode("utf-8", errors="replace"),
                                  entry.time.ToDatetime(tzinfo=datetime.timezone.utc))
        except grpc.RpcError as e:
            raise ClientError("ReadLogs", _rpc.code_of(e), _rpc.details_of(e)) from None
        finally:
            self._stream.cancel()


class Client:
    """A connection to the coordinator as a user (or admin). Thread-safe, as
    gRPC channels are; close() it, or use it as a context manager."""

    def __init__(self, address: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 30.0, tls_ca: Optional[str] = None,
                 insecure: Optional[bool] = None):
        """`address` (host:port), `token`, `tls_ca` (the CA file verifying the
        coordinator: its <state-dir>/tls/ca.pem) and `insecure` (plaintext)
        default to AIDN_ADDR, AIDN_TOKEN, AIDN_TLS_CA and AIDN_INSECURE, then
        aidnctl's config file, then 127.0.0.1:7070, no token and TLS verified
        with the system's roots. `timeout`: each call's deadline in seconds."""
        connection = _config.resolve(address, token, tls_ca=tls_ca, insecure=insecure)
        self.address = connection.address
        self._metadata = _rpc.metadata(connection.token)
        self._timeout = timeout
        self._channel = _rpc.make_channel(self.address, connection.tls_ca, connection.insecure)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name: str, request):
        try:
            return getattr(self._stub, name)(request, timeout=self._timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as e:
            raise ClientError(name, _rpc.code_of(e), _rpc.details_of(e)) from None

    # -- jobs -----------------------------------------------------------------

    def submit(self, spec: Union[str, os.PathLike, Mapping, job_pb2.JobSpec]) -> job_pb2.Job:
        """Submits a job: a dict as job.yaml would hold it, a JobSpec, or the
        path of a YAML or JSON file. The job as stored, defaults filled in."""
        request = coordinator_pb2.SubmitJobRequest(spec=_spec.load_spec(spec))
        return self._call("SubmitJob", request).job

    def get(self, job_id: str) -> job_pb2.Job:
        return self._call("GetJob", coordinator_pb2.GetJobRequest(job_id=job_id))

    def describe(self, job_id: str, events: int = 20) -> Dict[str, Any]:
        """The job, its checkpoints and its newest `events` events, as plain
        dicts (protobuf's JSON mapping with job.proto's field names)."""
        job = self.get(job_id)
        all_events = self.events(job_id)
        return {
            "job": _dict(job),
            "checkpoints": [_dict(c) for c in self.checkpoints(job_id)],
            "events": [_dict(e) for e in all_events[-events:]] if events > 0 else [],
        }

    def list(self, states: Iterable[Union[str, int]] = (),
             labels: Optional[Mapping[str, str]] = None,
             limit: Optional[int] = None) -> List[job_pb2.Job]:
        """Jobs, newest first, in `states` (names or Job.State values; all by
        default) carrying every one of `labels`; at most `limit`."""
        request = coordinator_pb2.ListJobsRequest(states=[_state(s) for s in states],
                                                  labels=dict(labels or {}))
        jobs = []
        while True:
            if limit is not None:
                request.page_size = max(1, min(1000, limit - len(jobs)))
            response = self._call("ListJobs", request)
            jobs.extend(response.jobs)
            if not response.next_page_token or (limit is not None and len(jobs) >= limit):
                return jobs[:limit] if limit is not None else jobs
            request.page_token = response.next_page_token

    def cancel(self, job_id: str, reason: str = "") -> job_pb2.Job:
        return self._call("CancelJob", coordinator_pb2.CancelJobRequest(job_id=job_id,
                                                                        reason=reason))

    def pause(self, job_id: str, reason: str = "") -> job_pb2.Job:
        """Checkpoint at a step the ranks agree on, then stop (state PAUSED,
        no slots held, no restart counted); at once for a job not running."""
        return self._call("PauseJob", coordinator_pb2.PauseJobRequest(job_id=job_id,
                                                                      reason=reason))

    def resume(self, job_id: str) -> job_pb2.Job:
        """Queue a PAUSED job again; it goes on from its checkpoint."""
        return self._call("ResumeJob", coordinator_pb2.ResumeJobRequest(job_id=job_id))

    def wait(self, job_id: str, timeout: Optional[float] = None,
             poll: float = 1.0) -> job_pb2.Job:
        """Polls until the job ended (SUCCEEDED, FAILED or CANCELLED); the job
        as last seen. TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job.state in _ENDED:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job_pb2.Job.State.Name(job.state)} "
                                   f"after {timeout} s")
            time.sleep(poll if deadline is None else
                       max(0.0, min(poll, deadline - time.monotonic())))

    def watch(self, job_id: str, from_step: int = 0, include_metrics: bool = True,
              after_event_seq: int = 0, timeout: Optional[float] = None) -> Iterator[Any]:
        """The job as it is now, then its state changes (Job), events (Event)
        and step metrics (StepMetrics) as they happen; ends when the job has
        ended and everything was sent. `timeout`: for the whole stream."""
        request = coordinator_pb2.WatchJobRequest(job_id=job_id, from_step=from_step,
                                                  include_metrics=include_metrics,
                                                  after_event_seq=after_event_seq)
        stream = self._stub.WatchJob(request, timeout=timeout, metadata=self._metadata)
        try:
            for response in stream:
                which = response.WhichOneof("item")
                if which is not None:
                    yield getattr(response, which)
        except grpc.RpcError as e:
            raise ClientError("WatchJob", _rpc.code_of(e), _rpc.details_of(e)) from None
        finally:
            stream.cancel()

    # -- what jobs leave behind ---------------------------------------------

    def logs(self, job_id: str, rank: Optional[int] = None,
             generation: Optional[int] = None, all_generations: bool = False,
             tail: int = 0, follow: bool = False,
             timeout: Optional[float] = None) -> LogStream:
        """The output of the job's ranks as LogLine, as `aidnctl logs` shows
        it: the current generation's (or `generation`'s, or with
        `all_generations` every one's), of every rank or of `rank`; with
        `tail` > 0 only the last `tail` of them. With `follow` the stream
        stays open for new lines and ends once the generation is over and its
        ranks' output is all in. `timeout`: for the whole stream; by default
        the client's timeout without `follow`, none with it. A stream that
        breaks raises ClientError (it is not read again)."""
        request = coordinator_pb2.ReadLogsRequest(job_id=job_id, all_generations=all_generations,
                                                  tail=tail, follow=follow)
        if rank is not None:
            request.rank = rank
        if generation is not None:
            request.generation = generation
        if timeout is None and not follow:
            timeout = self._timeout
        return LogStream(self._stub.ReadLogs(request, timeout=timeout,
                                             metadata=self._metadata))

    def events(self, job_id: str = "", after_seq: int = 0,
               limit: int = 0) -> List[job_pb2.Event]:
        """The job's events (every job's and the cluster's for ""), oldest
        first."""
        request = coordinator_pb2.ListEventsRequest(job_id=job_id, after_seq=after_seq,
                                                    limit=limit)
        return list(self._call("ListEvents", request).events)

    def metrics(self, job_id: str, from_step: int = 0, to_step: int = 0,
                limit: int = 0) -> List[job_pb2.StepMetrics]:
        """The job's steps from_step..to_step (0: no bound), aggregated over
        its ranks, ordered by step, TRAIN before EVAL at the same step."""
        request = coordinator_pb2.GetMetricsRequest(job_id=job_id, from_step=from_step,
                                                    to_step=to_step, limit=limit)
        return list(self._call("GetMetrics", request).steps)

    def checkpoints(self, job_id: str) -> List[job_pb2.Checkpoint]:
        """The job's checkpoints, oldest first."""
        request = coordinator_pb2.ListCheckpointsRequest(job_id=job_id)
        return list(self._call("ListCheckpoints", request).checkpoints)

    def workers(self) -> List[job_pb2.Worker]:
        return list(self._call("ListWorkers", coordinator_pb2.ListWorkersRequest()).workers)

    def cordon(self, worker_id: str, reason: str = "") -> job_pb2.Worker:
        """Admins: place no new ranks on the worker; running ones go on."""
        return self._set_scheduling(worker_id, job_pb2.Worker.CORDONED, reason)

    def drain(self, worker_id: str, reason: str = "") -> job_pb2.Worker:
        """Admins: cordon the worker and move each job running there to other
        workers at its next checkpoint (a restart that is not counted)."""
        return self._set_scheduling(worker_id, job_pb2.Worker.DRAINING, reason)

    def uncordon(self, worker_id: str) -> job_pb2.Worker:
        """Admins: place ranks on a cordoned or drained worker again."""
        return self._set_scheduling(worker_id, job_pb2.Worker.SCHEDULABLE, "")

    def remove_worker(self, worker_id: str) -> None:
        """Admins: forget a LOST worker (ClientError FAILED_PRECONDITION for a
        live one)."""
        self._call("RemoveWorker", coordinator_pb2.RemoveWorkerRequest(worker_id=worker_id))

    def _set_scheduling(self, worker_id: str, scheduling: int, reason: str) -> job_pb2.Worker:
        request = coordinator_pb2.SetWorkerSchedulingRequest(
            worker_id=worker_id, scheduling=scheduling, reason=reason)
        return self._call("SetWorkerScheduling", request)
