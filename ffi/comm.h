// Communicators: one per mesh axis, holding one group of ranks for every line
// of devices along that axis.  Owns each rank's symmetric workspace through a
// Memory backend (host memory for XLA:CPU, device memory for CUDA) and maps
// the device ordinal an FFI handler runs on to its (group, rank).
#pragma once

#include <array>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "multicast.h"
#include "protocol.h"

namespace sifar {

enum class Platform { kCpu, kCuda };

// The workspaces of a communicator spanning processes (peer_memory.h).
class PeerWorkspaces;

// Where workspaces live.  All copies are synchronous and only used off the
// hot path (set-up, stats, error reports, test knobs).
class Memory {
 public:
  virtual ~Memory() = default;
  virtual char* Alloc(int ordinal, size_t bytes) = 0;  // zero-filled
  virtual void Free(int ordinal, char* ptr) = 0;
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
  std::vector<int> ordinals;           // rank -> device ordinal (-1: a rank of another process)
  std::vector<char*> workspaces;       // rank -> workspace base
  std::vector<ErrorRecord*> errors;    // rank -> failure record, host view (null: another process's)
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
  // `peers`: the groups span processes; their workspaces come from it (the
  // groups are its ordinals: -1 for the ranks of other processes), and only
  // this process's ranks get error records and host writes.
  Comm(int id, Platform platform, int axis_key, std::string axis_name,
       std::vector<std::vector<int>> groups, size_t slot_bytes, double timeout_s, int lanes,
       std::shared_ptr<PeerWorkspaces> peers = nullptr);
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
    const ErrorRecord* e = groups_[group].errors[rank];
    return e != nullptr && __atomic_load_n(&e->failed, __ATOMIC_ACQUIRE) != 0;
  }
  // A rank of this process (the host reads and writes only those).
  bool IsLocal(int group, int rank) const { return groups_[group].ordinals[rank] >= 0; }
  bool spans_processes() const { return peers_ != nullptr; }
  // The process index of a rank (-1 when the communicator is this process's alone).
  int ProcessOf(int group, int rank) const;
  void SetSkew(uint32_t max_ns, uint32_t seed);
  void SetTimeout(double seconds);
  // In every group; blocks from `from_block` on skip (a CPU rank is block 0).
  void SetDrop(int rank, bool drop, int from_block = 0);
  void SetPoll(uint32_t depth, uint32_t gap_ns);
  // Testing and benchmarks (no kernel may run while the host writes epochs).
  void SetEpochs(uint32_t epoch);        // every block of every lane of every rank
  void SetEpochMask(uint32_t mask);      // tag epoch bits (0: the default 24)
  void SetTrace(bool on);                // record every call in the trace rings
  // Every rank's trace records, oldest first: (group, rank, record).
  std::vector<std::tuple<int, int, TraceRecord>> Trace() const;

  // Explicit buffers: `per_rank[r]` is rank r's copy (slot_total_bytes each).
  void RegisterBuffer(int group, const std::vector<uintptr_t>& per_rank);
  // Fills slots[r] with every rank's copy of the buffer whose rank-`rank` copy
  // starts at `ptr`; false if `ptr` is not a registered buffer.
  bool FindBuffer(int group, int rank, const void* ptr, char* (&slots)[kMaxRanks]) const;
  size_t slot_total_bytes() const { return layout_.slot.total; }

 private:
  void WriteControl(int g, int r, const Control& c);
  // Read-modify-write of the Control of `rank` (every rank if < 0) in every group.
  void UpdateControl(int rank, const std::function<void(Control&)>& update);
  Control ReadControl(int g, int r) const;

  int id_;
  Platform platform_;
  int axis_key_;
  std::string axis_name_;
  int nranks_;
  WorkspaceLayout layout_;
  std::unique_ptr<Memory> memory_;
  std::vector<Group> groups_;
  std::shared_ptr<PeerWorkspaces> peers_;
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
             const std::vector<std::vector<int>>& groups, size_t slot_bytes, double timeout_s,
             int lanes, std::shared_ptr<PeerWorkspaces> peers = nullptr);
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
