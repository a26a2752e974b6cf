#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "buffers.h"
#include "client.h"

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


}  // namespace

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
  return CopySerialized(args.serialized_bytes, args.serialized_bytes_size,
                        args.serialized_executable, args.serialized_executable_deleter);
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
  const PJRT_Api* api = client_->api();
  Owned<PJRT_Executable> view = GetExecutable(api, executable_.get());
  output_types_ = ReadOutputTypes(api, view.get());
  auto devices = PJRT_ARGS(PJRT_LoadedExecutable_AddressableDevices_Args);
  devices.executable = executable_.get();
  Check(api, PJRT_FN(api, PJRT_LoadedExecutable_AddressableDevices)(&devices),
        "PJRT_LoadedExecutable_AddressableDevices");
  devices_.assign(devices.addressable_devices,
                  devices.addressable_devices + devices.num_addressable_devices);
  for (PJRT_Device* device : devices_) device_ids_.push_back(DeviceId(api, device));
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
  if (devices_.size() != 1) {
    throw std::invalid_argument("the program runs over " + std::to_string(devices_.size()) +
                                " devices: run it with its shards (ExecuteSharded)");
  }
  for (size_t i = 0; i < inputs.size(); ++i) CheckInput(inputs[i], i);

  HostBuffers input_buffers(api);
  for (const HostInput& input : inputs) {
    input_buffers.Put(client_->get(), devices_[0], input.data, input.element_type, input.dims,
                      zero_copy);
  }
  Launched launched = Launch({input_buffers.raw()}, /*with_ends=*/true);
  std::vector<OutputCopy> copies;
  copies.reserve(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    copies.push_back({launched.outputs[0][i].get(), outputs[i], output_types_[i].dims.size(), i});
  }
  // The inputs' buffers (input_buffers) outlive the run: it may read them in place.
  CopyOutputsToHost(api, copies, launched.ends);
}

std::vector<std::vector<Owned<PJRT_Buffer>>> Executable::ExecuteOnDevices(
    const std::vector<std::vector<PJRT_Buffer*>>& argument_lists, bool await_completion) const {
  Launched launched = Launch(argument_lists, await_completion);
  for (const Owned<PJRT_Event>& end : launched.ends) {
    if (end) AwaitEvent(client_->api(), end.get(), "executing the program");
  }
  return std::move(launched.outputs);
}

Executable::Launched Executable::Launch(
    const std::vector<std::vector<PJRT_Buffer*>>& argument_lists, bool with_ends) const {
  const PJRT_Api* api = client_->api();
  const size_t count = argument_lists.size();
  if (count != devices_.size()) {
    throw std::invalid_argument("the program runs on " + std::to_string(devices_.size()) +
                                " devices, not " + std::to_string(count));
  }
  const size_t num_args = count == 0 ? 0 : argument_lists[0].size();
  std::vector<PJRT_Buffer* const*> arguments(count);
  std::vector<std::vector<PJRT_Buffer*>> output_lists(
      count, std::vector<PJRT_Buffer*>(output_types_.size(), nullptr));
  std::vector<PJRT_Buffer**> outputs(count);
  std::vector<PJRT_Event*> complete_events(count, nullptr);
  for (size_t d = 0; d < count; ++d) {
    if (argument_lists[d].size() != num_args) {
      throw std::invalid_argument("every device needs the same number of arguments");
    }
    arguments[d] = argument_lists[d].data();
    outputs[d] = output_lists[d].data();
  }

  auto options = PJRT_ARGS(PJRT_ExecuteOptions);
  auto args = PJRT_ARGS(PJRT_LoadedExecutable_Execute_Args);
  args.executable = executable_.get();
  args.options = &options;
  args.argument_lists = arguments.data();
  args.num_devices = count;
  args.num_args = num_args;
  args.output_lists = outputs.data();
  args.device_complete_events = with_ends ? complete_events.data() : nullptr;
  Check(api, PJRT_FN(api, PJRT_LoadedExecutable_Execute)(&args),
        "PJRT_LoadedExecutable_Execute");

  // Own every buffer and event at once: whatever the caller does next may throw.
  Launched launched;
  launched.outputs.resize(count);
  launched.ends.reserve(count);
  for (size_t d = 0; d < count; ++d) {
    launched.outputs[d].reserve(output_lists[d].size());
    for (PJRT_Buffer* buffer : output_lists[d]) launched.outputs[d].emplace_back(api, buffer);
    launched.ends.emplace_back(api, complete_events[d]);
  }
  return launched;
}

}  // namespace pjrt_pool
