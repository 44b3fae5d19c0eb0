#include "worker/engine/powersgd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/gemm.h"

namespace aidn::engine {
namespace {

// A gradient as torch's hook sees it: a matrix of n rows, the rest folded.
struct Matrix {
  float* data;
  int64_t n, m, r;
};

absl::Status Averaged(Communicator* comm, float* data, size_t count, const char* what) {
  if (count == 0) return absl::OkStatus();
  return Annotate(comm->AllReduce(data, count, ReduceOp::kSum), absl::StrCat("powersgd ", what));
}

}  // namespace

void OrthogonalizeColumns(float* a, int64_t rows, int64_t cols) {
  auto dot = [&](int64_t x, int64_t y) {
    double d = 0;
    for (int64_t r = 0; r < rows; ++r) d += static_cast<double>(a[r * cols + x]) * a[r * cols + y];
    return d;
  };
  for (int64_t i = 0; i < cols; ++i) {
    // The earlier columns taken out twice: a column all but inside their
    // span (a gradient of lower rank than r) keeps only rounding noise
    // after the first pass, which the second makes orthogonal too.
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t j = 0; j < i; ++j) {
        const float d = static_cast<float>(dot(j, i));
        for (int64_t r = 0; r < rows; ++r) a[r * cols + i] -= d * a[r * cols + j];
      }
    }
    const double norm = std::sqrt(dot(i, i));
    if (norm > 0) {
      const float inv = static_cast<float>(1.0 / norm);
      for (int64_t r = 0; r < rows; ++r) a[r * cols + i] *= inv;
    }
  }
}

const std::vector<float>* PowerSgd::error(int bucket) const {
  auto it = buckets_.find(bucket);
  if (it == buckets_.end() || it->second.error.empty()) return nullptr;
  return &it->second.error;
}

absl::Status PowerSgd::Reduce(int bucket, float* buffer,
                              const std::vector<std::vector<int64_t>>& shapes, Communicator* comm) {
  std::vector<Gradient> grads;
  float* at = buffer;
  for (const std::vector<int64_t>& s : shapes) {
    grads.push_back({at, s});
    int64_t numel = 1;
    for (const int64_t d : s) numel *= d;
    at += numel;
  }
  return Reduce(bucket, grads, comm);
}

PowerSgdPlan PlanPowerSgd(const std::vector<std::vector<int64_t>>& shapes,
                          const PowerSgdOptions& options) {
  PowerSgdPlan plan;
  for (const std::vector<int64_t>& s : shapes) {
    int64_t numel = 1;
    for (const int64_t d : s) numel *= d;
    const int64_t n = s.empty() ? 1 : s[0];
    const int64_t m = n > 0 ? numel / n : 0;
    const int64_t r = std::min<int64_t>({n, m, options.rank});
    PowerSgdPlan::Matrix& mat = plan.grads.emplace_back();
    mat.numel = numel;
    mat.n = n;
    mat.m = m;
    plan.total_floats += numel;
    if (numel > 0 && static_cast<double>((n + m) * r) * options.min_compression_rate <
                         static_cast<double>(n * m)) {
      mat.r = r;
      plan.p_floats += n * r;
      plan.q_floats += m * r;
    } else {
      plan.plain_floats += numel;
    }
  }
  return plan;
}

void RandomPowerSgdQ(const PowerSgdOptions& options, int64_t step, int bucket, float* q,
                     int64_t count) {
  std::mt19937_64 rng(options.seed * 1'000'003 + static_cast<uint64_t>(step) * 131 +
                      static_cast<uint64_t>(bucket));
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < count; ++i) q[i] = normal(rng);
}

