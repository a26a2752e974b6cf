#include "buffers.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

namespace pjrt_pool {
namespace {

bool IsAligned(const void* data, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(data) % alignment == 0;
}

// The row-major ("descending") minor-to-major order of a rank: the last
// dimension varies fastest, as numpy's C order has it.
std::vector<int64_t> RowMajor(size_t rank) {
  std::vector<int64_t> order(rank);
  for (size_t i = 0; i < rank; ++i) order[i] = static_cast<int64_t>(rank - 1 - i);
  return order;
}

// Whether a buffer's memory is dense and row-major: untiled, with the
// descending minor-to-major order. XLA's layout assignment may choose another
// order for a program's result (TPU keeps f32[32,16] as {0,1}), so this is
// asked, never assumed. False when the plugin cannot say.
bool IsDenseRowMajor(const PJRT_Api* api, PJRT_Buffer* buffer, size_t rank) {
  if (offsetof(PJRT_Api, PJRT_Buffer_GetMemoryLayout) + sizeof(void*) > api->struct_size ||
      api->PJRT_Buffer_GetMemoryLayout == nullptr) {
    return false;
  }
  auto args = PJRT_ARGS(PJRT_Buffer_GetMemoryLayout_Args);
  args.buffer = buffer;
  PJRT_Error* error = api->PJRT_Buffer_GetMemoryLayout(&args);
  if (error != nullptr) {
    IgnoreError(api, error);
    return false;
  }
  if (args.layout.type != PJRT_Buffer_MemoryLayout_Type_Tiled) return false;
  const PJRT_Buffer_MemoryLayout_Tiled& tiled = args.layout.tiled;
  if (tiled.num_tiles != 0 || tiled.minor_to_major_size != rank) return false;
  const std::vector<int64_t> expected = RowMajor(rank);
  return std::equal(expected.begin(), expected.end(), tiled.minor_to_major);
}

}  // namespace

void AwaitReady(const PJRT_Api* api, PJRT_Buffer* buffer) {
  auto ready = PJRT_ARGS(PJRT_Buffer_ReadyEvent_Args);
  ready.buffer = buffer;
  Check(api, PJRT_FN(api, PJRT_Buffer_ReadyEvent)(&ready), "PJRT_Buffer_ReadyEvent");
  Owned<PJRT_Event> event(api, ready.event);
  if (event) AwaitEvent(api, event.get(), "the run that made the value");
}

bool InHostMemory(const PJRT_Api* api, PJRT_Buffer* buffer) {
  if (offsetof(PJRT_Api, PJRT_Buffer_IsOnCpu) + sizeof(void*) > api->struct_size ||
      api->PJRT_Buffer_IsOnCpu == nullptr) {
    return false;
  }
  auto on_cpu = PJRT_ARGS(PJRT_Buffer_IsOnCpu_Args);
  on_cpu.buffer = buffer;
  Check(api, api->PJRT_Buffer_IsOnCpu(&on_cpu), "PJRT_Buffer_IsOnCpu");
  return on_cpu.is_on_cpu;
}

const void* HostPointer(const PJRT_Api* api, PJRT_Buffer* buffer, size_t expected_size,
                        size_t rank) {
  if (offsetof(PJRT_Api, PJRT_Buffer_UnsafePointer) + sizeof(void*) > api->struct_size ||
      api->PJRT_Buffer_UnsafePointer == nullptr ||
      api->PJRT_Buffer_OnDeviceSizeInBytes == nullptr || !InHostMemory(api, buffer)) {
    return nullptr;
  }
  auto size = PJRT_ARGS(PJRT_Buffer_OnDeviceSizeInBytes_Args);
  size.buffer = buffer;
  Check(api, api->PJRT_Buffer_OnDeviceSizeInBytes(&size), "PJRT_Buffer_OnDeviceSizeInBytes");
  if (size.on_device_size_in_bytes != expected_size) return nullptr;  // padded or tiled
  if (rank > 1 && !IsDenseRowMajor(api, buffer, rank)) return nullptr;
  auto pointer = PJRT_ARGS(PJRT_Buffer_UnsafePointer_Args);
  pointer.buffer = buffer;
  Check(api, api->PJRT_Buffer_UnsafePointer(&pointer), "PJRT_Buffer_UnsafePointer");
  return reinterpret_cast<const void*>(pointer.buffer_pointer);
}

std::string DimsText(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

// Checks an input before PJRT sees it: PJRT reads dims x element-size bytes
// from the pointer whatever the buffer holds, and aborts the process on an
// element type it does not know. The Python side converts arguments to the
// program's types first; this is the last line, for every caller.
void CheckInput(const HostInput& input, size_t index) {
  const std::string which = "input " + std::to_string(index);
  const size_t element_size = ElementSize(input.element_type);
  if (element_size == 0) {
    throw std::invalid_argument(
        which + " has element type " + std::to_string(input.element_type) +
        ", which is not a PJRT_Buffer_Type with a byte-sized host layout that pjrt-pool "
        "supports (codes 1-20 and 26-28)");
  }
  const std::optional<size_t> bytes = ArrayBytes(input.element_type, input.dims);
  if (!bytes) {
    throw std::invalid_argument(which + " has invalid dimensions " + DimsText(input.dims));
  }
  const size_t expected = *bytes;
  if (expected != input.size) {
    throw std::invalid_argument(
        which + " has dimensions " + DimsText(input.dims) + " of element type " +
        std::to_string(input.element_type) + " (" + std::to_string(element_size) +
        " bytes each), which need " + std::to_string(expected) + " bytes, but its buffer has " +
        std::to_string(input.size) + " bytes");
  }
}

void CopyToHost(const PJRT_Api* api, PJRT_Buffer* buffer, const HostOutput& output,
                size_t rank, size_t index) {
  // On CPU, a row-major result already sits in host memory: one memcpy.
  // Asking PJRT to copy (ToHostBuffer) hands the work to its thread pool and
  // costs a thread round trip, ~60 us, which dominates small programs.
  if (const void* source = HostPointer(api, buffer, output.size, rank)) {
    if (output.size > 0) std::memcpy(output.data, source, output.size);
    return;
  }
  Owned<PJRT_Event> copied = StartCopyToHost(api, buffer, output, rank, index);
  if (copied) AwaitEvent(api, copied.get(), "copying an output to host memory");
}

Owned<PJRT_Event> StartCopyToHost(const PJRT_Api* api, PJRT_Buffer* buffer,
                                  const HostOutput& output, size_t rank, size_t index) {
  // Without a host layout PJRT copies in the buffer's own device layout
  // (column-major for some TPU results): ask for dense row-major. A scalar's or
  // a vector's only dense layout is that already, so none is asked for them
  // (the plugin's own path, without a layout conversion).
  const std::vector<int64_t> minor_to_major = RowMajor(rank);
  auto layout = PJRT_ARGS(PJRT_Buffer_MemoryLayout);
  layout.type = PJRT_Buffer_MemoryLayout_Type_Tiled;
  layout.tiled = PJRT_ARGS(PJRT_Buffer_MemoryLayout_Tiled);
  layout.tiled.minor_to_major = minor_to_major.data();
  layout.tiled.minor_to_major_size = minor_to_major.size();
  PJRT_Buffer_MemoryLayout* host_layout = rank > 1 ? &layout : nullptr;
  auto to_host = PJRT_FN(api, PJRT_Buffer_ToHostBuffer);
  // Ask for the size first: PJRT would write past a buffer that is short.
  auto size = PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  size.src = buffer;
  size.host_layout = host_layout;
  Check(api, to_host(&size), "PJRT_Buffer_ToHostBuffer");
  Owned<PJRT_Event> size_event(api, size.event);
  if (size.dst_size != output.size) {
    throw PjrtException(PJRT_Error_Code_INVALID_ARGUMENT,
                        "output " + std::to_string(index) + " needs " +
                            std::to_string(size.dst_size) + " bytes but its buffer has " +
                            std::to_string(output.size));
  }
  if (output.size == 0) return Owned<PJRT_Event>(api, nullptr);
  auto copy = PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  copy.src = buffer;
  copy.host_layout = host_layout;
  copy.dst = output.data;
  copy.dst_size = output.size;
  Check(api, to_host(&copy), "PJRT_Buffer_ToHostBuffer");
  return Owned<PJRT_Event>(api, copy.event);
}

void CopyOutputsToHost(const PJRT_Api* api, const std::vector<OutputCopy>& copies,
                       const std::vector<Owned<PJRT_Event>>& run_ends) {
  std::exception_ptr failure;  // the first error; every started copy is awaited before it
  const auto await = [&](PJRT_Event* event, const char* what) {
    if (failure) {
      AwaitEventQuietly(api, event);
      return;
    }
    try {
      AwaitEvent(api, event, what);
    } catch (...) {
      failure = std::current_exception();
    }
  };
  // The plugin's copies off a device are asked for at once, before the run's end is
  // awaited: each starts as the run ends (as jax.jit's np.asarray asks right after
  // dispatch), not once this thread has woken to that end, and they overlap.
  std::vector<Owned<PJRT_Event>> started;
  std::vector<const OutputCopy*> in_host;  // read once the run has ended
  try {
    for (const OutputCopy& copy : copies) {
      if (InHostMemory(api, copy.buffer)) {
        in_host.push_back(&copy);
        continue;
      }
      Owned<PJRT_Event> event =
          StartCopyToHost(api, copy.buffer, copy.place, copy.rank, copy.index);
      if (event) started.push_back(std::move(event));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  bool ended = false;  // a plugin may give no completion event: then each buffer is awaited
  for (const Owned<PJRT_Event>& end : run_ends) {
    if (!end) continue;
    await(end.get(), "executing the program");
    ended = true;
  }
  if (!failure) {
    try {
      for (const OutputCopy* copy : in_host) {
        if (!ended) AwaitReady(api, copy->buffer);
        CopyToHost(api, copy->buffer, copy->place, copy->rank, copy->index);
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  for (const Owned<PJRT_Event>& event : started) {
    await(event.get(), "copying an output to host memory");
  }
  if (failure) std::rethrow_exception(failure);
}

HostBuffers::~HostBuffers() {
  buffers_.clear();
  for (auto& event : done_events_) AwaitEventQuietly(api_, event.get());
}

PJRT_Buffer* HostBuffers::Put(PJRT_Client* client, PJRT_Device* device, const void* data,
                              int element_type, const std::vector<int64_t>& dims,
                              bool zero_copy, const std::vector<int64_t>* byte_strides) {
  auto args = PJRT_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  args.client = client;
  args.data = data;
  args.type = static_cast<PJRT_Buffer_Type>(element_type);
  args.dims = dims.data();
  args.num_dims = dims.size();
  // XLA CPU aliases host memory only when it is 64-byte aligned; anything
  // else it would copy anyway, so ask for the copy explicitly.
  args.host_buffer_semantics = zero_copy && byte_strides == nullptr && IsAligned(data, kZeroCopyAlignment)
                                   ? PJRT_HostBufferSemantics_kImmutableZeroCopy
                                   : PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  if (byte_strides != nullptr) {
    args.byte_strides = byte_strides->data();
    args.num_byte_strides = byte_strides->size();
  }
  args.device = device;
  Check(api_, PJRT_FN(api_, PJRT_Client_BufferFromHostBuffer)(&args),
        "PJRT_Client_BufferFromHostBuffer");
  // Own both before anything can throw.
  Owned<PJRT_Event> done(api_, args.done_with_host_buffer);
  buffers_.emplace_back(api_, args.buffer);
  if (done) done_events_.push_back(std::move(done));
  return args.buffer;
}

Owned<PJRT_Buffer> HostBuffers::Take(size_t index) { return std::move(buffers_.at(index)); }

std::vector<PJRT_Buffer*> HostBuffers::raw() const {
  std::vector<PJRT_Buffer*> result;
  result.reserve(buffers_.size());
  for (const auto& buffer : buffers_) result.push_back(buffer.get());
  return result;
}

}  // namespace pjrt_pool
