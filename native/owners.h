// RAII owners for PJRT objects. Each PJRT object this module creates is held
// by exactly one Owned<T> from the moment the plugin returns it, so an
// exception anywhere in a call sequence still destroys everything it made.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "status.h"

namespace pjrt_pool {

// How to destroy each kind of PJRT object. Destroy errors are ignored: they
// happen only during cleanup, where the original failure matters more.
template <typename T>
struct Destroyer;

// Destroyer<PJRT_Kind> calls PJRT_Kind_Destroy with its args' `field` set.
#define PJRT_POOL_DESTROYER(Kind, field)                                      \
  template <>                                                                 \
  struct Destroyer<PJRT_##Kind> {                                             \
    static void Destroy(const PJRT_Api* api, PJRT_##Kind* object) noexcept {  \
      auto args = PJRT_ARGS(PJRT_##Kind##_Destroy_Args);                      \
      args.field = object;                                                    \
      IgnoreError(api, api->PJRT_##Kind##_Destroy(&args));                    \
    }                                                                         \
  };

PJRT_POOL_DESTROYER(Event, event)
PJRT_POOL_DESTROYER(Buffer, buffer)
PJRT_POOL_DESTROYER(Executable, executable)
PJRT_POOL_DESTROYER(LoadedExecutable, executable)
PJRT_POOL_DESTROYER(TopologyDescription, topology)
PJRT_POOL_DESTROYER(Client, client)

#undef PJRT_POOL_DESTROYER

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

// Copies the bytes a PJRT serialize call returned, then frees them with the deleter the call
// gave (also when the copy throws): `backing` holds the bytes until then.
template <typename Backing>
std::string CopySerialized(const char* bytes, size_t size, Backing* backing,
                           void (*deleter)(Backing*)) {
  struct Release {
    Backing* backing;
    void (*deleter)(Backing*);
    ~Release() {
      if (deleter != nullptr) deleter(backing);
    }
  } release{backing, deleter};
  return std::string(bytes, size);
}

// Blocks until `event` is ready and throws its error, if any. `what` names
// the operation the event belongs to.
inline void AwaitEvent(const PJRT_Api* api, PJRT_Event* event, const char* what) {
  auto args = PJRT_ARGS(PJRT_Event_Await_Args);
  args.event = event;
  Check(api, api->PJRT_Event_Await(&args), what);
}

// Blocks until `event` is ready, ignoring its error: for destructors, which must
// not free memory a transfer may still read, and must not throw.
inline void AwaitEventQuietly(const PJRT_Api* api, PJRT_Event* event) noexcept {
  auto args = PJRT_ARGS(PJRT_Event_Await_Args);
  args.event = event;
  IgnoreError(api, api->PJRT_Event_Await(&args));
}

}  // namespace pjrt_pool
