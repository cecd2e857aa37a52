#include "runtime/comm.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "runtime/peer_memory.h"

namespace sifar {

namespace {

// XLA:CPU ranks share this process's memory: a workspace is an aligned block.
class HostBackend : public Backend {
 public:
  char* Alloc(int, size_t bytes) override {
    void* p = std::aligned_alloc(kAlign, AlignUp(bytes, kAlign));
    if (p == nullptr) throw std::runtime_error("sifar_jax: host workspace allocation failed");
    std::memset(p, 0, bytes);
    return static_cast<char*>(p);
  }
  void Free(int, char* ptr) override { std::free(ptr); }
  void Zero(int, char* ptr, size_t bytes) override {
    std::memset(ptr, 0, bytes);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
  }
  void Write(int, char* dst, const void* src, size_t bytes) override {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (bytes == 4 && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
      uint32_t v;
      std::memcpy(&v, src, 4);
      __atomic_store_n(reinterpret_cast<uint32_t*>(dst), v, __ATOMIC_SEQ_CST);
    } else if (bytes == 8 && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
      uint64_t v;
      std::memcpy(&v, src, 8);
      __atomic_store_n(reinterpret_cast<uint64_t*>(dst), v, __ATOMIC_SEQ_CST);
    } else {
      std::memcpy(dst, src, bytes);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
  }
  void Read(int, void* dst, const char* src, size_t bytes) override {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    std::memcpy(dst, src, bytes);
  }
  char* AllocShared(int ordinal, size_t bytes, char** device) override {
    return *device = Alloc(ordinal, bytes);
  }
  void FreeShared(int ordinal, char* host) override { Free(ordinal, host); }
  void Synchronize(int) override {}
  void PrepareGroup(Group& g, size_t) override {
    g.multicast_refusal = "multicast needs NVLink GPUs";
  }
  void PrepareSpanningGroup(Group& g, const std::vector<int>&) override {
    g.multicast_refusal = "multicast needs every rank in one process";
  }
};

uint64_t IndexKey(int axis_key, int ordinal) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(axis_key)) << 32) |
         static_cast<uint32_t>(ordinal);
}

// ------------------------------------------------------------------- pool --
// Memory of one group, pooled for the process's lifetime.  Keyed by axis too,
// so an old executable of axis A and a new communicator of axis A share a
// workspace (one sequence of epochs), never one of another axis.
struct PoolKey {
  Platform platform;
  int axis_key;
  std::vector<int> ordinals;
  size_t bytes;
  bool operator<(const PoolKey& o) const {
    return std::tie(platform, axis_key, ordinals, bytes) <
           std::tie(o.platform, o.axis_key, o.ordinals, o.bytes);
  }
};

struct PooledGroup {
  std::vector<char*> workspaces;
  std::vector<ErrorRecord*> errors, errors_device;
};

class Pool {
 public:
  static Pool& Get() {
    static Pool* p = new Pool();  // never destroyed: handlers may run at exit
    return *p;
  }

