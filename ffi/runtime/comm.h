// Communicators: one per mesh axis, holding one group of ranks for every line
// of devices along that axis.  Each rank's symmetric workspace comes from a
// process-wide pool (host memory for XLA:CPU, device memory for CUDA) and the
// registry maps the device ordinal an FFI handler runs on to its (group, rank).
//
// Life cycle (docs: src/sifar_jax/comm.py):
// - Workspaces and error records are never freed while the process runs
//   (unless asked to): an executable compiled before shutdown() may hold
//   their addresses (kernel arguments recorded into a CUDA graph) and run
//   again.  Destroying a communicator returns its memory to the pool; a new
//   communicator of the same axis, devices and layout takes it back, zeroed.
// - Teardown waits for every handler call and every device of every group
//   before any memory changes hands.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/protocol.h"

namespace sifar {

// The optional NVLink multicast variant of a group (multicast.h); opaque here.
struct MulticastGroup;

enum class Platform { kCpu, kCuda };

struct Group;

// The workspaces of a communicator spanning processes (peer_memory.h).
class PeerWorkspaces;

// Where workspaces live and how a group's devices get ready.  All copies are
// synchronous and only used off the hot path (set-up, stats, error reports,
// test knobs).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual char* Alloc(int ordinal, size_t bytes) = 0;  // zero-filled
  virtual void Free(int ordinal, char* ptr) = 0;
  virtual void Zero(int ordinal, char* ptr, size_t bytes) = 0;
  // An aligned write of 4 or 8 bytes is one access: kernels may read the word
  // meanwhile and see the old or the new value, never a mix.
  virtual void Write(int ordinal, char* dst, const void* src, size_t bytes) = 0;
  virtual void Read(int ordinal, void* dst, const char* src, size_t bytes) = 0;
  // Memory both the host and the rank's kernels read and write without a copy
  // (error records): returns the host pointer, *device gets the kernel's.
  virtual char* AllocShared(int ordinal, size_t bytes, char** device) = 0;
  virtual void FreeShared(int ordinal, char* host) = 0;
  // Returns once nothing runs on `ordinal` any more; never throws.  (CPU
  // handlers run on the caller's threads: the registry waits for them.)
  virtual void Synchronize(int ordinal) = 0;
  // Readies a new group's devices (peer access, eager kernel loads) and sets
  // up its multicast variant where the guard allows it, else records why not
  // in g.multicast_refusal.
  virtual void PrepareGroup(Group& g, size_t slot_bytes) = 0;
  // The same for a group spanning processes: only this process's devices
  // (ordinals >= 0), with peer access to `peer_access`; never multicast.
  virtual void PrepareSpanningGroup(Group& g, const std::vector<int>& peer_access) = 0;
};

// The process-wide backend of a platform; throws where this build lacks it.
Backend& BackendFor(Platform platform);

struct Group {
  std::vector<int> ordinals;           // rank -> device ordinal (-1: a rank of another process)
  std::vector<char*> workspaces;       // rank -> workspace base
  std::vector<ErrorRecord*> errors;    // rank -> failure record, host view (null: another process's)
  std::vector<ErrorRecord*> errors_device;  // the same records, kernels' view
  // NVLink multicast (algorithm "multicast"): set up only where the guard
  // allows it; otherwise the guard's reason.
  std::shared_ptr<MulticastGroup> multicast;
  std::string multicast_refusal;
};

// Explicit dual buffering: a user buffer registered by sifar_jax.make_buffers,
// one copy per rank of one group.
struct RegisteredBuffer {
  uint64_t id;                            // unique in the process
  std::array<char*, kMaxRanks> per_rank;  // rank -> its copy
  size_t bytes;                           // of each copy
};

