#include "worker/engine/comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace aidn::engine {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x61'69'64'6e'73'68'6d'31ULL;  // "aidnshm1"
constexpr size_t kLine = 64;
constexpr size_t kMaxSegmentBytes = size_t{512} << 20;
constexpr size_t kMinSlotBytes = size_t{64} << 10;
// How often a sleeping waiter wakes to look at the peer's pid, its failed
// flag and the deadline.
constexpr auto kPollInterval = std::chrono::milliseconds(20);

// One per rank, each on its own cache line so that a rank bumping its word
// does not slow down the others' spinning on theirs.
struct alignas(kLine) RankLine {
  std::atomic<uint32_t> seq;       // the futex word: phases this rank finished
  std::atomic<uint32_t> sleepers;  // waiters sleeping (or about to) on seq
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> failed;
};
static_assert(sizeof(RankLine) == kLine);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct alignas(kLine) Header {
  uint64_t magic;
  uint64_t nonce;
  uint64_t world_size;
  uint64_t slot_bytes;
  // RankLine[world_size] follow.
};

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t DataOffset(int world) {
  return RoundUp(sizeof(Header) + sizeof(RankLine) * static_cast<size_t>(world), 4096);
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// True once `seq` reached `target`, across the 32-bit wrap.
bool Reached(uint32_t seq, uint32_t target) { return static_cast<int32_t>(seq - target) >= 0; }

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Ranks that agree on this share a kernel (boot id) and see each other's
// pids (PID namespace), so a peer's exit can be noticed with kill(pid, 0).
std::string HostIdentity() {
  struct stat ns {};
  const std::string pid_ns =
      stat("/proc/self/ns/pid", &ns) == 0 ? std::to_string(ns.st_ino) : "unknown";
  return absl::StrCat(ReadFirstLine("/proc/sys/kernel/random/boot_id"), "/", pid_ns);
}

uint64_t RandomU64() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// kill(pid, 0) succeeds on a zombie (an exited process its parent has not
// reaped yet), so that state is looked up too.
bool Exited(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  const std::string stat = ReadFirstLine(absl::StrCat("/proc/", pid, "/stat").c_str());
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z';
}

// Copies `n` floats.
void CopyFloats(const float* src, float* dst, size_t n) {
  if (n > 0) std::memcpy(dst, src, n * sizeof(float));
}

// out[i] = (src[0][i] + src[1][i] + ...) in rank order, divided by `divisor`
// when it is not 1 (kAvg, as the Gloo communicator: sum, then divide).
// Written to out_a and, when not null, out_b, in one pass over the sources.
void SumSlots(const float* const* src, int count, size_t n, float divisor, float* out_a,
              float* out_b) {
  constexpr size_t kBlock = 1024;
  float acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    const float* s0 = src[0] + base;
    for (size_t i = 0; i < m; ++i) acc[i] = s0[i];
    for (int j = 1; j < count; ++j) {
      const float* sj = src[j] + base;
      for (size_t i = 0; i < m; ++i) acc[i] += sj[i];
    }
    if (divisor != 1.0f) {
      for (size_t i = 0; i < m; ++i) acc[i] /= divisor;
    }
    std::memcpy(out_a + base, acc, m * sizeof(float));
    if (out_b != nullptr) std::memcpy(out_b + base, acc, m * sizeof(float));
  }
}

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(const ShmOptions& options, void* base, size_t bytes)
      : rank_(options.rank),
        world_(options.world_size),
        timeout_(options.timeout),
        spin_(std::max(0, options.spin)),
        base_(base),
        bytes_(bytes) {
    auto* header = static_cast<Header*>(base_);
    lines_ = reinterpret_cast<RankLine*>(header + 1);
    slot_floats_ = header->slot_bytes / sizeof(float);
    data_ = reinterpret_cast<float*>(static_cast<char*>(base_) + DataOffset(world_));
    // Everyone starts at the sequence word the set-up left (0).
    phase_ = lines_[rank_].seq.load();
  }

  ~ShmCommunicator() override { munmap(base_, bytes_); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int64_t sequence() const override { return sequence_.load(std::memory_order_relaxed); }

  absl::Status AllReduce(float* data, size_t count, ReduceOp op) override {
    AIDN_RETURN_IF_ERROR(Check("allreduce", data, count));
    const float divisor = op == ReduceOp::kAvg ? static_cast<float>(world_) : 1.0f;
    for (size_t off = 0; off < count; off += slot_floats_) {
      const size_t m = std::min(slot_floats_, count - off);
      CopyFloats(data + off, Slot(rank_), m);
      AIDN_RETURN_IF_ERROR(Sync("allreduce", count));
      // Shares of 16 floats (a cache line) so that no two ranks write the
      // same line of the result slot.
      const size_t share = RoundUp((m + world_ - 1) / world_, 16);
      const size_t lo = std::min(m, share * rank_);
      const size_t hi = std::min(m, lo + share);
      std::vector<const float*>& src = sources_;
      src.resize(world_);
      for (int j = 0; j < world_; ++j) src[j] = Slot(j) + lo;
      SumSlots(src.data(), world_, hi - lo, divisor, Result() + lo, data + off + lo);
      AIDN_RETURN_IF_ERROR(Sync("allreduce", count));
      CopyFloats(Result(), data + off, lo);
      CopyFloats(Result() + hi, data + off + hi, m - hi);
    }
    return Completed();
  }

  absl::Status Broadcast(float* data, size_t count, int root) override {
    if (root < 0 || root >= world_) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast: root ", root, " is not a rank of ", world_));
    }
    AIDN_RETURN_IF_ERROR(Check("broadcast", data, count));
    for (size_t off = 0; off < count; off += slot_floats_) {
      const size_t m = std::min(slot_floats_, count - off);
      // The root's own slot, not the result slot: peers may still be
      // copying the result of an allreduce just before.
      if (rank_ == root) CopyFloats(data + off, Slot(root), m);
      AIDN_RETURN_IF_ERROR(Sync("broadcast", count));
      if (rank_ != root) CopyFloats(Slot(root), data + off, m);
      // Nobody overwrites the root's slot before everyone read it.
      AIDN_RETURN_IF_ERROR(Sync("broadcast", count));
    }
    return Completed();
  }

  absl::Status AllGather(const float* in, size_t count, float* out) override {
    AIDN_RETURN_IF_ERROR(Check("allgather", in, count));
    AIDN_RETURN_IF_ERROR(Check("allgather", out, count));
    for (size_t off = 0; off < count; off += slot_floats_) {
      const size_t m = std::min(slot_floats_, count - off);
      CopyFloats(in + off, Slot(rank_), m);
      AIDN_RETURN_IF_ERROR(Sync("allgather", count));
      for (int j = 0; j < world_; ++j) CopyFloats(Slot(j), out + j * count + off, m);
      AIDN_RETURN_IF_ERROR(Sync("allgather", count));
    }
    return Completed();
  }

  absl::Status ReduceScatter(const float* in, size_t count, float* out, ReduceOp op) override {
    AIDN_RETURN_IF_ERROR(Check("reducescatter", in, count));
    AIDN_RETURN_IF_ERROR(Check("reducescatter", out, count));
    const float divisor = op == ReduceOp::kAvg ? static_cast<float>(world_) : 1.0f;
    // Each rank stages `m` floats of every block: world * m per slot.
    const size_t per_block = std::max<size_t>(1, slot_floats_ / world_);
    std::vector<const float*>& src = sources_;
    src.resize(world_);
    for (size_t off = 0; off < count; off += per_block) {
      const size_t m = std::min(per_block, count - off);
      for (int b = 0; b < world_; ++b) CopyFloats(in + b * count + off, Slot(rank_) + b * m, m);
      AIDN_RETURN_IF_ERROR(Sync("reducescatter", count));
      for (int j = 0; j < world_; ++j) src[j] = Slot(j) + rank_ * m;
      SumSlots(src.data(), world_, m, divisor, out + off, nullptr);
      AIDN_RETURN_IF_ERROR(Sync("reducescatter", count));
    }
    return Completed();
  }

  absl::Status Barrier() override {
    if (!error_.ok()) return Broken();
    AIDN_RETURN_IF_ERROR(Sync("barrier", 0));
    return Completed();
  }

 private:
  float* Slot(int j) { return data_ + static_cast<size_t>(j) * slot_floats_; }
  float* Result() { return Slot(world_); }

  absl::Status Broken() const {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory communicator is unusable after an earlier error: ", error_.message()));
  }

  absl::Status Check(const char* what, const void* data, size_t count) {
    if (!error_.ok()) return Broken();
    if (count > 0 && data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": null buffer of ", count, " floats"));
    }
    return absl::OkStatus();
  }

  absl::Status Completed() {
    sequence_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  // Marks this rank failed (peers waiting on it give up at once) and keeps
  // the first error.
  absl::Status Fail(absl::Status status) {
    lines_[rank_].failed.store(1);
    if (lines_[rank_].sleepers.load() > 0) Futex(&lines_[rank_].seq, FUTEX_WAKE, INT_MAX, nullptr);
    error_ = status;
    return status;
  }

  // Returns once every rank finished the phase this rank just finished.
  absl::Status Sync(const char* what, size_t count) {
    const uint32_t target = ++phase_;
    RankLine& mine = lines_[rank_];
    mine.seq.store(target);  // seq_cst: pairs with a sleeper's increment
    if (mine.sleepers.load() > 0) Futex(&mine.seq, FUTEX_WAKE, INT_MAX, nullptr);
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      if (absl::Status s = WaitFor(j, target); !s.ok()) {
        return Fail(absl::Status(s.code(), absl::StrCat("shared-memory ", what, " of ", count,
                                                        " floats: ", s.message())));
      }
    }
    return absl::OkStatus();
  }

  absl::Status WaitFor(int j, uint32_t target) {
    RankLine& line = lines_[j];
    for (int i = 0; i < spin_; ++i) {
      if (Reached(line.seq.load(std::memory_order_acquire), target)) return absl::OkStatus();
      Pause();
    }
    const Clock::time_point deadline = Clock::now() + timeout_;
    for (;;) {
      if (Reached(line.seq.load(std::memory_order_acquire), target)) return absl::OkStatus();
      if (line.failed.load() != 0) {
        return absl::AbortedError(absl::StrCat("rank ", j, " failed"));
      }
      const int32_t pid = line.pid.load();
      if (pid > 0 && Exited(pid)) {
        return absl::UnavailableError(absl::StrCat("rank ", j, " (pid ", pid, ") exited"));
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "rank ", j, " did not arrive within ",
            std::chrono::duration_cast<std::chrono::milliseconds>(timeout_).count(), " ms"));
      }
      line.sleepers.fetch_add(1);  // seq_cst: pairs with the peer's seq store
      const uint32_t seen = line.seq.load();
      if (!Reached(seen, target)) {
        timespec ts{0, std::chrono::nanoseconds(kPollInterval).count()};
        Futex(&line.seq, FUTEX_WAIT, seen, &ts);
      }
      line.sleepers.fetch_sub(1);
    }
  }

  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  const int spin_;
  void* const base_;
  const size_t bytes_;
  RankLine* lines_ = nullptr;
  float* data_ = nullptr;
  size_t slot_floats_ = 0;
  uint32_t phase_ = 0;
  std::vector<const float*> sources_;
  absl::Status error_;
  std::atomic<int64_t> sequence_{0};
};

