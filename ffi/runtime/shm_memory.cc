// Workspaces shared between processes on the CPU: one POSIX shared-memory
// object per rank (shm_open + mmap).  The object is unlinked as soon as every
// process has mapped it, so it lives exactly as long as its mappings; a
// process that dies before that leaves a name behind, which the next start
// removes (src/sifar_jax/distributed.py: clean_stale_shared_memory).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/peer_memory.h"

namespace sifar {

namespace {

std::runtime_error SysError(const std::string& what, const std::string& name) {
  return std::runtime_error("sifar_jax: " + what + " '" + name + "' failed: " +
                            std::strerror(errno));
}

// Names published by this process and not unlinked yet.
struct Published {
  std::mutex mu;
  std::set<std::string> names;
};
Published& PublishedSet() {
  static Published* p = new Published();  // never destroyed: atexit hooks use it
  return *p;
}

char* MapFd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    auto err = SysError("mmap of shared memory", name);
    close(fd);
    throw err;
  }
  close(fd);
  return static_cast<char*>(p);
}

class HostPeer : public PeerMemory {
 public:
  char* Export(int, size_t bytes, const std::string& name, std::string* handle) override {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw SysError("shm_open", name);
    {
      std::lock_guard<std::mutex> lock(PublishedSet().mu);
      PublishedSet().names.insert(name);
    }
    // ftruncate zero-fills; the pages appear as they are touched.
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      auto err = SysError("ftruncate of shared memory", name);
      close(fd);
      Unpublish(name);
      throw err;
    }
    try {
      char* p = MapFd(fd, bytes, name);
      *handle = name;
      return p;
    } catch (...) {
      Unpublish(name);
      throw;
    }
  }

  void Unpublish(const std::string& name) override {
    std::lock_guard<std::mutex> lock(PublishedSet().mu);
    if (PublishedSet().names.erase(name)) shm_unlink(name.c_str());
  }

  void FreeExported(int, char* base, size_t bytes, const std::string& name) override {
    Unpublish(name);
    munmap(base, bytes);
  }

  char* Map(int, const std::string& handle, size_t bytes) override {
    int fd = shm_open(handle.c_str(), O_RDWR, 0);
    if (fd < 0) throw SysError("shm_open of a peer's workspace", handle);
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      close(fd);
      throw std::runtime_error("sifar_jax: the peer's workspace '" + handle +
                               "' is smaller than this process's layout (" +
                               std::to_string(bytes) + " bytes): are all processes running the "
                               "same sifar_jax?");
    }
    return MapFd(fd, bytes, handle);
  }

  void Unmap(int, char* base, size_t bytes) override { munmap(base, bytes); }
  void Synchronize(int) override {}  // CPU ranks run on the caller's threads
};

}  // namespace

PeerMemory& HostPeerMemory() {
  static HostPeer* m = new HostPeer();
  return *m;
}

std::vector<std::string> PublishedNames() {
  std::lock_guard<std::mutex> lock(PublishedSet().mu);
  return {PublishedSet().names.begin(), PublishedSet().names.end()};
}

void UnpublishAll() {
  for (const std::string& name : PublishedNames()) HostPeerMemory().Unpublish(name);
}

}  // namespace sifar
