#include "ffi.h"

#include <array>
#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace pjrt_pool {
namespace {

using xla_ffi::CallFrame;
using xla_ffi::Error;
using xla_ffi::MetadataExtension;

// Zeroed room for a call frame, metadata extension and metadata up to the
// sizes a runtime may state: members past the ones declared in xla_ffi.h are
// left zero, as a runtime that knows them would leave them unset in a metadata
// request.
constexpr size_t kRoom = 128;
struct FrameStorage {
  CallFrame frame;
  char tail[kRoom];
};
struct ExtensionStorage {
  MetadataExtension extension;
  char tail[kRoom];
};

thread_local FfiProbe* t_probe = nullptr;

bool UsableApi(const xla_ffi::Api* api) {
  return api != nullptr &&
         api->struct_size >= offsetof(xla_ffi::Api, error_destroy) + sizeof(void*) &&
         api->api_version.struct_size >= xla_ffi::kApiVersionSize &&
         api->error_create != nullptr && api->error_message != nullptr &&
         api->error_destroy != nullptr;
}

// The probe: tells the probe on this thread what XLA showed it, and reports the
// runtime's own version, so that it is accepted and XLA logs nothing. It is
// never called to run (no program names its target), and refuses if it is.
Error* ProbeHandler(CallFrame* frame) {
  MetadataExtension* request = xla_ffi::MetadataRequest(frame);
  if (request == nullptr) {
    return UsableApi(frame->api)
               ? xla_ffi::MakeError(frame->api, xla_ffi::kInvalidArgument,
                                    "pjrt_pool_ffi_version_probe is pjrt-pool's probe of "
                                    "the plugin's XLA FFI version, not a kernel")
               : nullptr;
  }
  if (t_probe != nullptr) t_probe->Record(frame, request);
  xla_ffi::Metadata* metadata = request->metadata;
  if (metadata != nullptr && metadata->struct_size >= xla_ffi::kMetadataSize) {
    const bool usable = UsableApi(frame->api);
    metadata->api_version.major_version =
        usable ? frame->api->api_version.major_version : xla_ffi::kMajor;
    metadata->api_version.minor_version =
        usable ? frame->api->api_version.minor_version : xla_ffi::kMinor;
    metadata->traits = 0;
  }
  return nullptr;
}

// Takes the message out of an error `runtime` created, and destroys it.
std::string TakeMessage(const FfiRuntime& runtime, Error* error) {
  xla_ffi::ErrorMessageArgs args{};
  // 0.4 turned GetMessage into GetDetails, whose arguments also return the code.
  args.struct_size = runtime.version < FfiVersion{0, 4} ? xla_ffi::kErrorMessageArgsSize
                                                        : xla_ffi::kErrorDetailsArgsSize;
  args.error = error;
  runtime.api->error_message(&args);
  std::string message = args.message != nullptr ? args.message : "(no message)";
  xla_ffi::ErrorDestroyArgs destroy{};
  destroy.struct_size = xla_ffi::kErrorDestroyArgsSize;
  destroy.error = error;
  runtime.api->error_destroy(&destroy);
  return message;
}

// Adapters: a fixed table of functions, each forwarding to the handler in its
// slot (an XLA_FFI_Handler has no user data, so each wrapped handler needs a
// function of its own). Slots are written once, under g_adapters_mutex,
// before their function is handed out.
constexpr size_t kAdapters = 512;

struct AdapterSlot {
  std::atomic<xla_ffi::Handler*> handler{nullptr};
  std::atomic<int> major{0};
  std::atomic<int> minor{0};
};

AdapterSlot g_slots[kAdapters];
std::mutex g_adapters_mutex;
std::map<std::pair<void*, std::pair<int, int>>, size_t> g_adapter_of;

Error* Forward(const AdapterSlot& slot, CallFrame* frame) {
  Error* error = slot.handler.load(std::memory_order_acquire)(frame);
  MetadataExtension* request = xla_ffi::MetadataRequest(frame);
  if (error == nullptr && request != nullptr && request->metadata != nullptr &&
      request->metadata->struct_size >= xla_ffi::kMetadataSize) {
    request->metadata->api_version.major_version = slot.major.load(std::memory_order_relaxed);
    request->metadata->api_version.minor_version = slot.minor.load(std::memory_order_relaxed);
  }
  return error;
}

template <size_t I>
Error* Adapt(CallFrame* frame) {
  return Forward(g_slots[I], frame);
}

template <size_t... I>
constexpr std::array<xla_ffi::Handler*, sizeof...(I)> AdapterTable(std::index_sequence<I...>) {
  return {&Adapt<I>...};
}

constexpr std::array<xla_ffi::Handler*, kAdapters> kAdapterTable =
    AdapterTable(std::make_index_sequence<kAdapters>{});

}  // namespace

