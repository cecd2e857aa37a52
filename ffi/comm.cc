#include "comm.h"

#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "peer_memory.h"

namespace sifar {

namespace {

// XLA:CPU ranks share this process's memory: a workspace is an aligned block.
class HostMemory : public Memory {
 public:
  char* Alloc(int, size_t bytes) override {
    void* p = std::aligned_alloc(kAlign, AlignUp(bytes, kAlign));
    if (p == nullptr) throw std::runtime_error("sifar_jax: host workspace allocation failed");
    std::memset(p, 0, bytes);
    return static_cast<char*>(p);
  }
  void Free(int, char* ptr) override { std::free(ptr); }
  void Write(int, char* dst, const void* src, size_t bytes) override {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    std::memcpy(dst, src, bytes);
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
};

uint64_t IndexKey(int axis_key, int ordinal) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(axis_key)) << 32) |
         static_cast<uint32_t>(ordinal);
}

}  // namespace

std::unique_ptr<Memory> MakeHostMemory() { return std::make_unique<HostMemory>(); }

Comm::Comm(int id, Platform platform, int axis_key, std::string axis_name,
           std::vector<std::vector<int>> groups, size_t slot_bytes, double timeout_s, int lanes,
           std::shared_ptr<PeerWorkspaces> peers)
    : id_(id),
      platform_(platform),
      axis_key_(axis_key),
      axis_name_(std::move(axis_name)),
      nranks_(groups.empty() ? 0 : static_cast<int>(groups[0].size())),
      layout_(MakeWorkspaceLayout(slot_bytes, groups.empty() ? 1 : static_cast<int>(groups[0].size()),
                                  lanes)) {
  if (lanes < 1 || lanes > 64)
    throw std::invalid_argument("sifar_jax: lanes must be 1..64");
  if (slot_bytes == 0 || slot_bytes % 16 != 0)
    throw std::invalid_argument("sifar_jax: slot_bytes must be a positive multiple of 16");
  if (nranks_ < 1 || nranks_ > kMaxRanks)
    throw std::invalid_argument("sifar_jax: a communicator needs 1.." + std::to_string(kMaxRanks) +
                                " ranks per group");
#ifdef SIFAR_WITH_CUDA
  memory_ = platform == Platform::kCuda ? MakeCudaMemory() : MakeHostMemory();
#else
  if (platform == Platform::kCuda)
    throw std::runtime_error("sifar_jax was built without CUDA support");
  memory_ = MakeHostMemory();
#endif
  peers_ = std::move(peers);
  if (peers_ && (peers_->platform() != platform || peers_->ordinals() != groups ||
                 peers_->bytes() < layout_.total))
    throw std::invalid_argument("sifar_jax: the shared workspaces do not fit this communicator");
  for (auto& ords : groups) {
    if (static_cast<int>(ords.size()) != nranks_)
      throw std::invalid_argument("sifar_jax: all groups of an axis must have the same size");
    Group g;
    g.ordinals = ords;
    for (int ord : ords) {
      const int gi = static_cast<int>(groups_.size()), r = static_cast<int>(g.workspaces.size());
      g.workspaces.push_back(peers_ ? peers_->workspace(gi, r) : memory_->Alloc(ord, layout_.total));
      if (ord < 0) {  // another process's rank: its process keeps its record
        g.errors.push_back(nullptr);
        g.errors_device.push_back(nullptr);
        continue;
      }
      char* dev = nullptr;
      char* host = memory_->AllocShared(ord, sizeof(ErrorRecord), &dev);
      g.errors.push_back(reinterpret_cast<ErrorRecord*>(host));
      g.errors_device.push_back(reinterpret_cast<ErrorRecord*>(dev));
    }
    groups_.push_back(std::move(g));
  }
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g)
    for (int r = 0; r < nranks_; ++r) {
      if (!IsLocal(g, r)) continue;
      Control c{};
      c.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
      c.poll_depth = kDefaultPollDepth;
      c.poll_gap_ns = kDefaultPollGapNs;
      WriteControl(g, r, c);
    }
