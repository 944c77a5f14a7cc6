// Creating, attaching and unlinking the node's shared-memory segment.
#include "shm_segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>

namespace nbdist {
namespace {

std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

std::string random_name() {
  unsigned char bytes[12];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(errno_text("getrandom"));
    }
    got += static_cast<size_t>(n);
  }
  static const char hex[] = "0123456789abcdef";
  std::string name = "/nbdist-" + std::to_string(getuid()) + "-";
  for (unsigned char b : bytes) {
    name += hex[b >> 4];
    name += hex[b & 15];
  }
  return name;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

size_t header_bytes(int nranks) {
  return round_up(offsetof(Header, ranks) + sizeof(RankState) * static_cast<size_t>(nranks), 4096);
}

Segment Segment::create(int nranks, size_t slot_bytes, int nsets) {
  if (nranks < 1 || nranks > kMaxRanks) throw std::invalid_argument("shm: bad number of ranks");
  if (slot_bytes == 0 || slot_bytes % 4096 != 0 || nsets < 1)
    throw std::invalid_argument("shm: slot size must be a positive multiple of 4096");
  const size_t data_offset = header_bytes(nranks);
  const size_t total = data_offset + slot_bytes * static_cast<size_t>(nranks) * nsets;

  Segment seg;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    seg.name_ = random_name();
    fd = shm_open(seg.name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno != EEXIST) throw std::runtime_error(errno_text("shm_open(" + seg.name_ + ")"));
  }
  if (fd < 0) throw std::runtime_error("shm: could not find a free segment name");
  // If anything below fails, the name must not outlive this call.
  auto fail = [&](const std::string& what) {
    std::string msg = errno_text(what);
    close(fd);
    shm_unlink(seg.name_.c_str());
    throw std::runtime_error(msg);
  };
  if (fchmod(fd, 0600) != 0) fail("fchmod");
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) fail("ftruncate of the shm segment");
  // Reserve the pages now: on a full tmpfs a later first touch would be a SIGBUS.
  int rc = posix_fallocate(fd, 0, static_cast<off_t>(total));
  if (rc != 0) {
    errno = rc;
    fail("reserving " + std::to_string(total >> 20) + " MiB in /dev/shm (is it too small? "
         "NBDIST_SHM_SLOT_BYTES makes the segment smaller)");
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail("mmap of the shm segment");
  close(fd);
  seg.base_ = static_cast<char*>(p);
  seg.length_ = total;
  seg.hdr_ = new (p) Header();  // ftruncate zero-filled it; this only sets up the atomics
  Header* h = seg.hdr_;
  h->version = kShmVersion;
  h->nranks = static_cast<uint32_t>(nranks);
  h->slot_bytes = slot_bytes;
  h->nsets = static_cast<uint32_t>(nsets);
  h->owner_uid = getuid();
  h->data_offset = data_offset;
  h->total_bytes = total;
  for (int r = 0; r < nranks; ++r) new (&h->ranks[r]) RankState();
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kShmMagic;  // last: an attacher that sees it sees the rest
  return seg;
}

Segment Segment::attach(const std::string& name, int nranks) {
  Segment seg;
  seg.name_ = name;
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw std::runtime_error(errno_text("shm_open(" + name + ") to attach"));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    throw std::runtime_error(errno_text("fstat of the shm segment"));
  }
  if (st.st_uid != getuid() || (st.st_mode & 077) != 0) {
    close(fd);
    throw std::runtime_error("shm segment " + name + " is not private to this user; refusing it");
  }
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(errno_text("mmap of the shm segment"));
  seg.base_ = static_cast<char*>(p);
  seg.length_ = static_cast<size_t>(st.st_size);
  seg.hdr_ = static_cast<Header*>(p);
  std::atomic_thread_fence(std::memory_order_acquire);
  const Header* h = seg.hdr_;
  if (h->magic != kShmMagic || h->version != kShmVersion || h->nranks != static_cast<uint32_t>(nranks) ||
      h->total_bytes != seg.length_) {
    seg.unmap();
    throw std::runtime_error("shm segment " + name + " has an unexpected layout (another nbdist version?)");
  }
  return seg;
}

Segment::Segment(Segment&& o) noexcept { *this = std::move(o); }

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    unmap();
    name_ = std::move(o.name_);
    base_ = o.base_;
    hdr_ = o.hdr_;
    length_ = o.length_;
    o.base_ = nullptr;
    o.hdr_ = nullptr;
    o.length_ = 0;
  }
  return *this;
}

Segment::~Segment() { unmap(); }

bool Segment::register_rank(int local_rank, int global_rank) {
  RankState& me = hdr_->ranks[local_rank];
  me.pid = static_cast<int32_t>(getpid());
  me.global_rank = global_rank;
  uint32_t now = hdr_->attached.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (now == hdr_->nranks) {
    unlink();
    return true;
  }
  return false;
}

void Segment::unlink() {
  if (!name_.empty()) shm_unlink(name_.c_str());  // ENOENT: someone else already did
}

void Segment::unmap() {
  if (base_ != nullptr) munmap(base_, length_);
  base_ = nullptr;
  hdr_ = nullptr;
  length_ = 0;
}

}  // namespace nbdist
