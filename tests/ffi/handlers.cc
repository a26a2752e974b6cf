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
//   add_one_reporting_0_5, add_one_reporting_0_9: add_one, reporting XLA FFI
//               0.5 (as a handler built with jaxlib 0.12's headers that binds
//               no custom options, the only addition of 0.5) and 0.9 (a
//               version no XLA of the tests' plugins can take).
//
// Built by tests/ffi/build.py against the project's declarations of the XLA
// FFI C API (native/xla_ffi.h), not jaxlib's headers: those are of the
// installed jaxlib's XLA FFI version, which a plugin built from an older XLA
// refuses (jaxlib 0.12's FFI 0.5 on the FFI 0.4 of jaxlib 0.11's XLA). These
// handlers report XLA FFI 0.1, which every XLA takes, and use only what 0.1
// has.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>

#include "xla_ffi.h"

namespace ffi = pjrt_pool::xla_ffi;

namespace {

// Answers XLA's metadata request with the version these handlers are built
// for (or `minor`); returns false when the frame is a real call.
bool AnswerMetadata(ffi::CallFrame* frame, int minor = ffi::kMinor) {
  ffi::MetadataExtension* request = ffi::MetadataRequest(frame);
  if (request == nullptr) return false;
  ffi::Metadata* metadata = request->metadata;
  if (metadata != nullptr && metadata->struct_size >= ffi::kMetadataSize) {
    metadata->api_version.major_version = ffi::kMajor;
    metadata->api_version.minor_version = minor;
    metadata->traits = 0;
  }
  return true;
}

ffi::Error* Fail(ffi::CallFrame* frame, ffi::ErrorCode code, const std::string& message) {
  return ffi::MakeError(frame->api, code, message.c_str());
}

int64_t ElementCount(const ffi::Buffer* buffer) {
  int64_t count = 1;
  for (int64_t axis = 0; axis < buffer->rank; ++axis) count *= buffer->dims[axis];
  return count;
}

// The one f32 operand and the one f32 result of a handler, or an error.
struct InOut {
  const float* in = nullptr;
  float* out = nullptr;
  int64_t count = 0;
  ffi::Error* error = nullptr;
};

InOut F32InOut(ffi::CallFrame* frame, const char* name) {
  InOut result;
  const std::string prefix = std::string(name) + ": ";
  if (frame->stage != ffi::kExecute) {
    result.error = Fail(frame, ffi::kInvalidArgument, prefix + "runs in the execute stage only");
    return result;
  }
  if (frame->args.size != 1 || frame->rets.size != 1 || frame->args.kinds[0] != ffi::kBuffer ||
      frame->rets.kinds[0] != ffi::kBuffer) {
    result.error = Fail(frame, ffi::kInvalidArgument,
                        prefix + "takes one buffer and returns one buffer");
    return result;
  }
  const auto* in = static_cast<const ffi::Buffer*>(frame->args.values[0]);
  const auto* out = static_cast<const ffi::Buffer*>(frame->rets.values[0]);
  if (in->dtype != ffi::kF32 || out->dtype != ffi::kF32) {
    result.error = Fail(frame, ffi::kInvalidArgument,
                        prefix + "wrong buffer dtype: expected F32 (" +
                            std::to_string(ffi::kF32) + ") but got " +
                            std::to_string(in->dtype) + " in and " +
                            std::to_string(out->dtype) + " out");
    return result;
  }
  result.count = ElementCount(in);
  if (ElementCount(out) != result.count) {
    result.error = Fail(frame, ffi::kInvalidArgument, prefix + "input and output sizes differ");
    return result;
  }
  result.in = static_cast<const float*>(in->data);
  result.out = static_cast<float*>(out->data);
  return result;
}

// The volatile pointer keeps the compiler from proving the store undefined
// and dropping it.
int* volatile g_null = nullptr;

}  // namespace

extern "C" {

ffi::Error* add_one(ffi::CallFrame* frame) {
  if (AnswerMetadata(frame)) return nullptr;
  InOut io = F32InOut(frame, "add_one");
  if (io.error != nullptr) return io.error;
  for (int64_t i = 0; i < io.count; ++i) io.out[i] = io.in[i] + 1.0f;
  return nullptr;
}

ffi::Error* add_one_reporting_0_5(ffi::CallFrame* frame) {
  return AnswerMetadata(frame, 5) ? nullptr : add_one(frame);
}

ffi::Error* add_one_reporting_0_9(ffi::CallFrame* frame) {
  return AnswerMetadata(frame, 9) ? nullptr : add_one(frame);
}

ffi::Error* null_deref(ffi::CallFrame* frame) {
  if (AnswerMetadata(frame)) return nullptr;
  InOut io = F32InOut(frame, "null_deref");
  if (io.error != nullptr) return io.error;
  *g_null = static_cast<int>(io.count);
  return nullptr;
}

ffi::Error* sleep_ms(ffi::CallFrame* frame) {
  if (AnswerMetadata(frame)) return nullptr;
  InOut io = F32InOut(frame, "sleep_ms");
  if (io.error != nullptr) return io.error;
  if (io.count == 0) return Fail(frame, ffi::kInvalidArgument, "sleep_ms: needs a non-empty input");
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(io.in[0]));
  for (int64_t i = 0; i < io.count; ++i) io.out[i] = io.in[i];
  return nullptr;
}

// in + 1, or an error (kInvalidArgument) when in[0] is negative: a run that fails on demand.
ffi::Error* fail_if_negative(ffi::CallFrame* frame) {
  if (AnswerMetadata(frame)) return nullptr;
  InOut io = F32InOut(frame, "fail_if_negative");
  if (io.error != nullptr) return io.error;
  if (io.count > 0 && io.in[0] < 0.0f) {
    return Fail(frame, ffi::kInvalidArgument, "fail_if_negative: the input starts negative");
  }
  for (int64_t i = 0; i < io.count; ++i) io.out[i] = io.in[i] + 1.0f;
  return nullptr;
}

ffi::Error* device_error(ffi::CallFrame* frame) {
  if (AnswerMetadata(frame)) return nullptr;
  InOut io = F32InOut(frame, "device_error");
  if (io.error != nullptr) return io.error;
  return Fail(frame, ffi::kInternal,
              "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered "
              "(raised by the test handler device_error)");
}

}  // extern "C"
