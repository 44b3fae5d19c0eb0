#include "worker/engine/cuda/gpu_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/kernels.h"
#include "worker/engine/cuda/status.h"

namespace aidn::engine::cuda {

// ---------------------------------------------------------------- GpuModel

namespace {

// The same names and shapes in the same order, else INVALID_ARGUMENT naming
// the first difference ("parameter 3: CPU fc.bias [10], GPU fc.weight ...").
absl::Status Matching(const char* what, const std::vector<GpuParameter*>& gpu,
                      const std::vector<Parameter*>& cpu) {
  if (cpu.size() != gpu.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(cpu.size(), " CPU ", what, "s for ", gpu.size(), " GPU ", what, "s"));
  }
  for (size_t k = 0; k < cpu.size(); ++k) {
    const GpuParameter* g = gpu[k];
    if (cpu[k] == nullptr || cpu[k]->name != g->name || cpu[k]->value.shape() != g->value.shape()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", k, ": CPU ", cpu[k] == nullptr ? "null" : cpu[k]->name, " ",
                       cpu[k] == nullptr ? "" : cpu[k]->value.ShapeString(), ", GPU ", g->name, " ",
                       g->value.ShapeString()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuModel>> GpuModel::Create(GpuContext* ctx, const Sequential& cpu) {
  std::unique_ptr<GpuModel> model(new GpuModel(ctx));
  int last_run = -1;
  int units = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    AIDN_ASSIGN_OR_RETURN(std::unique_ptr<GpuLayer> layer, MirrorLayer(ctx, cpu.layer(i)));
    std::vector<GpuParameter*> params = layer->Parameters();
    for (GpuParameter* p : params) model->parameters_.push_back(p);
    for (GpuParameter* b : layer->Buffers()) model->buffers_.push_back(b);
    // Sequential::Add's units: one per layer with parameters.
    model->unit_.push_back(params.empty() ? 0 : ++units);
    model->layer_parameters_.push_back(params);
    if (!params.empty() && model->first_trainable_ < 0) {
      model->first_trainable_ = static_cast<int>(i);
    }
    // Sequential::Add's rule: only parameter-free layers are fused.
    const bool fused = params.empty() && last_run >= 0 &&
                       model->layers_[static_cast<size_t>(last_run)]->Fuse(*layer);
    model->fused_.push_back(fused);
    if (!fused) last_run = static_cast<int>(i);
    model->layers_.push_back(std::move(layer));
  }
  if (model->layers_.empty()) return absl::InvalidArgumentError("the CPU model has no layers");
  // Sized once: layers keep pointers to these tensors between Forward and
  // Backward.
  model->activations_.resize(model->layers_.size());
  model->grads_.resize(model->layers_.size());
  // The names were copied from the CPU layers; check the whole list too.
  AIDN_RETURN_IF_ERROR(model->Matches(cpu.Parameters()));
  AIDN_RETURN_IF_ERROR(Matching("buffer", model->buffers_, cpu.Buffers()));
  return model;
}

absl::StatusOr<std::unique_ptr<GpuModel>> GpuModel::Build(GpuContext* ctx,
                                                          const ModelConfig& config,
                                                          uint64_t seed) {
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<Sequential> cpu, BuildModel(config, seed));
  return Create(ctx, *cpu);
}

absl::Status GpuModel::Forward(const GpuTensor& input, GpuTensor* logits, bool training) {
  const GpuTensor* x = &input;
  const size_t last = layers_.size() - 1;
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->BeforeForward(0));
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fused_[i]) continue;
    GpuTensor* y = i == last ? logits : &activations_[i];
    const int unit = hooks_ != nullptr ? unit_[i] : 0;
    if (unit > 0) AIDN_RETURN_IF_ERROR(hooks_->BeforeForward(unit));
    AIDN_RETURN_IF_ERROR(
        Annotate(layers_[i]->Forward(*x, y, training), absl::StrCat("layer ", i, " forward")));
    if (unit > 0) AIDN_RETURN_IF_ERROR(hooks_->AfterForward(unit));
    x = y;
  }
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterForward(0));
  if (x != logits) AIDN_RETURN_IF_ERROR(logits->CopyFrom(ctx_, *x));
  return absl::OkStatus();
}

