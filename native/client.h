// A PJRT client on one plugin, and the executables it compiles or loads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "owners.h"
#include "plugin.h"
#include "shards.h"

namespace pjrt_pool {

class Executable;

class Client : public std::enable_shared_from_this<Client> {
 public:
  // Creates a client with the plugin-specific `options` (PJRT_NamedValues).
  // A program of one device runs on the first addressable device; a program
  // over several (SPMD) on those its device assignment names.
  static std::shared_ptr<Client> Create(std::shared_ptr<Plugin> plugin,
                                        const std::vector<Attribute>& options);

  const std::shared_ptr<Plugin>& plugin() const { return plugin_; }
  const PJRT_Api* api() const { return plugin_->api(); }
  PJRT_Client* get() const { return client_.get(); }
  PJRT_Device* device() const { return device_; }
  const std::string& platform_name() const { return platform_name_; }
  const std::string& platform_version() const { return platform_version_; }
  const std::string& device_kind() const { return device_kind_; }
  size_t num_devices() const { return devices_.size(); }
  // The addressable devices, in the plugin's order, and their ids (PJRT_DeviceDescription_Id).
  const std::vector<PJRT_Device*>& devices() const { return devices_; }
  const std::vector<int>& device_ids() const { return device_ids_; }

  // Compiles MLIR bytecode with a serialized CompileOptionsProto. Blocks; call
  // without the GIL.
  std::shared_ptr<Executable> Compile(std::string_view code,
                                      std::string_view compile_options);

  // Loads what Executable::Serialize (or UnloadedExecutable::Serialize, for a
  // topology this client's devices match) wrote with the same plugin build.
  std::shared_ptr<Executable> Deserialize(std::string_view serialized);

 private:
  explicit Client(std::shared_ptr<Plugin> plugin) : plugin_(std::move(plugin)) {}

  std::shared_ptr<Plugin> plugin_;
  Owned<PJRT_Client> client_;
  PJRT_Device* device_ = nullptr;  // owned by client_
  std::vector<PJRT_Device*> devices_;  // owned by client_
  std::vector<int> device_ids_;
  std::string platform_name_;
  std::string platform_version_;
  std::string device_kind_;
};

// The element type and dimensions of one program output.
struct OutputType {
  int element_type;  // PJRT_Buffer_Type
  std::vector<int64_t> dims;
};

// Queries that loaded and unloaded (deviceless) executables share, on the
// PJRT_Executable view of either.
std::vector<OutputType> ReadOutputTypes(const PJRT_Api* api, PJRT_Executable* executable);
// The plugin's serialized form, exactly as PJRT_Executable_Serialize gives it.
std::string SerializeExecutable(const PJRT_Api* api, PJRT_Executable* executable);
// The plugin's fingerprint of the executable (equal for equal compiles), or
// nullopt where the plugin does not implement it.
std::optional<std::string> ExecutableFingerprint(const PJRT_Api* api,
                                                 PJRT_Executable* executable);

// The id (PJRT_DeviceDescription_Id) of a device.
int DeviceId(const PJRT_Api* api, PJRT_Device* device);

// Bytes per element of a PJRT_Buffer_Type with a byte-sized host layout; 0 for
// any other code (INVALID, TOKEN, packed sub-byte types, unknown codes).
size_t ElementSize(int element_type);

// Bytes of a dense array of `element_type` with `dims`; nullopt for an
// element type ElementSize does not know, a negative dim or an overflow.
std::optional<size_t> ArrayBytes(int element_type, const std::vector<int64_t>& dims);

// One argument in host memory: dense, row-major.
struct HostInput {
  const void* data;
  size_t size;  // bytes
  int element_type;  // PJRT_Buffer_Type
  std::vector<int64_t> dims;
};

// Host memory that receives one output.
struct HostOutput {
  void* data;
  size_t size;  // bytes
};

class Executable {
 public:
  Executable(std::shared_ptr<Client> client, Owned<PJRT_LoadedExecutable> executable);

