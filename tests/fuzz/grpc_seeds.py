#!/usr/bin/env python3
"""Writes the seed corpus of grpc_fuzz (tests/fuzz/corpus/grpc): byte 0 the
method, byte 1 the token (indexes into grpc_fuzz.cc's tables), then the
request message. Needs the Python modules of proto/aidn/v1 on PYTHONPATH:
  protoc -Iproto --python_out=/tmp/pb proto/aidn/v1/*.proto
  PYTHONPATH=/tmp/pb python3 tests/fuzz/grpc_seeds.py
"""
import os

from aidn.v1 import cluster_pb2, job_pb2
from aidn.v1 import coordinator_pb2 as co

METHODS = ["SubmitJob", "GetJob", "ListJobs", "CancelJob", "WatchJob", "ListWorkers",
           "ListCheckpoints", "ListEvents", "GetMetrics", "ReadLogs", "RegisterWorker",
           "Heartbeat", "ReportTrainerExit", "JoinRendezvous", "KvSet", "KvGet", "KvAdd",
           "KvCompareAndSet", "ReportProgress", "StreamMetrics", "CommitCheckpoint",
           "ReportCheckpointInvalid", "ShipLogs", "SetWorkerScheduling", "RemoveWorker",
           "PauseJob", "ResumeJob"]
TOKENS = ["none", "garbage", "admin", "alice", "bob", "worker", "trainer"]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "grpc")


def seed(name, method, token, msg):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([METHODS.index(method), TOKENS.index(token)]) + msg.SerializeToString())


