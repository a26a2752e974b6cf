// Compiling without a device: a PJRT_TopologyDescription names the devices a
// program is for (libtpu makes one from a name such as "v5e:2x2" on a machine
// with no TPU), PJRT_Compile compiles for it with no client, and the
// unloaded executable it returns serializes into the bytes a client on
// matching devices loads (Client::Deserialize).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "client.h"
#include "owners.h"
#include "plugin.h"

namespace pjrt_pool {

class UnloadedExecutable;

// One device of a topology, as its PJRT_DeviceDescription says.
struct DeviceDescription {
  int id = 0;
  int process_index = 0;
  std::string kind;
  std::vector<Attribute> attributes;
};

class Topology : public std::enable_shared_from_this<Topology> {
 public:
  // Creates the topology `name` with plugin-specific `options` (for libtpu,
  // chips_per_host_bounds and the like). No device is opened.
  static std::shared_ptr<Topology> Create(std::shared_ptr<Plugin> plugin, const std::string& name,
                                          const std::vector<Attribute>& options);
  // Rebuilds a topology from what Serialize wrote, with the same plugin build.
  static std::shared_ptr<Topology> Deserialize(std::shared_ptr<Plugin> plugin,
                                               std::string_view serialized);
  // The topology of a client's devices; it lives as long as the client, which
  // the returned object keeps alive.
  static std::shared_ptr<Topology> OfClient(std::shared_ptr<Client> client);

  const std::shared_ptr<Plugin>& plugin() const { return plugin_; }
  const std::string& platform_name() const { return platform_name_; }
  const std::string& platform_version() const { return platform_version_; }
  const std::vector<DeviceDescription>& devices() const { return devices_; }
  const std::vector<Attribute>& attributes() const { return attributes_; }

  // The plugin's serialized form (what it says is for cache keys).
  std::string Serialize() const;

  // Compiles MLIR bytecode with a serialized CompileOptionsProto for this
  // topology, without a client. Blocks; call without the GIL.
  std::shared_ptr<UnloadedExecutable> Compile(std::string_view code,
                                              std::string_view compile_options) const;

 private:
  explicit Topology(std::shared_ptr<Plugin> plugin) : plugin_(std::move(plugin)) {}
  PJRT_TopologyDescription* get() const { return owned_ ? owned_.get() : borrowed_; }
  // Owns a description the plugin made (Create, Deserialize) and reads it (Describe).
  void Adopt(PJRT_TopologyDescription* made);
  // Reads the names, devices and attributes once the description is set.
  void Describe();

  std::shared_ptr<Plugin> plugin_;
  Owned<PJRT_TopologyDescription> owned_;   // made here: destroyed here
  PJRT_TopologyDescription* borrowed_ = nullptr;  // a client's: owned by client_
  std::shared_ptr<Client> client_;
  std::string platform_name_;
  std::string platform_version_;
  std::vector<DeviceDescription> devices_;
  std::vector<Attribute> attributes_;
};

// What PJRT_Compile returns for a topology: compiled, not loaded on any
// device. It serializes; a client on matching devices loads the bytes.
class UnloadedExecutable {
 public:
  UnloadedExecutable(std::shared_ptr<const Topology> topology, Owned<PJRT_Executable> executable);

  const std::vector<OutputType>& output_types() const { return output_types_; }
  size_t num_outputs() const { return output_types_.size(); }

  // The plugin's serialized form, exactly as PJRT_Executable_Serialize gives it.
  std::string Serialize() const;
  std::optional<std::string> Fingerprint() const;

 private:
  std::shared_ptr<const Topology> topology_;
  Owned<PJRT_Executable> executable_;
  std::vector<OutputType> output_types_;
};

}  // namespace pjrt_pool
