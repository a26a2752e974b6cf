#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "client.h"
#include "transfers.h"

namespace pjrt_pool {
namespace {

// PJRT_Executable is a view obtained from a loaded executable; it must be
// destroyed separately, so it gets its own owner for the queries below.
Owned<PJRT_Executable> GetExecutable(const PJRT_Api* api, PJRT_LoadedExecutable* loaded) {
  auto args = PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  args.loaded_executable = loaded;
  Check(api, PJRT_FN(api, PJRT_LoadedExecutable_GetExecutable)(&args),
        "PJRT_LoadedExecutable_GetExecutable");
  return Owned<PJRT_Executable>(api, args.executable);
}

std::string DimsText(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

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

// PJRT reads dims x element-size bytes from an input's pointer whatever the
// buffer holds, and aborts the process on an element type it does not know.
// The Python side converts arguments to the program's types first; this is the
// last line, for every caller.
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

InputBuffers::~InputBuffers() {
  buffers_.clear();
  for (auto& event : done_events_) {
    auto args = PJRT_ARGS(PJRT_Event_Await_Args);
    args.event = event.get();
    IgnoreError(api_, api_->PJRT_Event_Await(&args));
  }
}

Owned<PJRT_Buffer> BufferFromHost(const Client& client, const HostInput& input,
                                  PJRT_HostBufferSemantics semantics, Owned<PJRT_Event>* done) {
  const PJRT_Api* api = client.api();
  auto args = PJRT_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  args.client = client.get();
  args.data = input.data;
  args.type = static_cast<PJRT_Buffer_Type>(input.element_type);
  args.dims = input.dims.data();
  args.num_dims = input.dims.size();
  args.host_buffer_semantics = semantics;
  args.device = client.device();
  Check(api, PJRT_FN(api, PJRT_Client_BufferFromHostBuffer)(&args),
        "PJRT_Client_BufferFromHostBuffer");
  // Own both before anything can throw.
  *done = Owned<PJRT_Event>(api, args.done_with_host_buffer);
  return Owned<PJRT_Buffer>(api, args.buffer);
}

PJRT_Buffer* InputBuffers::FromHost(const Client& client, const HostInput& input,
                                    bool zero_copy) {
  // XLA CPU aliases host memory only when it is 64-byte aligned; anything
  // else it would copy anyway, so ask for the copy explicitly.
  const PJRT_HostBufferSemantics semantics =
      zero_copy && IsAligned(input.data, 64)
          ? PJRT_HostBufferSemantics_kImmutableZeroCopy
          : PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  Owned<PJRT_Event> done;
  Owned<PJRT_Buffer> buffer = BufferFromHost(client, input, semantics, &done);
  PJRT_Buffer* raw = buffer.get();
  if (done) done_events_.push_back(std::move(done));
  buffers_.push_back(std::move(buffer));
  return raw;
}

const void* HostPointer(const PJRT_Api* api, PJRT_Buffer* buffer, size_t expected_size,
                        size_t rank) {
  if (offsetof(PJRT_Api, PJRT_Buffer_UnsafePointer) + sizeof(void*) > api->struct_size ||
      api->PJRT_Buffer_IsOnCpu == nullptr || api->PJRT_Buffer_UnsafePointer == nullptr ||
      api->PJRT_Buffer_OnDeviceSizeInBytes == nullptr) {
    return nullptr;
  }
  auto on_cpu = PJRT_ARGS(PJRT_Buffer_IsOnCpu_Args);
  on_cpu.buffer = buffer;
  Check(api, api->PJRT_Buffer_IsOnCpu(&on_cpu), "PJRT_Buffer_IsOnCpu");
  if (!on_cpu.is_on_cpu) return nullptr;
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

void CopyToHost(const PJRT_Api* api, PJRT_Buffer* buffer, const HostOutput& output,
                size_t rank, size_t index) {
  // On CPU, a row-major result already sits in host memory: one memcpy.
  // Asking PJRT to copy (ToHostBuffer) hands the work to its thread pool and
  // costs a thread round trip, ~60 us, which dominates small programs.
  if (const void* source = HostPointer(api, buffer, output.size, rank)) {
    if (output.size > 0) std::memcpy(output.data, source, output.size);
    return;
  }
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
  if (output.size == 0) return;
  auto copy = PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  copy.src = buffer;
  copy.host_layout = host_layout;
  copy.dst = output.data;
  copy.dst_size = output.size;
  Check(api, to_host(&copy), "PJRT_Buffer_ToHostBuffer");
  Owned<PJRT_Event> copied(api, copy.event);
  if (copied) AwaitEvent(api, copied.get(), "copying an output to host memory");
}


size_t ElementSize(int element_type) {
  switch (element_type) {
    case PJRT_Buffer_Type_PRED:
    case PJRT_Buffer_Type_S8:
    case PJRT_Buffer_Type_U8:
    case PJRT_Buffer_Type_F8E5M2:
    case PJRT_Buffer_Type_F8E4M3FN:
    case PJRT_Buffer_Type_F8E4M3B11FNUZ:
    case PJRT_Buffer_Type_F8E5M2FNUZ:
    case PJRT_Buffer_Type_F8E4M3FNUZ:
    case PJRT_Buffer_Type_F8E4M3:
    case PJRT_Buffer_Type_F8E3M4:
    case PJRT_Buffer_Type_F8E8M0FNU:
      return 1;
    case PJRT_Buffer_Type_S16:
    case PJRT_Buffer_Type_U16:
    case PJRT_Buffer_Type_F16:
    case PJRT_Buffer_Type_BF16:
      return 2;
    case PJRT_Buffer_Type_S32:
    case PJRT_Buffer_Type_U32:
    case PJRT_Buffer_Type_F32:
      return 4;
    case PJRT_Buffer_Type_S64:
    case PJRT_Buffer_Type_U64:
    case PJRT_Buffer_Type_F64:
    case PJRT_Buffer_Type_C64:
      return 8;
    case PJRT_Buffer_Type_C128:
      return 16;
    default:  // INVALID, TOKEN, the packed sub-byte types, and codes unknown here
      return 0;
  }
}

std::optional<size_t> ArrayBytes(int element_type, const std::vector<int64_t>& dims) {
  size_t bytes = ElementSize(element_type);
  if (bytes == 0) return std::nullopt;
  for (int64_t dim : dims) {
    if (dim < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(dim), &bytes)) {
      return std::nullopt;
    }
  }
  return bytes;
}

std::vector<OutputType> ReadOutputTypes(const PJRT_Api* api, PJRT_Executable* executable) {
  auto count = PJRT_ARGS(PJRT_Executable_NumOutputs_Args);
  count.executable = executable;
  Check(api, PJRT_FN(api, PJRT_Executable_NumOutputs)(&count), "PJRT_Executable_NumOutputs");

  auto types = PJRT_ARGS(PJRT_Executable_OutputElementTypes_Args);
  types.executable = executable;
  Check(api, PJRT_FN(api, PJRT_Executable_OutputElementTypes)(&types),
        "PJRT_Executable_OutputElementTypes");

  auto dims = PJRT_ARGS(PJRT_Executable_OutputDimensions_Args);
  dims.executable = executable;
  Check(api, PJRT_FN(api, PJRT_Executable_OutputDimensions)(&dims),
        "PJRT_Executable_OutputDimensions");

  if (types.num_output_types != count.num_outputs || dims.num_outputs != count.num_outputs) {
    throw PjrtException(PJRT_Error_Code_INTERNAL,
                        "the PJRT plugin reported inconsistent output counts");
  }
  std::vector<OutputType> outputs(count.num_outputs);
  const int64_t* next_dim = dims.dims;
  for (size_t i = 0; i < count.num_outputs; ++i) {
    outputs[i].element_type = types.output_types[i];
    outputs[i].dims.assign(next_dim, next_dim + dims.dim_sizes[i]);
    next_dim += dims.dim_sizes[i];
  }
  return outputs;
}

std::string SerializeExecutable(const PJRT_Api* api, PJRT_Executable* executable) {
  auto args = PJRT_ARGS(PJRT_Executable_Serialize_Args);
  args.executable = executable;
  Check(api, PJRT_FN(api, PJRT_Executable_Serialize)(&args), "PJRT_Executable_Serialize");
  // The bytes live as long as serialized_executable; copy, then free it even
  // if the copy throws.
  struct Release {
    PJRT_Executable_Serialize_Args* args;
    ~Release() {
      if (args->serialized_executable_deleter != nullptr) {
        args->serialized_executable_deleter(args->serialized_executable);
      }
    }
  } release{&args};
  return std::string(args.serialized_bytes, args.serialized_bytes_size);
}

std::optional<std::string> ExecutableFingerprint(const PJRT_Api* api,
                                                 PJRT_Executable* executable) {
  if (offsetof(PJRT_Api, PJRT_Executable_Fingerprint) + sizeof(void*) > api->struct_size ||
      api->PJRT_Executable_Fingerprint == nullptr) {
    return std::nullopt;
  }
  auto args = PJRT_ARGS(PJRT_Executable_Fingerprint_Args);
  args.executable = executable;
  PJRT_Error* error = api->PJRT_Executable_Fingerprint(&args);
  if (error != nullptr) {
    IgnoreError(api, error);  // UNIMPLEMENTED on plugins that keep no fingerprint
    return std::nullopt;
  }
  return std::string(args.executable_fingerprint, args.executable_fingerprint_size);
}

Executable::Executable(std::shared_ptr<Client> client, Owned<PJRT_LoadedExecutable> executable)
    : client_(std::move(client)), executable_(std::move(executable)) {
  Owned<PJRT_Executable> view = GetExecutable(client_->api(), executable_.get());
  output_types_ = ReadOutputTypes(client_->api(), view.get());
}

std::string Executable::Serialize() const {
  Owned<PJRT_Executable> view = GetExecutable(client_->api(), executable_.get());
  return SerializeExecutable(client_->api(), view.get());
}

std::optional<std::string> Executable::Fingerprint() const {
  Owned<PJRT_Executable> view = GetExecutable(client_->api(), executable_.get());
  return ExecutableFingerprint(client_->api(), view.get());
}

void Executable::Execute(const std::vector<HostInput>& inputs,
                         const std::vector<HostOutput>& outputs, bool zero_copy) const {
  const PJRT_Api* api = client_->api();
  if (outputs.size() != output_types_.size()) {
    // PJRT writes num_outputs buffers into the list: a short one is written past.
    throw PjrtException(PJRT_Error_Code_INVALID_ARGUMENT,
                        "the program has " + std::to_string(output_types_.size()) +
                            " outputs but " + std::to_string(outputs.size()) +
                            " output buffers were given");
  }
  for (size_t i = 0; i < inputs.size(); ++i) CheckInput(inputs[i], i);

  InputBuffers input_buffers(api);
  std::vector<PJRT_Buffer*> arguments;
  arguments.reserve(inputs.size());
  for (const HostInput& input : inputs) {
    arguments.push_back(input_buffers.FromHost(*client_, input, zero_copy));
  }
  std::vector<Owned<PJRT_Buffer>> output_buffers = ExecuteBuffers(arguments);
  for (size_t i = 0; i < output_buffers.size(); ++i) {
    CopyToHost(api, output_buffers[i].get(), outputs[i], output_types_[i].dims.size(), i);
  }
}

std::vector<Owned<PJRT_Buffer>> Executable::ExecuteBuffers(
    const std::vector<PJRT_Buffer*>& arguments) const {
  const PJRT_Api* api = client_->api();
  std::vector<PJRT_Buffer*> argument_list = arguments;
  PJRT_Buffer* const* argument_lists[] = {argument_list.data()};
  std::vector<PJRT_Buffer*> output_list(output_types_.size(), nullptr);
  PJRT_Buffer** output_lists[] = {output_list.data()};
  PJRT_Event* complete_events[] = {nullptr};

  auto options = PJRT_ARGS(PJRT_ExecuteOptions);
  auto args = PJRT_ARGS(PJRT_LoadedExecutable_Execute_Args);
  args.executable = executable_.get();
  args.options = &options;
  args.argument_lists = argument_lists;
  args.num_devices = 1;
  args.num_args = argument_list.size();
  args.output_lists = output_lists;
  args.device_complete_events = complete_events;
  Check(api, PJRT_FN(api, PJRT_LoadedExecutable_Execute)(&args),
        "PJRT_LoadedExecutable_Execute");

  std::vector<Owned<PJRT_Buffer>> output_buffers;
  output_buffers.reserve(output_list.size());
  for (PJRT_Buffer* buffer : output_list) output_buffers.emplace_back(api, buffer);
  Owned<PJRT_Event> complete(api, complete_events[0]);
  if (complete) AwaitEvent(api, complete.get(), "executing the program");
  return output_buffers;
}

}  // namespace pjrt_pool
