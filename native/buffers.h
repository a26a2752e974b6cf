// Moving arrays between host memory and devices, one buffer at a time: the
// layers an execution is built of (host -> device buffers, execute on buffer
// lists, device buffers -> host), so that a single-device run, a run over
// several devices and (later) values kept on devices share them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "client.h"
#include "owners.h"

namespace pjrt_pool {

// XLA CPU aliases host memory (kImmutableZeroCopy) only when it is aligned to
// this many bytes; otherwise it copies.
constexpr size_t kZeroCopyAlignment = 64;

// Device buffers made from host memory, and the events that say when PJRT is
// done with that memory. Destroying the buffers first is what makes the
// zero-copy events fire; only after both may the host memory be released, so
// the destructor destroys the buffers, then awaits every event.
class HostBuffers {
 public:
  explicit HostBuffers(const PJRT_Api* api) : api_(api) {}
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;
  ~HostBuffers();

  // Copies (or, when allowed, aliases) `size` bytes of a dense row-major array
  // at `data` into a new buffer on `device`. zero_copy asks PJRT to alias
  // memory aligned to 64 bytes (XLA CPU honours it only then, and copies
  // silently otherwise); the memory must then stay valid until this object
  // is destroyed. With byte_strides (one per axis), `data` is the first
  // element of a block of a larger array, read in place with those strides
  // and copied during the call. Returns the buffer, owned here.
  PJRT_Buffer* Put(PJRT_Client* client, PJRT_Device* device, const void* data, int element_type,
                   const std::vector<int64_t>& dims, bool zero_copy,
                   const std::vector<int64_t>* byte_strides = nullptr);

  // Pointers to every buffer made, in order.
  std::vector<PJRT_Buffer*> raw() const;

  // Takes the buffer made `index`-th out of this object (the caller owns it
  // now); only for one whose memory PJRT copied (not zero_copy), which the
  // caller may keep past this object's life.
  Owned<PJRT_Buffer> Take(size_t index);

 private:
  const PJRT_Api* api_;
  std::vector<Owned<PJRT_Event>> done_events_;  // declared first, destroyed last
  std::vector<Owned<PJRT_Buffer>> buffers_;
};

// The dims as text ("[2, 3]"), for messages.
std::string DimsText(const std::vector<int64_t>& dims);

// Checks an input before PJRT sees it: PJRT reads dims x element-size bytes
// from the pointer whatever the buffer holds, and aborts the process on an
// element type it does not know. Throws std::invalid_argument naming `index`.
void CheckInput(const HostInput& input, size_t index);

// Blocks until `buffer`'s data is written (the run that makes it has ended),
// and throws that run's error, if any.
void AwaitReady(const PJRT_Api* api, PJRT_Buffer* buffer);

// Whether a buffer lives in host memory (CPU plugins keep buffers there);
// false when the plugin cannot say. Safe before the run that makes it ends.
bool InHostMemory(const PJRT_Api* api, PJRT_Buffer* buffer);

// Host memory a buffer lives in, or nullptr when it lives on a device, is not
// dense row-major, or the plugin cannot say.
const void* HostPointer(const PJRT_Api* api, PJRT_Buffer* buffer, size_t expected_size,
                        size_t rank);

// Copies a finished buffer into caller memory of exactly its size, in numpy's
// C order whatever layout the buffer has on its device. `index` names the
// output in errors.
void CopyToHost(const PJRT_Api* api, PJRT_Buffer* buffer, const HostOutput& output, size_t rank,
                size_t index);

// Asks the plugin to copy a buffer (finished or not: the copy waits for its
// data on the device) into caller memory as CopyToHost does, and returns the
// copy's event without awaiting it (empty for an empty output). The memory
// must stay valid until the event is ready.
Owned<PJRT_Event> StartCopyToHost(const PJRT_Api* api, PJRT_Buffer* buffer,
                                  const HostOutput& output, size_t rank, size_t index);

// One output of a run and the host memory it goes to.
struct OutputCopy {
  PJRT_Buffer* buffer;
  HostOutput place;
  size_t rank;
  size_t index;  // the output's index in the program, for errors
};

// Copies a run's outputs into host memory as CopyToHost does, `run_ends` being
// the run's completion events, not yet awaited (none, or only empty ones: each
// buffer's own readiness is awaited). Copies off a device start before the run's end is
// awaited, each as soon as the run ends; buffers in host memory are read once
// it has. Returns once the run and every copy have ended, then throws the
// first error, if any (so no copy still writes into the memory when it does).
void CopyOutputsToHost(const PJRT_Api* api, const std::vector<OutputCopy>& copies,
                       const std::vector<Owned<PJRT_Event>>& run_ends);

}  // namespace pjrt_pool
