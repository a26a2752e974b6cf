// Does a PJRT plugin compute a program's output into memory the caller provides?
//
// Built and run by scripts/view_donation.py: view_donation PLUGIN PROGRAM OPTIONS [owned]
//
// PROGRAM is StableHLO text whose output aliases its first parameter
// (tf.aliasing_output = 0): out = in + s for f32[1 << 20]. The first argument is
// a view of caller memory (PJRT_Client_CreateViewOfDeviceBuffer), donated to
// Execute; with "owned", a buffer the plugin allocated (a copy of that memory)
// instead, to show that the aliasing itself works. Prints whether the output
// buffer is the memory that was donated, and whether that memory now holds it.
// Error handling is minimal: any PJRT error is printed and ends the program.
#include <dlfcn.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "pjrt_c_api.h"

namespace {

const PJRT_Api* api = nullptr;

template <typename T>
T Args(size_t size) {
  T args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = size;
  return args;
}
#define ARGS(T) Args<T>(T##_STRUCT_SIZE)

void Check(PJRT_Error* error, const char* what) {
  if (error == nullptr) return;
  auto message = ARGS(PJRT_Error_Message_Args);
  message.error = error;
  api->PJRT_Error_Message(&message);
  std::printf("%s failed: %.*s\n", what, static_cast<int>(message.message_size),
              message.message);
  std::exit(1);
}

std::string Slurp(const char* path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

void* BufferPointer(PJRT_Buffer* buffer) {
  auto pointer = ARGS(PJRT_Buffer_UnsafePointer_Args);
  pointer.buffer = buffer;
  Check(api->PJRT_Buffer_UnsafePointer(&pointer), "PJRT_Buffer_UnsafePointer");
  return reinterpret_cast<void*>(pointer.buffer_pointer);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::printf("usage: %s PLUGIN PROGRAM OPTIONS [owned]\n", argv[0]);
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    std::printf("dlopen failed: %s\n", dlerror());
    return 1;
  }
  auto get_api = reinterpret_cast<const PJRT_Api* (*)()>(dlsym(library, "GetPjrtApi"));
  api = get_api();
  std::printf("api: %d.%d\n", api->pjrt_api_version.major_version,
              api->pjrt_api_version.minor_version);
  auto initialize = ARGS(PJRT_Plugin_Initialize_Args);
  Check(api->PJRT_Plugin_Initialize(&initialize), "PJRT_Plugin_Initialize");
  auto client = ARGS(PJRT_Client_Create_Args);
  Check(api->PJRT_Client_Create(&client), "PJRT_Client_Create");
  auto devices = ARGS(PJRT_Client_AddressableDevices_Args);
  devices.client = client.client;
  Check(api->PJRT_Client_AddressableDevices(&devices), "PJRT_Client_AddressableDevices");
  PJRT_Device* device = devices.addressable_devices[0];

  std::string code = Slurp(argv[2]), options = Slurp(argv[3]);
  auto program = ARGS(PJRT_Program);
  program.code = code.data();
  program.code_size = code.size();
  program.format = "mlir";
  program.format_size = 4;
  auto compile = ARGS(PJRT_Client_Compile_Args);
  compile.client = client.client;
  compile.program = &program;
  compile.compile_options = options.data();
  compile.compile_options_size = options.size();
  Check(api->PJRT_Client_Compile(&compile), "PJRT_Client_Compile");

  const int64_t n = 1 << 20;
  int64_t dims[1] = {n};
  auto* memory = static_cast<float*>(
      mmap(nullptr, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  for (int64_t i = 0; i < n; ++i) memory[i] = 1.0f;

  PJRT_Buffer* donated = nullptr;
  if (argc > 4) {  // "owned": a buffer of the plugin's, copied from the memory
    auto owned = ARGS(PJRT_Client_BufferFromHostBuffer_Args);
    owned.client = client.client;
    owned.data = memory;
    owned.type = PJRT_Buffer_Type_F32;
    owned.dims = dims;
    owned.num_dims = 1;
    owned.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
    owned.device = device;
    Check(api->PJRT_Client_BufferFromHostBuffer(&owned), "PJRT_Client_BufferFromHostBuffer");
    donated = owned.buffer;
    memory = static_cast<float*>(BufferPointer(donated));
  } else {
    if (api->struct_size < offsetof(PJRT_Api, PJRT_Client_CreateViewOfDeviceBuffer) +
                               sizeof(void*) ||
        api->PJRT_Client_CreateViewOfDeviceBuffer == nullptr) {
      std::printf("no PJRT_Client_CreateViewOfDeviceBuffer\n");
      return 0;
    }
    auto view = ARGS(PJRT_Client_CreateViewOfDeviceBuffer_Args);
    view.client = client.client;
    view.device_buffer_ptr = memory;
    view.dims = dims;
    view.num_dims = 1;
    view.element_type = PJRT_Buffer_Type_F32;
    view.device = device;
    // Required in practice: the 0.115 CPU plugin calls it unchecked
    // (std::bad_function_call without one).
    view.on_delete_callback = [](void*, void*) {};
    Check(api->PJRT_Client_CreateViewOfDeviceBuffer(&view),
          "PJRT_Client_CreateViewOfDeviceBuffer");
    donated = view.buffer;
  }

  float two = 2.0f;
  auto scalar = ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  scalar.client = client.client;
  scalar.data = &two;
  scalar.type = PJRT_Buffer_Type_F32;
  scalar.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  scalar.device = device;
  Check(api->PJRT_Client_BufferFromHostBuffer(&scalar), "PJRT_Client_BufferFromHostBuffer");

  PJRT_Buffer* arguments[2] = {donated, scalar.buffer};
  PJRT_Buffer* const* argument_lists[1] = {arguments};
  PJRT_Buffer* outputs[1] = {nullptr};
  PJRT_Buffer** output_lists[1] = {outputs};
  PJRT_Event* complete[1] = {nullptr};
  auto execute_options = ARGS(PJRT_ExecuteOptions);
  auto execute = ARGS(PJRT_LoadedExecutable_Execute_Args);
  execute.executable = compile.executable;
  execute.options = &execute_options;
  execute.argument_lists = argument_lists;
  execute.num_devices = 1;
  execute.num_args = 2;
  execute.output_lists = output_lists;
  execute.device_complete_events = complete;
  Check(api->PJRT_LoadedExecutable_Execute(&execute), "PJRT_LoadedExecutable_Execute");
  if (complete[0] != nullptr) {
    auto await = ARGS(PJRT_Event_Await_Args);
    await.event = complete[0];
    Check(api->PJRT_Event_Await(&await), "PJRT_Event_Await");
  }
  auto deleted = ARGS(PJRT_Buffer_IsDeleted_Args);
  deleted.buffer = donated;
  Check(api->PJRT_Buffer_IsDeleted(&deleted), "PJRT_Buffer_IsDeleted");
  std::printf("donated buffer consumed: %s\n", deleted.is_deleted ? "yes" : "no");
  std::printf("output in the donated memory: %s\n",
              BufferPointer(outputs[0]) == memory ? "yes" : "no");
  std::printf("donated memory holds the output: %s\n", memory[0] == 3.0f ? "yes" : "no");
  return 0;
}
