#include "hot_loop.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "buffers.h"

namespace pjrt_pool {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the frame fields are read as little-endian integers in place");

// worker/wire/protocol.py: a header "<IBB" (payload length, descriptor count,
// format), then at least kMinPayload bytes of payload. A HotRun's payload is
// "<qiB3x" (task id, slot, zero copy), a HotReply's "<q8x" (task id).
constexpr size_t kHeaderSize = 6;
constexpr size_t kMinPayload = 16;
constexpr size_t kFirstRead = kHeaderSize + kMinPayload;
constexpr uint8_t kFormatHotRun = 1;
constexpr uint8_t kFormatHotReply = 2;
constexpr uint8_t kFormatPlacedRun = 3;
// A PlacedRun's payload: "<qiBxHHHHH" (task id, slot, zero copy, then the
// counts of sources, destinations, new segments, drops, forgets), then each
// source and destination as "<qqq" (kind, id, offset), each new segment as
// "<qq" (id, size), each drop and forget as "<q".
constexpr size_t kPlacedHead = 24;
constexpr size_t kWhereSize = 24;
constexpr size_t kSegmentSize = 16;
constexpr size_t kMaxPlacedPayload = 1 << 20;
constexpr size_t kMaxFds = 64;  // protocol.MAX_FDS

template <typename T>
T Field(const char* data, size_t offset) {
  T value;
  std::memcpy(&value, data + offset, sizeof(T));
  return value;
}

double Now() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// The place [offset, offset + size) lies inside an arena of arena_size bytes.
bool Inside(size_t offset, size_t size, size_t arena_size) {
  size_t end;
  return !__builtin_add_overflow(offset, size, &end) && end <= arena_size;
}

// One recvmsg of a frame's first bytes into `frame`: the byte count, 0 at
// the end of the stream, -1 when nothing is there (flags has MSG_DONTWAIT)
// and -2 when a signal came first.
ssize_t ReadFirst(int fd, int flags, Unanswered& frame) {
  char data[kFirstRead];
  iovec vector{data, sizeof(data)};
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxFds * sizeof(int))];
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t got = recvmsg(fd, &message, flags | MSG_CMSG_CLOEXEC);
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
    if (errno == EINTR) return -2;
    throw SocketException(errno, "receiving a request");
  }
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* fds = CMSG_DATA(header);
    for (size_t i = 0; i < count; ++i) {
      frame.fds.push_back(Field<int>(reinterpret_cast<const char*>(fds), i * sizeof(int)));
    }
  }
  frame.truncated = (message.msg_flags & MSG_CTRUNC) != 0;
  frame.first.assign(data, static_cast<size_t>(got));
  return got;
}


// Closes received descriptors when it goes: none is left open, whatever throws.
class Descriptors {
 public:
  explicit Descriptors(const std::vector<int>& fds) : fds_(fds) {}
  ~Descriptors() {
    for (int fd : fds_) close(fd);
  }

 private:
  const std::vector<int>& fds_;
};

// Reads exactly `size` bytes; throws SocketException when the stream ends or fails.
void ReadExactly(int fd, char* data, size_t size) {
  while (size > 0) {
    ssize_t got = recv(fd, data, size, MSG_WAITALL);
    if (got == 0) throw SocketException(ECONNRESET, "the parent closed the socket mid-frame");
    if (got < 0) {
      if (errno == EINTR) continue;  // a frame is never left half read
      throw SocketException(errno, "receiving a request");
    }
    data += got;
    size -= static_cast<size_t>(got);
  }
}

}  // namespace

PlacedRequest ParsePlaced(const char* payload, size_t length) {
  if (length < kPlacedHead) throw std::invalid_argument("a placed run's frame is too short");
  PlacedRequest request;
  request.task_id = Field<int64_t>(payload, 0);
  request.slot = Field<int32_t>(payload, 8);
  request.zero_copy = Field<uint8_t>(payload, 12) != 0;
  const size_t sources = Field<uint16_t>(payload, 14);
  const size_t destinations = Field<uint16_t>(payload, 16);
  const size_t segments = Field<uint16_t>(payload, 18);
  const size_t drops = Field<uint16_t>(payload, 20);
  const size_t forgets = Field<uint16_t>(payload, 22);
  const size_t needed = kPlacedHead + kWhereSize * (sources + destinations) +
                        kSegmentSize * segments + 8 * (drops + forgets);
  if (needed > length) {
    throw std::invalid_argument("a placed run's counts do not fit its frame of " +
                                std::to_string(length) + " bytes");
  }
  size_t at = kPlacedHead;
  auto where = [&](std::vector<Where>& into, size_t count) {
    for (size_t i = 0; i < count; ++i, at += kWhereSize) {
      into.push_back(Where{Field<int64_t>(payload, at), Field<int64_t>(payload, at + 8),
                           Field<int64_t>(payload, at + 16)});
    }
  };
  where(request.sources, sources);
  where(request.destinations, destinations);
  for (size_t i = 0; i < segments; ++i, at += kSegmentSize) {
    request.segments.emplace_back(Field<int64_t>(payload, at), Field<int64_t>(payload, at + 8));
  }
  for (size_t i = 0; i < drops; ++i, at += 8) request.drops.push_back(Field<int64_t>(payload, at));
  for (size_t i = 0; i < forgets; ++i, at += 8) {
    request.forgets.push_back(Field<int64_t>(payload, at));
  }
  return request;
}

