// A PJRT plugin library: dlopen'ed, version-checked and initialized once per
// process, then shared by every client made from it. Plugins are never
// unloaded: their static state (thread pools, registries) outlives any safe
// point for dlclose.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ffi.h"
#include "named_values.h"
#include "pjrt.h"

namespace pjrt_pool {

// What registering an FFI handler found: the XLA FFI versions of the plugin
// and of the handler (unknown when the plugin's XLA does not show its own),
// and whether the handler runs through an adapter (see ffi.h).
struct FfiRegistration {
  std::optional<FfiVersion> plugin;
  std::optional<FfiVersion> handler;
  bool adapted = false;
};

class Plugin {
 public:
  // Loads the plugin at `path`, or returns the one already loaded from it.
  // Throws PluginLoadException when the file cannot be opened, has no
  // GetPjrtApi, or speaks an incompatible major API version.
  static std::shared_ptr<Plugin> Load(const std::string& path);

  const std::string& path() const { return path_; }
  const PJRT_Api* api() const { return api_; }
  int api_major() const { return api_->pjrt_api_version.major_version; }
  int api_minor() const { return api_->pjrt_api_version.minor_version; }
  const std::vector<Attribute>& attributes() const { return attributes_; }

  // Whether the plugin exposes PJRT_Extension_Type_FFI with register_handler.
  bool has_ffi_registration() const { return ffi_ != nullptr; }

  // The XLA FFI API version of the plugin's XLA for `platform` ("Host" for
  // CPU, "CUDA" for NVIDIA GPUs), or nullopt when its registration does not
  // show it. Read once per platform, by registering FfiProbe's handler.
  std::optional<FfiVersion> FfiApiVersion(const std::string& platform) const;

  // The XLA FFI version `handler` reports to this plugin's XLA, or nullopt
  // when the plugin's version is unknown (the handler is then not called).
  std::optional<FfiVersion> HandlerFfiVersion(void* handler, const std::string& platform) const;

  // Registers a typed XLA FFI handler (an XLA_FFI_Handler*) for `target` on
  // `platform`. A handler built for a newer XLA FFI than the plugin's is
  // registered through an adapter when ffi.h's Adaptable allows it and
  // refused with FfiVersionException otherwise: XLA would drop it without a
  // word. A target registered already (on the same platform) with the same
  // handler gets its first registration back, with no call into XLA and no
  // adapter taken; with a different handler it is refused with a
  // PjrtException (ALREADY_EXISTS) naming both, since the plugin's XLA keeps
  // the first handler and reports success for the second.
  FfiRegistration RegisterFfiHandler(const std::string& target, void* handler,
                                     const std::string& platform, uint32_t traits) const;

 private:
  Plugin(std::string path, const PJRT_Api* api);

  // Registers through the FFI extension, checking nothing.
  void RegisterThroughExtension(const std::string& target, void* handler,
                                const std::string& platform, uint32_t traits) const;
  // The plugin's FFI runtime for `platform`, probed on first use.
  const std::optional<FfiRuntime>& Runtime(const std::string& platform) const;

  std::string path_;
  const PJRT_Api* api_;
  std::vector<Attribute> attributes_;
  const FfiExtension* ffi_ = nullptr;
  mutable std::mutex ffi_mutex_;
  mutable std::map<std::string, std::optional<FfiRuntime>> ffi_runtimes_;

  // The handlers this process registered, by (canonical platform, target): the
  // handler's own address (not its adapter's) and what its registration found.
  struct Registered {
    void* handler;
    FfiRegistration registration;
  };
  // Held for a whole registration, so that two threads registering one target
  // cannot both find it free.
  mutable std::mutex registry_mutex_;
  mutable std::map<std::pair<std::string, std::string>, Registered> registered_;
};

}  // namespace pjrt_pool