def main():
    spec = job_pb2.JobSpec(world_size=1)
    spec.model.name = "mlp"
    bad = job_pb2.JobSpec(world_size=0)
    bad.model.name = "nope"
    escape = job_pb2.JobSpec(world_size=1)
    escape.model.name = "mlp"
    escape.checkpoint.dir = "/etc/aidn-escape"
    seed("submit-alice", "SubmitJob", "alice", co.SubmitJobRequest(spec=spec))
    seed("submit-invalid", "SubmitJob", "alice", co.SubmitJobRequest(spec=bad))
    seed("submit-escape", "SubmitJob", "bob", co.SubmitJobRequest(spec=escape))
    seed("submit-worker-token", "SubmitJob", "worker", co.SubmitJobRequest(spec=spec))
    seed("get-own", "GetJob", "alice", co.GetJobRequest(job_id="job-1"))
    seed("get-other", "GetJob", "bob", co.GetJobRequest(job_id="job-1"))
    seed("list-states", "ListJobs", "admin",
         co.ListJobsRequest(states=[job_pb2.Job.RUNNING], page_size=2))
    seed("cancel-other", "CancelJob", "alice", co.CancelJobRequest(job_id="job-2", reason="x"))
    seed("cancel-shared", "CancelJob", "alice", co.CancelJobRequest(job_id="job-3"))
    seed("cancel-no-token", "CancelJob", "none", co.CancelJobRequest(job_id="job-1"))
    seed("watch-queued", "WatchJob", "bob", co.WatchJobRequest(job_id="job-2"))
    seed("events", "ListEvents", "alice", co.ListEventsRequest(job_id="job-1", limit=5))
    seed("checkpoints", "ListCheckpoints", "alice", co.ListCheckpointsRequest(job_id="job-1"))
    seed("metrics", "GetMetrics", "alice", co.GetMetricsRequest(job_id="job-1"))
    seed("logs", "ReadLogs", "alice", co.ReadLogsRequest(job_id="job-1"))
    seed("workers", "ListWorkers", "garbage", co.ListWorkersRequest())
    seed("cordon-user-token", "SetWorkerScheduling", "alice", co.SetWorkerSchedulingRequest(
        worker_id="w1", scheduling=job_pb2.Worker.CORDONED))
    seed("drain-unknown", "SetWorkerScheduling", "admin", co.SetWorkerSchedulingRequest(
        worker_id="w9", scheduling=job_pb2.Worker.DRAINING, reason="maintenance"))
    seed("scheduling-bad-value", "SetWorkerScheduling", "admin",
         co.SetWorkerSchedulingRequest(worker_id="w1", scheduling=7))
    seed("remove-alive", "RemoveWorker", "admin", co.RemoveWorkerRequest(worker_id="w1"))
    seed("pause-other", "PauseJob", "alice", co.PauseJobRequest(job_id="job-2", reason="x"))
    seed("pause-queued", "PauseJob", "bob", co.PauseJobRequest(job_id="job-2"))
    seed("resume-not-paused", "ResumeJob", "admin", co.ResumeJobRequest(job_id="job-1"))
    seed("register-duplicate", "RegisterWorker", "worker", cluster_pb2.RegisterWorkerRequest(
        info=job_pb2.WorkerInfo(id="w1", address="127.0.0.1", cpu_slots=4, instance="other")))
    seed("register-user-token", "RegisterWorker", "alice", cluster_pb2.RegisterWorkerRequest(
        info=job_pb2.WorkerInfo(id="w2", cpu_slots=2)))
    seed("heartbeat", "Heartbeat", "worker", cluster_pb2.HeartbeatRequest(worker_id="w1"))
    seed("heartbeat-unknown", "Heartbeat", "worker", cluster_pb2.HeartbeatRequest(worker_id="w9"))
    seed("trainer-exit-stale", "ReportTrainerExit", "worker", cluster_pb2.ReportTrainerExitRequest(
        job_id="job-1", generation=7, rank=0, worker_id="w1"))
    seed("rendezvous", "JoinRendezvous", "trainer",
         cluster_pb2.JoinRendezvousRequest(job_id="job-1", generation=1, rank=0))
    seed("kvset-other-job", "KvSet", "trainer",
         cluster_pb2.KvSetRequest(job_id="job-2", key="k", value=b"v"))
    seed("kvset", "KvSet", "trainer",
         cluster_pb2.KvSetRequest(job_id="job-1", generation=1, key="k", value=b"v"))
    seed("kvget", "KvGet", "trainer", cluster_pb2.KvGetRequest(job_id="job-1", generation=1, key="k"))
    seed("kvadd", "KvAdd", "trainer",
         cluster_pb2.KvAddRequest(job_id="job-1", generation=1, key="n", delta=1))
    seed("kvcas", "KvCompareAndSet", "trainer",
         cluster_pb2.KvCompareAndSetRequest(job_id="job-1", generation=1, key="k"))
    seed("progress", "ReportProgress", "trainer",
         cluster_pb2.ReportProgressRequest(job_id="job-1", generation=1, rank=0, step=3))
    seed("progress-stale", "ReportProgress", "trainer",
         cluster_pb2.ReportProgressRequest(job_id="job-1", generation=0, rank=0, step=3))
    seed("metrics-stream", "StreamMetrics", "trainer",
         cluster_pb2.StreamMetricsRequest(job_id="job-1", generation=1, rank=0))
    seed("commit", "CommitCheckpoint", "trainer",
         cluster_pb2.CommitCheckpointRequest(job_id="job-1", generation=1, rank=0, step=10))
    seed("commit-other-job", "CommitCheckpoint", "trainer",
         cluster_pb2.CommitCheckpointRequest(job_id="job-2", generation=1, rank=0, step=10))
    seed("invalid-ckpt", "ReportCheckpointInvalid", "trainer",
         cluster_pb2.ReportCheckpointInvalidRequest(job_id="job-1", step=10))
    seed("shiplogs", "ShipLogs", "worker", cluster_pb2.ShipLogsRequest(
        worker_id="w1", chunks=[cluster_pb2.LogChunk(job_id="job-1", generation=1, rank=0)]))


if __name__ == "__main__":
    main()
