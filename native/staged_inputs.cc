#include "staged_inputs.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "buffers.h"

namespace pjrt_pool {
namespace {

bool IsReady(const PJRT_Api* api, PJRT_Event* event) {
  auto args = PJRT_ARGS(PJRT_Event_IsReady_Args);
  args.event = event;
  PJRT_Error* error = api->PJRT_Event_IsReady(&args);
  if (error != nullptr) {  // a plugin that cannot say keeps the copy until the destructor
    IgnoreError(api, error);
    return false;
  }
  return args.is_ready;
}

}  // namespace

void StagedInputs::FreeMemory::operator()(void* memory) const noexcept { std::free(memory); }

StagedInputs::~StagedInputs() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Copy& copy : copies_) {
    if (!copy.done) continue;
    AwaitEventQuietly(copy.client->api(), copy.done.get());
  }
}

Owned<PJRT_Buffer> StagedInputs::Put(const std::shared_ptr<Client>& client, PJRT_Device* device,
                                     const HostInput& input, bool zero_copy) {
  if (input.size > kMaxBytes) {
    throw std::invalid_argument("an input of " + std::to_string(input.size) +
                                " bytes is past what a run stages");
  }
  const PJRT_Api* api = client->api();
  std::lock_guard<std::mutex> lock(mutex_);
  SweepLocked();
  // aligned_alloc wants a multiple of the alignment, and a pointer even for 0 bytes.
  const size_t rounded = (input.size + kZeroCopyAlignment - 1) / kZeroCopyAlignment * kZeroCopyAlignment;
  std::unique_ptr<void, FreeMemory> memory(
      std::aligned_alloc(kZeroCopyAlignment, rounded == 0 ? kZeroCopyAlignment : rounded));
  if (memory == nullptr) throw std::bad_alloc();
  if (input.size != 0) std::memcpy(memory.get(), input.data, input.size);

  auto args = PJRT_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  args.client = client->get();
  args.data = memory.get();
  args.type = static_cast<PJRT_Buffer_Type>(input.element_type);
  args.dims = input.dims.data();
  args.num_dims = input.dims.size();
  args.host_buffer_semantics = zero_copy
                                   ? PJRT_HostBufferSemantics_kImmutableZeroCopy
                                   : PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
  args.device = device;
  Check(api, PJRT_FN(api, PJRT_Client_BufferFromHostBuffer)(&args),
        "PJRT_Client_BufferFromHostBuffer");
  // Own both before anything can throw.
  Owned<PJRT_Buffer> buffer(api, args.buffer);
  Owned<PJRT_Event> done(api, args.done_with_host_buffer);
  // Without an event PJRT has copied the memory during the call.
  if (done) copies_.push_back(Copy{client, std::move(memory), std::move(done)});
  return buffer;
}

size_t StagedInputs::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return copies_.size();
}

void StagedInputs::SweepLocked() {
  copies_.erase(std::remove_if(copies_.begin(), copies_.end(),
                               [](const Copy& copy) {
                                 return IsReady(copy.client->api(), copy.done.get());
                               }),
                copies_.end());
}

}  // namespace pjrt_pool
