#include "client.h"

#include <string>
#include <utility>

namespace pjrt_pool {

std::shared_ptr<Client> Client::Create(std::shared_ptr<Plugin> plugin,
                                       const std::vector<Attribute>& options) {
  const PJRT_Api* api = plugin->api();
  std::shared_ptr<Client> client(new Client(std::move(plugin)));

  std::vector<PJRT_NamedValue> named_values = NamedValues(options);
  auto create = PJRT_ARGS(PJRT_Client_Create_Args);
  SetCreateOptions(create, named_values);
  Check(api, PJRT_FN(api, PJRT_Client_Create)(&create), "PJRT_Client_Create");
  client->client_ = Owned<PJRT_Client>(api, create.client);

  auto name = PJRT_ARGS(PJRT_Client_PlatformName_Args);
  name.client = create.client;
  Check(api, PJRT_FN(api, PJRT_Client_PlatformName)(&name), "PJRT_Client_PlatformName");
  client->platform_name_.assign(name.platform_name, name.platform_name_size);

  auto version = PJRT_ARGS(PJRT_Client_PlatformVersion_Args);
  version.client = create.client;
  Check(api, PJRT_FN(api, PJRT_Client_PlatformVersion)(&version),
        "PJRT_Client_PlatformVersion");
  client->platform_version_.assign(version.platform_version, version.platform_version_size);

  auto devices = PJRT_ARGS(PJRT_Client_AddressableDevices_Args);
  devices.client = create.client;
  Check(api, PJRT_FN(api, PJRT_Client_AddressableDevices)(&devices),
        "PJRT_Client_AddressableDevices");
  if (devices.num_addressable_devices == 0) {
    throw PjrtException(PJRT_Error_Code_UNAVAILABLE,
                        "the PJRT plugin " + client->plugin_->path() +
                            " found no addressable device");
  }
  client->devices_.assign(devices.addressable_devices,
                          devices.addressable_devices + devices.num_addressable_devices);
  for (PJRT_Device* device : client->devices_) client->device_ids_.push_back(DeviceId(api, device));
  client->device_ = devices.addressable_devices[0];

  auto description = PJRT_ARGS(PJRT_Device_GetDescription_Args);
  description.device = client->device_;
  Check(api, PJRT_FN(api, PJRT_Device_GetDescription)(&description),
        "PJRT_Device_GetDescription");
  auto kind = PJRT_ARGS(PJRT_DeviceDescription_Kind_Args);
  kind.device_description = description.device_description;
  Check(api, PJRT_FN(api, PJRT_DeviceDescription_Kind)(&kind),
        "PJRT_DeviceDescription_Kind");
  client->device_kind_.assign(kind.device_kind, kind.device_kind_size);
  return client;
}

int DeviceId(const PJRT_Api* api, PJRT_Device* device) {
  auto description = PJRT_ARGS(PJRT_Device_GetDescription_Args);
  description.device = device;
  Check(api, PJRT_FN(api, PJRT_Device_GetDescription)(&description),
        "PJRT_Device_GetDescription");
  auto id = PJRT_ARGS(PJRT_DeviceDescription_Id_Args);
  id.device_description = description.device_description;
  Check(api, PJRT_FN(api, PJRT_DeviceDescription_Id)(&id), "PJRT_DeviceDescription_Id");
  return id.id;
}

std::shared_ptr<Executable> Client::Compile(std::string_view code,
                                            std::string_view compile_options) {
  const PJRT_Api* api = this->api();
  static const char kFormat[] = "mlir";
  auto program = PJRT_ARGS(PJRT_Program);
  // PJRT takes a non-const pointer but does not write through it.
  program.code = const_cast<char*>(code.data());
  program.code_size = code.size();
  program.format = kFormat;
  program.format_size = sizeof(kFormat) - 1;

  auto args = PJRT_ARGS(PJRT_Client_Compile_Args);
  args.client = client_.get();
  args.program = &program;
  args.compile_options = compile_options.data();
  args.compile_options_size = compile_options.size();
  Check(api, PJRT_FN(api, PJRT_Client_Compile)(&args), "PJRT_Client_Compile");
  return std::make_shared<Executable>(shared_from_this(),
                                      Owned<PJRT_LoadedExecutable>(api, args.executable));
}

std::shared_ptr<Executable> Client::Deserialize(std::string_view serialized) {
  const PJRT_Api* api = this->api();
  auto args = PJRT_ARGS(PJRT_Executable_DeserializeAndLoad_Args);
  args.client = client_.get();
  args.serialized_executable = serialized.data();
  args.serialized_executable_size = serialized.size();
  Check(api, PJRT_FN(api, PJRT_Executable_DeserializeAndLoad)(&args),
        "PJRT_Executable_DeserializeAndLoad");
  return std::make_shared<Executable>(
      shared_from_this(), Owned<PJRT_LoadedExecutable>(api, args.loaded_executable));
}

}  // namespace pjrt_pool
