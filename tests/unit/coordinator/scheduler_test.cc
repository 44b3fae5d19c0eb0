#include "coordinator/scheduler.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace aidn::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A worker from a picture of its CPU slots: '.' free, 'x' taken.
WorkerSlots Cpu(const std::string& id, const std::string& picture) {
  WorkerSlots w;
  w.worker_id = id;
  for (char c : picture) w.cpu_used.push_back(c == 'x');
  return w;
}

WorkerSlots CpuGpu(const std::string& id, const std::string& cpu, const std::string& gpu) {
  WorkerSlots w = Cpu(id, cpu);
  for (char c : gpu) w.gpu_used.push_back(c == 'x');
  return w;
}

GangRequest Ranks(int world_size, int slots_per_rank = 1, bool gpu = false) {
  GangRequest r;
  r.world_size = world_size;
  r.slots_per_rank = slots_per_rank;
  r.gpu = gpu;
  return r;
}

// "worker:slot" per rank, in rank order; also checks ranks are 0..n-1.
std::vector<std::string> Where(const std::vector<v1::RankPlacement>& placement) {
  std::vector<std::string> out;
  for (size_t i = 0; i < placement.size(); ++i) {
    EXPECT_EQ(placement[i].rank(), static_cast<int>(i));
    out.push_back(placement[i].worker_id() + ":" + std::to_string(placement[i].slot()));
  }
  return out;
}

