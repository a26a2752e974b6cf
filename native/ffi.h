// XLA FFI versions: what a plugin's XLA accepts, what a handler is built for,
// and adapters for the one step between them known to be safe.
//
// XLA registers an FFI handler only if the handler's XLA FFI API version is no
// newer than its own; a plugin's FFI extension drops a refused registration
// without an error. So before registering, pjrt-pool reads both versions:
// the plugin's by registering a probe handler, which XLA calls in the
// metadata stage with its own XLA_FFI_Api (whose version it reads), and the
// handler's by calling it in the metadata stage the same way XLA does.
#pragma once

#include <cstddef>
#include <string>

#include "status.h"
#include "xla_ffi.h"

namespace pjrt_pool {

struct FfiVersion {
  int major = 0;
  int minor = 0;

  std::string str() const { return std::to_string(major) + "." + std::to_string(minor); }
  bool operator==(const FfiVersion& other) const {
    return major == other.major && minor == other.minor;
  }
  bool operator<(const FfiVersion& other) const {
    return major != other.major ? major < other.major : minor < other.minor;
  }
};

// A plugin's XLA FFI runtime as its registration showed it: its API table and
// the sizes of the metadata call frame it builds, which HandlerVersion copies.
struct FfiRuntime {
  const xla_ffi::Api* api = nullptr;
  FfiVersion version;
  size_t frame_size = 0;
  size_t metadata_extension_size = 0;
  size_t metadata_size = 0;
  size_t api_version_size = 0;
};

// The handler's XLA FFI version is one the plugin's XLA cannot take.
class FfiVersionException : public PjrtException {
 public:
  FfiVersionException(FfiVersion handler, FfiVersion plugin, const std::string& message)
      : PjrtException(PJRT_Error_Code_FAILED_PRECONDITION, message),
        handler_(handler), plugin_(plugin) {}
  FfiVersion handler() const { return handler_; }
  FfiVersion plugin() const { return plugin_; }

 private:
  FfiVersion handler_;
  FfiVersion plugin_;
};

// Records what the probe handler sees while it is registered on this thread.
class FfiProbe {
 public:
  FfiProbe();
  ~FfiProbe();
  FfiProbe(const FfiProbe&) = delete;
  FfiProbe& operator=(const FfiProbe&) = delete;

  // The handler to register (under kProbeTarget) while this object lives.
  static void* Handler();
  static constexpr const char* kTarget = "pjrt_pool_ffi_version_probe";

  // Whether XLA asked the probe for its metadata during the registration.
  bool called() const { return called_; }
  // The runtime it showed; false when it passed no usable XLA_FFI_Api or a
  // call frame larger than this module can build.
  bool known() const { return known_; }
  const FfiRuntime& runtime() const { return runtime_; }

  void Record(xla_ffi::CallFrame* frame, const xla_ffi::MetadataExtension* request);

 private:
  bool called_ = false;
  bool known_ = false;
  FfiRuntime runtime_;
};

// Calls `handler` (an XLA_FFI_Handler*) in the metadata stage with the call
// frame `runtime` builds and returns the version it reports. Throws
// PjrtException with the handler's message when it refuses the call, as it
// would refuse XLA's.
FfiVersion HandlerVersion(const FfiRuntime& runtime, void* handler);

// Whether a handler built for `handler` may run on a runtime of version
// `runtime` through an adapter: true only across minor versions whose
// changes are known to keep older runtimes working (see ffi.cc).
bool Adaptable(FfiVersion runtime, FfiVersion handler);

// An XLA_FFI_Handler that forwards every call to `handler` and reports
// `version` as its own in the metadata stage. The same handler and version
// always get the same adapter, so that registering a handler under several
// targets takes one adapter. (The plugin's XLA keeps the first handler of a
// target and reports success for any other, so Plugin::RegisterFfiHandler
// refuses a second handler for a target before any adapter is taken.)
// Throws PjrtException when every adapter is taken.
void* Adapter(void* handler, FfiVersion version);

}  // namespace pjrt_pool
