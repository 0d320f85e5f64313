#include "moekit/common/thread_pool.h"

#include <cstdlib>

namespace moekit {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) {
    const char* env = std::getenv("MOEKIT_THREADS");
    threads = env ? std::atoi(env) : int(std::thread::hardware_concurrency());
    if (threads <= 0) threads = 1;
  }
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

void ThreadPool::drain() {
  for (;;) {
    int64_t i;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (next_ >= n_) return;
      i = next_++;
    }
    (*fn_)(i);
    std::lock_guard<std::mutex> lk(mu_);
    if (++finished_ == n_) done_cv_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call(call_mu_);
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    finished_ = 0;
    ++generation_;
  }
  cv_.notify_all();
  drain();
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return finished_ == n_; });
  fn_ = nullptr;
}

}  // namespace moekit
