#include "runtime/peer_memory.h"

#include <cstring>
#include <stdexcept>

namespace sifar {

PeerMemory& PeerMemoryFor(Platform platform) {
  if (platform == Platform::kCpu) return HostPeerMemory();
#ifdef SIFAR_WITH_CUDA
  return CudaPeerMemory();
#else
  throw std::runtime_error("sifar_jax was built without CUDA support");
#endif
}

PeerWorkspaces::PeerWorkspaces(Platform platform, std::vector<std::vector<int>> ordinals,
                               std::vector<std::vector<int>> processes,
                               std::vector<std::vector<int>> peer_devices, size_t bytes,
                               const std::string& name_prefix)
    : platform_(platform),
      memory_(PeerMemoryFor(platform)),
      backend_(BackendFor(platform)),
      ordinals_(std::move(ordinals)),
      processes_(std::move(processes)),
      peer_devices_(std::move(peer_devices)),
      bytes_(bytes) {
  if (processes_.size() != ordinals_.size())
    throw std::invalid_argument("sifar_jax: one process list per group");
  if (!peer_devices_.empty() && peer_devices_.size() != ordinals_.size())
    throw std::invalid_argument("sifar_jax: one peer device list per group");
  for (size_t g = 0; g < ordinals_.size(); ++g) {
    if (processes_[g].size() != ordinals_[g].size() ||
        (!peer_devices_.empty() && peer_devices_[g].size() != ordinals_[g].size()))
      throw std::invalid_argument("sifar_jax: one process and device per rank");
    if (MappingOrdinal(static_cast<int>(g)) < 0)
      throw std::invalid_argument("sifar_jax: a group without a rank of this process");
  }
  entries_.resize(ordinals_.size());
  try {
    for (size_t g = 0; g < ordinals_.size(); ++g) {
      entries_[g].resize(ordinals_[g].size());
      for (size_t r = 0; r < ordinals_[g].size(); ++r) {
        if (ordinals_[g][r] < 0) continue;
        Entry& e = entries_[g][r];
        const std::string name =
            name_prefix + ".g" + std::to_string(g) + ".r" + std::to_string(r);
        std::string handle;
        e.base = memory_.Export(ordinals_[g][r], bytes_, name, &handle);
        e.name = name;
        e.handle = handle;
        e.error_host = backend_.AllocShared(ordinals_[g][r], sizeof(ErrorRecord), &e.error_device);
      }
    }
  } catch (...) {
    Release();
    throw;
  }
}

PeerWorkspaces::~PeerWorkspaces() { Free(); }

void PeerWorkspaces::Free() {
  std::lock_guard<std::mutex> lock(mu_);
  if (freed_) return;  // (also at interpreter exit, after the atexit hook freed it)
  freed_ = true;
  SynchronizeLocked();
  Release();
}

void PeerWorkspaces::Release() {
  for (size_t g = 0; g < entries_.size(); ++g)
    for (size_t r = 0; r < entries_[g].size(); ++r) {
      Entry& e = entries_[g][r];
      if (e.error_host != nullptr) backend_.FreeShared(ordinals_[g][r], e.error_host);
      e.error_host = e.error_device = nullptr;
      if (e.base == nullptr) continue;
      if (ordinals_[g][r] >= 0) memory_.FreeExported(ordinals_[g][r], e.base, bytes_, e.name);
      else memory_.Unmap(MappingOrdinal(static_cast<int>(g)), e.base, bytes_);
      e.base = nullptr;
    }
}

void PeerWorkspaces::SynchronizeLocked() const {
  for (auto& ords : ordinals_)
    for (int ord : ords)
      if (ord >= 0) memory_.Synchronize(ord);
}

void PeerWorkspaces::Synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  SynchronizeLocked();
}