FfiProbe::FfiProbe() { t_probe = this; }
FfiProbe::~FfiProbe() { t_probe = nullptr; }

void* FfiProbe::Handler() { return reinterpret_cast<void*>(&ProbeHandler); }

void FfiProbe::Record(CallFrame* frame, const MetadataExtension* request) {
  called_ = true;
  const xla_ffi::Metadata* metadata = request->metadata;
  if (!UsableApi(frame->api) || metadata == nullptr ||
      frame->struct_size < xla_ffi::kCallFrameSize || frame->struct_size > sizeof(FrameStorage) ||
      request->extension_base.struct_size > sizeof(ExtensionStorage) ||
      metadata->struct_size < xla_ffi::kMetadataSize ||
      metadata->struct_size > sizeof(xla_ffi::Metadata)) {
    return;
  }
  known_ = true;
  runtime_.api = frame->api;
  runtime_.version = {frame->api->api_version.major_version,
                      frame->api->api_version.minor_version};
  runtime_.frame_size = frame->struct_size;
  runtime_.metadata_extension_size = request->extension_base.struct_size;
  runtime_.metadata_size = metadata->struct_size;
  runtime_.api_version_size = metadata->api_version.struct_size;
}

FfiVersion HandlerVersion(const FfiRuntime& runtime, void* handler) {
  xla_ffi::Metadata metadata{};
  metadata.struct_size = runtime.metadata_size;
  metadata.api_version.struct_size = runtime.api_version_size;
  ExtensionStorage extension{};
  extension.extension.extension_base.struct_size = runtime.metadata_extension_size;
  extension.extension.extension_base.type = xla_ffi::kMetadataExtension;
  extension.extension.metadata = &metadata;
  FrameStorage storage{};
  CallFrame& frame = storage.frame;
  frame.struct_size = runtime.frame_size;
  frame.extension_start = &extension.extension.extension_base;
  frame.api = runtime.api;
  frame.stage = xla_ffi::kExecute;
  frame.args.struct_size = xla_ffi::kArgsSize;
  frame.rets.struct_size = xla_ffi::kArgsSize;
  frame.attrs.struct_size = xla_ffi::kAttrsSize;
  Error* error = nullptr;
  try {
    error = reinterpret_cast<xla_ffi::Handler*>(handler)(&frame);
  } catch (const std::exception& e) {  // a handler in C++ that throws, as XLA guards against
    throw PjrtException(PJRT_Error_Code_INTERNAL,
                        std::string("the FFI handler threw when asked for its version: ") +
                            e.what());
  }
  if (error != nullptr) {
    throw PjrtException(PJRT_Error_Code_FAILED_PRECONDITION,
                        "the FFI handler did not report its XLA FFI version: " +
                            TakeMessage(runtime, error));
  }
  return {metadata.api_version.major_version, metadata.api_version.minor_version};
}

bool Adaptable(FfiVersion runtime, FfiVersion handler) {
  // Minor versions whose handlers run unchanged on the version before:
  //   0.5 added only XLA_FFI_CustomOptions_Get, at the end of XLA_FFI_Api, and
  //       the headers' handlers check the API's struct_size before calling it
  //       (a handler that binds custom options then fails with "Custom options
  //       are not supported by this FFI API" instead of reading past the table).
  // Not 0.4 (XLA_FFI_Error_GetMessage's arguments grew, a record stage and a
  // bundle member came), nor 0.3 (the state arguments changed layout).
  static constexpr int kAdditive[] = {5};
  if (runtime.major != handler.major || !(runtime < handler)) return false;
  for (int minor = runtime.minor + 1; minor <= handler.minor; ++minor) {
    bool additive = false;
    for (int step : kAdditive) additive = additive || step == minor;
    if (!additive) return false;
  }
  return true;
}

void* Adapter(void* handler, FfiVersion version) {
  std::lock_guard<std::mutex> lock(g_adapters_mutex);
  auto key = std::make_pair(handler, std::make_pair(version.major, version.minor));
  auto it = g_adapter_of.find(key);
  if (it != g_adapter_of.end()) return reinterpret_cast<void*>(kAdapterTable[it->second]);
  const size_t index = g_adapter_of.size();
  if (index >= kAdapters) {
    throw PjrtException(PJRT_Error_Code_RESOURCE_EXHAUSTED,
                        "all " + std::to_string(kAdapters) +
                            " XLA FFI version adapters of this process are in use");
  }
  AdapterSlot& slot = g_slots[index];
  slot.major.store(version.major, std::memory_order_relaxed);
  slot.minor.store(version.minor, std::memory_order_relaxed);
  slot.handler.store(reinterpret_cast<xla_ffi::Handler*>(handler), std::memory_order_release);
  g_adapter_of.emplace(key, index);
  return reinterpret_cast<void*>(kAdapterTable[index]);
}

}  // namespace pjrt_pool
