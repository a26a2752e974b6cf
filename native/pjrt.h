// The PJRT C API as this module uses it: the plugin's header (found at build
// time in the xla-cpu-pjrt package, never copied here) plus the one extension
// struct that header does not declare.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pjrt_c_api.h"

namespace pjrt_pool {

// The FFI extension (PJRT_Extension_Type_FFI) as the 0.115 CPU plugin lays it
// out. Only `register_handler` is used; the two earlier members are kept as
// opaque pointers so that its offset is right. Declared here because the 0.81
// header we build against predates the separate extension header.
//
// Unlike most PJRT argument structs, these have no `extension_start`: with one,
// the plugin reads the name pointer as the name's size (docs/facts.md, "The FFI extension").
struct FfiRegisterHandlerArgs {
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;  // XLA_FFI_Handler*
  const char* platform_name;
  size_t platform_name_size;
  uint32_t traits;
};

struct FfiExtension {
  PJRT_Extension_Base base;
  void* type_id_register;
  void* user_data_add;
  PJRT_Error* (*register_handler)(FfiRegisterHandlerArgs* args);
};

// Fills `struct_size` (the size this module was built with) and zeroes the
// rest, as every PJRT argument struct requires.
template <typename Args>
Args MakeArgs(size_t struct_size) {
  Args args{};
  args.struct_size = struct_size;
  return args;
}

}  // namespace pjrt_pool
