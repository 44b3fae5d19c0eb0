"""Checkpoint directories written and committed the way the C++ trainer does
it (worker/engine/checkpoint.cc), and the resume point verified the way it
verifies one.

    <AIDN_CHECKPOINT_DIR>/step-00000040/
      model.pt, ...   whatever the block wrote (plain files only)
      MANIFEST        sizes and CRC-32C of the files above; written last

Written atomically: the block writes into <dir>/.tmp-step-00000040-<pid>;
on its clean exit each file is fsync'd, the manifest written and fsync'd, the
directory fsync'd and renamed to step-00000040, and <dir> fsync'd. A reader
that finds step-N with a manifest that verifies sees the whole checkpoint.
"""

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from typing import Iterable, Iterator, NamedTuple, Optional

from . import _env, _job
from ._manifest import (MANIFEST_NAME, CheckpointInvalid, Manifest, ManifestEntry,
                        checkpoint_dir_name, checksum_file, format_manifest, plain_name,
                        sha256_hex, verify_checkpoint_dir)

log = logging.getLogger("aidn")


class Resume(NamedTuple):
    """A committed checkpoint to resume from: its step and directory."""
    step: int
    path: str


@dataclasses.dataclass
class _Written:
    path: str
    bytes: int
    manifest: str


def _step_of(step) -> int:
    try:
        value = step.__index__()
    except AttributeError:
        raise TypeError(f"aidn: step must be an integer, not {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"aidn: step must be >= 0, not {value}")
    return value


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


_TMP = re.compile(r"\.tmp-step-[0-9]+-([0-9]+)(\.old)?")
_cleared = set()
_cleared_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_temporaries(directory: str) -> None:
    """Removes, once per process, the .tmp-* directories that writers which
    died half way left in `directory`."""
    with _cleared_lock:
        if directory in _cleared:
            return
        _cleared.add(directory)
    for name in os.listdir(directory):
        m = _TMP.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _seal(directory: str, tmp: str, step: int) -> _Written:
    """Writes the manifest over what the block left in `tmp` and renames it to
    step-N, durably."""
    files = []
    for name in sorted(os.listdir(tmp)):
        path = os.path.join(tmp, name)
        if name == MANIFEST_NAME:
            raise ValueError(f"aidn.checkpoint: {MANIFEST_NAME} is the name of aidn's own "
                             "manifest; name the file otherwise")
        if not plain_name(name):
            raise ValueError(f"aidn.checkpoint: {name!r}: a checkpoint's file names may not "
                             "start with '.' or hold '/', spaces or control characters")
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise ValueError(f"aidn.checkpoint: {name}: only plain files go into a checkpoint "
                             "directory (no subdirectories or links)")
        _fsync(path)
        size, crc = checksum_file(path)
        files.append(ManifestEntry(name, size, crc))
    if not files:
        raise ValueError(f"aidn.checkpoint({step}): the block wrote no files into {tmp}")
    manifest = format_manifest(Manifest(step, files))
    _write_durably(os.path.join(tmp, MANIFEST_NAME), manifest)
    _fsync(tmp, directory=True)
    final = os.path.join(directory, checkpoint_dir_name(step))
    # A directory of the same step from an earlier generation that failed
    # before committing it goes first: rename() replaces no full directory.
    if os.path.lexists(final):
        old = tmp + ".old"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    _fsync(directory, directory=True)
    return _Written(final, sum(f.bytes for f in files) + len(manifest.encode()), manifest)


def _commit(job: _job.Job, step: int, written: _Written, directory: str,
            writer_ranks: Optional[Iterable[int]]) -> None:
    if job.env is None:
        job.warn_not_under_aidn("aidn.checkpoint (written, not committed)")
        return
    from .v1 import cluster_pb2
    ranks = [job.env.rank] if writer_ranks is None else [int(r) for r in writer_ranks]
    request = cluster_pb2.CommitCheckpointRequest(
        job_id=job.env.job_id, generation=job.env.generation, rank=job.env.rank, step=step,
        path=written.path, bytes=written.bytes, manifest_sha256=sha256_hex(written.manifest),
        writer_ranks=ranks)
    job.reporter().commit(request, directory)


@contextlib.contextmanager
def checkpoint(step, writer_ranks: Optional[Iterable[int]] = None) -> Iterator[str]:
    """`with aidn.checkpoint(step) as path:` write the checkpoint's files into
    `path` (a fresh, empty directory). On a clean exit of the block the
    checkpoint becomes <AIDN_CHECKPOINT_DIR>/step-NNNNNNNN with its manifest,
    and its commit is queued: it goes after this rank's reports up to `step`
    (writer_ranks: the ranks that write a part of it, the same list on each;
    default [this rank]). Checkpoints the job's keep_last retention drops are
    deleted when the coordinator names them. An exception in the block
    commits nothing and removes the directory.

    Without AIDN_CHECKPOINT_DIR (a job without checkpoint.dir, or a run by
    hand) `path` is a temporary directory removed after the block."""
    step = _step_of(step)
    job = _job.current()
    directory = _env.checkpoint_dir()
    if directory is None:
        job.warn_once("no-checkpoint-dir",
                      "aidn: AIDN_CHECKPOINT_DIR is not set: aidn.checkpoint() gives a "
                      "temporary directory, removed after the block")
        tmp = tempfile.mkdtemp(prefix=f"aidn-{checkpoint_dir_name(step)}-")
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    os.makedirs(directory, exist_ok=True)
    _remove_temporaries(directory)
    tmp = os.path.join(directory, ".tmp-%s-%d" % (checkpoint_dir_name(step), os.getpid()))
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        yield tmp
        written = _seal(directory, tmp, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("aidn: checkpoint of step %d written to %s (%d bytes)", step, written.path,
             written.bytes)
    _commit(job, step, written, directory, writer_ranks)


def remove_retired(directory: str, step: int) -> None:
    """Deletes the directory of a checkpoint that retention dropped."""
    path = os.path.join(directory, checkpoint_dir_name(step))
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError as e:
        log.warning("aidn: retention: cannot remove %s: %s", path, e.strerror)
        return
    log.info("aidn: retention removed the checkpoint of step %d", step)


# -- resume ------------------------------------------------------------------

_UNSET = object()
_resume_lock = threading.Lock()
_resumed = {}  # pid -> the answer of resume()


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def _report_invalid(job: _job.Job, step: int, reason: str) -> None:
    import grpc

    from . import _rpc
    from .v1 import cluster_pb2
    env = job.env
    request = cluster_pb2.ReportCheckpointInvalidRequest(
        job_id=env.job_id, generation=env.generation, rank=env.rank, step=step, reason=reason)
    backoff = _rpc.Backoff()
    attempts = 8
    for attempt in range(attempts):
        if attempt > 0:
            backoff.sleep()
        try:
            job.stub().ReportCheckpointInvalid(request, timeout=10.0,
                                               metadata=_rpc.metadata(env.token))
            return
        except grpc.RpcError as e:
            if _rpc.code_of(e) not in _rpc.TRANSIENT:
                log.warning("aidn: could not report the bad checkpoint: %s",
                            _rpc.details_of(e))
                return
    log.warning("aidn: gave up reporting the bad checkpoint after %d attempts: the "
                "coordinator stayed unreachable", attempts)


def resume() -> Optional[Resume]:
    """The checkpoint to resume from (AIDN_RESUME_STEP, AIDN_RESUME_PATH),
    verified against its manifest, or None on a fresh start. A checkpoint
    that fails verification is reported to the coordinator (which never offers
    it again) and None is returned, with a warning. Verified once per process;
    later calls give the same answer."""
    pid = os.getpid()
    with _resume_lock:
        answer = _resumed.get(pid, _UNSET)
        if answer is not _UNSET:
            return answer
        answer = _resume_uncached()
        _resumed[pid] = answer
        return answer


def _resume_uncached() -> Optional[Resume]:
    point = _env.resume_point()
    if point is None:
        return None
    step, path = point
    started = time.monotonic()
    try:
        manifest = verify_checkpoint_dir(path)
        if manifest.step != step:
            raise CheckpointInvalid(f"{MANIFEST_NAME}: says step {manifest.step}")
    except (CheckpointInvalid, OSError) as e:
        reason = f"{path}: {_reason(e)}"
        log.warning("aidn: not resuming from a checkpoint that fails verification: %s", reason)
        job = _job.current()
        if job.env is not None:
            _report_invalid(job, step, reason)
        return None
    log.info("aidn: resuming from the checkpoint of step %d at %s (verified in %.2f s)", step,
             path, time.monotonic() - started)
    return Resume(step, path)