  // Fills g's memory: a pooled set for this key (waited for and zeroed), or a
  // new one.
  void Acquire(const PoolKey& key, Backend& backend, Group& g) {
    PooledGroup m;
    bool reused = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(key);
      if (it != free_.end()) {
        m = std::move(it->second);
        free_.erase(it);
        reused = true;
      }
    }
    if (reused) {
      // An old executable may have run on it since: let it finish everywhere,
      // then every rank restarts from epoch 0 together.
      for (int ord : key.ordinals) backend.Synchronize(ord);
      for (size_t r = 0; r < key.ordinals.size(); ++r) {
        backend.Zero(key.ordinals[r], m.workspaces[r], key.bytes);
        std::memset(m.errors[r], 0, sizeof(ErrorRecord));
      }
    } else {
      try {
        for (int ord : key.ordinals) {
          m.workspaces.push_back(backend.Alloc(ord, key.bytes));
          char* dev = nullptr;
          char* host = backend.AllocShared(ord, sizeof(ErrorRecord), &dev);
          m.errors.push_back(reinterpret_cast<ErrorRecord*>(host));
          m.errors_device.push_back(reinterpret_cast<ErrorRecord*>(dev));
        }
      } catch (...) {
        FreeGroup(key, backend, m);
        throw;
      }
    }
    g.workspaces = std::move(m.workspaces);
    g.errors = std::move(m.errors);
    g.errors_device = std::move(m.errors_device);
  }

  // Takes g's memory back (the caller has waited for every device).
  void Release(const PoolKey& key, Group& g) {
    if (g.workspaces.empty()) return;
    PooledGroup m{std::move(g.workspaces), std::move(g.errors), std::move(g.errors_device)};
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(key, std::move(m));
  }

  // A multicast group is not reused (the guard decides anew at every init),
  // but an old executable may still name its mappings: keep it.
  void Retire(std::shared_ptr<MulticastGroup> mc) {
    if (!mc) return;
    std::lock_guard<std::mutex> lock(mu_);
    retired_.push_back(std::move(mc));
  }

  std::vector<PoolEntryInfo> Entries() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<PoolEntryInfo> out;
    for (auto& kv : free_)
      out.push_back({kv.first.platform, kv.first.axis_key, kv.first.ordinals, kv.first.bytes,
                     kv.second.workspaces});
    return out;
  }

  void FreeAll() {
    std::multimap<PoolKey, PooledGroup> free;
    std::vector<std::shared_ptr<MulticastGroup>> retired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free.swap(free_);
      retired.swap(retired_);
    }
    for (auto& kv : free)
      for (int ord : kv.first.ordinals) BackendFor(kv.first.platform).Synchronize(ord);
    retired.clear();  // unmaps the multicast views before the workspaces go
    for (auto& kv : free) FreeGroup(kv.first, BackendFor(kv.first.platform), kv.second);
  }

 private:
  static void FreeGroup(const PoolKey& key, Backend& backend, PooledGroup& m) {
    for (size_t r = 0; r < m.workspaces.size(); ++r) backend.Free(key.ordinals[r], m.workspaces[r]);
    for (size_t r = 0; r < m.errors.size(); ++r)
      backend.FreeShared(key.ordinals[r], reinterpret_cast<char*>(m.errors[r]));
  }

  std::mutex mu_;
  std::multimap<PoolKey, PooledGroup> free_;
  std::vector<std::shared_ptr<MulticastGroup>> retired_;
};

}  // namespace

#ifdef SIFAR_WITH_CUDA
Backend& CudaBackend();  // cuda_memory.cu
#endif

Backend& BackendFor(Platform platform) {
  static HostBackend* host = new HostBackend();
  if (platform == Platform::kCpu) return *host;
#ifdef SIFAR_WITH_CUDA
  return CudaBackend();
#else
  throw std::runtime_error("sifar_jax was built without CUDA support");
#endif
}

std::vector<PoolEntryInfo> PooledMemory() { return Pool::Get().Entries(); }
void ReleasePooledMemory() { Pool::Get().FreeAll(); }

Comm::Comm(int id, Platform platform, int axis_key, std::string axis_name,
           std::vector<std::vector<int>> groups, size_t slot_bytes, double timeout_s, int lanes,
           std::shared_ptr<PeerWorkspaces> peers)
    : id_(id),
      platform_(platform),
      axis_key_(axis_key),
      axis_name_(std::move(axis_name)),
      nranks_(groups.empty() ? 0 : static_cast<int>(groups[0].size())),
      layout_(MakeWorkspaceLayout(slot_bytes, groups.empty() ? 1 : static_cast<int>(groups[0].size()),
                                  lanes)),
      backend_(&BackendFor(platform)),
      peers_(std::move(peers)) {
  if (lanes < 1 || lanes > 64)
    throw std::invalid_argument("sifar_jax: lanes must be 1..64");
  if (slot_bytes == 0 || slot_bytes % 16 != 0)
    throw std::invalid_argument("sifar_jax: slot_bytes must be a positive multiple of 16");
  if (nranks_ < 1 || nranks_ > kMaxRanks)
    throw std::invalid_argument("sifar_jax: a communicator needs 1.." + std::to_string(kMaxRanks) +
                                " ranks per group");
  for (auto& ords : groups)
    if (static_cast<int>(ords.size()) != nranks_)
      throw std::invalid_argument("sifar_jax: all groups of an axis must have the same size");
  if (peers_ && (peers_->platform() != platform || peers_->ordinals() != groups ||
                 peers_->bytes() < layout_.total))
    throw std::invalid_argument("sifar_jax: the shared workspaces do not fit this communicator");
  try {
    for (auto& ords : groups) {
      groups_.emplace_back();
      groups_.back().ordinals = ords;
      if (peers_) TakeSharedMemory(static_cast<int>(groups_.size()) - 1);
      else Pool::Get().Acquire({platform_, axis_key_, ords, layout_.total}, *backend_, groups_.back());
    }
    // Fresh or zeroed workspaces, no kernel on them: the whole Control,
    // `failed` included (each process initialises its own ranks').
    Control init{};
    init.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
    for (int g = 0; g < static_cast<int>(groups_.size()); ++g)
      for (int r = 0; r < nranks_; ++r)
        if (IsLocal(g, r))
          backend_->Write(groups_[g].ordinals[r], groups_[g].workspaces[r] + layout_.control,
                          &init, sizeof(Control));
    for (int g = 0; g < static_cast<int>(groups_.size()); ++g) {
      if (peers_) backend_->PrepareSpanningGroup(groups_[g], peers_->PeerAccessList(g));
      else backend_->PrepareGroup(groups_[g], slot_bytes);
    }
  } catch (...) {
    ReturnMemory();
    throw;
  }
  buffers_.resize(groups_.size());
  last_buffer_.assign(groups_.size(), {});
}

