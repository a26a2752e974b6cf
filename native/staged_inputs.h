// Host inputs of runs that are not awaited, copied into memory the worker owns.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "client.h"
#include "owners.h"

namespace pjrt_pool {

// A run whose outputs all stay on the device is answered once it is dispatched
// (RunToValues without await_completion). Its host inputs lie in memory the
// caller reuses as soon as it is answered (a shared-memory segment of the
// parent), so without a copy the answer would wait for their transfers to the
// device, which on a TPU is most of a small training step's time in the worker.
// Put copies such an input here and lets PJRT read the copy for as long as its
// transfer takes (as jax.jit keeps a numpy argument alive until its transfer
// ends); a copy is freed once PJRT says it is done with it, which Put checks
// each time, and the destructor waits for those still in use.
class StagedInputs {
 public:
  // Inputs up to this many bytes are staged: past it the copy costs about what
  // the transfer does (host memory bandwidth against the host-to-device link),
  // so waiting for the transfer is no slower and needs no second copy in memory.
  static constexpr size_t kMaxBytes = size_t{1} << 20;

  StagedInputs() = default;
  StagedInputs(const StagedInputs&) = delete;
  StagedInputs& operator=(const StagedInputs&) = delete;
  ~StagedInputs();

  // A buffer on `device` made from a copy of `input` (of at most kMaxBytes),
  // owned by the caller. `zero_copy` lets PJRT alias the copy (CPU plugins),
  // which is then freed only after the buffer and the runs that use it end.
  Owned<PJRT_Buffer> Put(const std::shared_ptr<Client>& client, PJRT_Device* device,
                         const HostInput& input, bool zero_copy);

  // Copies PJRT still reads (for a worker's own bookkeeping and tests).
  size_t pending() const;

 private:
  struct FreeMemory {
    void operator()(void* memory) const noexcept;
  };
  struct Copy {
    std::shared_ptr<Client> client;  // keeps the plugin alive for the event
    std::unique_ptr<void, FreeMemory> memory;
    Owned<PJRT_Event> done;  // declared last, destroyed first
  };

  // Frees the copies whose events are ready; mutex_ held.
  void SweepLocked();

  mutable std::mutex mutex_;
  std::vector<Copy> copies_;
};

}  // namespace pjrt_pool
