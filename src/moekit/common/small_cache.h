// moekit/common/small_cache.h — a few values made on the host, kept by key (the prefill GEMMs'
// tensor maps: backends/sm90_layer.cu). Entries are replaced in turn; a value is copied out, so a
// later get() may replace any entry without touching what an earlier one returned. Not
// thread-safe: one per layer, whose forward calls come from one thread.
#pragma once

namespace moekit {

// Key: equality-comparable (operator==); Value: copyable.
template <typename Key, typename Value, int N>
class SmallCache {
 public:
  // *out = the value of key: the kept one, or make(out) for a new key. make returns an error
  // code whose zero value means success; a failure is returned and nothing is kept.
  template <typename Make>
  auto get(const Key& key, Value* out, Make&& make) -> decltype(make(out)) {
    using Err = decltype(make(out));
    for (const Entry& e : entries_)
      if (e.used && e.key == key) {
        ++hits_;
        *out = e.value;
        return Err{};
      }
    Entry& e = entries_[next_];
    e.used = false;
    if (const Err err = make(&e.value); err != Err{}) return err;
    e.key = key;
    e.used = true;
    next_ = (next_ + 1) % N;
    *out = e.value;
    return Err{};
  }
  long hits() const { return hits_; }  // lookups answered from the cache (tests)

 private:
  struct Entry {
    Value value{};
    Key key{};
    bool used = false;
  };
  Entry entries_[N];
  int next_ = 0;
  long hits_ = 0;
};

}  // namespace moekit
