// Programs over several devices (SPMD): how each global array of a run is cut
// into one block per device, and copying blocks between a row-major global
// array in host memory and dense per-device memory. The parent works the
// blocks out (JAX's devices_indices_map) and the worker hands them here once
// per executable (Executable::SetShards), so that a run splits its inputs
// and assembles its outputs without Python and without parsing shardings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pjrt_pool {

// One device's block of a global array: where it starts on each axis and its
// extent there.
struct Shard {
  std::vector<int64_t> start;
  std::vector<int64_t> dims;
};

// How one input or output of a program is split over its devices.
struct ArrayShards {
  int element_type = 0;              // PJRT_Buffer_Type
  std::vector<int64_t> dims;         // the global array's
  std::vector<Shard> shards;         // one per device, in the executable's device order
  std::vector<bool> first;           // whether a device holds the first copy of its block

  // Throws std::invalid_argument (naming `what`) for a block outside the array
  // or of another rank, or a shard count other than `devices`; fills `first`.
  void Check(const std::string& what, size_t devices);
  // Bytes from the array's start to a block's first element.
  size_t Offset(const Shard& shard) const;
  // Bytes of one block.
  size_t BlockBytes(const Shard& shard) const;
  // Whether a block occupies one contiguous run of the row-major array.
  bool Contiguous(const Shard& shard) const;
  // The array's row-major byte strides (what PJRT takes to read a block in place).
  std::vector<int64_t> ByteStrides() const;
  // Copies a dense block into its place in the global array.
  void Scatter(const char* block, const Shard& shard, char* global) const;
};

// The inputs and outputs of a program over several devices.
struct ShardPlan {
  std::vector<ArrayShards> inputs;
  std::vector<ArrayShards> outputs;
};

}  // namespace pjrt_pool
