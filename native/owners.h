// RAII owners for PJRT objects. Each PJRT object this module creates is held
// by exactly one Owned<T> from the moment the plugin returns it, so an
// exception anywhere in a call sequence still destroys everything it made.
#pragma once

#include <utility>

#include "status.h"

namespace pjrt_pool {

// How to destroy each kind of PJRT object. Destroy errors are ignored: they
// happen only during cleanup, where the original failure matters more.
template <typename T>
struct Destroyer;

template <>
struct Destroyer<PJRT_Event> {
  static void Destroy(const PJRT_Api* api, PJRT_Event* event) noexcept {
    auto args = PJRT_ARGS(PJRT_Event_Destroy_Args);
    args.event = event;
    IgnoreError(api, api->PJRT_Event_Destroy(&args));
  }
};

template <>
struct Destroyer<PJRT_Buffer> {
  static void Destroy(const PJRT_Api* api, PJRT_Buffer* buffer) noexcept {
    auto args = PJRT_ARGS(PJRT_Buffer_Destroy_Args);
    args.buffer = buffer;
    IgnoreError(api, api->PJRT_Buffer_Destroy(&args));
  }
};

template <>
struct Destroyer<PJRT_Executable> {
  static void Destroy(const PJRT_Api* api, PJRT_Executable* executable) noexcept {
    auto args = PJRT_ARGS(PJRT_Executable_Destroy_Args);
    args.executable = executable;
    IgnoreError(api, api->PJRT_Executable_Destroy(&args));
  }
};

template <>
struct Destroyer<PJRT_LoadedExecutable> {
  static void Destroy(const PJRT_Api* api, PJRT_LoadedExecutable* executable) noexcept {
    auto args = PJRT_ARGS(PJRT_LoadedExecutable_Destroy_Args);
    args.executable = executable;
    IgnoreError(api, api->PJRT_LoadedExecutable_Destroy(&args));
  }
};

template <>
struct Destroyer<PJRT_TopologyDescription> {
  static void Destroy(const PJRT_Api* api, PJRT_TopologyDescription* topology) noexcept {
    auto args = PJRT_ARGS(PJRT_TopologyDescription_Destroy_Args);
    args.topology = topology;
    IgnoreError(api, api->PJRT_TopologyDescription_Destroy(&args));
  }
};

template <>
struct Destroyer<PJRT_Client> {
  static void Destroy(const PJRT_Api* api, PJRT_Client* client) noexcept {
    auto args = PJRT_ARGS(PJRT_Client_Destroy_Args);
    args.client = client;
    IgnoreError(api, api->PJRT_Client_Destroy(&args));
  }
};

// Sole owner of one PJRT object; move-only.
template <typename T>
class Owned {
 public:
  Owned() = default;
  Owned(const PJRT_Api* api, T* ptr) : api_(api), ptr_(ptr) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  Owned(Owned&& other) noexcept
      : api_(other.api_), ptr_(std::exchange(other.ptr_, nullptr)) {}
  Owned& operator=(Owned&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = other.api_;
      ptr_ = std::exchange(other.ptr_, nullptr);
    }
    return *this;
  }
  ~Owned() { reset(); }

  T* get() const { return ptr_; }
  explicit operator bool() const { return ptr_ != nullptr; }
  void reset() noexcept {
    if (ptr_ != nullptr) Destroyer<T>::Destroy(api_, std::exchange(ptr_, nullptr));
  }

 private:
  const PJRT_Api* api_ = nullptr;
  T* ptr_ = nullptr;
};

// Blocks until `event` is ready and throws its error, if any. `what` names
// the operation the event belongs to.
inline void AwaitEvent(const PJRT_Api* api, PJRT_Event* event, const char* what) {
  auto args = PJRT_ARGS(PJRT_Event_Await_Args);
  args.event = event;
  Check(api, api->PJRT_Event_Await(&args), what);
}

}  // namespace pjrt_pool
