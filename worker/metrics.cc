#include "worker/metrics.h"

#include <dlfcn.h>

#include <mutex>

namespace aidn::worker {

WorkerMetrics::WorkerMetrics(metrics::Registry* r)
    : registry(r),
      trainers_running(
          r->AddGauge("aidn_worker_trainers_running", "Trainer processes running now.").Add({})),
      trainers_started(
          r->AddCounter("aidn_worker_trainers_started_total", "Trainer processes started.")
              .Add({})),
      trainer_restarts(r->AddCounter("aidn_worker_trainer_restarts_total",
                                     "Trainers started for a later generation of a job this "
                                     "worker ran before (the job restarted).")
                           .Add({})),
      trainer_exits(r->AddCounter(
          "aidn_worker_trainer_exits_total",
          "Trainer exits by outcome: ok, failed, stopped (on an order), killed (by a signal "
          "otherwise), not_started.")),
      coordinator_up(r->AddGauge("aidn_worker_coordinator_up",
                                 "1 when the last call to the coordinator succeeded.")
                         .Add({})),
      coordinator_call_failures(r->AddCounter("aidn_worker_coordinator_call_failures_total",
                                              "Failed calls to the coordinator, by call.")),
      trainer_cpu_seconds(r->AddCounter("aidn_worker_trainer_cpu_seconds_total",
                                        "CPU time (user + system) a running trainer used so far.")),
      trainer_resident_memory_bytes(r->AddGauge("aidn_worker_trainer_resident_memory_bytes",
                                                "Resident memory of a running trainer.")),
      gpu_memory_used_bytes(
          r->AddGauge("aidn_worker_gpu_memory_used_bytes", "GPU memory in use (NVML).")),
      gpu_memory_total_bytes(
          r->AddGauge("aidn_worker_gpu_memory_total_bytes", "GPU memory in all (NVML).")) {}

namespace {

// The few NVML entry points used, by their C ABI (nvml.h): loading the
// library at run time keeps the worker free of a link-time driver
// dependency, and works in CPU builds run on GPU nodes too.
struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
using NvmlDevice = void*;
struct Nvml {
  int (*init)() = nullptr;
  int (*count)(unsigned int*) = nullptr;
  int (*handle)(unsigned int, NvmlDevice*) = nullptr;
  int (*memory)(NvmlDevice, NvmlMemory*) = nullptr;
  bool ok = false;
};

const Nvml& LoadNvml() {
  static Nvml nvml;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    nvml.init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    nvml.count = reinterpret_cast<int (*)(unsigned int*)>(dlsym(lib, "nvmlDeviceGetCount_v2"));
    nvml.handle = reinterpret_cast<int (*)(unsigned int, NvmlDevice*)>(
        dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    nvml.memory =
        reinterpret_cast<int (*)(NvmlDevice, NvmlMemory*)>(dlsym(lib, "nvmlDeviceGetMemoryInfo"));
    nvml.ok = nvml.init != nullptr && nvml.count != nullptr && nvml.handle != nullptr &&
              nvml.memory != nullptr && nvml.init() == 0;
  });
  return nvml;
}

}  // namespace

std::vector<GpuMemory> ReadGpuMemory() {
  std::vector<GpuMemory> out;
  const Nvml& nvml = LoadNvml();
  if (!nvml.ok) return out;
  unsigned int count = 0;
  if (nvml.count(&count) != 0) return out;
  for (unsigned int i = 0; i < count; ++i) {
    NvmlDevice device = nullptr;
    NvmlMemory memory{};
    if (nvml.handle(i, &device) != 0 || nvml.memory(device, &memory) != 0) continue;
    out.push_back({static_cast<int>(i), static_cast<int64_t>(memory.used),
                   static_cast<int64_t>(memory.total)});
  }
  return out;
}

}  // namespace aidn::worker
