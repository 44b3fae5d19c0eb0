#ifndef AIDN_WORKER_ENGINE_TENSOR_H_
#define AIDN_WORKER_ENGINE_TENSOR_H_

// A dense float32 tensor in row-major order with a device tag. Its storage
// is host memory; the GPU engine keeps device memory in a type of its own
// (cuda/gpu_tensor.h), so the CPU engine stays free of CUDA.
// Storage is 64-byte aligned (AVX-512 loads) and reused by Resize when the
// new size fits, so steady-state training allocates nothing.
//
// Not thread-safe; move-only (copies are explicit: Clone()).

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace aidn::engine {

enum class Device { kCpu, kCuda };

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled.
  explicit Tensor(std::vector<int64_t> shape, Device device = Device::kCpu);
  Tensor(std::initializer_list<int64_t> shape) : Tensor(std::vector<int64_t>(shape)) {}
  // A moved-from tensor is empty (shape [], no storage).
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  // An owning copy (of a view, too).
  Tensor Clone() const;
  // A tensor over `data` (numel floats), which it does not own: the memory
  // must outlive it. DDP keeps gradients as views into its buckets so that
  // the allreduce needs no copies. A Resize beyond numel gives the tensor
  // storage of its own (and detaches it).
  static Tensor View(float* data, std::vector<int64_t> shape);
  bool is_view() const { return data_ != nullptr && storage_ == nullptr; }

  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  int64_t numel() const { return numel_; }
  Device device() const { return device_; }

  float* data() { return data_; }
  const float* data() const { return data_; }
  float& operator[](int64_t i) { return data_[i]; }
  float operator[](int64_t i) const { return data_[i]; }

  // Changes the shape; keeps the storage when it is large enough (contents
  // are then unspecified), else allocates zeroed storage.
  void Resize(std::vector<int64_t> shape);
  void Fill(float value);
  void Zero() { Fill(0.0f); }

  // "[64, 784]"
  std::string ShapeString() const;

 private:
  struct Free {
    void operator()(float* p) const;
  };
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  int64_t capacity_ = 0;
  Device device_ = Device::kCpu;
  std::unique_ptr<float[], Free> storage_;
  float* data_ = nullptr;
};

// A trainable tensor and its gradient (same shape), named as in a PyTorch
// state_dict ("0.weight", "2.bias"), so checkpoints and the safetensors
// export line up with torch's nn.Sequential.
struct Parameter {
  std::string name;
  Tensor value;
  Tensor grad;
  // A shard of a parameter (ZeRO, ddp.h) holds a flat piece of it; this is
  // the whole parameter's shape (empty: not a shard), which decides, as the
  // whole's would, whether weight decay applies.
  std::vector<int64_t> whole_shape;
  // No rank used the parameter this step (DDP's find_unused_parameters):
  // torch's "grad is None", the optimizer leaves it and its state alone.
  bool no_grad = false;
};

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_TENSOR_H_
