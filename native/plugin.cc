#include "plugin.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

#include "status.h"

namespace pjrt_pool {
namespace {

// Copies the plugin's attributes out of PJRT's NamedValue array; the array
// lives for the process, but owning copies keep the boundary code simple.
std::vector<Attribute> ReadAttributes(const PJRT_Api* api) {
  if (offsetof(PJRT_Api, PJRT_Plugin_Attributes) + sizeof(void*) > api->struct_size ||
      api->PJRT_Plugin_Attributes == nullptr) {
    return {};
  }
  auto args = PJRT_ARGS(PJRT_Plugin_Attributes_Args);
  Check(api, api->PJRT_Plugin_Attributes(&args), "PJRT_Plugin_Attributes");
  return ReadNamedValues(args.attributes, args.num_attributes);
}

const FfiExtension* FindFfiExtension(const PJRT_Api* api) {
  for (const PJRT_Extension_Base* ext = api->extension_start; ext != nullptr;
       ext = ext->next) {
    if (ext->type != PJRT_Extension_Type_FFI) continue;
    // Older FFI extensions end before register_handler.
    if (ext->struct_size < offsetof(FfiExtension, register_handler) + sizeof(void*)) {
      return nullptr;
    }
    auto* ffi = reinterpret_cast<const FfiExtension*>(ext);
    return ffi->register_handler != nullptr ? ffi : nullptr;
  }
  return nullptr;
}

}  // namespace

Plugin::Plugin(std::string path, const PJRT_Api* api)
    : path_(std::move(path)), api_(api), attributes_(ReadAttributes(api)),
      ffi_(FindFfiExtension(api)) {}

std::shared_ptr<Plugin> Plugin::Load(const std::string& path) {
  // One PJRT_Plugin_Initialize per library per process: dlopen of the same
  // file returns the same handle, so loads are memoized by path.
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<Plugin>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(path);
  if (it != loaded.end()) return it->second;

  // RTLD_LOCAL keeps the plugin's copies of LLVM, protobuf and absl apart
  // from any other XLA in the process (jaxlib in the parent).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    throw PluginLoadException("cannot load PJRT plugin " + path + ": " +
                              (reason ? reason : "unknown dlopen error"));
  }
  using GetPjrtApiFn = const PJRT_Api* (*)();
  auto get_api = reinterpret_cast<GetPjrtApiFn>(dlsym(handle, "GetPjrtApi"));
  if (get_api == nullptr) {
    dlclose(handle);
    throw PluginLoadException(path + " is not a PJRT plugin: it exports no GetPjrtApi");
  }
  const PJRT_Api* api = get_api();
  if (api == nullptr) {
    throw PluginLoadException("GetPjrtApi of " + path + " returned no API");
  }
  if (api->pjrt_api_version.major_version != PJRT_API_MAJOR) {
    throw PluginLoadException(
        path + " implements PJRT C API " +
        std::to_string(api->pjrt_api_version.major_version) + "." +
        std::to_string(api->pjrt_api_version.minor_version) +
        " but pjrt-pool speaks major version " + std::to_string(PJRT_API_MAJOR));
  }
  // The calls every session needs must lie inside the plugin's struct.
  if (api->struct_size < PJRT_STRUCT_SIZE(PJRT_Api, PJRT_Executable_OutputDimensions)) {
    throw PluginLoadException(
        path + " has a PJRT_Api too old for pjrt-pool (minor version " +
        std::to_string(api->pjrt_api_version.minor_version) + ")");
  }
  auto init = PJRT_ARGS(PJRT_Plugin_Initialize_Args);
  Check(api, PJRT_FN(api, PJRT_Plugin_Initialize)(&init), "PJRT_Plugin_Initialize");

  std::shared_ptr<Plugin> plugin(new Plugin(path, api));
  loaded.emplace(path, plugin);
  return plugin;
}

void Plugin::RegisterThroughExtension(const std::string& target, void* handler,
                                      const std::string& platform, uint32_t traits) const {
  if (ffi_ == nullptr) {
    throw PjrtException(PJRT_Error_Code_UNIMPLEMENTED,
                        "the PJRT plugin " + path_ +
                            " has no FFI extension with handler registration");
  }
  FfiRegisterHandlerArgs args{};
  args.struct_size = sizeof(FfiRegisterHandlerArgs);
  args.target_name = target.data();
  args.target_name_size = target.size();
  args.handler = handler;
  args.platform_name = platform.data();
  args.platform_name_size = platform.size();
  args.traits = traits;
  Check(api_, ffi_->register_handler(&args), "PJRT_FFI_Register_Handler");
}

