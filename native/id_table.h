// Objects a worker keeps by the id the parent gave each (its kept values, its
// mapped segments), shared with the runs that use them: one dropped while a
// run holds it goes when that run lets go of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pjrt_pool {

// T has size() (its bytes). `what` names a T in errors ("value", "segment").
template <typename T>
class IdTable {
 public:
  explicit IdTable(const char* what) : what_(what) {}

  // Keeps `item` under `id`, replacing any held under it.
  void Put(int64_t id, std::shared_ptr<T> item) {
    std::shared_ptr<T> replaced;  // released after the lock, if no run holds it
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<T>& entry = items_[id];
    replaced = std::move(entry);
    entry = std::move(item);
  }

  // The item under `id`; throws std::invalid_argument when none is held.
  std::shared_ptr<T> Get(int64_t id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = items_.find(id);
    if (found == items_.end()) {
      throw std::invalid_argument(std::string(what_) + " " + std::to_string(id) +
                                  " is not held by this worker");
    }
    return found->second;
  }

  // Lets go of the items under these ids (unknown ids are ignored).
  void Drop(const std::vector<int64_t>& ids) {
    std::vector<std::shared_ptr<T>> dropped;  // released after the lock
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t id : ids) {
      auto found = items_.find(id);
      if (found == items_.end()) continue;
      dropped.push_back(std::move(found->second));
      items_.erase(found);
    }
  }

  size_t count() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return items_.size();
  }

  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t total = 0;
    for (const auto& entry : items_) total += entry.second->size();
    return total;
  }

 private:
  const char* what_;
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, std::shared_ptr<T>> items_;
};

}  // namespace pjrt_pool