Comm::~Comm() { ReturnMemory(); }

void Comm::TakeSharedMemory(int gi) {
  Group& g = groups_[gi];
  for (int r = 0; r < nranks_; ++r) {
    g.workspaces.push_back(peers_->workspace(gi, r));
    ErrorRecord* host = nullptr;
    ErrorRecord* dev = nullptr;
    // Another process's rank: its process keeps its record.
    if (IsLocal(gi, r)) host = peers_->error_record(gi, r, &dev);
    g.errors.push_back(host);
    g.errors_device.push_back(dev);
  }
}

void Comm::ReturnMemory() {
  // Every device of every group first: a rank's kernel may still read a
  // peer's workspace after its own device is idle.
  for (auto& g : groups_)
    for (int ord : g.ordinals)
      if (ord >= 0) backend_->Synchronize(ord);
  if (peers_) {
    // Not pooled here: the shared workspaces and error records belong to
    // `peers_`, which src/sifar_jax/distributed.py pools, reuses or frees
    // together with the other processes.
    peers_.reset();
    return;
  }
  for (auto& g : groups_) {
    Pool::Get().Retire(std::move(g.multicast));
    Pool::Get().Release({platform_, axis_key_, g.ordinals, layout_.total}, g);
  }
}

int Comm::ProcessOf(int group, int rank) const {
  return peers_ ? peers_->process(group, rank) : -1;
}

std::vector<std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms>> Comm::Stats() const {
  std::vector<std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms>> out;
  for (auto& g : groups_)
    for (size_t r = 0; r < g.workspaces.size(); ++r) {
      if (g.ordinals[r] < 0) continue;  // another process counts its own ranks
      std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms> s;
      backend_->Read(g.ordinals[r], s.data(), g.workspaces[r] + layout_.stats, sizeof(s));
      // The portable kernels count calls per lane (no atomic on their fast path).
      for (int l = 0; l < layout_.lanes; ++l) {
        std::array<uint64_t, kNumAlgorithms> calls;
        backend_->Read(g.ordinals[r], calls.data(),
                      g.workspaces[r] + layout_.LaneAt(l) + layout_.lane.calls, sizeof(calls));
        for (int a = 0; a < kNumAlgorithms; ++a) s[a][kCalls] += calls[a];
      }
      out.push_back(s);
    }
  return out;
}

bool Comm::FirstError(ErrorRecord* out, int* group) const {
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g)
    for (int r = 0; r < nranks_; ++r) {
      if (!RankFailed(g, r)) continue;
      std::memcpy(out, groups_[g].errors[r], sizeof(ErrorRecord));
      *group = g;
      return true;
    }
  return false;
}

template <typename T>
void Comm::WriteControlField(int rank, size_t offset, T value) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "one aligned word per write");
  for (auto& g : groups_)
    for (int r = 0; r < nranks_; ++r)
      if ((rank < 0 || r == rank) && g.ordinals[r] >= 0)
        backend_->Write(g.ordinals[r], g.workspaces[r] + layout_.control + offset, &value,
                        sizeof(T));
}

void Comm::SetSkew(uint32_t max_ns, uint32_t seed) {
  // Two words: a kernel starting in between draws from (new max, old seed),
  // which is as random as any other draw.
  WriteControlField(-1, offsetof(Control, skew_max_ns), max_ns);
  WriteControlField(-1, offsetof(Control, skew_seed), seed);
}

void Comm::SetTimeout(double seconds) {
  WriteControlField(-1, offsetof(Control, timeout_ns), static_cast<uint64_t>(seconds * 1e9));
}

