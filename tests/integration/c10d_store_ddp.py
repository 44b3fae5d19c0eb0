"""One rank of a gloo job whose store is aidn's c10d store: init_process_group
with env:// and TORCHELASTIC_USE_AGENT_STORE=True (every rank a TCPStore
client of MASTER_ADDR:MASTER_PORT), one all_reduce, a barrier, exit."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t.item()
dist.barrier()
print(f"rank {rank} of {world}: all_reduce {t.item():g}", flush=True)
dist.destroy_process_group()
os._exit(0)  # gloo processes may hang at exit (pytorch#56297)