HotLoop::HotLoop(int fd, uint8_t* arena, size_t arena_size, double spin_seconds)
    : fd_(fd), arena_(arena), arena_size_(arena_size), spin_seconds_(spin_seconds) {
  segments_.Borrow(0, arena, arena_size);
}

void HotLoop::SetSlot(int64_t slot, std::shared_ptr<Executable> executable,
                      std::vector<SlotInput> inputs, std::vector<SlotOutput> outputs) {
  const std::string which = "hot slot " + std::to_string(slot) + ": ";
  Slot value;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SlotInput& input = inputs[i];
    if (!Inside(input.offset, input.size, arena_size_) ||
        ArrayBytes(input.element_type, input.dims) != input.size) {
      throw std::invalid_argument(which + "input " + std::to_string(i) +
                                  " is not an array of its type inside the arena");
    }
    value.inputs.push_back(
        HostInput{arena_ + input.offset, input.size, input.element_type, input.dims});
  }
  const std::vector<OutputType>& types = executable->output_types();
  if (outputs.size() != types.size()) {
    throw std::invalid_argument(which + "the program has " + std::to_string(types.size()) +
                                " outputs, not " + std::to_string(outputs.size()));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const SlotOutput& output = outputs[i];
    if (!Inside(output.offset, output.size, arena_size_) ||
        ArrayBytes(types[i].element_type, types[i].dims) != output.size) {
      throw std::invalid_argument(which + "output " + std::to_string(i) +
                                  " is not a place of its size inside the arena");
    }
    value.outputs.push_back(HostOutput{arena_ + output.offset, output.size});
  }
  value.executable = std::move(executable);
  Install(slot, std::make_shared<const Slot>(std::move(value)));
}

void HotLoop::Install(int64_t slot, std::shared_ptr<const Slot> value) {
  std::shared_ptr<const Slot> replaced;  // released after the lock, if no run holds it
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& entry = slots_[slot];
  replaced = std::move(entry.slot);
  entry.slot = std::move(value);
}

void HotLoop::SetPlacedSlot(int64_t slot, std::shared_ptr<Executable> executable,
                            const std::vector<std::pair<int, std::vector<int64_t>>>& inputs) {
  Slot value;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& [element_type, dims] = inputs[i];
    const std::optional<size_t> size = ArrayBytes(element_type, dims);
    if (!size) {
      throw std::invalid_argument("hot slot " + std::to_string(slot) + ": input " +
                                  std::to_string(i) + " has no byte-sized type");
    }
    value.inputs.push_back(HostInput{nullptr, *size, element_type, dims});
  }
  value.executable = std::move(executable);
  value.in_arena = false;
  Install(slot, std::make_shared<const Slot>(std::move(value)));
}

void HotLoop::DropSlot(int64_t slot) {
  std::shared_ptr<const Slot> dropped;  // released after the lock, if no run holds it
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = slots_.find(slot);
  if (found == slots_.end()) return;
  dropped = std::move(found->second.slot);
  slots_.erase(found);
}

bool HotLoop::HasSlot(int64_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.count(slot) != 0;
}

std::shared_ptr<const HotLoop::Slot> HotLoop::Take(int64_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = slots_.find(slot);
  if (found == slots_.end()) return nullptr;
  found->second.last_use = ++clock_;
  return found->second.slot;
}

void HotLoop::Run(int64_t task_id, int64_t slot, bool zero_copy) {
  std::shared_ptr<const Slot> value = Take(slot);
  if (value == nullptr || !value->in_arena) {
    throw std::invalid_argument("hot slot " + std::to_string(slot) +
                                " is not registered with places in the arena");
  }
  RunSlot(task_id, *value, zero_copy);
}

