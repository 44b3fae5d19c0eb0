#!/usr/bin/env python3
"""Fashion-MNIST with a small CNN under PyTorch DDP, in the style of the
PyTorch DDP tutorial: one process per rank, torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK optional).

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        /usr/bin/python3 train.py --epochs 1

The data are Debian's dataset-fashion-mnist IDX files (gzip), read with the
standard library and torch alone. Rank 0 saves a checkpoint (model, optimizer,
step) to --checkpoint every --checkpoint-every steps and at the end; every rank
loads it at start when it is there, so a job started again carries on where
it stopped. The same --seed gives the same run.
"""

import argparse
import gzip
import hashlib
import os
import struct
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("FASHION_MNIST_DIR", DEFAULT_DATA),
                   help="directory of the four IDX files (env FASHION_MNIST_DIR)")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps in all (0: no limit)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the shuffle")
    p.add_argument("--checkpoint", default=os.environ.get("CHECKPOINT_PATH", ""),
                   help="checkpoint file; empty: none (env CHECKPOINT_PATH)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save every this many steps (0: at the end of each epoch only)")
    p.add_argument("--log-every", type=int, default=100, help="log every this many steps")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per rank (0: OMP_NUM_THREADS, else 1)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# Data: IDX files (http://yann.lecun.com/exdb/mnist/), gzip'd or not.

def read_idx(path):
    """The tensor in an IDX file: uint8, shape from its header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack_from(">HBB", data, 0)
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    shape = struct.unpack_from(">" + "I" * ndim, data, 4)
    offset = 4 + 4 * ndim
    count = 1
    for n in shape:
        count *= n
    if len(data) - offset != count:
        raise ValueError(f"{path}: {len(data) - offset} bytes of data, the header says {count}")
    return torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8).reshape(shape)


def find_file(directory, stem):
    for name in (stem + ".gz", stem):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{stem}(.gz) not in {directory} (install dataset-fashion-mnist)")


def load_split(directory, prefix):
    """(images as float N×1×28×28 scaled to [0, 1] and normalised, labels as int64)."""
    images = read_idx(find_file(directory, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(find_file(directory, f"{prefix}-labels-idx1-ubyte"))
    x = images.float().div_(255.0).sub_(0.2860).div_(0.3530).unsqueeze(1)
    return TensorDataset(x, labels.long())


# ---------------------------------------------------------------------------
# Model: conv 1→32 3x3, ReLU, maxpool 2, conv 32→64 3x3, ReLU, maxpool 2,
# fc 1600→128, ReLU, fc 128→10 (aidn's built-in "cnn").

class SmallCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(64 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


# ---------------------------------------------------------------------------
# Checkpoints: one file, written by rank 0 (to a temporary name, then renamed,
# so a rank killed half way leaves the previous one whole).

def save_checkpoint(path, model, optimizer, step, epoch):
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "step": step, "epoch": epoch}
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path, model, optimizer, device):
    state = torch.load(path, map_location=device)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def all_reduce_sum(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def evaluate(model, test_set, rank, world_size, device):
    """(mean loss, accuracy) over the whole test set; each rank takes every
    world_size-th sample, so no sample counts twice."""
    model.eval()
    x, y = test_set.tensors
    x, y = x[rank::world_size], y[rank::world_size]
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), 1000):
            out = model(x[i:i + 1000].to(device))
            target = y[i:i + 1000].to(device)
            loss_sum += F.cross_entropy(out, target, reduction="sum").item()
            correct += (out.argmax(1) == target).sum().item()
    model.train()
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, len(y)], device)
    return loss_sum / count, correct / count


def weights_digest(model):
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None):
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, threads))

    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    train_set = load_split(args.data_dir, "train")
    test_set = load_split(args.data_dir, "t10k")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DDP(SmallCnn().to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    step = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        step = load_checkpoint(args.checkpoint, model, optimizer, device)
        # Every rank must carry on from the same step.
        low, high = all_reduce_sum([-step, step], device)
        if -low != high:
            raise RuntimeError(f"ranks loaded different checkpoints (steps {-low} to {high})")
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {step}", flush=True)
    if rank == 0:
        print(f"training: {world_size} ranks on {device.type}, {steps_per_epoch} steps per epoch, "
              f"{total_steps} steps, batch {args.batch_size} per rank", flush=True)

    def checkpoint(epoch):
        if rank == 0 and args.checkpoint:
            save_checkpoint(args.checkpoint, model, optimizer, step, epoch)
        dist.barrier()

    window_start, window_loss, window_steps = time.perf_counter(), 0.0, 0
    while step < total_steps:
        epoch = step // steps_per_epoch
        sampler.set_epoch(epoch)
        skip = step % steps_per_epoch  # batches a resumed run did already
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            window_loss += loss.item()
            window_steps += 1
            if step % args.log_every == 0 or step == total_steps:
                loss_sum, = all_reduce_sum([window_loss], device)
                seconds = time.perf_counter() - window_start
                if rank == 0:
                    print(f"epoch {epoch + 1} step {step}/{total_steps} | "
                          f"loss {loss_sum / window_steps / world_size:.4f} | "
                          f"{1e3 * seconds / window_steps:.1f} ms | "
                          f"{window_steps * args.batch_size * world_size / seconds:.0f} samples/s",
                          flush=True)
                window_start, window_loss, window_steps = time.perf_counter(), 0.0, 0
            if args.checkpoint_every > 0 and step % args.checkpoint_every == 0:
                checkpoint(epoch + 1)
            if step == total_steps:
                break
        test_loss, accuracy = evaluate(model, test_set, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch + 1} step {step} | test_loss {test_loss:.4f} | "
                  f"test_accuracy {accuracy:.4f}", flush=True)
        if args.checkpoint_every <= 0 or step % args.checkpoint_every != 0:
            checkpoint(epoch + 1)

    print(f"rank {rank}: done at step {step}, weights {weights_digest(model)}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Gloo processes can hang in exit handlers (pytorch#56297).
    os._exit(0)


if __name__ == "__main__":
    main()