// Time left until `deadline`, not negative.
std::chrono::milliseconds Left(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds::zero(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// The store's value of every rank's "<prefix>/<name>/<r>", all within
// `timeout`.
absl::StatusOr<std::vector<std::string>> GatherAll(KeyValueStore& store, const std::string& prefix,
                                                   const std::string& name, int world,
                                                   std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::vector<std::string> values;
  for (int r = 0; r < world; ++r) {
    AIDN_ASSIGN_OR_RETURN(std::string value,
                          store.Get(absl::StrCat(prefix, "/", name, "/", r), Left(deadline)));
    values.push_back(std::move(value));
  }
  return values;
}

struct Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
};

// Rank 0: creates, sizes and maps the segment and writes its header.
absl::StatusOr<Mapping> CreateSegment(const std::string& name, int world, size_t slot_bytes,
                                      uint64_t nonce) {
  const size_t bytes = DataOffset(world) + slot_bytes * static_cast<size_t>(world + 1);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", strerror(errno)));
  // posix_fallocate, unlike ftruncate, fails now (ENOSPC) rather than with a
  // SIGBUS at the first touch when /dev/shm is too small.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::UnavailableError(
        absl::StrCat("allocating ", bytes, " bytes in /dev/shm", name, ": ", strerror(err)));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("mmap ", name, ": ", strerror(errno)));
  }
  auto* header = static_cast<Header*>(base);
  header->magic = kMagic;
  header->nonce = nonce;
  header->world_size = static_cast<uint64_t>(world);
  header->slot_bytes = slot_bytes;
  auto* lines = reinterpret_cast<RankLine*>(header + 1);
  for (int r = 0; r < world; ++r) new (&lines[r]) RankLine{};
  return Mapping{base, bytes};
}