absl::Status GpuModel::Backward(const GpuTensor& grad_logits, const GradReadyFn& on_ready) {
  const GpuTensor* g = &grad_logits;
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->BeforeBackward(0));
  for (int i = static_cast<int>(layers_.size()) - 1; i >= 0; --i) {
    const size_t at = static_cast<size_t>(i);
    if (fused_[at]) continue;
    // No gradient for the model's input or anything before the first layer
    // with parameters (as Sequential::Backward).
    GpuTensor* grad_input = i > first_trainable_ && first_trainable_ >= 0 ? &grads_[at] : nullptr;
    const int unit = hooks_ != nullptr ? unit_[at] : 0;
    if (unit > 0) AIDN_RETURN_IF_ERROR(hooks_->BeforeBackward(unit));
    AIDN_RETURN_IF_ERROR(
        Annotate(layers_[at]->Backward(*g, grad_input), absl::StrCat("layer ", i, " backward")));
    if (unit > 0) AIDN_RETURN_IF_ERROR(hooks_->AfterBackward(unit));
    if (on_ready && !layer_parameters_[at].empty()) {
      // What the forward did not use gets no gradient (as
      // Sequential::Backward): the reducer decides what that means.
      const std::vector<GpuParameter*> unused = layers_[at]->UnusedParameters();
      if (unused.empty()) {
        AIDN_RETURN_IF_ERROR(on_ready(layer_parameters_[at]));
      } else {
        std::vector<GpuParameter*> used;
        for (GpuParameter* p : layer_parameters_[at]) {
          if (std::find(unused.begin(), unused.end(), p) == unused.end()) used.push_back(p);
        }
        if (!used.empty()) AIDN_RETURN_IF_ERROR(on_ready(used));
      }
    }
    if (grad_input == nullptr) break;
    g = grad_input;
  }
  if (hooks_ != nullptr) AIDN_RETURN_IF_ERROR(hooks_->AfterBackward(0));
  return absl::OkStatus();
}

absl::Status GpuModel::ZeroGrad() {
  if (hooks_ != nullptr) return absl::OkStatus();
  for (GpuParameter* p : parameters_) AIDN_RETURN_IF_ERROR(p->grad.Zero(ctx_));
  return absl::OkStatus();
}

void GpuModel::SetSeed(uint64_t seed) {
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i]->SetSeed(LayerSeed(seed, i));
}

void GpuModel::SetBatchNormSync(StreamCollectives* sync) {
  for (auto& layer : layers_) layer->SetBatchNormSync(sync);
}

bool GpuModel::DrawsOnTheHost() const {
  for (const auto& layer : layers_) {
    if (layer->DrawsOnTheHost()) return true;
  }
  return false;
}

std::vector<GpuParameter*> GpuModel::UnusedParameters() const {
  std::vector<GpuParameter*> unused;
  for (const auto& layer : layers_) {
    for (GpuParameter* p : layer->UnusedParameters()) unused.push_back(p);
  }
  return unused;
}

int64_t GpuModel::ParameterCount() const {
  int64_t n = 0;
  for (const GpuParameter* p : parameters_) n += p->value.numel();
  return n;
}

std::string GpuModel::Describe() const {
  std::string s = "Sequential(\n";
  for (size_t i = 0; i < layers_.size(); ++i) {
    absl::StrAppend(&s, "  (", i, "): ", layers_[i]->Describe(), "\n");
  }
  return s + ")";
}

absl::Status GpuModel::Matches(const std::vector<Parameter*>& cpu) const {
  return Matching("parameter", parameters_, cpu);
}

