"""aidn's Python client.

Inside a job (a rank process started by an aidn worker; docs/python.md):

    import aidn

    start = aidn.resume()                   # None, or (step, path) verified
    for step in range(start.step + 1 if start else 1, steps + 1):
        loss = train_one_step()
        aidn.report(step, loss=loss, samples=64, epoch=epoch, total_steps=steps)
        asked = aidn.should_checkpoint(step)    # every rank, every step
        if rank == 0 and (step % 100 == 0 or asked):
            with aidn.checkpoint(step) as path:
                torch.save(state, os.path.join(path, "state.pt"))
        if aidn.should_stop():
            break
    aidn.flush()

Outside aidn the same calls are harmless no-ops (with one warning), so the
script runs by hand too. From anywhere, aidn.Client talks to the coordinator
as aidnctl does (submit, list, watch, cancel, metrics, ...).
"""

import operator
import time as _time

from . import _job
from ._ask import should_checkpoint
from ._checkpoint import Resume, checkpoint, resume
from ._manifest import CheckpointInvalid, verify_checkpoint_dir
from ._stop import should_stop

__all__ = [
    "CheckpointInvalid", "Client", "ClientError", "Resume", "checkpoint", "current_job",
    "flush", "report", "resume", "should_checkpoint", "should_stop", "verify_checkpoint_dir",
]

# The keyword arguments of report() beside step, loss and samples, and the
# MetricRecord field (or progress value) each one fills.
_FLOAT_FIELDS = ("lr", "step_seconds", "allreduce_seconds", "compute_seconds", "test_loss",
                 "test_accuracy")
_INT_FIELDS = ("epoch", "total_steps")
SUPPORTED_METRICS = ("loss", "samples") + _INT_FIELDS + _FLOAT_FIELDS
_EVAL_FIELDS = frozenset({"test_loss", "test_accuracy"})


def current_job():
    """The job this process is a rank of (job_id, generation, rank,
    world_size, ...), or None when it does not run under aidn."""
    return _job.current().env


def _number(name, value, kind):
    what = "a number" if kind is float else "an integer"
    # float("1.5") would take a string.
    if not isinstance(value, (str, bytes)):
        try:
            return float(value) if kind is float else operator.index(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"aidn.report(): {name} must be {what}, not {type(value).__name__}")


def report(step, loss=None, samples=None, **more):
    """Reports this rank's step `step` (counted from 1): a TRAIN record with
    loss (this rank's), samples (this rank's), and any of epoch, lr,
    step_seconds, allreduce_seconds, compute_seconds; an EVAL record when
    test_loss or test_accuracy is given (only an EVAL record when no training
    value is). total_steps is the run's length, for progress. epoch and
    total_steps carry over to later reports. Never blocks: records go in
    batches from a background thread, and progress beats go every second
    from the first report on. An unknown keyword is a TypeError."""
    unknown = sorted(set(more) - set(SUPPORTED_METRICS))
    if unknown:
        raise TypeError(f"aidn.report() got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"supported: step, {', '.join(SUPPORTED_METRICS)}")
    step = _number("step", step, int)
    if step < 0:
        raise ValueError(f"aidn.report(): step must be >= 0, not {step}")
    values = {}
    if loss is not None:
        values["loss"] = _number("loss", loss, float)
    if samples is not None:
        values["samples"] = _number("samples", samples, int)
    for name, value in more.items():
        if value is not None:
            values[name] = _number(name, value, int if name in _INT_FIELDS else float)

    job = _job.current()
    if "epoch" in values:
        job.epoch = values.pop("epoch")
    if "total_steps" in values:
        job.total_steps = values.pop("total_steps")
    job.last_step = max(job.last_step, step)
    if job.env is None:
        job.warn_not_under_aidn("aidn.report")
        return
    reporter = job.reporter()
    if reporter.fenced:
        return

    from .v1 import job_pb2
    now = _time.time()
    base = dict(step=step, epoch=job.epoch, rank=job.env.rank, generation=job.env.generation)
    eval_values = {k: values.pop(k) for k in list(values) if k in _EVAL_FIELDS}
    if values or not eval_values:
        record = job_pb2.MetricRecord(kind=job_pb2.MetricRecord.TRAIN, **base, **values)
        record.time.FromNanoseconds(int(now * 1e9))
        reporter.record(record)
    if eval_values:
        record = job_pb2.MetricRecord(kind=job_pb2.MetricRecord.EVAL, **base, **eval_values)
        record.time.FromNanoseconds(int(now * 1e9))
        reporter.record(record)
    reporter.progress(job.last_step, job.epoch, job.total_steps)


def flush(timeout: float = 10.0) -> bool:
    """Sends the records and checkpoint commits held now and waits (at most
    `timeout` seconds) until the coordinator says they are stored. True when
    they are, or when there is nothing to send (not under aidn, nothing
    reported, or the generation is over). Interpreter exit does this too
    (for at most 5 s), but os._exit() skips it: call flush() first."""
    job = _job.current()
    if job.env is None:
        return True
    reporter = job.reporter_if_started()
    return True if reporter is None else reporter.flush(timeout)


def __getattr__(name):
    # The client pulls in more (spec parsing, CoordinatorService stubs): only
    # on first use.
    if name in ("Client", "ClientError"):
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'aidn' has no attribute {name!r}")