void PeerWorkspaces::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  if (freed_) throw std::runtime_error("sifar_jax: freed shared workspaces cannot be reused");
  SynchronizeLocked();
  for (size_t g = 0; g < entries_.size(); ++g)
    for (size_t r = 0; r < entries_[g].size(); ++r) {
      Entry& e = entries_[g][r];
      if (ordinals_[g][r] < 0) continue;
      backend_.Zero(ordinals_[g][r], e.base, bytes_);
      std::memset(e.error_host, 0, sizeof(ErrorRecord));
    }
}

int PeerWorkspaces::MappingOrdinal(int g) const {
  for (int ord : ordinals_[g])
    if (ord >= 0) return ord;
  return -1;
}

std::vector<std::tuple<int, int, std::string>> PeerWorkspaces::Handles() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::tuple<int, int, std::string>> out;
  for (size_t g = 0; g < entries_.size(); ++g)
    for (size_t r = 0; r < entries_[g].size(); ++r)
      if (ordinals_[g][r] >= 0)
        out.emplace_back(static_cast<int>(g), static_cast<int>(r), entries_[g][r].handle);
  return out;
}

void PeerWorkspaces::MapPeer(int g, int r, const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  if (g < 0 || g >= static_cast<int>(entries_.size()) || r < 0 ||
      r >= static_cast<int>(entries_[g].size()))
    throw std::out_of_range("sifar_jax: no rank " + std::to_string(r) + " in group " +
                            std::to_string(g));
  if (ordinals_[g][r] >= 0)
    throw std::invalid_argument("sifar_jax: rank " + std::to_string(r) +
                                " belongs to this process; only peers' ranks are mapped");
  if (entries_[g][r].base != nullptr)
    throw std::invalid_argument("sifar_jax: rank " + std::to_string(r) + " is mapped already");
  entries_[g][r].base = memory_.Map(MappingOrdinal(g), handle, bytes_);
}

void PeerWorkspaces::Unpublish() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t g = 0; g < entries_.size(); ++g)
    for (size_t r = 0; r < entries_[g].size(); ++r)
      if (ordinals_[g][r] >= 0 && entries_[g][r].base != nullptr)
        memory_.Unpublish(entries_[g][r].name);
}

void PeerWorkspaces::UnmapPeers() {
  std::lock_guard<std::mutex> lock(mu_);
  SynchronizeLocked();
  for (size_t g = 0; g < entries_.size(); ++g)
    for (size_t r = 0; r < entries_[g].size(); ++r) {
      Entry& e = entries_[g][r];
      if (ordinals_[g][r] >= 0 || e.base == nullptr) continue;
      memory_.Unmap(MappingOrdinal(static_cast<int>(g)), e.base, bytes_);
      e.base = nullptr;
    }
}

std::vector<int> PeerWorkspaces::PeerAccessList(int g) const {
  std::vector<int> out;
  for (int ord : ordinals_[g])
    if (ord >= 0) out.push_back(ord);
  // One local GPU maps the peers' workspaces (IPC enables its peer access);
  // any other local GPU of the group needs peer access to the remote GPUs.
  if (out.size() > 1 && !peer_devices_.empty())
    for (size_t r = 0; r < ordinals_[g].size(); ++r)
      if (ordinals_[g][r] < 0 && peer_devices_[g][r] >= 0) out.push_back(peer_devices_[g][r]);
  return out;
}

char* PeerWorkspaces::workspace(int g, int r) const {
  std::lock_guard<std::mutex> lock(mu_);
  char* p = entries_[g][r].base;
  if (p == nullptr)
    throw std::runtime_error("sifar_jax: the workspace of rank " + std::to_string(r) +
                             " (process " + std::to_string(processes_[g][r]) +
                             ") was never mapped");
  return p;
}

ErrorRecord* PeerWorkspaces::error_record(int g, int r, ErrorRecord** device) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry& e = entries_[g][r];
  if (e.error_host == nullptr)
    throw std::runtime_error("sifar_jax: rank " + std::to_string(r) +
                             " has no error record in this process");
  *device = reinterpret_cast<ErrorRecord*>(e.error_device);
  return reinterpret_cast<ErrorRecord*>(e.error_host);
}

}  // namespace sifar
