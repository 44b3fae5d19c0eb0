# The GPT decoder written out in plain PyTorch (1.13), for checking aidn's:
# Hugging Face GPT-2's tensor names and layouts (Conv1D weights [in, out],
# tanh GELU, explicit causal attention, the LM head tied to wte), read from
# safetensors files by the published layout (an 8-byte header length, a
# JSON header, raw little-endian data). Two uses:
#
#   gpt_torch.py oracle DIR N_LAYER N_HEAD N_EMBD BLOCK VOCAB STEPS B T
#       trains DIR/init.safetensors on DIR/tokens.i32 (STEPS x B x (T+1)
#       int32) with nanoGPT's AdamW (decay on matrices and embeddings only,
#       clipping at 1.0); writes first.safetensors (logits, loss, every
#       gradient of step 1), final.safetensors and losses.txt.
#   gpt_torch.py zero DIR N_LAYER N_HEAD N_EMBD BLOCK VOCAB STEPS B T
#       the same training as one rank (RANK, WORLD_SIZE, MASTER_ADDR and
#       MASTER_PORT from the environment) of a gloo group: each rank a slice
#       of every batch, gradients averaged with all_reduce, the AdamW step
#       through torch.distributed.optim.ZeroRedundancyOptimizer (each rank
#       updates its shard of the parameters); rank 0 writes zero.safetensors.
#   gpt_torch.py generate FILE PROMPT LENGTH
#       greedy continuation of PROMPT's bytes by the model in FILE (an aidn
#       export: sizes from its "aidn.gpt" metadata); prints the bytes.
import json
import math
import struct
import sys

import torch
import torch.nn.functional as F


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=torch.float32)
        out[name] = t.reshape(info["shape"]).clone()
    return out, header.get("__metadata__", {})


def save(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def forward(P, n_layer, n_head, n_embd, idx):
    def ln(x, pre):
        return F.layer_norm(x, (n_embd,), P[pre + ".weight"], P.get(pre + ".bias"), 1e-5)

    def lin(x, pre):
        y = x @ P[pre + ".weight"]
        return y + P[pre + ".bias"] if pre + ".bias" in P else y

    b, t = idx.shape
    x = P["transformer.wte.weight"][idx] + P["transformer.wpe.weight"][:t]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    hd = n_embd // n_head
    for l in range(n_layer):
        h = f"transformer.h.{l}."
        q, k, v = lin(ln(x, h + "ln_1"), h + "attn.c_attn").split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, n_embd)
        x = x + lin(y, h + "attn.c_proj")
        x = x + lin(F.gelu(lin(ln(x, h + "ln_2"), h + "mlp.c_fc"), approximate="tanh"),
                    h + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    return x @ P["transformer.wte.weight"].t()


def oracle(d, n_layer, n_head, n_embd, block, vocab, steps, B, T):
    init, _ = load(f"{d}/init.safetensors")
    P = {k: torch.nn.Parameter(v) for k, v in init.items()}
    names = list(P)
    tokens = torch.frombuffer(bytearray(open(f"{d}/tokens.i32", "rb").read()), dtype=torch.int32)
    tokens = tokens.long().reshape(steps, B, T + 1)
    decay = [P[n] for n in names if P[n].dim() >= 2]
    no_decay = [P[n] for n in names if P[n].dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for s in range(steps):
        x, y = tokens[s, :, :-1], tokens[s, :, 1:]
        opt.zero_grad(set_to_none=True)
        logits = forward(P, n_layer, n_head, n_embd, x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        if s == 0:
            first = {"logits": logits.reshape(-1, vocab), "loss": loss.reshape(1)}
            for n in names:
                first["grad." + n] = P[n].grad
            save(f"{d}/first.safetensors", first)
        torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        opt.step()
        losses.append(loss.item())
    save(f"{d}/final.safetensors", {n: P[n] for n in names})
    with open(f"{d}/losses.txt", "w") as f:
        f.write("\n".join(repr(v) for v in losses))
    print(f"torch: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps")


def zero(d, n_layer, n_head, n_embd, block, vocab, steps, B, T):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    init, _ = load(f"{d}/init.safetensors")
    P = {k: torch.nn.Parameter(v) for k, v in init.items()}
    names = list(P)
    tokens = torch.frombuffer(bytearray(open(f"{d}/tokens.i32", "rb").read()), dtype=torch.int32)
    tokens = tokens.long().reshape(steps, B, T + 1)
    rows = B // world
    decay = [P[n] for n in names if P[n].dim() >= 2]
    no_decay = [P[n] for n in names if P[n].dim() < 2]
    opt = ZeroRedundancyOptimizer([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  optimizer_class=torch.optim.AdamW,
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for s in range(steps):
        batch = tokens[s, rank * rows:(rank + 1) * rows]
        x, y = batch[:, :-1], batch[:, 1:]
        opt.zero_grad(set_to_none=True)
        logits = forward(P, n_layer, n_head, n_embd, x)
        F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)).backward()
        for n in names:
            dist.all_reduce(P[n].grad)
            P[n].grad /= world
        torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        opt.step()
    if rank == 0:
        save(f"{d}/zero.safetensors", {n: P[n] for n in names})
    dist.destroy_process_group()


def generate(path, prompt, length):
    P, meta = load(path)
    sizes = dict(kv.split("=") for kv in meta["aidn.gpt"].split(","))
    n_layer, n_head, n_embd, block = (int(sizes[k]) for k in
                                      ("n_layer", "n_head", "n_embd", "block_size"))
    idx = list(prompt.encode("utf-8"))
    with torch.no_grad():
        for _ in range(length):
            context = torch.tensor([idx[-block:]], dtype=torch.long)
            logits = forward(P, n_layer, n_head, n_embd, context)[0, -1]
            idx.append(int(torch.argmax(logits)))
    sys.stdout.buffer.write(bytes(idx))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "oracle":
        oracle(sys.argv[2], *map(int, sys.argv[3:11]))
    elif sys.argv[1] == "zero":
        zero(sys.argv[2], *map(int, sys.argv[3:11]))
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
