// Typed XLA FFI handlers for the custom-call tests.
//
//   add_one:    f32 buffer in, f32 buffer out = in + 1.
//   null_deref: writes through a null pointer when run, which kills the
//               process with SIGSEGV (the worker-pool crash tests use it).
//   sleep_ms:   f32 buffer in, out = in, after sleeping in[0] milliseconds: a
//               task of a chosen length for the timeout and shutdown tests.
//   device_error: fails with the message a CUDA device reports for an illegal
//               address, which leaves a real device's context unusable: the
//               pool must retire the worker (tested on CPU).
//
// Built by tests/ffi/build.py with jaxlib's FFI headers.
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error AddOneImpl(ffi::Buffer<ffi::F32> in, ffi::ResultBuffer<ffi::F32> out) {
  const size_t n = in.element_count();
  if (out->element_count() != n) {
    return ffi::Error::InvalidArgument("add_one: input and output sizes differ");
  }
  const float* src = in.typed_data();
  float* dst = out->typed_data();
  for (size_t i = 0; i < n; ++i) dst[i] = src[i] + 1.0f;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(add_one, AddOneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The volatile pointer keeps the compiler from proving the store undefined
// and dropping it.
static int* volatile g_null = nullptr;

static ffi::Error NullDerefImpl(ffi::Buffer<ffi::F32> in, ffi::ResultBuffer<ffi::F32> out) {
  *g_null = static_cast<int>(in.element_count());
  (void)out;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(null_deref, NullDerefImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

static ffi::Error SleepMsImpl(ffi::Buffer<ffi::F32> in, ffi::ResultBuffer<ffi::F32> out) {
  const size_t n = in.element_count();
  if (n == 0 || out->element_count() != n) {
    return ffi::Error::InvalidArgument("sleep_ms: needs equal, non-empty input and output");
  }
  const float* src = in.typed_data();
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(src[0]));
  float* dst = out->typed_data();
  for (size_t i = 0; i < n; ++i) dst[i] = src[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(sleep_ms, SleepMsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

static ffi::Error DeviceErrorImpl(ffi::Buffer<ffi::F32> in, ffi::ResultBuffer<ffi::F32> out) {
  (void)in;
  (void)out;
  return ffi::Error::Internal(
      "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered "
      "(raised by the test handler device_error)");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(device_error, DeviceErrorImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