#ifdef SIFAR_WITH_CUDA
  if (platform == Platform::kCuda)
    for (auto& g : groups_) {
      if (peers_) {
        const int gi = static_cast<int>(&g - groups_.data());
        g.multicast_refusal = "multicast needs every rank in one process";
        for (int ord : g.ordinals)
          if (ord >= 0) PrepareCudaDevice(ord, peers_->PeerAccessList(gi), false);
        continue;
      }
      // The guard reads the environment first and makes no CUDA call when it
      // refuses (always, on hosts where multicast is off).
      std::optional<std::string> refusal = MulticastRefusalHere(g.ordinals);
      if (refusal) g.multicast_refusal = *refusal;
      else g.multicast = CreateMulticastGroup(g.ordinals, slot_bytes);
      for (int ord : g.ordinals) PrepareCudaDevice(ord, g.ordinals, g.multicast != nullptr);
    }
#else
  for (auto& g : groups_) g.multicast_refusal = "sifar_jax was built without CUDA";
#endif
  if (platform == Platform::kCpu)
    for (auto& g : groups_) g.multicast_refusal = "multicast needs NVLink GPUs";
}

Comm::~Comm() {
  for (auto& g : groups_) g.multicast.reset();  // unmaps before the workspaces go
  for (auto& g : groups_)
    for (size_t r = 0; r < g.workspaces.size(); ++r) {
      if (!peers_) memory_->Free(g.ordinals[r], g.workspaces[r]);
      if (g.errors[r]) memory_->FreeShared(g.ordinals[r], reinterpret_cast<char*>(g.errors[r]));
    }
  peers_.reset();  // unmaps the peers' workspaces, frees this process's
}

int Comm::ProcessOf(int group, int rank) const {
  return peers_ ? peers_->process(group, rank) : -1;
}

void Comm::WriteControl(int g, int r, const Control& c) {
  memory_->Write(groups_[g].ordinals[r], groups_[g].workspaces[r] + layout_.control, &c,
                 sizeof(Control));
}

Control Comm::ReadControl(int g, int r) const {
  Control c;
  memory_->Read(groups_[g].ordinals[r], &c, groups_[g].workspaces[r] + layout_.control,
                sizeof(Control));
  return c;
}

std::vector<std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms>> Comm::Stats() const {
  std::vector<std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms>> out;
  for (auto& g : groups_)
    for (size_t r = 0; r < g.workspaces.size(); ++r) {
      if (g.ordinals[r] < 0) continue;  // another process counts its own ranks
      std::array<std::array<uint64_t, kNumStats>, kNumAlgorithms> s;
      memory_->Read(g.ordinals[r], s.data(), g.workspaces[r] + layout_.stats, sizeof(s));
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

void Comm::UpdateControl(int rank, const std::function<void(Control&)>& update) {
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g)
    for (int r = 0; r < nranks_; ++r) {
      if ((rank >= 0 && r != rank) || !IsLocal(g, r)) continue;  // each process writes its own
      Control c = ReadControl(g, r);
      update(c);
      WriteControl(g, r, c);
    }
}

void Comm::SetSkew(uint32_t max_ns, uint32_t seed) {
  UpdateControl(-1, [&](Control& c) {
    c.skew_max_ns = max_ns;
    c.skew_seed = seed;
  });
}

void Comm::SetTimeout(double seconds) {
  UpdateControl(-1, [&](Control& c) { c.timeout_ns = static_cast<uint64_t>(seconds * 1e9); });
}

void Comm::SetPoll(uint32_t depth, uint32_t gap_ns) {
  if (depth < 1 || depth > kMaxPollDepth)
    throw std::out_of_range("sifar_jax: poll depth must be 1.." + std::to_string(kMaxPollDepth));
  UpdateControl(-1, [&](Control& c) {
    c.poll_depth = depth;
    c.poll_gap_ns = gap_ns;
  });
}

void Comm::RegisterBuffer(int group, const std::vector<uintptr_t>& per_rank) {
  if (group < 0 || group >= static_cast<int>(groups_.size()) ||
      static_cast<int>(per_rank.size()) != nranks_)
    throw std::invalid_argument("sifar_jax: RegisterBuffer needs one pointer per rank");
  std::array<char*, kMaxRanks> b{};
  for (int r = 0; r < nranks_; ++r) {
    if (per_rank[r] % 16) throw std::invalid_argument("sifar_jax: buffers must be 16-byte aligned");
    b[r] = reinterpret_cast<char*>(per_rank[r]);
  }
  std::lock_guard<std::mutex> lock(buffers_mu_);
  groups_[group].buffers.push_back(b);
}

bool Comm::FindBuffer(int group, int rank, const void* ptr, char* (&slots)[kMaxRanks]) const {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  for (const auto& b : groups_[group].buffers)
    if (b[rank] == ptr) {
      for (int r = 0; r < kMaxRanks; ++r) slots[r] = b[r];
      return true;
    }
  return false;
}

void Comm::SetDrop(int rank, bool drop, int from_block) {
  if (rank < 0 || rank >= nranks_) throw std::out_of_range("sifar_jax: rank out of range");
  if (from_block < 0 || from_block >= kMaxBlocks)
    throw std::out_of_range("sifar_jax: from_block out of range");
  UpdateControl(rank, [&](Control& c) { c.drop = drop ? static_cast<uint32_t>(from_block) + 1 : 0u; });
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
        memory_->Write(g.ordinals[r], lane + layout_.lane.epochs, e.data(), e.size() * sizeof(uint32_t));
        memory_->Write(g.ordinals[r], lane + layout_.lane.barrier, b.data(), b.size() * sizeof(uint64_t));
      }
}

