// Communicators: one per mesh axis, holding one group of ranks for every line
// of devices along that axis.  Owns each rank's symmetric workspace through a
// Memory backend (host memory for XLA:CPU, device memory for CUDA) and maps
// the device ordinal an FFI handler runs on to its (group, rank).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "multicast.h"
#include "protocol.h"

namespace sifar {

enum class Platform { kCpu, kCuda };

// Where workspaces live.  All copies are synchronous and only used off the
// hot path (set-up, stats, error reports, test knobs).
class Memory {
 public:
  virtual ~Memory() = default;
  virtual char* Alloc(int ordinal, size_t bytes) = 0;  // zero-filled
  virtual void Free(int ordinal, char* ptr) = 0;
  // An aligned write of 4 or 8 bytes is one access: kernels may read the word
  // meanwhile and see the old or the new value, never a mix.
  virtual void Write(int ordinal, char* dst, const void* src, size_t bytes) = 0;
  virtual void Read(int ordinal, void* dst, const char* src, size_t bytes) = 0;
  // Memory both the host and the rank's kernels read and write without a copy
  // (error records): returns the host pointer, *device gets the kernel's.
  virtual char* AllocShared(int ordinal, size_t bytes, char** device) = 0;
  virtual void FreeShared(int ordinal, char* host) = 0;
};

std::unique_ptr<Memory> MakeHostMemory();
#ifdef SIFAR_WITH_CUDA
std::unique_ptr<Memory> MakeCudaMemory();
// Enables peer access to every device of the group and loads every kernel on
// `ordinal` now: a lazy module load while a peer spins can deadlock on the
// driver's process-wide lock.
// `multicast`: also load the multicast kernels (only where a multicast group
// exists, so hosts with multicast off never load that code).
void PrepareCudaDevice(int ordinal, const std::vector<int>& group, bool multicast);
#endif

struct Group {
  std::vector<int> ordinals;           // rank -> device ordinal
  std::vector<char*> workspaces;       // rank -> workspace base
  std::vector<ErrorRecord*> errors;    // rank -> failure record, host view
  std::vector<ErrorRecord*> errors_device;  // the same records, kernels' view
  // NVLink multicast (algorithm "multicast"): set up only where the guard
  // allows it; otherwise the guard's reason.
  std::shared_ptr<MulticastGroup> multicast;
  std::string multicast_refusal;
  // Explicit dual buffering: user-visible buffers, each one Slot per rank,
  // registered when sifar_jax.make_buffers creates them.  Index -> [rank].
  std::vector<std::array<char*, kMaxRanks>> buffers;
};

class Comm {
 public:
  Comm(int id, Platform platform, int axis_key, std::string axis_name,
       std::vector<std::vector<int>> groups, size_t slot_bytes, double timeout_s);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int id() const { return id_; }
  Platform platform() const { return platform_; }
  int axis_key() const { return axis_key_; }
  const std::string& axis_name() const { return axis_name_; }
  int nranks() const { return nranks_; }
  size_t slot_bytes() const { return layout_.slot.slot_bytes; }
  const WorkspaceLayout& layout() const { return layout_; }
  const std::vector<Group>& groups() const { return groups_; }
  const Group& group(int g) const { return groups_[g]; }

  // Host-side views of a rank's workspace (backend copies).
  std::vector<std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms>> Stats() const;
  // The first failure recorded by any rank, if any.
  bool FirstError(ErrorRecord* out, int* group) const;
  bool RankFailed(int group, int rank) const {
    return __atomic_load_n(&groups_[group].errors[rank]->failed, __ATOMIC_ACQUIRE) != 0;
  }
  void SetSkew(uint32_t max_ns, uint32_t seed);
  void SetTimeout(double seconds);
  void SetDrop(int rank, bool drop);  // in every group
  void SetPoll(uint32_t depth, uint32_t gap_ns);

  // Explicit buffers: `per_rank[r]` is rank r's copy (slot_total_bytes each).
  void RegisterBuffer(int group, const std::vector<uintptr_t>& per_rank);
  // Fills slots[r] with every rank's copy of the buffer whose rank-`rank` copy
  // starts at `ptr`; false if `ptr` is not a registered buffer.
  bool FindBuffer(int group, int rank, const void* ptr, char* (&slots)[kMaxRanks]) const;
  size_t slot_total_bytes() const { return layout_.slot.total; }

 private:
  // Writes one Control field of `rank` (every rank if < 0) in every group.
  // Only that field: kernels may be running, and `failed` / `error_claimed`
  // belong to them (the host writes those only when it (re)initialises a
  // workspace that no kernel uses).
  template <typename T>
  void WriteControlField(int rank, size_t offset, T value);

  int id_;
  Platform platform_;
  int axis_key_;
  std::string axis_name_;
  int nranks_;
  WorkspaceLayout layout_;
  std::unique_ptr<Memory> memory_;
  std::vector<Group> groups_;
  mutable std::mutex buffers_mu_;  // registration (Python) vs lookups (handlers)
};

// Where a handler invocation stands.
struct RankRef {
  Comm* comm = nullptr;
  int group = -1;
  int rank = -1;
};

// Process-wide registry.  Handlers look communicators up by (axis key, device
// ordinal) on every call, so a destroyed communicator is an error, not a
// dangling pointer.
class Registry {
 public:
  static Registry& Get();
  int Create(Platform platform, int axis_key, const std::string& axis_name,
             const std::vector<std::vector<int>>& groups, size_t slot_bytes, double timeout_s);
  void Destroy(int id);
  void DestroyAll();
  RankRef Lookup(int axis_key, int ordinal);
  // Runs f(Comm&) under the registry lock; false if no such communicator.
  template <typename F>
  bool With(int id, F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find(id);
    if (it == comms_.end()) return false;
    f(*it->second);
    return true;
  }
  std::vector<int> Ids();

 private:
  std::mutex mu_;
  int next_id_ = 1;
  std::unordered_map<int, std::unique_ptr<Comm>> comms_;
  // (axis_key << 32 | ordinal) -> (comm id, group, rank)
  std::unordered_map<uint64_t, std::array<int, 3>> index_;
};

}  // namespace sifar