void Comm::SetDrop(int rank, bool drop, int from_block) {
  if (rank < 0 || rank >= nranks_) throw std::out_of_range("sifar_jax: rank out of range");
  if (from_block < 0 || from_block >= kMaxBlocks)
    throw std::out_of_range("sifar_jax: from_block out of range");
  WriteControlField(rank, offsetof(Control, drop), drop ? static_cast<uint32_t>(from_block) + 1 : 0u);
}

void Comm::SetEpochs(uint32_t epoch) {
  // The barrier words must look as if epoch `epoch` had just completed, or a
  // wrap-safe comparison would take today's values for later ones.
  std::vector<uint32_t> e(kMaxBlocks, epoch);
  std::vector<uint64_t> b(kMaxBlocks * kMaxRanks, BarrierWord(0, BarrierValue(epoch, kBottom)));
  for (auto& g : groups_)
    for (size_t r = 0; r < g.workspaces.size(); ++r)
      for (int l = 0; l < layout_.lanes && g.ordinals[r] >= 0; ++l) {
        char* lane = g.workspaces[r] + layout_.LaneAt(l);
        backend_->Write(g.ordinals[r], lane + layout_.lane.epochs, e.data(), e.size() * sizeof(uint32_t));
        backend_->Write(g.ordinals[r], lane + layout_.lane.barrier, b.data(), b.size() * sizeof(uint64_t));
      }
}

void Comm::SetEpochMask(uint32_t mask) {
  if (mask > kEpochTagMask || (mask != 0 && (mask & (mask + 1)) != 0 ) || mask == 1)
    throw std::invalid_argument("sifar_jax: the epoch mask must be 2^k-1 with 2 <= k <= 24, or 0");
  WriteControlField(-1, offsetof(Control, epoch_mask), mask);
}

void Comm::SetTrace(bool on) {
  if (on) {  // start from an empty ring
    TraceRing empty{};
    for (auto& g : groups_)
      for (size_t r = 0; r < g.workspaces.size(); ++r)
        if (g.ordinals[r] >= 0)
          backend_->Write(g.ordinals[r], g.workspaces[r] + layout_.trace, &empty,
                          offsetof(TraceRing, records));
  }
  WriteControlField(-1, offsetof(Control, trace), on ? 1u : 0u);
}

std::vector<std::tuple<int, int, TraceRecord>> Comm::Trace() const {
  std::vector<std::tuple<int, int, TraceRecord>> out;
  std::unique_ptr<TraceRing> ring(new TraceRing);
  for (int gi = 0; gi < static_cast<int>(groups_.size()); ++gi) {
    const Group& g = groups_[gi];
    for (int r = 0; r < static_cast<int>(g.workspaces.size()); ++r) {
      if (!IsLocal(gi, r)) continue;
      backend_->Read(g.ordinals[r], ring.get(), g.workspaces[r] + layout_.trace, sizeof(TraceRing));
      const unsigned long long n = ring->next;
      const unsigned long long first = n > kTraceCapacity ? n - kTraceCapacity : 0;
      for (unsigned long long k = first; k < n; ++k)
        out.emplace_back(gi, r, ring->records[k % kTraceCapacity]);
    }
  }
  return out;
}

uint64_t Comm::RegisterBuffer(int group, const std::vector<uintptr_t>& per_rank,
                              size_t bytes) {
  if (group < 0 || group >= static_cast<int>(groups_.size()) ||
      static_cast<int>(per_rank.size()) != nranks_)
    throw std::invalid_argument("sifar_jax: RegisterBuffer needs one pointer per rank");
  if (bytes < slot_total_bytes())
    throw std::invalid_argument("sifar_jax: a buffer must hold a whole slot");
  static std::atomic<uint64_t> next_id{1};
  RegisteredBuffer b{next_id++, {}, bytes};
  for (int r = 0; r < nranks_; ++r) {
    if (per_rank[r] % 16) throw std::invalid_argument("sifar_jax: buffers must be 16-byte aligned");
    b.per_rank[r] = reinterpret_cast<char*>(per_rank[r]);
  }
  auto overlaps = [&](const RegisteredBuffer& old) {
    for (int r = 0; r < nranks_; ++r)
      if (old.per_rank[r] < b.per_rank[r] + b.bytes && b.per_rank[r] < old.per_rank[r] + old.bytes)
        return true;
    return false;
  };
  std::lock_guard<std::mutex> lock(buffers_mu_);
  auto& list = buffers_[group];
  list.erase(std::remove_if(list.begin(), list.end(), overlaps), list.end());
  list.push_back(b);
  return b.id;
}

