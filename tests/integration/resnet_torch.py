# torchvision's ResNets (0.14) with the small-image stem aidn builds (conv1
# a 3x3, stride 1 convolution without bias, no max pool), for checking
# aidn's against:
#
#   resnet_torch.py DIR NAME CHANNELS SIDE CLASSES BATCH
#       loads DIR/init.safetensors (aidn's weights and buffers, by
#       torchvision's names; only num_batches_tracked may be missing) and
#       picks a batch of BATCH normal images [CHANNELS, SIDE, SIDE] and
#       labels whose ReLU inputs all lie at least KINK_MARGIN from zero or
#       at it exactly (a
#       value nearer may fall on the other side of the kink in the other
#       implementation's float32 rounding, and through BatchNorm that one
#       element moves every gradient upstream by a percent); writes them to
#       DIR/images.f32 and DIR/labels.i32, runs them through one training
#       forward and backward (mean cross-entropy), then an eval forward;
#       writes DIR/torch.safetensors: "logits", "loss", "eval_logits", every
#       gradient as "grad.<name>" and every buffer after the training
#       forward under its name.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

# The safetensors reader and writer of the GPT oracle beside this script.
from gpt_torch import load, save


KINK_MARGIN = 1e-5


def smallest_relu_input(model, images):
    """The smallest |x| any ReLU sees in a training forward (BatchNorm's
    momentum 0 meanwhile, so the running statistics stay as they are)."""
    smallest = [float("inf")]

    def hook(module, inputs):
        # Exact zeros (a BatchNorm channel of equal values gives its bias,
        # 0) come out of both implementations alike.
        x = inputs[0].detach().abs()
        x = x[x != 0]
        if x.numel():
            smallest[0] = min(smallest[0], x.min().item())

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, nn.ReLU)]
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in norms:
        m.momentum = 0.0
    model.train()
    with torch.no_grad():
        model(images)
    for m in norms:
        m.momentum = 0.1
    for h in handles:
        h.remove()
    return smallest[0]


def main():
    d, name = sys.argv[1], sys.argv[2]
    channels, side, classes, batch = (int(a) for a in sys.argv[3:7])
    model = getattr(torchvision.models, name)(num_classes=classes)
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    missing, unexpected = model.load_state_dict(load(d + "/init.safetensors")[0], strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    for seed in range(1000):
        g = torch.Generator().manual_seed(seed)
        images = torch.randn(batch, channels, side, side, generator=g)
        labels = torch.randint(0, classes, (batch,), generator=g)
        if smallest_relu_input(model, images) >= KINK_MARGIN:
            break
    else:
        sys.exit(f"no batch of 1000 keeps its ReLU inputs {KINK_MARGIN} from zero")
    images.numpy().tofile(d + "/images.f32")
    labels.to(torch.int32).numpy().tofile(d + "/labels.i32")
    model.train()
    logits = model(images)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    out = {"logits": logits, "loss": loss.reshape(1)}
    for k, p in model.named_parameters():
        out["grad." + k] = p.grad
    for k, b in model.named_buffers():
        if not k.endswith("num_batches_tracked"):
            out[k] = b
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = model(images)
    save(d + "/torch.safetensors", out)
    print(f"{name}: batch seed {seed}")


if __name__ == "__main__":
    main()
