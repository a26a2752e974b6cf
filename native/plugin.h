// A PJRT plugin library: dlopen'ed, version-checked and initialized once per
// process, then shared by every client made from it. Plugins are never
// unloaded: their static state (thread pools, registries) outlives any safe
// point for dlclose.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "pjrt.h"

namespace pjrt_pool {

// One key-value pair from PJRT_Plugin_Attributes.
// Also the form of client create options.
struct Attribute {
  using Value = std::variant<std::string, int64_t, std::vector<int64_t>, float, bool>;
  std::string name;
  Value value;
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

  // Registers a typed XLA FFI handler (an XLA_FFI_Handler*) for `target` on
  // `platform` ("Host" for CPU, "CUDA" for NVIDIA GPUs).
  void RegisterFfiHandler(const std::string& target, void* handler,
                          const std::string& platform, uint32_t traits) const;

 private:
  Plugin(std::string path, const PJRT_Api* api);

  std::string path_;
  const PJRT_Api* api_;
  std::vector<Attribute> attributes_;
  const FfiExtension* ffi_ = nullptr;
};

}  // namespace pjrt_pool