void Comm::SetEpochMask(uint32_t mask) {
  if (mask > kEpochTagMask || (mask != 0 && (mask & (mask + 1)) != 0 ) || mask == 1)
    throw std::invalid_argument("sifar_jax: the epoch mask must be 2^k-1 with 2 <= k <= 24, or 0");
  UpdateControl(-1, [&](Control& c) { c.epoch_mask = mask; });
}

void Comm::SetTrace(bool on) {
  if (on) {  // start from an empty ring
    TraceRing empty{};
    for (auto& g : groups_)
      for (size_t r = 0; r < g.workspaces.size(); ++r)
        if (g.ordinals[r] >= 0)
          memory_->Write(g.ordinals[r], g.workspaces[r] + layout_.trace, &empty,
                       offsetof(TraceRing, records));
  }
  UpdateControl(-1, [&](Control& c) { c.trace = on ? 1u : 0u; });
}

std::vector<std::tuple<int, int, TraceRecord>> Comm::Trace() const {
  std::vector<std::tuple<int, int, TraceRecord>> out;
  std::unique_ptr<TraceRing> ring(new TraceRing);
  for (int gi = 0; gi < static_cast<int>(groups_.size()); ++gi) {
    const Group& g = groups_[gi];
    for (int r = 0; r < static_cast<int>(g.workspaces.size()); ++r) {
      if (!IsLocal(gi, r)) continue;
      memory_->Read(g.ordinals[r], ring.get(), g.workspaces[r] + layout_.trace, sizeof(TraceRing));
      const unsigned long long n = ring->next;
      const unsigned long long first = n > kTraceCapacity ? n - kTraceCapacity : 0;
      for (unsigned long long k = first; k < n; ++k)
        out.emplace_back(gi, r, ring->records[k % kTraceCapacity]);
    }
  }
  return out;
}

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
  auto comm = std::make_unique<Comm>(id, platform, axis_key, axis_name, groups, slot_bytes,
                                     timeout_s, lanes, std::move(peers));
  for (int g = 0; g < static_cast<int>(groups.size()); ++g)
    for (int r = 0; r < static_cast<int>(groups[g].size()); ++r)
      if (groups[g][r] >= 0) index_[IndexKey(axis_key, groups[g][r])] = {id, g, r};
  comms_[id] = std::move(comm);
  return id;
}

void Registry::Destroy(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(id);
  if (it == comms_.end()) return;
  for (auto i = index_.begin(); i != index_.end();)
    i = (i->second[0] == id) ? index_.erase(i) : std::next(i);
  comms_.erase(it);
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

RankRef Registry::Lookup(int axis_key, int ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(IndexKey(axis_key, ordinal));
  if (it == index_.end()) return {};
  return {comms_.at(it->second[0]).get(), it->second[1], it->second[2]};
}

}  // namespace sifar
