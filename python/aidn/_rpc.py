"""Channels and call options shared by the in-job reporter and the Client,
set up as the C++ clients set theirs (common/rpc/client.cc)."""

import os
import random
import time

# Read once, when gRPC starts: between calls a synchronous client finishes a
# reconnection only when its backup poller runs (every 5 s by default), which
# keeps a rank away from a restarted coordinator for that long. A value the
# user set wins.
os.environ.setdefault("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100")

import grpc  # noqa: E402

MAX_MESSAGE_BYTES = 4 * 1024 * 1024

# Failures worth another call later (common/rpc/retry.h).
TRANSIENT = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
})


def make_channel(address: str, tls_ca: str = "", insecure: bool = False) -> grpc.Channel:
    """A channel to the coordinator at host:port that reconnects quickly
    after a coordinator restart: TLS, verifying the coordinator with the CA
    file `tls_ca` (its <state-dir>/tls/ca.pem; empty: the system's roots),
    or plaintext with `insecure`. OSError for a CA file that cannot be
    read."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if insecure:
        return grpc.insecure_channel(address, options=options)
    roots = None
    if tls_ca:
        with open(tls_ca, "rb") as f:
            roots = f.read()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots),
                               options=options)


def metadata(token: str):
    """The call metadata that carries a bearer token (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def code_of(error: Exception):
    """The gRPC status code of a failed call, or UNKNOWN."""
    code = getattr(error, "code", None)
    if callable(code):
        try:
            return code()
        except Exception:  # noqa: BLE001 - a broken error object is an unknown failure
            pass
    return grpc.StatusCode.UNKNOWN


def details_of(error: Exception) -> str:
    details = getattr(error, "details", None)
    if callable(details):
        try:
            return details() or ""
        except Exception:  # noqa: BLE001
            pass
    return str(error)


class Backoff:
    """Exponential backoff, 100 ms doubling up to 2 s, with a little jitter."""

    def __init__(self, initial: float = 0.1, maximum: float = 2.0):
        self._initial = initial
        self._max = maximum
        self._current = initial

    def next(self) -> float:
        wait = self._current
        self._current = min(self._max, self._current * 2)
        return wait * random.uniform(0.9, 1.1)

    def sleep(self, deadline: float = float("inf")) -> None:
        time.sleep(max(0.0, min(self.next(), deadline - time.monotonic())))

    def reset(self) -> None:
        self._current = self._initial
