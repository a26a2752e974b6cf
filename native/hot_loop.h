// The worker's hot loop: receive a HotRun, run its slot's executable on the
// arena, send the HotReply, all without Python. Python (worker.serve.server) keeps
// everything else: it registers a slot after a program's first full run, and
// gets back each frame that is not a HotRun of a registered slot, to finish
// reading and answer it. The frame layout mirrors worker/wire/protocol.py (a test
// sends and receives through both).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "client.h"
#include "device_values.h"
#include "segments.h"

namespace pjrt_pool {

// A socket call failed with `error` (an errno value).
class SocketException : public std::runtime_error {
 public:
  SocketException(int error, const std::string& what) : std::runtime_error(what), error_(error) {}
  int error() const { return error_; }

 private:
  int error_;
};

// A run's slot is not registered (its program was unloaded): Python's
// LookupError, after which the parent sends the full Run.
class SlotMissingException : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// Where one array of a placed run comes from or goes to (worker/wire/protocol.py,
// PlacedRun): a place in shared memory (`segment`, 0 for the arena, and the byte
// `offset` there), or a value the worker keeps (`id`: an input's value, or the
// id to keep an output under).
struct Where {
  enum Kind : int64_t { kPlace = 0, kValue = 1 };
  int64_t kind;
  int64_t id;  // the segment, or the value
  int64_t offset;  // in the segment; 0 for a value
};

// A placed run (a run whose arrays lie anywhere in shared memory, or stay in the
// worker), with what comes with it: segments to map first (each with its
// descriptor, in order), values to drop and segments to forget.
struct PlacedRequest {
  int64_t task_id = -1;
  int64_t slot = -1;
  bool zero_copy = true;
  std::vector<Where> sources;
  std::vector<Where> destinations;
  std::vector<std::pair<int64_t, int64_t>> segments;  // (id, size)
  std::vector<int64_t> drops;
  std::vector<int64_t> forgets;
};

// One input of a hot slot: its place in the arena and its type.
struct SlotInput {
  size_t offset;
  size_t size;  // bytes
  int element_type;  // PJRT_Buffer_Type
  std::vector<int64_t> dims;
};

// One output of a hot slot: its place in the arena.
struct SlotOutput {
  size_t offset;
  size_t size;  // bytes
};

// A frame the loop did not answer: the bytes of its first read and the
// descriptors that came with them, for the caller to finish (and close).
struct Unanswered {
  std::string first;  // empty: the other end closed the socket
  std::vector<int> fds;
  bool truncated = false;  // MSG_CTRUNC: the kernel dropped descriptors
  bool interrupted = false;  // a signal came before any byte: nothing was read
};

// Every method may be called from any thread, at any time: a slot set or
// dropped while Serve or Run runs it is replaced or forgotten for the next
// run, and the run under way keeps the slot it began with.
class HotLoop {
 public:
  // The loop reads and writes `fd` (the worker's socket, which the caller
  // keeps open) and runs on `arena`, which holds arena_size data bytes and
  // then the control bytes; both outlive the loop. Before it blocks, it
  // polls for `spin_seconds` (a request that comes at once skips a wake-up).
  HotLoop(int fd, uint8_t* arena, size_t arena_size, double spin_seconds);

  // Registers (or replaces) a slot; throws std::invalid_argument for a place
  // outside the arena or an input whose size is not its dims x element size.
  // A slot whose inputs have no place in the arena (SlotInput::offset < 0,
  // and no outputs given) runs only as placed runs.
  void SetSlot(int64_t slot, std::shared_ptr<Executable> executable,
               std::vector<SlotInput> inputs, std::vector<SlotOutput> outputs);
  // Registers (or replaces) a slot that runs only as placed runs: its
  // executable and each input's (PJRT_Buffer_Type, dims).
  void SetPlacedSlot(int64_t slot, std::shared_ptr<Executable> executable,
                     const std::vector<std::pair<int, std::vector<int64_t>>>& inputs);
  // Forgets a slot (its program was unloaded); an unknown slot is ignored.
  void DropSlot(int64_t slot);
  bool HasSlot(int64_t slot) const;

  // Answers HotRuns and PlacedRuns of registered slots until a frame comes that is
  // not one (a PlacedRun of a slot it does not hold included); returns that frame.
  // A run's failure is thrown (what Execute throws), with its task in
  // last_task_id(); a socket failure throws SocketException.
  // Blocks; call without the GIL.
  Unanswered Serve();

  // Runs one slot for a task as Serve does, without the socket: writes the
  // started id, runs. Throws std::invalid_argument for an unknown slot.
  // Blocks; call without the GIL.
  void Run(int64_t task_id, int64_t slot, bool zero_copy);

  // Runs a placed request as Serve does, without the socket: maps its new
  // segments (`fds`, one per entry of request.segments, closed here whatever
  // happens), drops and forgets what it names, writes the started id, runs.
  // Throws SlotMissingException for an unknown slot, std::invalid_argument for
  // a place outside its segment or a value that is not held or does not fit.
  // Blocks; call without the GIL.
  void RunPlaced(const PlacedRequest& request, const std::vector<int>& fds);

  // The segments mapped and the values kept (for a worker's own bookkeeping).
  SegmentTable& segments() { return segments_; }
  ValueTable& values() { return values_; }

  // The task of the last run begun (Serve's or Run's), -1 before any.
  int64_t last_task_id() const { return last_task_id_.load(std::memory_order_acquire); }

  // The slots run since the last call, least recently run first (for the
  // caller's LRU of loaded programs).
  std::vector<int64_t> TakeUsed();

 private:
  struct Slot {
    std::shared_ptr<Executable> executable;
    std::vector<HostInput> inputs;  // data is null for a slot with no arena places
    std::vector<HostOutput> outputs;
    bool in_arena = true;  // runs as a HotRun on the arena
  };
  struct Entry {
    // Shared with a run under way, which holds it until its Execute returns.
    std::shared_ptr<const Slot> slot;
    uint64_t last_use = 0;
  };

  // Puts (or replaces) a slot's value.
  void Install(int64_t slot, std::shared_ptr<const Slot> value);
  // The slot a run of `slot` uses now (marked used), or null when none is set.
  std::shared_ptr<const Slot> Take(int64_t slot);
  void RunSlot(int64_t task_id, const Slot& value, bool zero_copy);
  void SendReply(int64_t task_id);
  void Started(int64_t task_id);
  // Reads the rest of a placed run's frame (its first read is in `frame`).
  PlacedRequest ReadPlaced(const Unanswered& frame);

  int fd_;
  uint8_t* arena_;
  size_t arena_size_;
  double spin_seconds_;
  // Guards slots_, clock_ and taken_at_; never held while a program runs.
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, Entry> slots_;
  uint64_t clock_ = 0;  // counts runs; a slot's last_use is the count at its last run
  uint64_t taken_at_ = 0;  // clock_ at the last TakeUsed
  std::atomic<int64_t> last_task_id_{-1};
  SegmentTable segments_;  // 0 is the arena's data bytes
  ValueTable values_;
  // Declared last, destroyed first: waits for transfers still reading its copies.
  StagedInputs staged_;
};

// Parses a placed run's payload (the bytes after the frame's header).
// Throws std::invalid_argument for one whose counts do not fit its length.
PlacedRequest ParsePlaced(const char* payload, size_t length);

}  // namespace pjrt_pool