void HotLoop::Started(int64_t task_id) {
  // Before any work: if the process dies from here on, the parent knows the
  // task had started (protocol.CONTROL_BYTES, protocol.STARTED).
  last_task_id_.store(task_id, std::memory_order_release);
  std::memcpy(arena_ + arena_size_, &task_id, sizeof(task_id));
}

void HotLoop::RunSlot(int64_t task_id, const Slot& value, bool zero_copy) {
  Started(task_id);
  value.executable->Execute(value.inputs, value.outputs, zero_copy);
}

void HotLoop::RunPlaced(const PlacedRequest& request, const std::vector<int>& fds) {
  {
    Descriptors closing(fds);
    if (fds.size() != request.segments.size()) {
      throw std::invalid_argument("a placed run names " + std::to_string(request.segments.size()) +
                                  " new segments but came with " + std::to_string(fds.size()) +
                                  " descriptors");
    }
    // First, whatever follows fails: the parent counts them as mapped once sent (unless
    // the request fails: then it sends them again, and a segment mapped twice is replaced).
    for (size_t i = 0; i < fds.size(); ++i) {
      const auto& [id, size] = request.segments[i];
      if (size <= 0) throw std::invalid_argument("a segment of " + std::to_string(size) + " bytes");
      segments_.Map(id, fds[i], static_cast<size_t>(size));
    }
  }
  values_.Drop(request.drops);
  segments_.Drop(request.forgets);
  Started(request.task_id);
  std::shared_ptr<const Slot> slot = Take(request.slot);
  if (slot == nullptr) {
    throw SlotMissingException("hot slot " + std::to_string(request.slot) +
                               " is not loaded in this worker");
  }
  const Executable& executable = *slot->executable;
  const std::vector<OutputType>& types = executable.output_types();
  if (request.sources.size() != slot->inputs.size() ||
      request.destinations.size() != types.size()) {
    throw std::invalid_argument(
        "a placed run gives " + std::to_string(request.sources.size()) + " inputs and " +
        std::to_string(request.destinations.size()) + " outputs to a program of " +
        std::to_string(slot->inputs.size()) + " and " + std::to_string(types.size()));
  }
  std::vector<std::shared_ptr<Mapping>> held;  // every segment the run touches, until it ends
  std::vector<Argument> arguments;
  arguments.reserve(slot->inputs.size());
  for (size_t i = 0; i < slot->inputs.size(); ++i) {
    const Where& source = request.sources[i];
    Argument argument{slot->inputs[i], nullptr};
    if (source.kind == Where::kValue) {
      argument.value = values_.Get(source.id);
    } else {
      held.push_back(segments_.Get(source.id));
      argument.host.data = held.back()->At(source.offset, argument.host.size, "an input");
      held.back()->RegisterForDma(executable.client());
    }
    arguments.push_back(std::move(argument));
  }
  std::vector<HostOutput> places(types.size(), HostOutput{nullptr, 0});
  for (size_t i = 0; i < types.size(); ++i) {
    const Where& destination = request.destinations[i];
    if (destination.kind == Where::kValue) continue;
    const size_t size = ArrayBytes(types[i].element_type, types[i].dims).value_or(0);
    held.push_back(segments_.Get(destination.id));
    places[i] = HostOutput{held.back()->At(destination.offset, size, "an output"), size};
    held.back()->RegisterForDma(executable.client());
  }
  // A run whose outputs all stay in the worker is not awaited, as jax.jit
  // dispatches a step: the reply goes back while the device runs, and the next
  // run that takes these values waits for them on the device.
  const bool all_kept = std::all_of(request.destinations.begin(), request.destinations.end(),
                                     [](const Where& where) { return where.kind == Where::kValue; });
  std::vector<Owned<PJRT_Event>> run_ends;  // awaited with the copies, which start first
  std::vector<std::shared_ptr<DeviceValue>> outputs =
      RunToValues(executable, arguments, request.zero_copy, /*await_completion=*/!all_kept,
                  &staged_, all_kept ? nullptr : &run_ends);
  // Every placed output is copied before any value is kept: a copy that fails fails the
  // run with nothing kept, so no value outlives a run whose handles are never made.
  if (!all_kept) {
    std::vector<OutputCopy> copies;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (request.destinations[i].kind == Where::kValue) continue;
      copies.push_back({outputs[i]->buffer(), places[i], types[i].dims.size(), i});
    }
    CopyOutputsToHost(executable.client()->api(), copies, run_ends);
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Where& destination = request.destinations[i];
    if (destination.kind == Where::kValue) values_.Put(destination.id, std::move(outputs[i]));
  }
}

