"""What the worker tells a rank process about its job, from the AIDN_*
environment variables it sets (docs/python.md lists them)."""

import dataclasses
import os
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """One rank of one generation of an aidn job."""
    coordinator: str  # host:port
    token: str  # the rank's job-scoped trainer token
    job_id: str
    generation: int
    rank: int
    world_size: int
    worker_id: str
    tls_ca: str = ""  # the CA file that verifies the coordinator
    insecure: bool = False  # plaintext: the coordinator runs with --insecure


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    text = environ.get(name, "")
    if text == "":
        if default is None:
            raise ValueError(f"aidn: {name} is not set")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"aidn: {name}={text!r} is not an integer") from None


def job_env(environ: Mapping[str, str] = os.environ) -> Optional[JobEnv]:
    """The job this process is a rank of, or None when it does not run under
    aidn (AIDN_COORDINATOR or AIDN_JOB_ID unset). A variable that is set but
    malformed is a ValueError naming it."""
    coordinator = environ.get("AIDN_COORDINATOR", "")
    job_id = environ.get("AIDN_JOB_ID", "")
    if not coordinator or not job_id:
        return None
    rank = _int(environ, "AIDN_RANK", _int(environ, "RANK", 0))
    return JobEnv(
        coordinator=coordinator,
        token=environ.get("AIDN_TRAINER_TOKEN", ""),
        job_id=job_id,
        generation=_int(environ, "AIDN_GENERATION"),
        rank=rank,
        world_size=_int(environ, "AIDN_WORLD_SIZE", _int(environ, "WORLD_SIZE", 1)),
        worker_id=environ.get("AIDN_WORKER_ID", ""),
        tls_ca=environ.get("AIDN_TLS_CA", ""),
        insecure=environ.get("AIDN_INSECURE", "") in ("1", "true"),
    )


def checkpoint_dir(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """AIDN_CHECKPOINT_DIR, or None when the job has no checkpoint directory."""
    return environ.get("AIDN_CHECKPOINT_DIR") or None


def resume_point(environ: Mapping[str, str] = os.environ):
    """(step, path) of AIDN_RESUME_STEP and AIDN_RESUME_PATH, or None when
    either is unset (a fresh start)."""
    path = environ.get("AIDN_RESUME_PATH", "")
    if environ.get("AIDN_RESUME_STEP", "") == "" or not path:
        return None
    return _int(environ, "AIDN_RESUME_STEP"), path