const std::optional<FfiRuntime>& Plugin::Runtime(const std::string& platform) const {
  std::lock_guard<std::mutex> lock(ffi_mutex_);
  auto it = ffi_runtimes_.find(platform);
  if (it != ffi_runtimes_.end()) return it->second;
  std::optional<FfiRuntime> runtime;
  if (ffi_ != nullptr) {
    // XLA asks the handler for its metadata inside the registration call,
    // on this thread, passing the runtime's own XLA_FFI_Api.
    FfiProbe probe;
    try {
      RegisterThroughExtension(FfiProbe::kTarget, FfiProbe::Handler(), platform, 0);
      if (probe.known()) runtime = probe.runtime();
    } catch (const PjrtException&) {
      // Unknown then: a registration that fails for the same reason says why itself.
    }
  }
  return ffi_runtimes_.emplace(platform, runtime).first->second;
}

std::optional<FfiVersion> Plugin::FfiApiVersion(const std::string& platform) const {
  const std::optional<FfiRuntime>& runtime = Runtime(platform);
  if (!runtime) return std::nullopt;
  return runtime->version;
}

std::optional<FfiVersion> Plugin::HandlerFfiVersion(void* handler,
                                                    const std::string& platform) const {
  const std::optional<FfiRuntime>& runtime = Runtime(platform);
  if (!runtime) return std::nullopt;
  return HandlerVersion(*runtime, handler);
}

namespace {

// XLA's FFI registry keys handlers by canonical platform name: case aside,
// "cpu" is "host".
std::string CanonicalPlatform(const std::string& platform) {
  std::string lower = platform;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower == "cpu" ? "host" : lower;
}

// A handler's address, with its symbol and library where the dynamic linker knows them.
std::string DescribeHandler(void* handler) {
  std::ostringstream out;
  out << handler;
  Dl_info info{};
  if (dladdr(handler, &info) != 0 && info.dli_fname != nullptr) {
    out << " (";
    if (info.dli_sname != nullptr && info.dli_saddr == handler) out << info.dli_sname << " in ";
    out << info.dli_fname << ")";
  }
  return out.str();
}

}  // namespace

FfiRegistration Plugin::RegisterFfiHandler(const std::string& target, void* handler,
                                           const std::string& platform,
                                           uint32_t traits) const {
  std::lock_guard<std::mutex> lock(registry_mutex_);
  void* const own = handler;  // an adapter may take its place below
  const auto key = std::make_pair(CanonicalPlatform(platform), target);
  auto found = registered_.find(key);
  if (found != registered_.end()) {
    if (found->second.handler == handler) return found->second.registration;
    throw PjrtException(
        PJRT_Error_Code_ALREADY_EXISTS,
        "the FFI target " + target + " is registered already on " + platform + " with the " +
            "handler at " + DescribeHandler(found->second.handler) +
            ": the handler at " + DescribeHandler(handler) + " cannot replace it (the " +
            "plugin's XLA keeps the first handler of a target); register each target once, " +
            "or this handler under another target name");
  }
  FfiRegistration registration;
  const std::optional<FfiRuntime>& runtime = Runtime(platform);
  if (runtime) {
    const FfiVersion plugin = runtime->version;
    const FfiVersion version = HandlerVersion(*runtime, handler);
    registration.plugin = plugin;
    registration.handler = version;
    // XLA takes versions from 0.1 up to its own, of its major version.
    const bool accepted =
        version.major == plugin.major && !(plugin < version) && !(version < FfiVersion{0, 1});
    if (!accepted) {
      if (!Adaptable(plugin, version)) {
        throw FfiVersionException(
            version, plugin,
            "the FFI handler for " + target + " is built for XLA FFI API " + version.str() +
                ", but the XLA of the PJRT plugin " + path_ + " has XLA FFI API " +
                plugin.str() + " and takes handlers of that version or older");
      }
      handler = Adapter(handler, plugin);
      registration.adapted = true;
    }
  }
  RegisterThroughExtension(target, handler, platform, traits);
  registered_.emplace(key, Registered{own, registration});
  return registration;
}

}  // namespace pjrt_pool
