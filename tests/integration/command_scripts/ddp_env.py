"""A torch.distributed program as a command job runs it: checks torchrun's
environment, joins the process group over env:// (gloo), all-reduces, and
prints what the test checks. Exit code 3 names a broken contract."""
import json
import os
import sys

import torch
import torch.distributed as dist

REQUIRED = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "AIDN_JOB_ID",
            "AIDN_GENERATION", "AIDN_RANK", "AIDN_COORDINATOR", "AIDN_TRAINER_TOKEN"]
missing = [k for k in REQUIRED if k not in os.environ]
if missing:
    print("missing environment:", missing, flush=True)
    sys.exit(3)

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
store_key = os.environ.get("DDP_ENV_STORE_KEY")
report = {k: os.environ[k] for k in REQUIRED if k != "AIDN_TRAINER_TOKEN"}
report["sum"] = t.item()
report["cwd"] = os.getcwd()
report["uid"] = os.getuid()
report["user_env"] = os.environ.get("USER_VAR", "")
if store_key and rank == 0:
    # A key set in one generation must not be visible in the next: a raw
    # client of the store, past torch's per-attempt key prefix.
    import datetime
    raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                        datetime.timedelta(seconds=30))
    # A counter: 1 when this generation's store never saw it before.
    report["saw_key"] = raw.add(store_key, 1) > 1
print("DDP_ENV " + json.dumps(report), flush=True)
dist.barrier()
fail_generation = os.environ.get("FAIL_IN_GENERATION")
if fail_generation and os.environ["AIDN_GENERATION"] == fail_generation and rank == 1:
    os._exit(9)
dist.destroy_process_group()
os._exit(0)
