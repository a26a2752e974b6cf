#include "topology.h"

#include <utility>

namespace pjrt_pool {
namespace {

DeviceDescription Describe(const PJRT_Api* api, PJRT_DeviceDescription* description) {
  DeviceDescription device;
  auto id = PJRT_ARGS(PJRT_DeviceDescription_Id_Args);
  id.device_description = description;
  Check(api, PJRT_FN(api, PJRT_DeviceDescription_Id)(&id), "PJRT_DeviceDescription_Id");
  device.id = id.id;
  auto process = PJRT_ARGS(PJRT_DeviceDescription_ProcessIndex_Args);
  process.device_description = description;
  Check(api, PJRT_FN(api, PJRT_DeviceDescription_ProcessIndex)(&process),
        "PJRT_DeviceDescription_ProcessIndex");
  device.process_index = process.process_index;
  auto kind = PJRT_ARGS(PJRT_DeviceDescription_Kind_Args);
  kind.device_description = description;
  Check(api, PJRT_FN(api, PJRT_DeviceDescription_Kind)(&kind), "PJRT_DeviceDescription_Kind");
  device.kind.assign(kind.device_kind, kind.device_kind_size);
  auto attributes = PJRT_ARGS(PJRT_DeviceDescription_Attributes_Args);
  attributes.device_description = description;
  Check(api, PJRT_FN(api, PJRT_DeviceDescription_Attributes)(&attributes),
        "PJRT_DeviceDescription_Attributes");
  device.attributes = ReadNamedValues(attributes.attributes, attributes.num_attributes);
  return device;
}

}  // namespace

std::shared_ptr<Topology> Topology::Create(std::shared_ptr<Plugin> plugin,
                                           const std::string& name,
                                           const std::vector<Attribute>& options) {
  const PJRT_Api* api = plugin->api();
  std::shared_ptr<Topology> topology(new Topology(std::move(plugin)));
  std::vector<PJRT_NamedValue> named_values = NamedValues(options);
  auto args = PJRT_ARGS(PJRT_TopologyDescription_Create_Args);
  args.topology_name = name.data();
  args.topology_name_size = name.size();
  SetCreateOptions(args, named_values);
  Check(api, PJRT_FN(api, PJRT_TopologyDescription_Create)(&args),
        "PJRT_TopologyDescription_Create");
  topology->Adopt(args.topology);
  return topology;
}

std::shared_ptr<Topology> Topology::Deserialize(std::shared_ptr<Plugin> plugin,
                                                std::string_view serialized) {
  const PJRT_Api* api = plugin->api();
  std::shared_ptr<Topology> topology(new Topology(std::move(plugin)));
  auto args = PJRT_ARGS(PJRT_TopologyDescription_Deserialize_Args);
  args.serialized_topology = serialized.data();
  args.serialized_topology_size = serialized.size();
  Check(api, PJRT_FN(api, PJRT_TopologyDescription_Deserialize)(&args),
        "PJRT_TopologyDescription_Deserialize");
  topology->Adopt(args.topology);
  return topology;
}

std::shared_ptr<Topology> Topology::OfClient(std::shared_ptr<Client> client) {
  const PJRT_Api* api = client->api();
  std::shared_ptr<Topology> topology(new Topology(client->plugin()));
  auto args = PJRT_ARGS(PJRT_Client_TopologyDescription_Args);
  args.client = client->get();
  Check(api, PJRT_FN(api, PJRT_Client_TopologyDescription)(&args),
        "PJRT_Client_TopologyDescription");
  topology->borrowed_ = args.topology;
  topology->client_ = std::move(client);
  topology->Describe();
  return topology;
}

void Topology::Adopt(PJRT_TopologyDescription* made) {
  owned_ = Owned<PJRT_TopologyDescription>(plugin_->api(), made);
  Describe();
}

void Topology::Describe() {
  const PJRT_Api* api = plugin_->api();
  auto name = PJRT_ARGS(PJRT_TopologyDescription_PlatformName_Args);
  name.topology = get();
  Check(api, PJRT_FN(api, PJRT_TopologyDescription_PlatformName)(&name),
        "PJRT_TopologyDescription_PlatformName");
  platform_name_.assign(name.platform_name, name.platform_name_size);

  auto version = PJRT_ARGS(PJRT_TopologyDescription_PlatformVersion_Args);
  version.topology = get();
  Check(api, PJRT_FN(api, PJRT_TopologyDescription_PlatformVersion)(&version),
        "PJRT_TopologyDescription_PlatformVersion");
  platform_version_.assign(version.platform_version, version.platform_version_size);

  auto descriptions = PJRT_ARGS(PJRT_TopologyDescription_GetDeviceDescriptions_Args);
  descriptions.topology = get();
  Check(api, PJRT_FN(api, PJRT_TopologyDescription_GetDeviceDescriptions)(&descriptions),
        "PJRT_TopologyDescription_GetDeviceDescriptions");
  for (size_t i = 0; i < descriptions.num_descriptions; ++i) {
    devices_.push_back(pjrt_pool::Describe(api, descriptions.descriptions[i]));
  }

  auto attributes = PJRT_ARGS(PJRT_TopologyDescription_Attributes_Args);
  attributes.topology = get();
  PJRT_Error* error = PJRT_FN(api, PJRT_TopologyDescription_Attributes)(&attributes);
  if (error == nullptr) {
    attributes_ = ReadNamedValues(attributes.attributes, attributes.num_attributes);
  } else {
    IgnoreError(api, error);  // optional: a topology may keep no attributes
  }
}

std::string Topology::Serialize() const {
  const PJRT_Api* api = plugin_->api();
  auto args = PJRT_ARGS(PJRT_TopologyDescription_Serialize_Args);
  args.topology = get();
  Check(api, PJRT_FN(api, PJRT_TopologyDescription_Serialize)(&args),
        "PJRT_TopologyDescription_Serialize");
  return CopySerialized(args.serialized_bytes, args.serialized_bytes_size,
                        args.serialized_topology, args.serialized_topology_deleter);
}

std::shared_ptr<UnloadedExecutable> Topology::Compile(std::string_view code,
                                                      std::string_view compile_options) const {
  const PJRT_Api* api = plugin_->api();
  static const char kFormat[] = "mlir";
  auto program = PJRT_ARGS(PJRT_Program);
  program.code = const_cast<char*>(code.data());  // PJRT does not write through it
  program.code_size = code.size();
  program.format = kFormat;
  program.format_size = sizeof(kFormat) - 1;

  auto args = PJRT_ARGS(PJRT_Compile_Args);
  args.topology = get();
  args.program = &program;
  args.compile_options = compile_options.data();
  args.compile_options_size = compile_options.size();
  args.client = nullptr;  // deviceless: the topology alone says what to compile for
  Check(api, PJRT_FN(api, PJRT_Compile)(&args), "PJRT_Compile");
  return std::make_shared<UnloadedExecutable>(shared_from_this(),
                                              Owned<PJRT_Executable>(api, args.executable));
}

UnloadedExecutable::UnloadedExecutable(std::shared_ptr<const Topology> topology,
                                       Owned<PJRT_Executable> executable)
    : topology_(std::move(topology)), executable_(std::move(executable)) {
  output_types_ = ReadOutputTypes(topology_->plugin()->api(), executable_.get());
}

std::string UnloadedExecutable::Serialize() const {
  return SerializeExecutable(topology_->plugin()->api(), executable_.get());
}

std::optional<std::string> UnloadedExecutable::Fingerprint() const {
  return ExecutableFingerprint(topology_->plugin()->api(), executable_.get());
}

}  // namespace pjrt_pool
