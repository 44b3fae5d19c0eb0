#!/usr/bin/python3
"""Runs a command as a child, then prints what it cost as one line to stderr:

    RUSAGE {"wall_s": ..., "user_s": ..., "sys_s": ..., "minor_faults": ...,
            "voluntary_switches": ..., "involuntary_switches": ...}

and exits with the child's status. bench/commands.sh wraps each rank with it,
by hand and under aidn alike, to tell runs slowed by the machine (a storm of
page faults from the allocator handing memory back and taking it again) from
runs slowed by the launcher.

    bench/rusage.py /usr/bin/python3 train.py --max-steps 300
"""

import json
import resource
import subprocess
import sys
import time


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: rusage.py PROGRAM [ARGS...]")
    start = time.monotonic()
    status = subprocess.call(sys.argv[1:])
    wall = time.monotonic() - start
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print("RUSAGE " + json.dumps({
        "wall_s": round(wall, 3), "user_s": round(r.ru_utime, 3), "sys_s": round(r.ru_stime, 3),
        "minor_faults": r.ru_minflt, "voluntary_switches": r.ru_nvcsw,
        "involuntary_switches": r.ru_nivcsw}), file=sys.stderr, flush=True)
    sys.exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    main()
