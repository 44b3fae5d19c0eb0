"""One torch.distributed.TCPStore client (is_master=False) against aidn's c10d
store at argv[1]:argv[2], through every call a rank can make. Prints OK and
exits 0, or raises. argv[3] names this client's role in the two-client
hand-off: "first" waits for a key the "second" sets."""
import datetime
import os
import sys

from torch.distributed import PrefixStore, TCPStore

host, port, role = sys.argv[1], int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=30)
# world_size given: the client adds 1 to the store's "init/" key on connect.
store = TCPStore(host, port, 2, False, timeout)

if role == "first":
    store.set(f"{role}/k", "v")
    assert store.get(f"{role}/k") == b"v"
    assert store.add(f"{role}/n", 5) == 5
    assert store.add(f"{role}/n", -2) == 3
    assert store.get(f"{role}/n") == b"3"
    assert store.compare_set(f"{role}/cs", "", "first") == b"first"
    assert store.compare_set(f"{role}/cs", "first", "second") == b"second"
    assert store.compare_set(f"{role}/cs", "wrong", "third") == b"second"
    assert store.compare_set(f"{role}/missing", "x", "y") == b"x"
    if hasattr(store, "check"):  # not bound in Python before 2.x
        assert store.check([f"{role}/k", f"{role}/n"])
        assert not store.check([f"{role}/missing"])
    assert store.delete_key(f"{role}/k")
    assert not store.delete_key(f"{role}/k")
    before = store.num_keys()
    store.set(f"{role}/extra", b"\x00\xff binary")
    assert store.num_keys() == before + 1
    assert store.get(f"{role}/extra") == b"\x00\xff binary"
    # What torch.distributed.rendezvous does with TORCHELASTIC_USE_AGENT_STORE.
    prefixed = PrefixStore("/worker/attempt_0", store)
    prefixed.set("x", "1")
    assert store.get("/worker/attempt_0/x") == b"1"
    # A WAIT that times out on the client leaves the connection usable.
    try:
        store.wait([f"{role}/never"], datetime.timedelta(milliseconds=300))
        raise AssertionError("wait on a missing key returned")
    except RuntimeError:
        pass
    # The hand-off: block until the other client sets the key.
    store.set("first/ready", "1")
    store.wait(["second/done"])
    assert store.get("second/done") == b"ok"
else:
    store.wait(["first/ready"])
    store.set("second/done", "ok")

print("OK", role, flush=True)
os._exit(0)
