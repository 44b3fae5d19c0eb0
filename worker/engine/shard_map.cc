#include "worker/engine/shard_map.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "absl/strings/str_cat.h"

namespace aidn::engine {

ShardMap::Group ShardMap::Lay(const std::vector<Parameter*>& parameters, int world_size,
                              size_t extra_floats) {
  Group group;
  group.parameters = parameters;
  for (const Parameter* p : parameters) {
    group.offsets.push_back(group.floats);
    group.floats += (static_cast<size_t>(p->value.numel()) + 15) / 16 * 16;
  }
  group.floats += extra_floats;
  const size_t unit = size_t{16} * static_cast<size_t>(world_size);
  group.floats = (group.floats + unit - 1) / unit * unit;
  return group;
}

ShardMap::ShardMap(std::vector<Group> groups, std::vector<Parameter*> parameters, int rank,
                   int world_size)
    : groups_(std::move(groups)),
      parameters_(std::move(parameters)),
      rank_(rank),
      world_(world_size) {}

absl::Status ShardMap::CheckEveryRankOwnsSome(const std::vector<Group>& groups, int world_size) {
  const size_t world = static_cast<size_t>(world_size);
  size_t elements = 0;
  for (const Group& g : groups) {
    for (const Parameter* p : g.parameters) elements += static_cast<size_t>(p->value.numel());
  }
  for (size_t r = 0; r < world; ++r) {
    bool owns = false;
    for (size_t k = 0; k < groups.size() && !owns; ++k) {
      const Group& g = groups[k];
      const size_t chunk = g.floats / world, begin = r * chunk, end = begin + chunk;
      for (size_t i = 0; i < g.parameters.size() && !owns; ++i) {
        const size_t n = static_cast<size_t>(g.parameters[i]->value.numel());
        owns = n > 0 && g.offsets[i] < end && g.offsets[i] + n > begin;
      }
    }
    if (!owns) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding: rank ", r, " of ", world_size,
                       " would own no parameter element, only padding (the model has ", elements,
                       " elements in ", groups.size(), " groups); use fewer ranks or ddp"));
    }
  }
  return absl::OkStatus();
}

size_t ShardMap::padding_floats(size_t extra) const {
  size_t padding = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    size_t used = g + 1 == groups_.size() ? extra : 0;
    for (const Parameter* p : groups_[g].parameters) used += static_cast<size_t>(p->value.numel());
    padding += groups_[g].floats - used;
  }
  return padding;
}

void ShardMap::MakeShards(const std::function<float*(int)>& value_slice,
                          const std::function<float*(int)>& grad_slice) {
  for (int g = 0; g < num_groups(); ++g) {
    const Group& group = groups_[static_cast<size_t>(g)];
    const size_t begin = static_cast<size_t>(rank_) * chunk(g), end = begin + chunk(g);
    float* values = value_slice(g);
    float* grads = grad_slice(g);
    for (size_t i = 0; i < group.parameters.size(); ++i) {
      Parameter* p = group.parameters[i];
      const size_t offset = group.offsets[i];
      const size_t n = static_cast<size_t>(p->value.numel());
      // This rank's piece of the parameter, if its slice covers any.
      const size_t lo = std::max(begin, offset), hi = std::min(end, offset + n);
      if (lo >= hi) continue;
      auto shard = std::make_unique<Parameter>();
      shard->name = absl::StrCat(p->name, "[", lo - offset, ":", hi - offset, "]");
      shard->value = Tensor::View(values + (lo - begin), {static_cast<int64_t>(hi - lo)});
      shard->grad = Tensor::View(grads + (lo - begin), {static_cast<int64_t>(hi - lo)});
      shard->whole_shape = p->value.shape();
      shards_.push_back(std::move(shard));
      places_.push_back({p, g, offset, lo, hi});
    }
  }
  // The optimizer's order: registration order of the parameters they are
  // pieces of (a parameter has at most one piece per rank).
  std::unordered_map<const Parameter*, size_t> order;
  for (size_t i = 0; i < parameters_.size(); ++i) order[parameters_[i]] = i;
  std::vector<size_t> index(shards_.size());
  for (size_t i = 0; i < index.size(); ++i) index[i] = i;
  std::sort(index.begin(), index.end(), [&](size_t a, size_t b) {
    return order.at(places_[a].whole) < order.at(places_[b].whole);
  });
  std::vector<std::unique_ptr<Parameter>> shards;
  std::vector<Place> places;
  for (size_t i : index) {
    shards.push_back(std::move(shards_[i]));
    places.push_back(places_[i]);
  }
  shards_ = std::move(shards);
  places_ = std::move(places);
  for (Place& p : places_) p.parameter = order.at(p.whole);
  for (const auto& s : shards_) shard_view_.push_back(s.get());
}

ShardMap::ShardPlace ShardMap::place(size_t k) const {
  const Place& p = places_[k];
  return {p.group, p.lo, p.hi, p.parameter, p.offset};
}

void ShardMap::CopyNoGradToShards() {
  for (size_t k = 0; k < shards_.size(); ++k) shards_[k]->no_grad = places_[k].whole->no_grad;
}

std::vector<ShardMap::Piece> ShardMap::WeightPieces() const {
  std::vector<Piece> pieces;
  for (size_t k = 0; k < shards_.size(); ++k) {
    const Place& place = places_[k];
    pieces.push_back({shards_[k]->name, place.whole->name, place.whole->value.shape(),
                      place.lo - place.offset, place.hi - place.offset, &shards_[k]->value});
  }
  return pieces;
}

absl::StatusOr<std::vector<ShardMap::Piece>> ShardMap::StatePieces(
    const std::vector<StateEntry>& shard_state) const {
  std::unordered_map<std::string, size_t> shard_index;
  for (size_t k = 0; k < shards_.size(); ++k) shard_index[shards_[k]->name] = k;
  std::vector<Piece> pieces;
  for (const auto& [name, tensor] : shard_state) {
    // "<parameter>[a:b].<buffer>": the shard's name ends at the "].".
    const size_t cut = name.rfind("].");
    auto it =
        cut == std::string::npos ? shard_index.end() : shard_index.find(name.substr(0, cut + 1));
    if (it == shard_index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding: optimizer state ", name, " belongs to no shard"));
    }
    const Place& place = places_[it->second];
    if (tensor == nullptr || tensor->numel() != static_cast<int64_t>(place.hi - place.lo)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding: optimizer state ", name, " is missing or misshapen"));
    }
    pieces.push_back({name, absl::StrCat(place.whole->name, name.substr(cut + 1)),
                      place.whole->value.shape(), place.lo - place.offset, place.hi - place.offset,
                      tensor});
  }
  return pieces;
}

}  // namespace aidn::engine