// Other ranks: maps the segment and checks it is the one rank 0 made.
absl::StatusOr<Mapping> AttachSegment(const std::string& name, int world, size_t slot_bytes,
                                      uint64_t nonce) {
  const size_t bytes = DataOffset(world) + slot_bytes * static_cast<size_t>(world + 1);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return absl::UnavailableError(absl::StrCat(name, " is not ", bytes, " bytes"));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat("mmap ", name, ": ", strerror(errno)));
  }
  const auto* header = static_cast<const Header*>(base);
  if (header->magic != kMagic || header->nonce != nonce ||
      header->world_size != static_cast<uint64_t>(world) || header->slot_bytes != slot_bytes) {
    munmap(base, bytes);
    return absl::UnavailableError(absl::StrCat(name, " is another segment (not rank 0's)"));
  }
  return Mapping{base, bytes};
}

absl::StatusOr<ShmAttempt> Negotiate(const ShmOptions& options, KeyValueStore& store) {
  const int rank = options.rank;
  const int world = options.world_size;
  const std::string& prefix = options.prefix;
  ShmAttempt attempt;

  AIDN_RETURN_IF_ERROR(
      store.Set(absl::StrCat(prefix, "/host/", rank),
                options.host_identity.empty() ? HostIdentity() : options.host_identity));
  AIDN_ASSIGN_OR_RETURN(const std::vector<std::string> hosts,
                        GatherAll(store, prefix, "host", world, options.timeout));
  const int64_t here = std::count(hosts.begin(), hosts.end(), hosts[0]);
  if (here != world) {
    attempt.description =
        absl::StrCat("only ", here, " of ", world, " ranks share rank 0's host and pid namespace");
    return attempt;
  }

  // Every rank computes the same slot size from the same options.
  const size_t max_slot =
      (kMaxSegmentBytes - DataOffset(world)) / static_cast<size_t>(world + 1) / 4096 * 4096;
  if (max_slot < kMinSlotBytes) {
    attempt.description = absl::StrCat(world, " ranks are too many for one segment");
    return attempt;
  }
  const size_t slot =
      std::clamp(RoundUp(options.slot_bytes, 4096), RoundUp(kMinSlotBytes, 4096), max_slot);
  // Rank 0 publishes "<name> <nonce>" or "- <why not>".
  Mapping mapping;
  std::string why_not;
  const std::string segment_key = absl::StrCat(prefix, "/segment");
  std::string name;
  uint64_t nonce = 0;
  if (rank == 0) {
    nonce = RandomU64();
    name = absl::StrCat("/aidn-", getpid(), "-", absl::Hex(RandomU64(), absl::kZeroPad16));
    absl::StatusOr<Mapping> made = CreateSegment(name, world, slot, nonce);
    if (made.ok()) {
      mapping = *made;
      AIDN_RETURN_IF_ERROR(store.Set(segment_key, absl::StrCat(name, " ", nonce)));
    } else {
      why_not = std::string(made.status().message());
      AIDN_RETURN_IF_ERROR(store.Set(segment_key, absl::StrCat("- ", why_not)));
    }
  } else {
    AIDN_ASSIGN_OR_RETURN(const std::string value, store.Get(segment_key, options.timeout));
    std::vector<std::string> parts = absl::StrSplit(value, absl::MaxSplits(' ', 1));
    if (parts.size() != 2) {
      why_not = absl::StrCat("rank 0 published \"", value, "\"");
    } else if (parts[0] == "-") {
      why_not = absl::StrCat("rank 0: ", parts[1]);
    } else {
      name = parts[0];
      nonce = std::strtoull(parts[1].c_str(), nullptr, 10);
      absl::StatusOr<Mapping> attached = AttachSegment(name, world, slot, nonce);
      if (attached.ok()) {
        mapping = *attached;
      } else {
        why_not = std::string(attached.status().message());
      }
    }
  }
  if (mapping.base != MAP_FAILED) {
    auto* lines = reinterpret_cast<RankLine*>(static_cast<Header*>(mapping.base) + 1);
    lines[rank].pid.store(getpid());
  }
  AIDN_RETURN_IF_ERROR(store.Set(absl::StrCat(prefix, "/attached/", rank),
                                 why_not.empty() ? std::string("ok") : why_not));
  AIDN_ASSIGN_OR_RETURN(const std::vector<std::string> attached,
                        GatherAll(store, prefix, "attached", world, options.timeout));
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());
  for (int r = 0; r < world; ++r) {
    if (attached[r] != "ok" && why_not.empty()) {
      why_not = absl::StrCat("rank ", r, ": ", attached[r]);
    }
  }
  if (!why_not.empty()) {
    if (mapping.base != MAP_FAILED) munmap(mapping.base, mapping.bytes);
    attempt.description = why_not;
    return attempt;
  }
  attempt.communicator = std::make_unique<ShmCommunicator>(options, mapping.base, mapping.bytes);
  attempt.description = absl::StrCat(world, " ranks on one host, ", slot >> 10, " KiB slots");
  return attempt;
}

}  // namespace

absl::StatusOr<ShmAttempt> CreateShmCommunicator(const ShmOptions& options, KeyValueStore* store) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", options.rank, " of world size ",
                                                   options.world_size, " is out of range"));
  }
  if (options.timeout <= std::chrono::milliseconds(0)) {
    return absl::InvalidArgumentError("timeout must be positive");
  }
  if (options.world_size > 1 && store == nullptr) {
    return absl::InvalidArgumentError("a store is needed for more than one rank");
  }
  if (options.world_size == 1) {
    // Nothing to share; the caller's single-rank path (Gloo's) serves.
    return ShmAttempt{nullptr, "one rank"};
  }
  absl::StatusOr<ShmAttempt> attempt = Negotiate(options, *store);
  if (!attempt.ok()) return Annotate(attempt.status(), "shared-memory set-up");
  return attempt;
}

}  // namespace aidn::engine