absl::Status GpuModel::CopyBuffersTo(const std::vector<Parameter*>& cpu) const {
  AIDN_RETURN_IF_ERROR(Matching("buffer", buffers_, cpu));
  for (size_t k = 0; k < cpu.size(); ++k) {
    AIDN_RETURN_IF_ERROR(buffers_[k]->value.CopyToHost(ctx_, &cpu[k]->value));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::CopyParametersFrom(const std::vector<Parameter*>& cpu) {
  AIDN_RETURN_IF_ERROR(Matches(cpu));
  for (size_t k = 0; k < cpu.size(); ++k) {
    AIDN_RETURN_IF_ERROR(parameters_[k]->value.CopyFromHost(ctx_, cpu[k]->value));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::CopyParametersTo(const std::vector<Parameter*>& cpu) const {
  AIDN_RETURN_IF_ERROR(Matches(cpu));
  for (size_t k = 0; k < cpu.size(); ++k) {
    AIDN_RETURN_IF_ERROR(parameters_[k]->value.CopyToHost(ctx_, &cpu[k]->value));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::CopyGradientsTo(const std::vector<Parameter*>& cpu) const {
  AIDN_RETURN_IF_ERROR(Matches(cpu));
  for (size_t k = 0; k < cpu.size(); ++k) {
    AIDN_RETURN_IF_ERROR(parameters_[k]->grad.CopyToHost(ctx_, &cpu[k]->grad));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- loss

absl::Status GpuCrossEntropy::ReserveSlots(int slots) {
  if (slots < 1) return absl::InvalidArgumentError(absl::StrCat(slots, " loss slots"));
  if (slots <= slots_) return absl::OkStatus();
  loss_.Release();
  AIDN_ASSIGN_OR_RETURN(loss_, ctx_->allocator().Allocate(sizeof(double) * slots));
  slots_ = slots;
  return absl::OkStatus();
}

absl::Status GpuCrossEntropy::Compute(const GpuTensor& logits, const std::vector<int32_t>& labels,
                                      GpuTensor* grad_logits, double grad_scale) {
  AIDN_RETURN_IF_ERROR(ReserveSlots(1));
  return Compute(logits, labels, grad_logits, grad_scale, 0);
}

absl::Status GpuCrossEntropy::Compute(const GpuTensor& logits, const std::vector<int32_t>& labels,
                                      GpuTensor* grad_logits, double grad_scale, int slot) {
  if (logits.rank() != 2) {
    return absl::InvalidArgumentError("logits must be [N, classes], got " + logits.ShapeString());
  }
  const int64_t n = logits.dim(0);
  const int64_t classes = logits.dim(1);
  if (static_cast<int64_t>(labels.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(labels.size(), " labels for logits ", logits.ShapeString()));
  }
  for (int32_t label : labels) {
    if (label < 0 || label >= classes) {
      return absl::InvalidArgumentError(
          absl::StrCat("label ", label, " not in [0, ", classes, ")"));
    }
  }
  const size_t label_bytes = sizeof(int32_t) * labels.size();
  if (label_bytes > labels_.bytes()) {
    labels_.Release();
    AIDN_ASSIGN_OR_RETURN(labels_, ctx_->allocator().Allocate(label_bytes));
  }
  if (n > 0) {
    // From pageable memory: the call returns once `labels` is staged, so the
    // caller may reuse it. The next micro-batch's labels overwrite these
    // only after this one's kernel has read them (stream order).
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(labels_.data(), labels.data(), label_bytes,
                                              cudaMemcpyHostToDevice, ctx_->stream()));
  }
  return ComputeOnDevice(logits, static_cast<const int32_t*>(labels_.data()), n, grad_logits,
                         grad_scale, slot);
}

absl::Status GpuCrossEntropy::ComputeOnDevice(const GpuTensor& logits, const int32_t* labels,
                                              int64_t n, GpuTensor* grad_logits, double grad_scale,
                                              int slot) {
  if (slot < 0 || slot >= slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss slot ", slot, " of ", slots_, " reserved"));
  }
  if (logits.rank() != 2 || logits.dim(0) != n) {
    return absl::InvalidArgumentError(absl::StrCat(n, " labels for logits ", logits.ShapeString()));
  }
  const int64_t classes = logits.dim(1);
  if (grad_logits != nullptr) AIDN_RETURN_IF_ERROR(grad_logits->Resize(ctx_, {n, classes}));
  if (sizeof(double) * static_cast<size_t>(n) > row_loss_.bytes()) {
    row_loss_.Release();
    AIDN_ASSIGN_OR_RETURN(row_loss_,
                          ctx_->allocator().Allocate(sizeof(double) * static_cast<size_t>(n)));
  }
  return LaunchSoftmaxCrossEntropy(ctx_->stream(), logits.data(), labels, n, classes,
                                   grad_logits != nullptr ? grad_logits->data() : nullptr,
                                   grad_scale, static_cast<double*>(row_loss_.data()),
                                   static_cast<double*>(loss_.data()) + slot);
}

absl::StatusOr<double> GpuCrossEntropy::Loss() const {
  if (loss_.data() == nullptr) return absl::FailedPreconditionError("Loss() before Compute()");
  double loss = 0;
  AIDN_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(&loss, loss_.data(), sizeof(double), cudaMemcpyDeviceToHost, ctx_->stream()));
  // `loss` is a host local read right after: wait for the copy.
  AIDN_RETURN_IF_ERROR(ctx_->Synchronize());
  return loss;
}

// ---------------------------------------------------------------- trainer

namespace {

// Makes *buffer, pinned host memory, hold at least `count` values of T:
// a smaller one is freed and replaced (contents lost; *moved set). Callers
// grow only between steps, after the last step's copies have completed.
template <typename T>
absl::Status GrowPinned(T** buffer, size_t* capacity, size_t count, bool* moved) {
  *moved = false;
  if (count <= *capacity) return absl::OkStatus();
  if (*buffer != nullptr) cudaFreeHost(*buffer);
  *buffer = nullptr;
  *capacity = 0;
  *moved = true;
  AIDN_RETURN_IF_CUDA_ERROR(cudaMallocHost(reinterpret_cast<void**>(buffer), sizeof(T) * count));
  *capacity = count;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuTrainer>> GpuTrainer::Create(
    GpuContext* ctx, GpuModel* model, const OptimizerConfig& optimizer,
    const std::vector<GpuParameter*>* optimized) {
  std::unique_ptr<GpuTrainer> trainer(new GpuTrainer(ctx, model));
  AIDN_ASSIGN_OR_RETURN(
      trainer->optimizer_,
      GpuOptimizer::Create(ctx, optimizer,
                           optimized != nullptr ? *optimized : model->Parameters()));
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&trainer->done_, cudaEventDisableTiming));
  if (ctx->options().precision == Precision::kFp16) {
    AIDN_RETURN_IF_ERROR(trainer->SetLossScale(LossScaleOptions()));
  }
  return trainer;
}

absl::Status GpuTrainer::SetLossScale(const LossScaleOptions& options) {
  if (ctx_->options().precision != Precision::kFp16) {
    return absl::FailedPreconditionError("loss scaling is for fp16 (bf16 and fp32 need none)");
  }
  AIDN_ASSIGN_OR_RETURN(DynamicLossScaler scaler, DynamicLossScaler::Create(options));
  if (found_.data() == nullptr) {
    AIDN_ASSIGN_OR_RETURN(found_, ctx_->allocator().Allocate(sizeof(int32_t)));
  }
  if (host_found_ == nullptr) {
    AIDN_RETURN_IF_CUDA_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&host_found_), sizeof(int32_t)));
  }
  scaler_ = scaler;
  return absl::OkStatus();
}

absl::Status GpuTrainer::RestoreLossScale(const LossScaleState& state) {
  if (!scaler_) {
    return absl::FailedPreconditionError("no loss scale to restore: only fp16 training has one");
  }
  return scaler_->Restore(state);
}

absl::Status GpuTrainer::WaitFor() {
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(done_, ctx_->stream()));
  if (wait_) return wait_(done_);
  AIDN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(done_));
  return absl::OkStatus();
}

absl::StatusOr<bool> GpuTrainer::UnscaleAndCheck(double scale) {
  return UnscaleAndCheckGradients(
      ctx_, optimizer_->parameters(), scale, static_cast<int32_t*>(found_.data()), host_found_,
      [this]() -> absl::Status {
        if (!check_wait_) return WaitFor();
        AIDN_RETURN_IF_CUDA_ERROR(cudaEventRecord(done_, ctx_->stream()));
        return check_wait_(done_);
      },
      overflow_allreduce_);
}

GpuTrainer::~GpuTrainer() {
  // Nothing of ours may still be in flight when the pinned buffers go.
  if (done_ != nullptr) {
    cudaEventSynchronize(done_);
    cudaEventDestroy(done_);
  }
  if (graph_exec_ != nullptr) cudaGraphExecDestroy(graph_exec_);
  if (host_losses_ != nullptr) cudaFreeHost(host_losses_);
  if (host_found_ != nullptr) cudaFreeHost(host_found_);
  if (staged_images_ != nullptr) cudaFreeHost(staged_images_);
  if (staged_labels_ != nullptr) cudaFreeHost(staged_labels_);
}

void GpuTrainer::SetCudaGraphs(bool on) {
  graphs_ = on;
  graphs_failed_ = false;
  InvalidateGraph();
}

void GpuTrainer::InvalidateGraph() {
  if (graph_exec_ != nullptr) cudaGraphExecDestroy(graph_exec_);
  graph_exec_ = nullptr;
  graph_key_.clear();
  warm_key_.clear();
}

std::string GpuTrainer::GraphBlocker() const {
  if (!graphs_) return "CUDA graphs off";
  if (graphs_failed_) return graph_note_;
  if (grad_ready_ || after_backward_ || wait_ || check_wait_ || before_forward_) {
    return "CUDA graphs not used: the step has hooks (DDP, or a test's)";
  }
  if (scaler_) return "CUDA graphs not used: fp16 loss scaling waits on the host mid-step";
  if (model_->DrawsOnTheHost()) {
    return "CUDA graphs not used: dropout masks and stochastic depth are drawn on the host";
  }
  return "";
}

absl::Status GpuTrainer::Stage(const std::vector<MicroBatch>& micro) {
  size_t floats = 0, labels = 0;
  for (const MicroBatch& b : micro) {
    floats += static_cast<size_t>(b.images->numel());
    labels += b.labels->size();
  }
  // Growing moves the buffers a captured graph reads: the graph goes.
  bool images_moved = false, labels_moved = false;
  AIDN_RETURN_IF_ERROR(GrowPinned(&staged_images_, &staged_image_floats_, floats, &images_moved));
  AIDN_RETURN_IF_ERROR(GrowPinned(&staged_labels_, &staged_label_count_, labels, &labels_moved));
  // (Also when an earlier allocation failed after the pinned buffer grew.)
  if (labels_moved || device_labels_.bytes() < sizeof(int32_t) * labels) {
    device_labels_.Release();
    AIDN_ASSIGN_OR_RETURN(device_labels_, ctx_->allocator().Allocate(sizeof(int32_t) * labels));
  }
  if (images_moved || labels_moved) InvalidateGraph();
  size_t image_at = 0, label_at = 0;
  for (size_t i = 0; i < micro.size(); ++i) {
    const Tensor& images = *micro[i].images;
    const std::vector<int32_t>& l = *micro[i].labels;
    if (images.rank() < 1 || images.dim(0) != static_cast<int64_t>(l.size())) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch ", i, ": ", l.size(),
                                                     " labels for images ", images.ShapeString()));
    }
    for (int32_t label : l) {
      // The upper bound is known once a step has run (its logits' width);
      // the first step's eager run checks it then.
      if (label < 0 || (classes_ > 0 && label >= classes_)) {
        return absl::InvalidArgumentError(
            absl::StrCat("label ", label, " not in [0, ", classes_ > 0 ? classes_ : 0, ")"));
      }
    }
    std::memcpy(staged_images_ + image_at, images.data(),
                sizeof(float) * static_cast<size_t>(images.numel()));
    std::memcpy(staged_labels_ + label_at, l.data(), sizeof(int32_t) * l.size());
    image_at += static_cast<size_t>(images.numel());
    label_at += l.size();
  }
  return absl::OkStatus();
}