  // The type of each output on one device: for a program over several
  // devices, one device's block of it.
  const std::vector<OutputType>& output_types() const { return output_types_; }
  size_t num_outputs() const { return output_types_.size(); }
  const std::shared_ptr<Client>& client() const { return client_; }
  // The devices the executable runs on, in the order PJRT takes their
  // argument lists, and their ids.
  const std::vector<PJRT_Device*>& devices() const { return devices_; }
  const std::vector<int>& device_ids() const { return device_ids_; }

  // The plugin's serialized form of this executable.
  std::string Serialize() const;
  // The plugin's fingerprint (see ExecutableFingerprint).
  std::optional<std::string> Fingerprint() const;

  // Runs once on the executable's device. Inputs 64-byte aligned are handed
  // to PJRT without copying when `zero_copy` is set; each output is copied
  // into the matching HostOutput, whose size must be the output's exact size.
  // Throws std::invalid_argument, before any PJRT call, for an input whose
  // element type is not known or whose size is not dims x element size.
  // Blocks until the outputs are written; call without the GIL.
  void Execute(const std::vector<HostInput>& inputs,
               const std::vector<HostOutput>& outputs, bool zero_copy) const;

  // Runs once over every device of the executable, argument_lists[d] being
  // device d's buffers (in devices() order), and, where `await_completion`,
  // waits until every device is done. Returns each device's output buffers,
  // owned. Without waiting (as jax.jit dispatches), the outputs become ready
  // when the run ends, a later run that takes them waits for them on the
  // device, and a failure of the run is the error of whatever reads them
  // (AwaitReady); the argument buffers may be destroyed at once, since PJRT
  // frees a buffer's memory only once the runs that use it have ended.
  std::vector<std::vector<Owned<PJRT_Buffer>>> ExecuteOnDevices(
      const std::vector<std::vector<PJRT_Buffer*>>& argument_lists,
      bool await_completion = true) const;

  // A run dispatched and not awaited: each device's output buffers and, when
  // asked for, each device's completion event (else empty owners).
  struct Launched {
    std::vector<std::vector<Owned<PJRT_Buffer>>> outputs;
    std::vector<Owned<PJRT_Event>> ends;
  };
  // Dispatches a run as ExecuteOnDevices does and returns at once; the caller
  // awaits the ends (or reads the outputs, which wait for the run) before the
  // host memory the run reads in place may change.
  Launched Launch(const std::vector<std::vector<PJRT_Buffer*>>& argument_lists,
                  bool with_ends) const;

  // Says how a program over several devices splits its global inputs and
  // outputs: `device_ids` are the program's devices in its device assignment's
  // order, and each array's shards are in that order too (they are put in
  // devices() order here). Throws std::invalid_argument for a plan that does
  // not fit the executable. Call once, before the first ExecuteSharded.
  void SetShards(const std::vector<int>& device_ids, ShardPlan plan);
  bool sharded() const { return shards_ != nullptr; }

  // Runs a program over several devices on global arrays: each input's
  // blocks go to their devices (read in place, with the array's strides, or
  // aliased when contiguous, aligned and zero_copy is set), the program runs
  // once over all devices, and the first copy of each output block is
  // written into its place in the global output (a replicated output is
  // copied once). Throws std::invalid_argument, before any PJRT call, for
  // arrays that do not fit the plan. Blocks; call without the GIL.
  void ExecuteSharded(const std::vector<HostInput>& inputs,
                      const std::vector<HostOutput>& outputs, bool zero_copy) const;

 private:
  std::shared_ptr<Client> client_;
  Owned<PJRT_LoadedExecutable> executable_;
  std::vector<OutputType> output_types_;
  std::vector<PJRT_Device*> devices_;  // owned by the client
  std::vector<int> device_ids_;
  std::shared_ptr<const ShardPlan> shards_;  // set once, before runs
};

}  // namespace pjrt_pool
