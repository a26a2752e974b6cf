// Program values that stay where the plugin put them: the outputs a pool worker
// keeps on its device between runs (a pool's kept values), and the outputs
// Executable.run hands to numpy without a copy where they live in host memory.
//
// A value is a list of buffers, one per device it lies on: one today; a value
// sharded over k devices will hold k (an argument then gives each device its
// own buffer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "client.h"
#include "id_table.h"
#include "staged_inputs.h"

namespace pjrt_pool {

class DeviceValue {
 public:
  // Takes the buffers, which hold an array of `element_type` and `dims`.
  DeviceValue(std::shared_ptr<Client> client, std::vector<Owned<PJRT_Buffer>> buffers,
              int element_type, std::vector<int64_t> dims);
  DeviceValue(const DeviceValue&) = delete;
  DeviceValue& operator=(const DeviceValue&) = delete;

  // A value copied from host memory to the client's first device (the memory may be
  // reused as soon as this returns). Throws std::invalid_argument for an input
  // CheckInput refuses. Blocks; call without the GIL.
  static std::shared_ptr<DeviceValue> FromHost(std::shared_ptr<Client> client,
                                               const HostInput& input);

  int element_type() const { return element_type_; }
  const std::vector<int64_t>& dims() const { return dims_; }
  // Bytes of the array in host memory (dense, row-major).
  size_t size() const { return size_; }
  const std::shared_ptr<Client>& client() const { return client_; }
  // The buffer on the value's one device.
  PJRT_Buffer* buffer() const { return buffers_.front().get(); }

  // The host memory the value lies in, dense row-major, or nullptr where it lies
  // on a device (or in another layout): CPU plugins give it.
  const void* HostView() const;
  // Copies the value into caller memory of exactly size() bytes, row-major.
  // Blocks; call without the GIL.
  void ToHost(const HostOutput& output) const;

 private:
  std::shared_ptr<Client> client_;
  std::vector<Owned<PJRT_Buffer>> buffers_;
  int element_type_;
  std::vector<int64_t> dims_;
  size_t size_;
};

// One argument of a run: host memory, or (value set) a value on the device.
struct Argument {
  HostInput host;
  std::shared_ptr<const DeviceValue> value;
};

// Runs `executable` once on its client's device and returns its outputs as
// values there. Host arguments are read without a copy where `zero_copy` and
// the plugin allow it; a value argument must have the input's element type and
// dims. Without `await_completion` it returns once the run is dispatched (host
// arguments are then copied, never read in place): the values are read once it
// ends (see ExecuteOnDevices); with `staged`, its small host arguments are
// copied there, so that it returns without waiting for their transfers either.
// With `await_completion` and `run_ends`, the run's completion events are put
// there unawaited, for the caller to await with its copies of the outputs
// (CopyOutputsToHost), so that those start as the run ends; host arguments read
// in place are read until the run's end, which the caller awaits before their
// memory may change. Throws std::invalid_argument, before any PJRT call, for an
// argument that does not fit. Blocks; call without the GIL.
std::vector<std::shared_ptr<DeviceValue>> RunToValues(
    const Executable& executable, const std::vector<Argument>& arguments, bool zero_copy,
    bool await_completion = true, StagedInputs* staged = nullptr,
    std::vector<Owned<PJRT_Event>>* run_ends = nullptr);

// The values a worker keeps between runs, by the id the parent gave each; a
// dropped value's device memory is freed once no run uses it.
class ValueTable : public IdTable<const DeviceValue> {
 public:
  ValueTable() : IdTable("value") {}
};

}  // namespace pjrt_pool
