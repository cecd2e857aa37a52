// Communicators whose groups hold ranks of several processes on one host (one
// process per GPU, or per set of CPU devices).  Each process allocates the
// workspaces of its own ranks in memory another process can map (POSIX shared
// memory on the CPU, CUDA IPC on GPUs) and publishes a handle for each; it maps
// the handles of the other processes' ranks.  The kernels then get every
// rank's workspace pointer exactly as in one process: the protocol does not
// know where a workspace came from.  The handles travel through
// jax.distributed's key-value store (src/sifar_jax/distributed.py; docs/design.md,
// Processes).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/comm.h"

namespace sifar {

// How one platform exports and maps workspaces.  Off the hot path; throws on
// failure (except the release calls, which never throw).
class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  // A zero-filled workspace of `bytes` for local device `ordinal`, published
  // under `name` (unique on this host); *handle: what a peer maps it by.
  virtual char* Export(int ordinal, size_t bytes, const std::string& name,
                       std::string* handle) = 0;
  // Every peer has mapped it: the name goes, so nothing outlives the
  // processes that use it.  Idempotent.
  virtual void Unpublish(const std::string& name) = 0;
  virtual void FreeExported(int ordinal, char* base, size_t bytes, const std::string& name) = 0;
  // Maps a peer's workspace for the kernels of local device `ordinal`.
  virtual char* Map(int ordinal, const std::string& handle, size_t bytes) = 0;
  virtual void Unmap(int ordinal, char* base, size_t bytes) = 0;
  // Returns once no kernel runs on local device `ordinal`.
  virtual void Synchronize(int ordinal) = 0;
};

PeerMemory& HostPeerMemory();  // shm_memory.cc: POSIX shared memory
#ifdef SIFAR_WITH_CUDA
PeerMemory& CudaPeerMemory();  // cuda_ipc.cu: cudaIpcGetMemHandle / cudaIpcOpenMemHandle
#endif
PeerMemory& PeerMemoryFor(Platform platform);

// Shared-memory names this process published and has not unpublished yet
// (the atexit hook and the tests read them).
std::vector<std::string> PublishedNames();
void UnpublishAll();

// The workspaces of one communicator spanning processes, [group][rank], for
// the groups that hold at least one rank of this process, and the error
// records of this process's ranks.  Shared by the Python set-up and the
// communicator (enable_shared_from_this: nanobind then hands C++ the object's
// own shared_ptr, not one holding a Python reference).  It outlives its
// communicator: src/sifar_jax/distributed.py pools it at shutdown (an executable
// compiled before may replay into it) and hands it to the next communicator
// of the same layout once every process agrees (docs/design.md, Processes).
class PeerWorkspaces : public std::enable_shared_from_this<PeerWorkspaces> {
 public:
  // ordinals[g][r]: local device ordinal of rank r, or -1 for a rank of
  // another process.  processes[g][r]: the process index of every rank (for
  // error messages).  peer_devices[g][r]: the CUDA ordinal, in this process,
  // of every rank's GPU (-1 where not visible; empty on the CPU): a group
  // with several local GPUs gets peer access to the remote ones.
  // Allocates and publishes the local ranks' workspaces, named
  // name_prefix + ".g<g>.r<r>".
  PeerWorkspaces(Platform platform, std::vector<std::vector<int>> ordinals,
                 std::vector<std::vector<int>> processes,
                 std::vector<std::vector<int>> peer_devices, size_t bytes,
                 const std::string& name_prefix);
  ~PeerWorkspaces();  // Free()
  PeerWorkspaces(const PeerWorkspaces&) = delete;
  PeerWorkspaces& operator=(const PeerWorkspaces&) = delete;

  // (group, rank, handle) of every local rank.
  std::vector<std::tuple<int, int, std::string>> Handles() const;
  // Maps rank r of group g (a rank of another process).
  void MapPeer(int g, int r, const std::string& handle);
  // Every process has mapped every workspace: forget the names.
  void Unpublish();
  // Returns once nothing runs on this process's devices of these groups.
  void Synchronize();
  // For reuse by a new communicator: waits for this process's devices, then
  // zeroes its ranks' workspaces and error records (the peers zero theirs;
  // the caller makes every process finish that before any first use).
  void Reset();
  // Waits for this process's devices, then unmaps the peers' workspaces
  // (before the owners free them).  No call may run afterwards.
  void UnmapPeers();
  // Waits for this process's devices, then unmaps and frees everything,
  // error records included.  Idempotent; never throws.
  void Free();

  Platform platform() const { return platform_; }
  size_t bytes() const { return bytes_; }
  const std::vector<std::vector<int>>& ordinals() const { return ordinals_; }
  bool local(int g, int r) const { return ordinals_[g][r] >= 0; }
  int process(int g, int r) const { return processes_[g][r]; }
  // The devices a local device of group g needs peer access to.
  std::vector<int> PeerAccessList(int g) const;
  // Throws unless every rank's workspace is there.
  char* workspace(int g, int r) const;
  // The error record of local rank r of group g: host view; *device gets the
  // kernels' view.
  ErrorRecord* error_record(int g, int r, ErrorRecord** device) const;

 private:
  struct Entry {
    char* base = nullptr;
    std::string name;    // local ranks: the published name
    std::string handle;  // local ranks: what peers map it by
    char* error_host = nullptr;    // local ranks: the error record (Backend::AllocShared)
    char* error_device = nullptr;
  };
  int MappingOrdinal(int g) const;  // the local device that maps group g's peers
  void SynchronizeLocked() const;   // waits for this process's devices
  void Release();                   // frees / unmaps everything (never throws)

  Platform platform_;
  PeerMemory& memory_;
  Backend& backend_;  // this process's error records, zeroing
  std::vector<std::vector<int>> ordinals_, processes_, peer_devices_;
  size_t bytes_;
  mutable std::mutex mu_;
  bool freed_ = false;
  std::vector<std::vector<Entry>> entries_;
};

}  // namespace sifar
