#include "worker/engine/comm/communicator.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace aidn::engine {

absl::Status Communicator::AllReduceHalf(uint16_t* data, size_t count, HalfFormat format) {
  if (data == nullptr && count != 0) {
    return absl::InvalidArgumentError("allreduce of halves: null buffer");
  }
  // Two halves ride in each float of the gather (the bits are copied, never
  // computed on); an odd count pads the last with a zero.
  const size_t words = (count + 1) / 2;
  const size_t world = static_cast<size_t>(world_size());
  std::vector<float> gathered(words * world);
  float* mine = gathered.data() + static_cast<size_t>(rank()) * words;
  if (count > 0) std::memcpy(mine, data, count * sizeof(uint16_t));
  if (absl::Status s = AllGather(mine, words, gathered.data()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("allreduce of ", count, " ", HalfFormatName(format),
                                               " values: ", s.message()));
  }
  std::vector<float> sum(count, 0.0f);
  std::vector<uint16_t> halves(count);
  for (size_t r = 0; r < world; ++r) {
    if (count > 0) std::memcpy(halves.data(), gathered.data() + r * words, count * 2);
    AddHalves(halves.data(), count, format, sum.data());
  }
  ToHalf(sum.data(), count, 1.0f, format, data);
  return absl::OkStatus();
}

}  // namespace aidn::engine
