#include "shards.h"

#include <cstring>
#include <map>
#include <stdexcept>
#include <utility>

#include "buffers.h"
#include "client.h"

namespace pjrt_pool {

void ArrayShards::Check(const std::string& what, size_t devices) {
  if (ElementSize(element_type) == 0) {
    throw std::invalid_argument(what + " has an element type pjrt-pool does not support");
  }
  if (shards.size() != devices) {
    throw std::invalid_argument(what + " has " + std::to_string(shards.size()) +
                                " blocks for " + std::to_string(devices) + " devices");
  }
  std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, bool> seen;
  first.assign(shards.size(), false);
  for (size_t device = 0; device < shards.size(); ++device) {
    const Shard& shard = shards[device];
    if (shard.start.size() != dims.size() || shard.dims.size() != dims.size()) {
      throw std::invalid_argument(what + ": a block's rank is not the array's");
    }
    for (size_t axis = 0; axis < dims.size(); ++axis) {
      if (shard.start[axis] < 0 || shard.dims[axis] < 0 ||
          shard.start[axis] + shard.dims[axis] > dims[axis]) {
        throw std::invalid_argument(what + ": a block lies outside the array");
      }
    }
    first[device] = seen.emplace(std::make_pair(shard.start, shard.dims), true).second;
  }
}

std::vector<int64_t> ArrayShards::ByteStrides() const {
  std::vector<int64_t> strides(dims.size());
  int64_t stride = static_cast<int64_t>(ElementSize(element_type));
  for (size_t axis = dims.size(); axis-- > 0;) {
    strides[axis] = stride;
    stride *= dims[axis];
  }
  return strides;
}

size_t ArrayShards::Offset(const Shard& shard) const {
  const std::vector<int64_t> strides = ByteStrides();
  size_t offset = 0;
  for (size_t axis = 0; axis < dims.size(); ++axis) {
    offset += static_cast<size_t>(shard.start[axis] * strides[axis]);
  }
  return offset;
}

size_t ArrayShards::BlockBytes(const Shard& shard) const {
  size_t bytes = ElementSize(element_type);
  for (int64_t dim : shard.dims) bytes *= static_cast<size_t>(dim);
  return bytes;
}

bool ArrayShards::Contiguous(const Shard& shard) const {
  // Row-major: past the first axis the block does not span whole, every
  // later axis must be whole, and every earlier one a single index.
  size_t axis = 0;
  while (axis < dims.size() && shard.dims[axis] == 1) ++axis;  // single indices
  if (axis == dims.size()) return true;
  for (++axis; axis < dims.size(); ++axis) {
    if (shard.dims[axis] != dims[axis]) return false;
  }
  return true;
}

void ArrayShards::Scatter(const char* block, const Shard& shard, char* global) const {
  const size_t rank = dims.size();
  const std::vector<int64_t> strides = ByteStrides();
  // The innermost axes a block spans whole (with the one before them, which
  // it may span in part) are one contiguous run in both layouts.
  size_t inner = rank;
  while (inner > 0 && shard.dims[inner - 1] == dims[inner - 1]) --inner;
  const size_t run_axis = inner == 0 ? 0 : inner - 1;
  size_t run = ElementSize(element_type);
  for (size_t axis = run_axis; axis < rank; ++axis) run *= static_cast<size_t>(shard.dims[axis]);
  if (run == 0) return;
  // An odometer over the axes before the run.
  std::vector<int64_t> index(run_axis, 0);
  const char* from = block;
  while (true) {
    size_t offset = 0;
    for (size_t axis = 0; axis < rank; ++axis) {
      const int64_t at = shard.start[axis] + (axis < run_axis ? index[axis] : 0);
      offset += static_cast<size_t>(at * strides[axis]);
    }
    std::memcpy(global + offset, from, run);
    from += run;
    size_t axis = run_axis;
    while (axis > 0 && ++index[axis - 1] == shard.dims[axis - 1]) index[--axis] = 0;
    if (axis == 0) return;
  }
}

// Executable's methods for programs over several devices (declared in client.h).

void Executable::SetShards(const std::vector<int>& device_ids, ShardPlan plan) {
  if (device_ids.size() != devices_.size()) {
    throw std::invalid_argument("the program was compiled for " +
                                std::to_string(devices_.size()) + " devices, not " +
                                std::to_string(device_ids.size()));
  }
  // Position of each program device (device-assignment order) among devices().
  std::vector<size_t> order(devices_.size());
  for (size_t logical = 0; logical < device_ids.size(); ++logical) {
    size_t found = devices_.size();
    for (size_t d = 0; d < device_ids_.size(); ++d) {
      if (device_ids_[d] == device_ids[logical]) found = d;
    }
    if (found == devices_.size()) {
      throw std::invalid_argument("the program's device " + std::to_string(device_ids[logical]) +
                                  " is not one the executable runs on");
    }
    order[found] = logical;
  }
  auto reorder = [&](ArrayShards& array, const std::string& what) {
    if (array.shards.size() != order.size()) array.Check(what, order.size());  // says why
    std::vector<Shard> placed(order.size());
    for (size_t d = 0; d < order.size(); ++d) placed[d] = array.shards[order[d]];
    array.shards = std::move(placed);
    array.Check(what, order.size());
  };
  for (size_t i = 0; i < plan.inputs.size(); ++i) {
    reorder(plan.inputs[i], "input " + std::to_string(i));
  }
  if (plan.outputs.size() != output_types_.size()) {
    throw std::invalid_argument("the program has " + std::to_string(output_types_.size()) +
                                " outputs, not " + std::to_string(plan.outputs.size()));
  }
  for (size_t o = 0; o < plan.outputs.size(); ++o) {
    ArrayShards& output = plan.outputs[o];
    reorder(output, "output " + std::to_string(o));
    // PJRT gives each device a buffer of the output's per-device type.
    for (const Shard& shard : output.shards) {
      if (shard.dims != output_types_[o].dims ||
          output.element_type != output_types_[o].element_type) {
        throw std::invalid_argument("output " + std::to_string(o) + "'s block " +
                                    DimsText(shard.dims) + " is not the program's " +
                                    DimsText(output_types_[o].dims) + " per device");
      }
    }
  }
  shards_ = std::make_shared<const ShardPlan>(std::move(plan));
}

void Executable::ExecuteSharded(const std::vector<HostInput>& inputs,
                                const std::vector<HostOutput>& outputs, bool zero_copy) const {
  const PJRT_Api* api = client_->api();
  if (shards_ == nullptr) throw std::invalid_argument("the program's shards are not set");
  const ShardPlan& plan = *shards_;
  if (inputs.size() != plan.inputs.size() || outputs.size() != plan.outputs.size()) {
    throw std::invalid_argument(
        "the program takes " + std::to_string(plan.inputs.size()) + " inputs and gives " +
        std::to_string(plan.outputs.size()) + " outputs, not " + std::to_string(inputs.size()) +
        " and " + std::to_string(outputs.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    CheckInput(inputs[i], i);
    if (inputs[i].dims != plan.inputs[i].dims ||
        inputs[i].element_type != plan.inputs[i].element_type) {
      throw std::invalid_argument("input " + std::to_string(i) + " is " +
                                  DimsText(inputs[i].dims) + ", not the program's " +
                                  DimsText(plan.inputs[i].dims));
    }
  }
  for (size_t o = 0; o < outputs.size(); ++o) {
    if (ArrayBytes(plan.outputs[o].element_type, plan.outputs[o].dims) != outputs[o].size) {
      throw std::invalid_argument("output " + std::to_string(o) + "'s buffer is not " +
                                  DimsText(plan.outputs[o].dims) + " of its type");
    }
  }

  HostBuffers input_buffers(api);
  std::vector<std::vector<PJRT_Buffer*>> argument_lists(devices_.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const ArrayShards& array = plan.inputs[i];
    const std::vector<int64_t> strides = array.ByteStrides();
    const char* base = static_cast<const char*>(inputs[i].data);
    for (size_t d = 0; d < devices_.size(); ++d) {
      const Shard& shard = array.shards[d];
      const bool dense = array.Contiguous(shard);
      argument_lists[d].push_back(input_buffers.Put(client_->get(), devices_[d],
                                                    base + array.Offset(shard),
                                                    array.element_type, shard.dims, zero_copy,
                                                    dense ? nullptr : &strides));
    }
  }
  std::vector<std::vector<Owned<PJRT_Buffer>>> results = ExecuteOnDevices(argument_lists);
  std::vector<char> staging;
  for (size_t o = 0; o < outputs.size(); ++o) {
    const ArrayShards& array = plan.outputs[o];
    char* base = static_cast<char*>(outputs[o].data);
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (!array.first[d]) continue;  // another device's copy of the same block is written
      const Shard& shard = array.shards[d];
      const size_t bytes = array.BlockBytes(shard);
      if (array.Contiguous(shard)) {
        CopyToHost(api, results[d][o].get(), HostOutput{base + array.Offset(shard), bytes},
                   shard.dims.size(), o);
      } else {
        staging.resize(bytes);
        CopyToHost(api, results[d][o].get(), HostOutput{staging.data(), bytes},
                   shard.dims.size(), o);
        array.Scatter(staging.data(), shard, base);
      }
    }
  }
}

}  // namespace pjrt_pool