class Comm {
 public:
  // `peers`: the groups span processes; their workspaces come from it, not
  // from the pool (the groups are its ordinals: -1 for the ranks of other
  // processes), and only this process's ranks get error records and host
  // writes.
  Comm(int id, Platform platform, int axis_key, std::string axis_name,
       std::vector<std::vector<int>> groups, size_t slot_bytes, double timeout_s, int lanes,
       std::shared_ptr<PeerWorkspaces> peers = nullptr);
  // Waits for every device of every group, then returns the memory to the
  // pool (a communicator spanning processes lets go of `peers`, which holds
  // its workspaces and error records, instead).
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
  // Testing and benchmarks (no kernel may run while the host writes epochs).
  void SetEpochs(uint32_t epoch);        // every block of every lane of every rank
  void SetEpochMask(uint32_t mask);      // tag epoch bits (0: the default 24)
  void SetTrace(bool on);                // record every call in the trace rings
  // Every rank's trace records, oldest first: (group, rank, record).
  std::vector<std::tuple<int, int, TraceRecord>> Trace() const;

  // Explicit buffers.  `per_rank[r]` is rank r's copy (`bytes` each).  A new
  // registration drops every older one that overlaps it on any rank: its
  // memory has been freed, since a live allocation now occupies it.
  // Returns the registration's id.
  uint64_t RegisterBuffer(int group, const std::vector<uintptr_t>& per_rank, size_t bytes);
  bool UnregisterBuffer(uint64_t id);  // false if there is no such registration
  std::vector<RegisteredBuffer> Buffers(int group) const;
  // Fills slots[r] with every rank's copy of the one registered buffer whose
  // rank-`rank` copy starts at `ptr`.  False, with *why set to the message
  // for the user, if there is none, if several match, or if this rank's
  // previous explicit call used the same registered buffer (dual buffering
  // needs the two buffers to alternate).  `in_run_order`: this rank's calls
  // reach FindBuffer in the order they run (false while a CUDA graph is
  // recorded: that check is skipped and its memory forgotten).
  bool FindBuffer(int group, int rank, const void* ptr, char* (&slots)[kMaxRanks],
                  std::string* why, bool in_run_order = true) const;
  size_t slot_total_bytes() const { return layout_.slot.total; }

 private:
  // Writes one Control field of `rank` (every rank if < 0) in every group,
  // this process's ranks only (each process writes its own).
  // Only that field: kernels may be running, and `failed` / `error_claimed`
  // belong to them (the host writes those only when it (re)initialises a
  // workspace that no kernel uses).
  template <typename T>
  void WriteControlField(int rank, size_t offset, T value);
  void TakeSharedMemory(int group);  // workspaces and local error records, from peers_
  void ReturnMemory();  // every group's memory back to the pool (or to peers_)

  int id_;
  Platform platform_;
  int axis_key_;
  std::string axis_name_;
  int nranks_;
  WorkspaceLayout layout_;
  Backend* backend_;
  std::vector<Group> groups_;
  std::shared_ptr<PeerWorkspaces> peers_;  // null unless the groups span processes
  // Registration (Python) vs lookups (handlers).
  mutable std::mutex buffers_mu_;
  std::vector<std::vector<RegisteredBuffer>> buffers_;  // [group]
  // [group][rank]: the registration of this rank's previous explicit call
  // (a registration, not an address: a new array may reuse a dead one's).
  mutable std::vector<std::array<uint64_t, kMaxRanks>> last_buffer_;
};

// Where a handler invocation stands.  Holding `comm` keeps the communicator
// (and so its memory) alive until the handler returns.
struct RankRef {
  std::shared_ptr<Comm> comm;
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
  // Unlists the communicator, waits until no handler call holds it, then
  // destroys it (which waits for its devices); returns after all of that.
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
  // Handler calls holding communicator `id` right now (tests).
  int CallsInFlight(int id);

 private:
  std::mutex mu_;
  int next_id_ = 1;
  std::unordered_map<int, std::shared_ptr<Comm>> comms_;
  // (axis_key << 32 | ordinal) -> (comm id, group, rank)
  std::unordered_map<uint64_t, std::array<int, 3>> index_;
};

// The pool of workspaces and error records (see the top of this file).
struct PoolEntryInfo {
  Platform platform;
  int axis_key;
  std::vector<int> ordinals;
  size_t workspace_bytes;
  std::vector<char*> workspaces;  // rank order
};
// What the pool holds now (memory no communicator uses).
std::vector<PoolEntryInfo> PooledMemory();
// Frees every pooled workspace, error record and retired multicast group.
// Only safe when no executable that used them will run again.
void ReleasePooledMemory();

}  // namespace sifar
