#include "segments.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

namespace pjrt_pool {

bool DmaMapWanted() {
  static const bool wanted = [] {
    const char* value = std::getenv("PJRT_POOL_DMA_MAP");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return wanted;
}

std::shared_ptr<Mapping> Mapping::OfDescriptor(int fd, size_t size) {
  if (size == 0) throw std::invalid_argument("a shared-memory segment of 0 bytes");
  // Populated at once: a segment is mapped to be read or written whole, and one
  // system call maps every page, where touching them would fault one at a time.
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    throw std::system_error(errno, std::generic_category(),
                            "mapping a shared-memory segment of " + std::to_string(size) + " bytes");
  }
  return std::shared_ptr<Mapping>(new Mapping(static_cast<uint8_t*>(data), size, true));
}

std::shared_ptr<Mapping> Mapping::Borrowed(uint8_t* data, size_t size) {
  return std::shared_ptr<Mapping>(new Mapping(data, size, false));
}

Mapping::~Mapping() {
  if (dma_client_ != nullptr) {
    const PJRT_Api* api = dma_client_->api();
    auto args = PJRT_ARGS(PJRT_Client_DmaUnmap_Args);
    args.client = dma_client_->get();
    args.data = data_;
    IgnoreError(api, api->PJRT_Client_DmaUnmap(&args));
  }
  if (owned_) munmap(data_, size_);
}

uint8_t* Mapping::At(int64_t offset, size_t bytes, const char* what) const {
  size_t end;
  if (offset < 0 || __builtin_add_overflow(static_cast<size_t>(offset), bytes, &end) ||
      end > size_) {
    throw std::invalid_argument(std::string(what) + " of " + std::to_string(bytes) +
                                " bytes at offset " + std::to_string(offset) +
                                " does not lie in its segment of " + std::to_string(size_) +
                                " bytes");
  }
  return data_ + offset;
}

void Mapping::RegisterForDma(const std::shared_ptr<Client>& client) {
  std::lock_guard<std::mutex> lock(dma_mutex_);
  if (dma_tried_) return;
  dma_tried_ = true;
  const PJRT_Api* api = client->api();
  if (!DmaMapWanted() ||
      offsetof(PJRT_Api, PJRT_Client_DmaUnmap) + sizeof(void*) > api->struct_size ||
      api->PJRT_Client_DmaMap == nullptr || api->PJRT_Client_DmaUnmap == nullptr) {
    return;
  }
  auto args = PJRT_ARGS(PJRT_Client_DmaMap_Args);
  args.client = client->get();
  args.data = data_;
  args.size = size_;
  PJRT_Error* error = api->PJRT_Client_DmaMap(&args);
  if (error != nullptr) {
    IgnoreError(api, error);  // UNIMPLEMENTED on the CPU plugins: transfers copy, as before
    return;
  }
  dma_client_ = client;
}

}  // namespace pjrt_pool
