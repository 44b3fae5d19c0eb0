// The GPT decoder against PyTorch (python3-torch 1.13): a GPT of the same
// definition, written out below in plain torch (Hugging Face's [in, out]
// Conv1D weights, tanh GELU, explicit causal attention), loads aidn's
// initial weights through safetensors and runs the same batches of bytes.
// On the first batch the logits, the loss and every gradient must agree
// within 1e-4 relative (‖a − b‖ / ‖b‖ per tensor); after 20 steps of AdamW
// (betas 0.9/0.95, weight decay 0.1 on matrices and embeddings only,
// gradient clipping at 1.0, as nanoGPT trains) every weight must (but the
// key bias, whose true gradient is zero: see below), and so must each
// step's loss.
//
// Skips only when /usr/bin/python3 cannot import torch.

#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "worker/engine/cpu.h"
#include "worker/engine/gpt.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/safetensors.h"

namespace aidn::engine {
namespace {

constexpr char kPython[] = "/usr/bin/python3";
constexpr int kSteps = 20;
constexpr int kBatch = 4;
constexpr int kSeqLen = 32;
constexpr double kTolerance = 1e-4;

constexpr char kTorchScript[] = R"PY(
# The PyTorch side: usage  gpt_oracle.py DIR N_LAYER N_HEAD N_EMBD BLOCK VOCAB STEPS B T
import json, math, struct, sys
import torch
import torch.nn.functional as F

d = sys.argv[1]
n_layer, n_head, n_embd, block, vocab, steps, B, T = map(int, sys.argv[2:10])
torch.set_num_threads(1)


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
    return out


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


P = {k: torch.nn.Parameter(v) for k, v in load(f"{d}/init.safetensors").items()}
names = list(P)


def ln(x, pre):
    return F.layer_norm(x, (n_embd,), P[pre + ".weight"], P.get(pre + ".bias"), 1e-5)


def lin(x, pre):
    y = x @ P[pre + ".weight"]
    return y + P[pre + ".bias"] if pre + ".bias" in P else y


def forward(idx):
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
    logits = forward(x)
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
)PY";

double RelativeError(const float* a, const float* b, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

class GptTorchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string probe = absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1");
    if (std::system(probe.c_str()) != 0) GTEST_SKIP() << "no torch for " << kPython;
    std::string tmpl = (std::filesystem::temp_directory_path() / "aidn_gpt_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Writes the batches and the initial weights, runs torch over them.
  void RunTorch(const GptConfig& c, Gpt& gpt, const std::vector<int32_t>& tokens) {
    std::vector<const Parameter*> params(gpt.Parameters().begin(), gpt.Parameters().end());
    ASSERT_TRUE(SaveSafetensors(dir_ + "/init.safetensors", params).ok());
    std::ofstream(dir_ + "/tokens.i32", std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()),
               static_cast<std::streamsize>(tokens.size() * sizeof(int32_t)));
    { std::ofstream(dir_ + "/gpt_oracle.py") << kTorchScript; }
    const std::string command =
        absl::StrCat(kPython, " ", dir_, "/gpt_oracle.py ", dir_, " ", c.n_layer, " ", c.n_head,
                     " ", c.n_embd, " ", c.block_size, " ", c.vocab_size, " ", kSteps, " ", kBatch,
                     " ", kSeqLen, " >", dir_, "/oracle.log 2>&1");
    const int rc = std::system(command.c_str());
    std::ifstream log(dir_ + "/oracle.log");
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    ASSERT_EQ(rc, 0) << "the torch script failed:\n" << text;
    std::printf("%s", text.c_str());
  }

  std::map<std::string, Tensor> Read(const std::string& name) {
    auto tensors = ReadSafetensors(dir_ + "/" + name);
    EXPECT_TRUE(tensors.ok()) << tensors.status();
    return tensors.ok() ? std::move(*tensors) : std::map<std::string, Tensor>{};
  }

  std::string dir_;
};

TEST_F(GptTorchTest, FirstStepAndTwentyAdamWStepsMatchPyTorch) {
  ConfigureCpu(1);
  GptConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.block_size = 64;
  c.vocab_size = 256;
  std::unique_ptr<Gpt> gpt = *Gpt::Create(c, 5);
  // Bytes of text-like skew: mostly a small alphabet, some of everything.
  std::mt19937_64 rng(17);
  std::vector<int32_t> tokens(static_cast<size_t>(kSteps * kBatch * (kSeqLen + 1)));
  for (int32_t& t : tokens) {
    t = static_cast<int32_t>(rng() % 4 == 0 ? rng() % 256 : 97 + rng() % 26);
  }
  RunTorch(c, *gpt, tokens);
  if (HasFatalFailure()) return;

  OptimizerConfig oc;
  oc.name = "adamw";
  oc.lr = 1e-3;
  oc.beta1 = 0.9;
  oc.beta2 = 0.95;
  oc.weight_decay = 0.1;
  oc.decay_matrices_only = true;
  oc.grad_clip_norm = 1.0;
  auto optimizer = Optimizer::Create(oc, gpt->Parameters());
  ASSERT_TRUE(optimizer.ok()) << optimizer.status();

  std::ifstream losses_file(dir_ + "/losses.txt");
  std::vector<double> torch_losses;
  for (double v; losses_file >> v;) torch_losses.push_back(v);
  ASSERT_EQ(torch_losses.size(), static_cast<size_t>(kSteps));

  std::vector<int32_t> x(kBatch * kSeqLen), y(kBatch * kSeqLen);
  for (int s = 0; s < kSteps; ++s) {
    for (int b = 0; b < kBatch; ++b) {
      const int32_t* row = tokens.data() + (s * kBatch + b) * (kSeqLen + 1);
      std::memcpy(x.data() + b * kSeqLen, row, kSeqLen * sizeof(int32_t));
      std::memcpy(y.data() + b * kSeqLen, row + 1, kSeqLen * sizeof(int32_t));
    }
    gpt->ZeroGrad();
    const double loss = gpt->Forward(x.data(), y.data(), kBatch, kSeqLen, /*training=*/true);
    gpt->Backward();
    EXPECT_NEAR(loss, torch_losses[static_cast<size_t>(s)],
                kTolerance * std::abs(torch_losses[static_cast<size_t>(s)]))
        << "step " << s;
    if (s == 0) {
      std::map<std::string, Tensor> first = Read("first.safetensors");
      const Tensor& logits = first["logits"];
      ASSERT_EQ(logits.numel(), gpt->logits().numel());
      EXPECT_LT(RelativeError(gpt->logits().data(), logits.data(), logits.numel()), kTolerance);
      for (const Parameter* p : gpt->Parameters()) {
        const Tensor& g = first["grad." + p->name];
        ASSERT_EQ(g.numel(), p->grad.numel()) << p->name;
        const double err = RelativeError(p->grad.data(), g.data(), g.numel());
        EXPECT_LT(err, kTolerance) << "gradient of " << p->name;
      }
    }
    ASSERT_TRUE((*optimizer)->Step(oc.lr).ok());
  }
  // The key part of each c_attn.bias is left out: it adds q·b_k to every
  // score of a row, which the softmax cancels, so its true gradient is 0
  // and each side's is float rounding noise (1e-10), which AdamW's m/sqrt(v)
  // turns into steps of about lr either way. The query and value parts
  // must match.
  std::map<std::string, Tensor> final_weights = Read("final.safetensors");
  const int64_t width = c.n_embd;
  for (const Parameter* p : gpt->Parameters()) {
    const Tensor& w = final_weights[p->name];
    ASSERT_EQ(w.numel(), p->value.numel()) << p->name;
    if (p->name.ends_with("attn.c_attn.bias")) {
      EXPECT_LT(RelativeError(p->value.data(), w.data(), width), kTolerance) << p->name << " q";
      EXPECT_LT(RelativeError(p->value.data() + 2 * width, w.data() + 2 * width, width), kTolerance)
          << p->name << " v";
      continue;
    }
    EXPECT_LT(RelativeError(p->value.data(), w.data(), w.numel()), kTolerance)
        << "after " << kSteps << " steps: " << p->name;
  }
}

}  // namespace
}  // namespace aidn::engine