absl::Status GpuTrainer::QueueStaged(const std::vector<MicroBatch>& micro, double grad_scale) {
  cudaStream_t stream = ctx_->stream();
  AIDN_RETURN_IF_ERROR(model_->ZeroGrad());
  size_t image_at = 0, label_at = 0;
  for (size_t i = 0; i < micro.size(); ++i) {
    const Tensor& images = *micro[i].images;
    const int64_t n = images.dim(0);
    AIDN_RETURN_IF_ERROR(input_.Resize(ctx_, images.shape()));
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(input_.data(), staged_images_ + image_at,
                                              sizeof(float) * static_cast<size_t>(images.numel()),
                                              cudaMemcpyHostToDevice, stream));
    AIDN_RETURN_IF_ERROR(model_->Forward(input_, &logits_, /*training=*/true));
    if (logits_.rank() == 2) {
      classes_ = logits_.dim(1);
      for (size_t j = 0; j < static_cast<size_t>(n); ++j) {
        if (staged_labels_[label_at + j] >= classes_) {
          return absl::InvalidArgumentError(
              absl::StrCat("label ", staged_labels_[label_at + j], " not in [0, ", classes_, ")"));
        }
      }
    }
    int32_t* labels = static_cast<int32_t*>(device_labels_.data()) + label_at;
    AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(labels, staged_labels_ + label_at,
                                              sizeof(int32_t) * static_cast<size_t>(n),
                                              cudaMemcpyHostToDevice, stream));
    AIDN_RETURN_IF_ERROR(
        loss_.ComputeOnDevice(logits_, labels, n, &grad_logits_, grad_scale, static_cast<int>(i)));
    AIDN_RETURN_IF_ERROR(model_->Backward(grad_logits_));
    image_at += static_cast<size_t>(images.numel());
    label_at += static_cast<size_t>(n);
  }
  AIDN_RETURN_IF_ERROR(optimizer_->Queue(/*args_in_memory=*/true));
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host_losses_, loss_.device_losses(),
                                            sizeof(double) * micro.size(), cudaMemcpyDeviceToHost,
                                            stream));
  return absl::OkStatus();
}

