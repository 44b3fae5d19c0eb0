"""PyTorch's own TCPStore server (is_master=True) for bench/store: prints
"port N", serves until stdin closes, exits."""
import datetime
import os
import sys

from torch.distributed import TCPStore

store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=300),
                 wait_for_workers=False)
print("port", store.port, flush=True)
sys.stdin.read()
os._exit(0)