bool Comm::UnregisterBuffer(uint64_t id) {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  for (auto& list : buffers_)
    for (auto it = list.begin(); it != list.end(); ++it)
      if (it->id == id) {
        list.erase(it);
        return true;
      }
  return false;
}

std::vector<RegisteredBuffer> Comm::Buffers(int group) const {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  return buffers_.at(group);
}

bool Comm::FindBuffer(int group, int rank, const void* ptr, char* (&slots)[kMaxRanks],
                      std::string* why, bool in_run_order) const {
  const std::string who = "sifar_jax.sifar_psum_into: rank " + std::to_string(rank) +
                          " of axis '" + axis_name_ + "'";
  std::lock_guard<std::mutex> lock(buffers_mu_);
  const RegisteredBuffer* found = nullptr;
  for (const auto& b : buffers_[group]) {
    if (b.per_rank[rank] != ptr) continue;
    if (found != nullptr) {  // cannot happen while registrations follow the arrays' lives
      *why = who + " was given a buffer that matches two registered buffers; make new "
             "buffers with sifar_jax.make_buffers";
      return false;
    }
    found = &b;
  }
  if (found == nullptr) {
    *why = who + " was given a buffer that sifar_jax.make_buffers did not register: XLA copied "
           "it (or it was made before the last sifar_jax.init). Pass both buffers into the "
           "jitted step with donate_argnums, return them, and feed the returned buffers to the "
           "next step";
    return false;
  }
  uint64_t& last = last_buffer_[group][rank];
  if (in_run_order && last == found->id) {
    *why = who + " was given the buffer its previous all-reduce wrote: consecutive calls of "
           "sifar_psum_into must alternate the two buffers of sifar_jax.make_buffers "
           "(y, a = sifar_psum_into(x, axis, a, b); z, b = sifar_psum_into(y, axis, b, a))";
    return false;
  }
  last = in_run_order ? found->id : 0;  // 0: unknown
  for (int r = 0; r < kMaxRanks; ++r) slots[r] = found->per_rank[r];
  return true;
}

// --------------------------------------------------------------- registry --
Registry& Registry::Get() {
  static Registry* r = new Registry();  // never destroyed: handlers may run at exit
  return *r;
}

int Registry::Create(Platform platform, int axis_key, const std::string& axis_name,
                     const std::vector<std::vector<int>>& groups, size_t slot_bytes,
                     double timeout_s, int lanes, std::shared_ptr<PeerWorkspaces> peers) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& g : groups)
    for (int ord : g)
      if (ord >= 0 && index_.count(IndexKey(axis_key, ord)))
        throw std::invalid_argument("sifar_jax: device " + std::to_string(ord) +
                                    " already has a communicator for axis '" + axis_name +
                                    "'; call sifar_jax.shutdown() first");
  int id = next_id_++;
  auto comm = std::make_shared<Comm>(id, platform, axis_key, axis_name, groups, slot_bytes,
                                     timeout_s, lanes, std::move(peers));
  for (int g = 0; g < static_cast<int>(groups.size()); ++g)
    for (int r = 0; r < static_cast<int>(groups[g].size()); ++r)
      if (groups[g][r] >= 0) index_[IndexKey(axis_key, groups[g][r])] = {id, g, r};
  comms_[id] = std::move(comm);
  return id;
}

void Registry::Destroy(int id) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find(id);
    if (it == comms_.end()) return;
    for (auto i = index_.begin(); i != index_.end();)
      i = (i->second[0] == id) ? index_.erase(i) : std::next(i);
    comm = std::move(it->second);
    comms_.erase(it);
  }
  // No new handler call can find it now.  Those under way end by themselves:
  // a rank whose peer will not come any more times out.
  while (comm.use_count() > 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
  comm.reset();  // ~Comm waits for the devices, then pools the memory
}

void Registry::DestroyAll() {
  for (int id : Ids()) Destroy(id);
}

std::vector<int> Registry::Ids() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> ids;
  for (auto& kv : comms_) ids.push_back(kv.first);
  return ids;
}

int Registry::CallsInFlight(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(id);
  return it == comms_.end() ? 0 : static_cast<int>(it->second.use_count()) - 1;
}

RankRef Registry::Lookup(int axis_key, int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(IndexKey(axis_key, ordinal));
  if (it == index_.end()) return {};
  return {comms_.at(it->second[0]), it->second[1], it->second[2]};
}

}  // namespace sifar
