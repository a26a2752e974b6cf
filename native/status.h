// PJRT errors as C++ exceptions. Every PJRT_Error* this module receives goes
// through Check(), so a failing plugin call always surfaces as one exception
// type carrying the PJRT code and message; module.cc turns it into the Python
// exception at the single binding boundary.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "pjrt.h"

namespace pjrt_pool {

// A PJRT call failed: `code` is a PJRT_Error_Code, `message` the plugin's text
// prefixed with the call that failed.
class PjrtException : public std::runtime_error {
 public:
  PjrtException(int code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// A plugin library could not be loaded or is not a usable PJRT plugin.
class PluginLoadException : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The name of a PJRT_Error_Code ("INVALID_ARGUMENT"), or "UNKNOWN".
const char* ErrorCodeName(int code);

// Throws PjrtException for a non-null `error` (destroying it first); `what`
// names the PJRT call for the message.
void Check(const PJRT_Api* api, PJRT_Error* error, const char* what);

// Destroys `error` without throwing: for destructors and cleanup paths where a
// second failure must not hide the first.
void IgnoreError(const PJRT_Api* api, PJRT_Error* error) noexcept;

// Returns `fn`, or throws UNIMPLEMENTED when the plugin's PJRT_Api is too old
// to have the member at `offset` (struct_size gating) or leaves it null.
template <typename Fn>
Fn* RequireFn(const PJRT_Api* api, Fn* fn, size_t offset, const char* name) {
  if (offset + sizeof(void*) > api->struct_size || fn == nullptr) {
    throw PjrtException(PJRT_Error_Code_UNIMPLEMENTED,
                        std::string("the PJRT plugin does not implement ") + name);
  }
  return fn;
}

}  // namespace pjrt_pool

// The plugin's function `name`, checked to exist in its PJRT_Api.
#define PJRT_FN(api, name) \
  ::pjrt_pool::RequireFn((api), (api)->name, offsetof(PJRT_Api, name), #name)

// A zeroed argument struct of type `T` with its struct_size set.
#define PJRT_ARGS(T) ::pjrt_pool::MakeArgs<T>(T##_STRUCT_SIZE)
