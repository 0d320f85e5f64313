// moekit/common/thread_pool.h — a fixed pool of worker threads and a blocking parallel_for.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moekit {

class ThreadPool {
 public:
  // threads = 0: std::thread::hardware_concurrency() (or $MOEKIT_THREADS).
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // Runs fn(i) for i in [0, n), spread over the pool and the calling thread; returns when all
  // are done. Work items are claimed dynamically; fn must not throw. Calls from several threads
  // are serialised; fn must not call parallel_for itself.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

  static ThreadPool& global();

 private:
  void worker_loop();
  void drain();
  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, next_ = 0, finished_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace moekit
