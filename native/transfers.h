// Host memory to PJRT buffers and back: the two ends of every execution, shared
// by Executable::Execute (host in, host out) and device values (kept buffers,
// native/device_values.h). Defined in executable.cc.
#pragma once

#include <cstddef>
#include <vector>

#include "client.h"

namespace pjrt_pool {

// Checks an input before PJRT sees it (element type known, size = dims x
// element size); throws std::invalid_argument naming input `index`.
void CheckInput(const HostInput& input, size_t index);

// A buffer on the client's device made from host memory with `semantics`, and
// the event (in `done`; may be empty) that fires once PJRT no longer reads
// that memory.
Owned<PJRT_Buffer> BufferFromHost(const Client& client, const HostInput& input,
                                  PJRT_HostBufferSemantics semantics, Owned<PJRT_Event>* done);

// Input buffers made from host memory and the events that say when PJRT is
// done with that memory. Destroying the buffers first is what makes the
// zero-copy events fire; only after both may the caller's memory be released.
class InputBuffers {
 public:
  explicit InputBuffers(const PJRT_Api* api) : api_(api) {}
  InputBuffers(const InputBuffers&) = delete;
  InputBuffers& operator=(const InputBuffers&) = delete;
  ~InputBuffers();

  // A buffer on the client's device from host memory: aliased without a copy
  // where `zero_copy` and the plugin allows it (64-byte aligned), else copied
  // during the call. The memory must stay valid until this object is gone.
  PJRT_Buffer* FromHost(const Client& client, const HostInput& input, bool zero_copy);

 private:
  const PJRT_Api* api_;
  std::vector<Owned<PJRT_Event>> done_events_;  // declared first, destroyed last
  std::vector<Owned<PJRT_Buffer>> buffers_;
};

// Host memory a buffer lives in, or nullptr when it lives on a device, is not
// dense row-major, or the plugin cannot say. CPU plugins keep buffers in host
// memory.
const void* HostPointer(const PJRT_Api* api, PJRT_Buffer* buffer, size_t expected_size,
                        size_t rank);

// Copies a finished buffer into caller memory of exactly its size, in numpy's
// C order whatever layout the buffer has on its device. `index` names the
// output in errors.
void CopyToHost(const PJRT_Api* api, PJRT_Buffer* buffer, const HostOutput& output,
                size_t rank, size_t index);

}  // namespace pjrt_pool
