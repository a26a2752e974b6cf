// A worker's mappings of the parent's shared-memory segments, kept between runs
// by the id the parent gave each: a segment reused for call after call is
// mapped once, so its pages fault in once (worker/wire/shm.py, the parent's
// pool/executor/segments.py). Segment 0 is the worker's arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "client.h"
#include "id_table.h"

namespace pjrt_pool {

// One mapped segment; unmapped (and unregistered from DMA) when the last user
// lets go of it, so a run under way keeps what it reads and writes.
class Mapping {
 public:
  // Maps `size` bytes of the memfd `fd` shared, its pages populated; the
  // descriptor is not kept. Throws std::system_error when mmap fails.
  static std::shared_ptr<Mapping> OfDescriptor(int fd, size_t size);
  // Memory this object does not own (the arena, which Python maps).
  static std::shared_ptr<Mapping> Borrowed(uint8_t* data, size_t size);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // The place [offset, offset + bytes) inside, or throws std::invalid_argument
  // naming `what`.
  uint8_t* At(int64_t offset, size_t bytes, const char* what) const;
  // Registers the memory with the client for direct transfers
  // (PJRT_Client_DmaMap), once, where the plugin has it and it succeeds; plugins
  // without it (the CPU plugins) or refusing it are simply not asked again.
  void RegisterForDma(const std::shared_ptr<Client>& client);

 private:
  Mapping(uint8_t* data, size_t size, bool owned) : data_(data), size_(size), owned_(owned) {}

  uint8_t* data_;
  size_t size_;
  bool owned_;
  std::mutex dma_mutex_;
  bool dma_tried_ = false;
  std::shared_ptr<Client> dma_client_;  // set: registered with this client
};

// A worker's mapped segments by id; a forgotten one (Drop) is unmapped once no
// run or view uses it.
class SegmentTable : public IdTable<Mapping> {
 public:
  SegmentTable() : IdTable("shared-memory segment") {}
  // Maps a segment under `id` (see Mapping::OfDescriptor), replacing any
  // mapping of that id.
  void Map(int64_t id, int fd, size_t size) { Put(id, Mapping::OfDescriptor(fd, size)); }
  // Puts memory this table does not own under `id` (the arena, as 0).
  void Borrow(int64_t id, uint8_t* data, size_t size) { Put(id, Mapping::Borrowed(data, size)); }
};

// Whether PJRT_Client_DmaMap is tried at all: not when the environment variable
// PJRT_POOL_DMA_MAP is "0" (to compare transfers with and without it).
bool DmaMapWanted();

}  // namespace pjrt_pool