absl::Status GpuTrainer::GraphStep(const std::vector<MicroBatch>& micro, double lr,
                                   double grad_scale) {
  AIDN_RETURN_IF_ERROR(Stage(micro));
  AIDN_RETURN_IF_ERROR(optimizer_->EnableArgsInMemory());
  AIDN_RETURN_IF_ERROR(optimizer_->Prepare(lr));
  absl::Status s = GraphStepPrepared(micro, grad_scale);
  if (!s.ok()) {
    // A step that failed before its update ran is not counted (as eagerly,
    // where the update is prepared last).
    optimizer_->Unprepare();
    // Whatever it queued must be done before the next step's Stage and
    // Prepare rewrite the pinned buffers its copies read (its error, if
    // any, is the context's, which the next call reports anyway).
    ctx_->Synchronize().IgnoreError();
  }
  return s;
}

absl::Status GpuTrainer::GraphStepPrepared(const std::vector<MicroBatch>& micro,
                                           double grad_scale) {
  // What a graph bakes in: the micro-batches' shapes, and which update
  // kernel runs (SGD's first step is another).
  std::vector<int64_t> key = {static_cast<int64_t>(micro.size()),
                              optimizer_->prepared_first_step() ? 1 : 0};
  for (const MicroBatch& b : micro) {
    key.insert(key.end(), b.images->shape().begin(), b.images->shape().end());
    key.push_back(-1);
  }
  cudaStream_t stream = ctx_->stream();
  // Another user of the context moved the shared workspace the graph uses.
  if (graph_exec_ != nullptr && ctx_->workspace_generation() != graph_workspace_) {
    InvalidateGraph();
  }
  if (graph_exec_ != nullptr && key == graph_key_) {
    AIDN_RETURN_IF_CUDA_ERROR(cudaGraphLaunch(graph_exec_, stream));
    optimizer_->Replayed();
    ++graph_steps_;
    graph_note_.clear();
    return absl::OkStatus();
  }
  if (key != warm_key_) {
    // A new shape: run it eagerly once (algorithm search, allocations,
    // which may move buffers an old graph reads).
    InvalidateGraph();
    AIDN_RETURN_IF_ERROR(QueueStaged(micro, grad_scale));
    warm_key_ = key;
    graph_note_ = "CUDA graphs: a step of a new shape ran eagerly before capture";
    return absl::OkStatus();
  }
  // The second step of this shape: capture it, then launch the graph.
  // The warm-up made every buffer this shape needs, so capturing allocates
  // nothing; an allocation (even one served from the allocator's cache, which
  // a capture does not notice) could leave the graph holding a block that is
  // later freed or handed to another user, so it fails the capture.
  const CachingAllocator::Stats before = ctx_->allocator().stats();
  const uint64_t workspace_before = ctx_->workspace_generation();
  AIDN_RETURN_IF_CUDA_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  absl::Status queued = QueueStaged(micro, grad_scale);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  const CachingAllocator::Stats& after = ctx_->allocator().stats();
  if (queued.ok() &&
      (after.cuda_mallocs != before.cuda_mallocs || after.cache_hits != before.cache_hits ||
       ctx_->workspace_generation() != workspace_before)) {
    queued = absl::InternalError("the captured step allocated device memory");
  }
  cudaGraphExec_t exec = nullptr;
  cudaError_t instantiated = cudaErrorUnknown;
  if (queued.ok() && ended == cudaSuccess && graph != nullptr) {
    instantiated = cudaGraphInstantiate(&exec, graph, 0);
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!queued.ok() || ended != cudaSuccess || instantiated != cudaSuccess) {
    // Nothing captured ran: graphs off for good, this step eagerly.
    cudaGetLastError();
    graphs_failed_ = true;
    graph_note_ = absl::StrCat(
        "CUDA graphs off: capture failed: ",
        !queued.ok() ? std::string(queued.message())
        : ended != cudaSuccess
            ? absl::StrCat("cudaStreamEndCapture: ", cudaGetErrorString(ended))
            : absl::StrCat("cudaGraphInstantiate: ", cudaGetErrorString(instantiated)));
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    optimizer_->Unqueue();
    return QueueStaged(micro, grad_scale);
  }
  graph_exec_ = exec;
  graph_key_ = key;
  graph_workspace_ = ctx_->workspace_generation();
  if (const cudaError_t launched = cudaGraphLaunch(graph_exec_, stream); launched != cudaSuccess) {
    // The update captured in it did not run: the step is not counted.
    InvalidateGraph();
    optimizer_->Unqueue();
    AIDN_RETURN_IF_CUDA_ERROR(launched);
  }
  ++graph_steps_;
  graph_note_.clear();
  return absl::OkStatus();
}