absl::Status PowerSgd::Reduce(int bucket, const std::vector<Gradient>& grads, Communicator* comm) {
  std::vector<std::vector<int64_t>> shapes;
  for (const Gradient& g : grads) shapes.push_back(g.shape);
  const PowerSgdPlan plan = PlanPowerSgd(shapes, options_);
  std::vector<int64_t> numels;
  for (size_t g = 0; g < grads.size(); ++g) numels.push_back(plan.grads[g].numel);
  const int64_t total = plan.total_floats;
  const float world = static_cast<float>(comm->world_size());
  last_uncompressed_ = total;
  // Every element of the bucket in order, wherever it lies.
  auto each = [&](auto&& fn) {
    int64_t k = 0;
    for (size_t g = 0; g < grads.size(); ++g) {
      for (int64_t i = 0; i < numels[g]; ++i, ++k) fn(grads[g].data[i], k);
    }
  };
  if (!active()) {
    last_sent_ = total;
    std::vector<float> packed(static_cast<size_t>(total));
    each([&](float& v, int64_t k) { packed[static_cast<size_t>(k)] = v; });
    AIDN_RETURN_IF_ERROR(Averaged(comm, packed.data(), packed.size(), "allreduce"));
    each([&](float& v, int64_t k) { v = packed[static_cast<size_t>(k)] / world; });
    return absl::OkStatus();
  }
  BucketState& state = buckets_[bucket];
  std::vector<float> input;
  if (options_.error_feedback) {
    state.error.resize(static_cast<size_t>(total), 0.0f);
    input.resize(static_cast<size_t>(total));
    each([&](float& v, int64_t k) {
      v += state.error[static_cast<size_t>(k)];
      input[static_cast<size_t>(k)] = v;
    });
  }
  // Which gradients are compressed; the others go as they are, packed.
  std::vector<Matrix> matrices;
  std::vector<std::pair<float*, int64_t>> plain;
  for (size_t g = 0; g < grads.size(); ++g) {
    const PowerSgdPlan::Matrix& mat = plan.grads[g];
    if (mat.r > 0) {
      matrices.push_back({grads[g].data, mat.n, mat.m, mat.r});
    } else {
      plain.emplace_back(grads[g].data, numels[g]);
    }
  }
  const int64_t plain_floats = plan.plain_floats;
  const int64_t q_floats = plan.q_floats;
  last_sent_ = plan.floats_sent();
  // Q: random (the same on every rank) the first time or without warm
  // start, else the last step's; orthogonalised either way.
  const bool fresh =
      !options_.warm_start || !state.has_q || static_cast<int64_t>(state.q.size()) != q_floats;
  state.p.resize(static_cast<size_t>(plan.p_floats));
  state.q.resize(static_cast<size_t>(q_floats));
  if (fresh) RandomPowerSgdQ(options_, step_, bucket, state.q.data(), q_floats);
  {
    int64_t q_at = 0;
    for (const Matrix& mat : matrices) {
      OrthogonalizeColumns(state.q.data() + q_at, mat.m, mat.r);
      q_at += mat.m * mat.r;
    }
  }
  // P = M Q.
  int64_t p_at = 0, q_at = 0;
  for (const Matrix& mat : matrices) {
    Sgemm(false, false, mat.n, mat.r, mat.m, 1.0f, mat.data, mat.m, state.q.data() + q_at, mat.r,
          0.0f, state.p.data() + p_at, mat.r);
    p_at += mat.n * mat.r;
    q_at += mat.m * mat.r;
  }
  // The uncompressed gradients, averaged.
  std::vector<float> packed;
  packed.reserve(static_cast<size_t>(plain_floats));
  for (const auto& [data, numel] : plain) packed.insert(packed.end(), data, data + numel);
  AIDN_RETURN_IF_ERROR(Averaged(comm, packed.data(), packed.size(), "uncompressed allreduce"));
  {
    const float* from = packed.data();
    for (const auto& [data, numel] : plain) {
      for (int64_t i = 0; i < numel; ++i) data[i] = from[i] / world;
      from += numel;
    }
  }
  // P summed (orthogonalised next: no need to average), Q = M^T P summed
  // and averaged, M = P Q^T.
  AIDN_RETURN_IF_ERROR(Averaged(comm, state.p.data(), state.p.size(), "P allreduce"));
  p_at = 0;
  q_at = 0;
  for (const Matrix& mat : matrices) {
    OrthogonalizeColumns(state.p.data() + p_at, mat.n, mat.r);
    Sgemm(true, false, mat.m, mat.r, mat.n, 1.0f, mat.data, mat.m, state.p.data() + p_at, mat.r,
          0.0f, state.q.data() + q_at, mat.r);
    p_at += mat.n * mat.r;
    q_at += mat.m * mat.r;
  }
  AIDN_RETURN_IF_ERROR(Averaged(comm, state.q.data(), state.q.size(), "Q allreduce"));
  for (float& v : state.q) v /= world;
  p_at = 0;
  q_at = 0;
  for (const Matrix& mat : matrices) {
    Sgemm(false, true, mat.n, mat.m, mat.r, 1.0f, state.p.data() + p_at, mat.r,
          state.q.data() + q_at, mat.r, 0.0f, mat.data, mat.m);
    p_at += mat.n * mat.r;
    q_at += mat.m * mat.r;
  }
  state.has_q = options_.warm_start;
  if (options_.error_feedback) {
    each([&](float& v, int64_t k) {
      state.error[static_cast<size_t>(k)] = input[static_cast<size_t>(k)] - v;
    });
  }
  return absl::OkStatus();
}

}  // namespace aidn::engine
