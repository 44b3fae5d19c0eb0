#include "worker/engine/comm/process_grid.h"

#include "absl/strings/str_cat.h"

namespace aidn::engine {

const char* GridDimName(GridDim dim) {
  switch (dim) {
    case GridDim::kData:
      return "data";
    case GridDim::kTensor:
      return "tensor";
    case GridDim::kPipeline:
      return "pipeline";
  }
  return "?";
}

absl::StatusOr<ProcessGrid> ProcessGrid::Create(int world_size, const GridShape& shape) {
  if (shape.data < 1 || shape.tensor < 1 || shape.pipeline < 1) {
    return absl::InvalidArgumentError(absl::StrCat("grid sizes must be >= 1: data ", shape.data,
                                                   ", tensor ", shape.tensor, ", pipeline ",
                                                   shape.pipeline));
  }
  const int64_t product = int64_t{shape.data} * shape.tensor * shape.pipeline;
  if (product != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", world_size, " is not data x tensor x pipeline = ", shape.data,
                     " x ", shape.tensor, " x ", shape.pipeline, " = ", product));
  }
  return ProcessGrid(shape);
}

int ProcessGrid::Size(GridDim dim) const {
  switch (dim) {
    case GridDim::kData:
      return shape_.data;
    case GridDim::kTensor:
      return shape_.tensor;
    case GridDim::kPipeline:
      return shape_.pipeline;
  }
  return 1;
}

GridCoords ProcessGrid::CoordsOf(int rank) const {
  GridCoords c;
  c.tensor = rank % shape_.tensor;
  c.data = (rank / shape_.tensor) % shape_.data;
  c.pipeline = rank / (shape_.tensor * shape_.data);
  return c;
}

int ProcessGrid::RankOf(const GridCoords& c) const {
  return (c.pipeline * shape_.data + c.data) * shape_.tensor + c.tensor;
}

std::vector<int> ProcessGrid::Group(int rank, GridDim dim) const {
  const GridCoords base = CoordsOf(rank);
  std::vector<int> ranks;
  for (int i = 0; i < Size(dim); ++i) {
    GridCoords c = base;
    (dim == GridDim::kData ? c.data : dim == GridDim::kTensor ? c.tensor : c.pipeline) = i;
    ranks.push_back(RankOf(c));
  }
  return ranks;
}

std::string ProcessGrid::GroupName(int rank, GridDim dim) const {
  const GridCoords c = CoordsOf(rank);
  switch (dim) {
    case GridDim::kData:
      return absl::StrCat("data/t", c.tensor, "p", c.pipeline);
    case GridDim::kTensor:
      return absl::StrCat("tensor/d", c.data, "p", c.pipeline);
    case GridDim::kPipeline:
      return absl::StrCat("pipeline/d", c.data, "t", c.tensor);
  }
  return "?";
}

}  // namespace aidn::engine