TEST(PlaceGang, PutsASingleRankOnAWorkerWithRoom) {
  auto placement = PlaceGang(Ranks(1), {Cpu("a", "..")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("a:0"));
}

TEST(PlaceGang, ChoosesTheFullestWorkerThatHoldsTheWholeJob) {
  // a has 4 free, b 2 free, c 1 free: b is the tightest fit for 2 ranks.
  auto placement = PlaceGang(Ranks(2), {Cpu("a", "...."), Cpu("b", "xx.."), Cpu("c", "xxx.")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("b:2", "b:3"));
}

TEST(PlaceGang, PrefersOneWorkerOverSpanningEvenIfOthersAreFuller) {
  auto placement = PlaceGang(Ranks(3), {Cpu("a", "x.x."), Cpu("b", "x..."), Cpu("c", "xx..")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("b:1", "b:2", "b:3"));
}

TEST(PlaceGang, SpansTheFewestWorkersTakingTheLargestFreeFirst) {
  // 5 ranks: no worker holds them all; b (3 free) then c (2 free) does it
  // on two workers, where a (1 free) would make it three.
  auto placement = PlaceGang(Ranks(5), {Cpu("a", "xxx."), Cpu("b", "x..."), Cpu("c", "xx..")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("b:1", "b:2", "b:3", "c:2", "c:3"));
}

TEST(PlaceGang, KeepsRanksContiguousPerWorkerWithRankZeroOnTheFirstChosen) {
  auto placement = PlaceGang(Ranks(6), {Cpu("small", "..."), Cpu("big", "....")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  ASSERT_EQ(placement->size(), 6u);
  // The worker with the most room comes first and holds ranks 0..3.
  EXPECT_THAT(Where(*placement),
              ElementsAre("big:0", "big:1", "big:2", "big:3", "small:0", "small:1"));
}

TEST(PlaceGang, UsesScatteredFreeSlotsForOneSlotRanks) {
  auto placement = PlaceGang(Ranks(2), {Cpu("a", "x.x.")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("a:1", "a:3"));
}

TEST(PlaceGang, GivesEachMultiThreadRankConsecutiveFreeSlots) {
  // Free runs: [0,1], [3,4,5]: room for a 2-slot rank in each, not two in
  // the second (one slot would be left over).
  auto placement = PlaceGang(Ranks(2, 2), {Cpu("a", "..x...")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("a:0", "a:3"));
}

TEST(PlaceGang, FragmentedSlotsDoNotHoldAMultiThreadRank) {
  // Two free slots on each worker, but never two side by side.
  absl::StatusOr<std::vector<v1::RankPlacement>> placement =
      PlaceGang(Ranks(1, 2), {Cpu("a", ".x.x"), Cpu("b", "x.x.")});
  ASSERT_FALSE(placement.ok());
  // It would fit an idle cluster, so it waits rather than being refused.
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kResourceExhausted) << placement.status();
}

TEST(PlaceGang, MultiThreadRanksSpanWorkersWhenNoneHoldsThemAll) {
  auto placement = PlaceGang(Ranks(3, 2), {Cpu("a", "...."), Cpu("b", "x...")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("a:0", "a:2", "b:1"));
}

TEST(PlaceGang, GpuJobsTakeGpusOnlyAndOneGpuPerRank) {
  // CPU slots all taken, GPUs free: a GPU job does not care about CPU slots,
  // and slots_per_rank (threads) does not multiply GPUs.
  auto placement = PlaceGang(Ranks(2, 4, /*gpu=*/true), {CpuGpu("a", "xxxx", "..")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("a:0", "a:1"));
}

TEST(PlaceGang, GpuJobSkipsTakenGpus) {
  auto placement = PlaceGang(Ranks(1, 1, true), {CpuGpu("a", "....", "x."), CpuGpu("b", "", "xx")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_THAT(Where(*placement), ElementsAre("a:1"));
}

TEST(PlaceGang, GpuJobOnACpuOnlyClusterCanNeverFit) {
  auto placement = PlaceGang(Ranks(1, 1, true), {Cpu("a", "........")});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(placement.status().message(), HasSubstr("gpu"));
}

TEST(PlaceGang, CpuJobIgnoresFreeGpus) {
  auto placement = PlaceGang(Ranks(1), {CpuGpu("a", "x", "....")});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PlaceGang, JobBiggerThanTheClusterIsFailedPreconditionSayingNeedAndHave) {
  auto placement = PlaceGang(Ranks(4), {Cpu("a", "."), Cpu("b", ".")});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(placement.status().message(), HasSubstr("needs 4"));
  EXPECT_THAT(placement.status().message(), HasSubstr("has 2"));
  EXPECT_THAT(placement.status().message(), HasSubstr("cpu"));
}

TEST(PlaceGang, ThreadsPerRankCountTowardsWhetherTheClusterCouldEverHoldTheJob) {
  // Three slots per worker hold one 2-slot rank each: 2 ranks at most, even
  // with 6 slots in all.
  auto placement = PlaceGang(Ranks(3, 2), {Cpu("a", "..."), Cpu("b", "...")});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kFailedPrecondition) << placement.status();
}

TEST(PlaceGang, JobThatFitsOnlyAnIdleClusterIsResourceExhausted) {
  auto placement = PlaceGang(Ranks(2), {Cpu("a", "x."), Cpu("b", "xx")});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(placement.status().message(), HasSubstr("2"));
}

TEST(PlaceGang, NoWorkersMeansTheJobCannotFit) {
  auto placement = PlaceGang(Ranks(1), {});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(PlaceGang, WorkersWithoutSlotsAreNoRoom) {
  auto placement = PlaceGang(Ranks(1), {Cpu("a", ""), Cpu("b", "")});
  ASSERT_FALSE(placement.ok());
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(PlaceGang, FillsAClusterExactly) {
  auto placement = PlaceGang(Ranks(4), {Cpu("a", ".."), Cpu("b", "..")});
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(placement->size(), 4u);
}

// Random clusters: every placement returned must be a valid gang placement,
// and an error must only come when there really is no room.
TEST(PlaceGang, RandomClustersGetValidPlacements) {
  std::mt19937 rng(20240607);
  int placed = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int n_workers = std::uniform_int_distribution<int>(0, 5)(rng);
    std::vector<WorkerSlots> workers;
    for (int w = 0; w < n_workers; ++w) {
      const int n_slots = std::uniform_int_distribution<int>(0, 8)(rng);
      std::string picture;
      for (int s = 0; s < n_slots; ++s) {
        picture += std::uniform_int_distribution<int>(0, 2)(rng) == 0 ? 'x' : '.';
      }
      workers.push_back(Cpu("w" + std::to_string(w), picture));
    }
    const int k = std::uniform_int_distribution<int>(1, 3)(rng);
    const int world = std::uniform_int_distribution<int>(1, 8)(rng);
    auto placement = PlaceGang(Ranks(world, k), workers);

    // Room there is now: ranks of k consecutive free slots, packed per run.
    int room = 0;
    int room_idle = 0;
    std::map<std::string, int> room_of;
    for (const WorkerSlots& w : workers) {
      room_idle += static_cast<int>(w.cpu_used.size()) / k;
      int run = 0;
      for (size_t s = 0; s <= w.cpu_used.size(); ++s) {
        if (s < w.cpu_used.size() && !w.cpu_used[s]) {
          ++run;
        } else {
          room_of[w.worker_id] += run / k;
          run = 0;
        }
      }
      room += room_of[w.worker_id];
    }
    if (!placement.ok()) {
      const auto expected = room_idle < world ? absl::StatusCode::kFailedPrecondition
                                              : absl::StatusCode::kResourceExhausted;
      EXPECT_EQ(placement.status().code(), expected) << placement.status();
      EXPECT_LT(room, world) << "refused although there was room: " << placement.status();
      continue;
    }
    ++placed;
    ASSERT_EQ(static_cast<int>(placement->size()), world);
    std::map<std::string, std::vector<bool>> used;
    for (const WorkerSlots& w : workers) used[w.worker_id] = w.cpu_used;
    std::vector<std::string> order;  // workers in the order ranks use them
    for (int r = 0; r < world; ++r) {
      const v1::RankPlacement& p = (*placement)[r];
      ASSERT_EQ(p.rank(), r);
      ASSERT_TRUE(used.contains(p.worker_id()));
      std::vector<bool>& slots = used[p.worker_id()];
      for (int s = p.slot(); s < p.slot() + k; ++s) {
        ASSERT_GE(s, 0);
        ASSERT_LT(s, static_cast<int>(slots.size())) << p.worker_id() << " slot " << s;
        ASSERT_FALSE(slots[s]) << p.worker_id() << " slot " << s << " taken twice";
        slots[s] = true;
      }
      if (order.empty() || order.back() != p.worker_id()) order.push_back(p.worker_id());
    }
    // Contiguous per worker: no worker appears in two separate runs.
    std::set<std::string> distinct(order.begin(), order.end());
    EXPECT_EQ(distinct.size(), order.size()) << "ranks of a worker are not contiguous";
    // As few workers as possible: the largest rooms first reach `world` with
    // the fewest workers.
    std::vector<int> rooms;
    for (const auto& [id, r] : room_of) rooms.push_back(r);
    std::sort(rooms.rbegin(), rooms.rend());
    size_t fewest = 0;
    for (int sum = 0; sum < world; sum += rooms[fewest++]) {
    }
    EXPECT_EQ(order.size(), fewest) << "trial " << trial;
    if (fewest == 1) {
      // Best fit: no worker with less room could have held the job.
      int tightest = 1 << 30;
      for (int r : rooms) {
        if (r >= world) tightest = std::min(tightest, r);
      }
      EXPECT_EQ(room_of[order[0]], tightest) << "trial " << trial;
    }
  }
  EXPECT_GT(placed, 100);
}

// --- SlotTable ---------------------------------------------------------------

v1::Job JobOn(const std::string& worker_id, bool gpu, int threads, std::vector<int> slots) {
  v1::Job job;
  job.mutable_spec()->set_device(gpu ? v1::JobSpec::GPU : v1::JobSpec::CPU);
  job.mutable_spec()->set_threads_per_rank(threads);
  for (int s : slots) {
    v1::RankPlacement* p = job.add_placement();
    p->set_worker_id(worker_id);
    p->set_slot(s);
  }
  return job;
}

TEST(SlotTable, PlacementsTakeConsecutiveCpuSlotsOrOneGpuPerRank) {
  SlotTable table;
  table.AddWorker("a", 4, 2);
  table.MarkUsed(JobOn("a", /*gpu=*/false, /*threads=*/2, {1}));
  table.MarkUsed(JobOn("a", /*gpu=*/true, /*threads=*/8, {1}));
  // Placements on workers not in the table, or past a worker's slots, are ignored.
  table.MarkUsed(JobOn("gone", false, 1, {0}));
  table.MarkUsed(JobOn("a", false, 4, {3}));
  const std::vector<WorkerSlots> all = table.Snapshot([](const std::string&) { return true; });
  ASSERT_EQ(all.size(), 1u);
  EXPECT_THAT(all[0].cpu_used, ElementsAre(false, true, true, true));
  EXPECT_THAT(all[0].gpu_used, ElementsAre(false, true));
}

TEST(SlotTable, SnapshotKeepsTheEligibleWorkersInIdOrder) {
  SlotTable table;
  table.AddWorker("c", 1, 0);
  table.AddWorker("a", 1, 0);
  table.AddWorker("b", 1, 0);
  const std::vector<WorkerSlots> some =
      table.Snapshot([](const std::string& id) { return id != "b"; });
  ASSERT_EQ(some.size(), 2u);
  EXPECT_EQ(some[0].worker_id, "a");
  EXPECT_EQ(some[1].worker_id, "c");
  const GangRequest request = GangRequestOf([] {
    v1::JobSpec spec;
    spec.set_world_size(3);
    spec.set_device(v1::JobSpec::GPU);
    spec.set_threads_per_rank(2);
    return spec;
  }());
  EXPECT_EQ(request.world_size, 3);
  EXPECT_TRUE(request.gpu);
  EXPECT_EQ(request.slots_per_rank, 2);
}

}  // namespace
}  // namespace aidn::coordinator