PlacedRequest HotLoop::ReadPlaced(const Unanswered& frame) {
  const size_t length = Field<uint32_t>(frame.first.data(), 0);
  if (length < kPlacedHead || length > kMaxPlacedPayload) {
    throw SocketException(EPROTO, "a placed run's frame has a payload of " +
                                      std::to_string(length) + " bytes");
  }
  std::string payload(frame.first.data() + kHeaderSize, frame.first.size() - kHeaderSize);
  const size_t have = payload.size();
  payload.resize(length);
  ReadExactly(fd_, payload.data() + have, length - have);
  return ParsePlaced(payload.data(), payload.size());
}

std::vector<int64_t> HotLoop::TakeUsed() {
  std::vector<std::pair<uint64_t, int64_t>> used;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [slot, value] : slots_) {
      if (value.last_use > taken_at_) used.emplace_back(value.last_use, slot);
    }
    taken_at_ = clock_;
  }
  std::sort(used.begin(), used.end());
  std::vector<int64_t> slots;
  slots.reserve(used.size());
  for (const auto& entry : used) slots.push_back(entry.second);
  return slots;
}

void HotLoop::SendReply(int64_t task_id) {
  char data[kFirstRead] = {};
  const uint32_t length = kMinPayload;
  std::memcpy(data, &length, sizeof(length));
  data[5] = static_cast<char>(kFormatHotReply);
  std::memcpy(data + kHeaderSize, &task_id, sizeof(task_id));
  size_t sent = 0;
  while (sent < sizeof(data)) {
    ssize_t count = send(fd_, data + sent, sizeof(data) - sent, MSG_NOSIGNAL);
    if (count < 0) {
      if (errno == EINTR) continue;  // a reply is never left half sent
      throw SocketException(errno, "sending a reply");
    }
    sent += static_cast<size_t>(count);
  }
}

Unanswered HotLoop::Serve() {
  while (true) {
    Unanswered frame;
    ssize_t got = -1;
    // A caller running programs one after another sends the next request at
    // once: poll a little before sleeping, which costs a wake-up.
    const double deadline = Now() + spin_seconds_;
    do {
      got = ReadFirst(fd_, MSG_DONTWAIT, frame);
    } while (got == -1 && Now() < deadline);
    while (got == -1) {  // sleep until readable (the socket may be non-blocking)
      pollfd readable{fd_, POLLIN, 0};
      if (poll(&readable, 1, -1) < 0) {
        if (errno != EINTR) throw SocketException(errno, "waiting for a request");
        got = -2;
        break;
      }
      got = ReadFirst(fd_, MSG_DONTWAIT, frame);
    }
    if (got == -2) {
      frame.interrupted = true;
      return frame;
    }
    const char* data = frame.first.data();
    const bool whole = static_cast<size_t>(got) == kFirstRead && !frame.truncated;
    if (whole && Field<uint8_t>(data, 5) == kFormatPlacedRun &&
        Field<uint8_t>(data, 4) == frame.fds.size()) {
      // A slot this loop does not hold is the caller's: a program whose executable the
      // loop cannot run (the Python side runs it), or one unloaded (it says so). The
      // caller reads the rest of the frame, its descriptors included, once its length is
      // known to be a placed run's (else the stream is not ours: ReadPlaced says so).
      const size_t length = Field<uint32_t>(data, 0);
      if (length >= kPlacedHead && length <= kMaxPlacedPayload &&
          !HasSlot(Field<int32_t>(data, 14))) {
        return frame;
      }
      const int64_t task_id = Field<int64_t>(data, 6);
      last_task_id_.store(task_id, std::memory_order_release);  // a failure is this task's
      PlacedRequest request;
      try {
        request = ReadPlaced(frame);
      } catch (...) {
        for (int fd : frame.fds) close(fd);
        throw;
      }
      RunPlaced(request, frame.fds);
      SendReply(request.task_id);
      continue;
    }
    const bool hot = whole && frame.fds.empty() && Field<uint32_t>(data, 0) == kMinPayload &&
                     Field<uint8_t>(data, 4) == 0 && Field<uint8_t>(data, 5) == kFormatHotRun;
    if (!hot) return frame;  // the caller reads the rest and answers it
    const int64_t task_id = Field<int64_t>(data, 6);
    const int64_t slot = Field<int32_t>(data, 14);
    std::shared_ptr<const Slot> value = Take(slot);
    if (value == nullptr || !value->in_arena) return frame;  // the caller says it is not loaded
    RunSlot(task_id, *value, Field<uint8_t>(data, 18) != 0);
    SendReply(task_id);
  }
}

}  // namespace pjrt_pool
