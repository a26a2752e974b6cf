#include "device_values.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "buffers.h"

namespace pjrt_pool {

DeviceValue::DeviceValue(std::shared_ptr<Client> client, std::vector<Owned<PJRT_Buffer>> buffers,
                         int element_type, std::vector<int64_t> dims)
    : client_(std::move(client)),
      buffers_(std::move(buffers)),
      element_type_(element_type),
      dims_(std::move(dims)),
      size_(ArrayBytes(element_type_, dims_).value_or(0)) {
  if (buffers_.empty()) throw std::invalid_argument("a device value needs a buffer");
}

std::shared_ptr<DeviceValue> DeviceValue::FromHost(std::shared_ptr<Client> client,
                                                   const HostInput& input) {
  CheckInput(input, 0);
  // Copied during the call (not zero_copy): the caller's memory (a shared-memory
  // segment the parent reuses) may change as soon as this returns.
  std::vector<Owned<PJRT_Buffer>> buffers;
  {
    HostBuffers copied(client->api());  // awaits PJRT's done with the memory as it goes
    copied.Put(client->get(), client->device(), input.data, input.element_type, input.dims,
               /*zero_copy=*/false);
    buffers.push_back(copied.Take(0));
  }
  return std::make_shared<DeviceValue>(std::move(client), std::move(buffers),
                                       input.element_type, input.dims);
}

const void* DeviceValue::HostView() const {
  // A value kept by a run that was not awaited is read only once that run ended.
  AwaitReady(client_->api(), buffer());
  return HostPointer(client_->api(), buffer(), size_, dims_.size());
}

void DeviceValue::ToHost(const HostOutput& output) const {
  if (output.size != size_) {
    throw std::invalid_argument("a value of " + std::to_string(size_) +
                                " bytes cannot be copied into " + std::to_string(output.size));
  }
  AwaitReady(client_->api(), buffer());  // CopyToHost may read the memory itself (CPU)
  CopyToHost(client_->api(), buffer(), output, dims_.size(), 0);
}

std::vector<std::shared_ptr<DeviceValue>> RunToValues(
    const Executable& executable, const std::vector<Argument>& arguments, bool zero_copy,
    bool await_completion, StagedInputs* staged, std::vector<Owned<PJRT_Event>>* run_ends) {
  // Host memory read in place must stay as it is until the run ends: the
  // caller's memory then is read during the call, or staged (a copy this side
  // owns, which may be aliased).
  const bool stage = !await_completion && staged != nullptr;
  const bool stage_zero_copy = zero_copy;
  if (!await_completion) zero_copy = false;
  const std::shared_ptr<Client>& client = executable.client();
  if (executable.devices().size() != 1) {
    throw std::invalid_argument(
        "the program runs over " + std::to_string(executable.devices().size()) +
        " devices: a value holds one device's buffer (run it with its shards)");
  }
  PJRT_Device* device = executable.devices()[0];
  for (size_t i = 0; i < arguments.size(); ++i) {
    const Argument& argument = arguments[i];
    if (argument.value == nullptr) {
      CheckInput(argument.host, i);
    } else if (argument.value->element_type() != argument.host.element_type ||
               argument.value->dims() != argument.host.dims) {
      throw std::invalid_argument("input " + std::to_string(i) +
                                  " is a value of another element type or shape than the "
                                  "program takes there");
    } else if (argument.value->client() != client) {
      throw std::invalid_argument("input " + std::to_string(i) +
                                  " is a value of another client than the program's");
    }
  }
  HostBuffers input_buffers(client->api());  // outlives the run: zero-copy inputs
  std::vector<Owned<PJRT_Buffer>> staged_buffers;  // their memory is staged's to free
  std::vector<PJRT_Buffer*> buffers;
  buffers.reserve(arguments.size());
  for (const Argument& argument : arguments) {
    const HostInput& host = argument.host;
    if (argument.value != nullptr) {
      buffers.push_back(argument.value->buffer());
    } else if (stage && host.size <= StagedInputs::kMaxBytes) {
      staged_buffers.push_back(staged->Put(client, device, host, stage_zero_copy));
      buffers.push_back(staged_buffers.back().get());
    } else {
      buffers.push_back(input_buffers.Put(client->get(), device, host.data, host.element_type,
                                          host.dims, zero_copy));
    }
  }
  std::vector<Owned<PJRT_Buffer>> outputs;
  if (await_completion && run_ends != nullptr) {
    Executable::Launched launched = executable.Launch({buffers}, /*with_ends=*/true);
    outputs = std::move(launched.outputs[0]);
    *run_ends = std::move(launched.ends);
  } else {
    outputs = std::move(executable.ExecuteOnDevices({buffers}, await_completion)[0]);
  }
  const std::vector<OutputType>& types = executable.output_types();
  std::vector<std::shared_ptr<DeviceValue>> values;
  values.reserve(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::vector<Owned<PJRT_Buffer>> one;
    one.push_back(std::move(outputs[i]));
    values.push_back(std::make_shared<DeviceValue>(client, std::move(one),
                                                   types[i].element_type, types[i].dims));
  }
  return values;
}

}  // namespace pjrt_pool
