// The part of XLA's FFI C API (xla/ffi/api/c_api.h in XLA, shipped by jaxlib as
// jaxlib/include/xla/ffi/api/c_api.h) that pjrt-pool uses, declared here
// because no FFI header is a build requirement: the header jaxlib installs is
// of whatever version is installed, and what matters is the version of the
// plugin's XLA, read at run time.
//
// These are the layouts of XLA FFI API 0.1, the oldest version any XLA FFI
// runtime accepts. Later versions (0.2 to 0.5, checked against jaxlib
// 0.10.2's, 0.11.2's and 0.12.0.1's headers) only add members at the ends of
// these structs (XLA_FFI_Metadata.state_type_id in 0.3, the error code in
// XLA_FFI_Error_GetDetails_Args in 0.4) and functions at the end of
// XLA_FFI_Api, and every struct carries its size: so a handler written against
// these declarations works with every runtime, and this module can build the
// call frames and read the versions of handlers of any version. Sizes are
// "up to the last member", as XLA_FFI_STRUCT_SIZE computes them.
//
// Used by the native module (plugin.cc, ffi.cc) and by the test suite's own
// handlers (tests/ffi/handlers.cc), which therefore report version 0.1.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pjrt_pool::xla_ffi {

// The version these declarations describe.
inline constexpr int kMajor = 0;
inline constexpr int kMinor = 1;

struct Api;    // XLA_FFI_Api: the runtime's function table
struct Error;  // XLA_FFI_Error: opaque, owned by whoever receives it

// XLA_FFI_Extension_Type: the only extension a call frame carries is the
// metadata request, with which XLA asks a handler for its version.
enum ExtensionType : int { kMetadataExtension = 1 };

// XLA_FFI_ExecutionStage.
enum ExecutionStage : int { kInstantiate = 0, kPrepare = 1, kInitialize = 2, kExecute = 3 };

// XLA_FFI_Error_Code (absl's status codes).
enum ErrorCode : int { kOk = 0, kInvalidArgument = 3, kInternal = 13 };

// XLA_FFI_ArgType / XLA_FFI_RetType: buffers are the only kind.
enum BufferKind : int { kBuffer = 1 };

// XLA_FFI_DataType (the values of xla::PrimitiveType).
enum DataType : int { kF32 = 11 };

struct ExtensionBase {  // XLA_FFI_Extension_Base
  size_t struct_size;
  ExtensionType type;
  ExtensionBase* next;
};

struct ApiVersion {  // XLA_FFI_Api_Version
  size_t struct_size;
  ExtensionBase* extension_start;
  int major_version;
  int minor_version;
};
inline constexpr size_t kApiVersionSize = offsetof(ApiVersion, minor_version) + sizeof(int);

struct Metadata {  // XLA_FFI_Metadata
  size_t struct_size;
  ApiVersion api_version;
  uint32_t traits;
  // state_type_id (0.3 and later) and whatever later versions add: handlers of
  // those versions write it, so storage for it is kept even where the runtime's
  // struct_size ends before it.
  int64_t reserved[8];
};
inline constexpr size_t kMetadataSize = offsetof(Metadata, traits) + sizeof(uint32_t);

struct MetadataExtension {  // XLA_FFI_Metadata_Extension
  ExtensionBase extension_base;
  Metadata* metadata;
};
inline constexpr size_t kMetadataExtensionSize =
    offsetof(MetadataExtension, metadata) + sizeof(Metadata*);

struct ByteSpan {  // XLA_FFI_ByteSpan
  const char* ptr;
  size_t len;
};

struct Args {  // XLA_FFI_Args (and, with `kinds` of results, XLA_FFI_Rets)
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  BufferKind* kinds;
  void** values;
};
inline constexpr size_t kArgsSize = offsetof(Args, values) + sizeof(void**);

struct Attrs {  // XLA_FFI_Attrs
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  int* kinds;
  ByteSpan** names;
  void** values;
};
inline constexpr size_t kAttrsSize = offsetof(Attrs, values) + sizeof(void**);

struct CallFrame {  // XLA_FFI_CallFrame
  size_t struct_size;
  ExtensionBase* extension_start;
  const Api* api;
  void* ctx;
  ExecutionStage stage;
  Args args;
  Args rets;
  Attrs attrs;
  void* future;  // out; not part of struct_size
};
inline constexpr size_t kCallFrameSize = offsetof(CallFrame, attrs) + sizeof(Attrs);

struct Buffer {  // XLA_FFI_Buffer
  size_t struct_size;
  ExtensionBase* extension_start;
  DataType dtype;
  void* data;
  int64_t rank;
  int64_t* dims;
};

struct ErrorCreateArgs {  // XLA_FFI_Error_Create_Args
  size_t struct_size;
  ExtensionBase* extension_start;
  const char* message;
  ErrorCode errc;
};
inline constexpr size_t kErrorCreateArgsSize = offsetof(ErrorCreateArgs, errc) + sizeof(int);

struct ErrorMessageArgs {  // XLA_FFI_Error_GetMessage_Args (0.4: _GetDetails_Args)
  size_t struct_size;
  ExtensionBase* extension_start;
  Error* error;
  const char* message;  // out
  ErrorCode errc;       // out, 0.4 and later
};
inline constexpr size_t kErrorMessageArgsSize = offsetof(ErrorMessageArgs, message) + sizeof(char*);
inline constexpr size_t kErrorDetailsArgsSize = offsetof(ErrorMessageArgs, errc) + sizeof(int);

struct ErrorDestroyArgs {  // XLA_FFI_Error_Destroy_Args
  size_t struct_size;
  ExtensionBase* extension_start;
  Error* error;
};
inline constexpr size_t kErrorDestroyArgsSize = offsetof(ErrorDestroyArgs, error) + sizeof(Error*);

// The start of XLA_FFI_Api, which every version shares.
struct Api {
  size_t struct_size;
  ExtensionBase* extension_start;
  ApiVersion api_version;
  void* internal_api;
  Error* (*error_create)(ErrorCreateArgs* args);
  void (*error_message)(ErrorMessageArgs* args);
  void (*error_destroy)(ErrorDestroyArgs* args);
};

// XLA_FFI_Handler.
using Handler = Error*(CallFrame* frame);

// The metadata request in `frame`, or null when the frame is a real call.
inline MetadataExtension* MetadataRequest(CallFrame* frame) {
  ExtensionBase* extension = frame->extension_start;
  if (extension == nullptr || extension->type != kMetadataExtension ||
      extension->struct_size < kMetadataExtensionSize) {
    return nullptr;
  }
  return reinterpret_cast<MetadataExtension*>(extension);
}

// A new error from the runtime `api` (ownership passes to the caller, which
// returns it to XLA).
inline Error* MakeError(const Api* api, ErrorCode code, const char* message) {
  ErrorCreateArgs args{};
  args.struct_size = kErrorCreateArgsSize;
  args.message = message;
  args.errc = code;
  return api->error_create(&args);
}

}  // namespace pjrt_pool::xla_ffi
