#ifndef AIDN_WORKER_ENGINE_COMM_PROCESS_GRID_H_
#define AIDN_WORKER_ENGINE_COMM_PROCESS_GRID_H_

// How a job's ranks map onto a data x tensor x pipeline grid, and which
// ranks each dimension's communicator groups. Tensor is innermost (its
// groups are runs of consecutive ranks, so a tensor group lies on one node
// when it fits there, as its all-reduces are the most frequent), data next,
// pipeline outermost (Megatron-LM's order):
//
//   rank = (pipeline_index * data + data_index) * tensor + tensor_index
//
// A rank belongs to one group per dimension: the ranks that differ from it
// in that coordinate only. Pure; thread-compatible.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace aidn::engine {

struct GridShape {
  int data = 1;
  int tensor = 1;
  int pipeline = 1;
};

struct GridCoords {
  int data = 0;
  int tensor = 0;
  int pipeline = 0;
};

enum class GridDim { kData, kTensor, kPipeline };

class ProcessGrid {
 public:
  // INVALID_ARGUMENT unless every size is >= 1 and their product is
  // `world_size`, naming the sizes.
  static absl::StatusOr<ProcessGrid> Create(int world_size, const GridShape& shape);

  int world_size() const { return shape_.data * shape_.tensor * shape_.pipeline; }
  const GridShape& shape() const { return shape_; }
  int Size(GridDim dim) const;

  GridCoords CoordsOf(int rank) const;
  int RankOf(const GridCoords& coords) const;
  // The ranks of `rank`'s group along `dim`, in the order of that
  // coordinate (so a rank's index in it is its coordinate).
  std::vector<int> Group(int rank, GridDim dim) const;
  // A name that tells the groups of `dim` apart (the same for every member):
  // the dimension and the group's other two coordinates, "tensor/d1p0".
  std::string GroupName(int rank, GridDim dim) const;

 private:
  explicit ProcessGrid(const GridShape& shape) : shape_(shape) {}

  GridShape shape_;
};

// "data", "tensor", "pipeline".
const char* GridDimName(GridDim dim);

}  // namespace aidn::engine

#endif  // AIDN_WORKER_ENGINE_COMM_PROCESS_GRID_H_