absl::StatusOr<double> GpuTrainer::Step(const Tensor& images, const std::vector<int32_t>& labels,
                                        double lr) {
  return Step({MicroBatch{&images, &labels, std::nullopt}}, lr);
}

absl::StatusOr<double> GpuTrainer::Step(const std::vector<MicroBatch>& micro, double lr) {
  if (micro.empty()) return absl::InvalidArgumentError("a step needs at least one micro-batch");
  for (size_t i = 0; i < micro.size(); ++i) {
    if (micro[i].images == nullptr || micro[i].labels == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch ", i, " has no data"));
    }
  }
  const int k = static_cast<int>(micro.size());
  const double* slots_before = loss_.device_losses();
  AIDN_RETURN_IF_ERROR(loss_.ReserveSlots(k));
  if (loss_.device_losses() != slots_before) InvalidateGraph();
  bool losses_moved = false;
  AIDN_RETURN_IF_ERROR(
      GrowPinned(&host_losses_, &host_slots_, static_cast<size_t>(k), &losses_moved));
  if (losses_moved) InvalidateGraph();
  // The CPU trainer's scale, computed as it computes it (times the loss
  // scale in fp16).
  const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const double grad_scale =
      scaler_ ? loss_scale / static_cast<double>(k) : 1.0 / static_cast<double>(k);
  last_skipped_ = false;
  if (graphs_) {
    graph_note_ = GraphBlocker();
    if (graph_note_.empty()) {
      AIDN_RETURN_IF_ERROR(GraphStep(micro, lr, grad_scale));
      AIDN_RETURN_IF_ERROR(WaitFor());
      double loss = 0;
      for (int i = 0; i < k; ++i) loss += host_losses_[i] / static_cast<double>(k);
      return loss;
    }
    // An eager step may move buffers a graph reads.
    InvalidateGraph();
  }
  AIDN_RETURN_IF_ERROR(model_->ZeroGrad());
  if (before_forward_) AIDN_RETURN_IF_ERROR(before_forward_());
  // Which parameters some forward of the step used (stochastic depth skips
  // blocks); all of them for most models.
  const std::vector<GpuParameter*>& params = model_->Parameters();
  std::vector<bool> used(params.size(), false);
  std::vector<GpuParameter*> unused;
  for (int i = 0; i < k; ++i) {
    const MicroBatch& b = micro[static_cast<size_t>(i)];
    if (b.seed.has_value()) model_->SetSeed(*b.seed);
    AIDN_RETURN_IF_ERROR(input_.CopyFromHost(ctx_, *b.images));
    AIDN_RETURN_IF_ERROR(model_->Forward(input_, &logits_, /*training=*/true));
    AIDN_RETURN_IF_ERROR(loss_.Compute(logits_, *b.labels, &grad_logits_, grad_scale, i));
    unused = model_->UnusedParameters();
    for (size_t j = 0; j < params.size(); ++j) {
      if (std::find(unused.begin(), unused.end(), params[j]) == unused.end()) used[j] = true;
    }
    const bool last = i == k - 1;
    if (last && before_last_backward_) AIDN_RETURN_IF_ERROR(before_last_backward_(used, unused));
    AIDN_RETURN_IF_ERROR(
        model_->Backward(grad_logits_, last ? grad_ready_ : GpuModel::GradReadyFn()));
  }
  if (!grad_ready_) {
    for (size_t j = 0; j < params.size(); ++j) params[j]->no_grad = !used[j];
  }
  if (after_backward_) AIDN_RETURN_IF_ERROR(after_backward_());
  if (scaler_) {
    AIDN_ASSIGN_OR_RETURN(const bool overflow, UnscaleAndCheck(loss_scale));
    last_skipped_ = !scaler_->Update(overflow);
  }
  if (!last_skipped_) AIDN_RETURN_IF_ERROR(optimizer_->Step(lr));
  AIDN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host_losses_, loss_.device_losses(), sizeof(double) * k,
                                            cudaMemcpyDeviceToHost, ctx_->stream()));
  // The only wait of the step (the second in fp16).
  AIDN_RETURN_IF_ERROR(WaitFor());
  double loss = 0;
  for (int i = 0; i < k; ++i) loss += host_losses_[i] / static_cast<double>(k);
  return loss;
}

}  // namespace aidn::engine::cuda
