#include "status.h"

#include <string>

namespace pjrt_pool {

const char* ErrorCodeName(int code) {
  static const char* const kNames[] = {
      "OK",           "CANCELLED",         "UNKNOWN",        "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",    "ALREADY_EXISTS", "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",         "UNAVAILABLE",    "DATA_LOSS",
      "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(sizeof(kNames) / sizeof(kNames[0]))) {
    return "UNKNOWN";
  }
  return kNames[code];
}

void IgnoreError(const PJRT_Api* api, PJRT_Error* error) noexcept {
  if (error == nullptr) return;
  auto args = PJRT_ARGS(PJRT_Error_Destroy_Args);
  args.error = error;
  api->PJRT_Error_Destroy(&args);
}

void Check(const PJRT_Api* api, PJRT_Error* error, const char* what) {
  if (error == nullptr) return;
  auto message_args = PJRT_ARGS(PJRT_Error_Message_Args);
  message_args.error = error;
  api->PJRT_Error_Message(&message_args);
  std::string message(message_args.message, message_args.message_size);

  int code = PJRT_Error_Code_UNKNOWN;
  auto code_args = PJRT_ARGS(PJRT_Error_GetCode_Args);
  code_args.error = error;
  // GetCode itself returns an error only when it cannot tell; keep UNKNOWN then.
  PJRT_Error* code_error = api->PJRT_Error_GetCode(&code_args);
  if (code_error == nullptr) {
    code = code_args.code;
  } else {
    IgnoreError(api, code_error);
  }
  IgnoreError(api, error);
  throw PjrtException(code, std::string(what) + ": " + message);
}

}  // namespace pjrt_pool
