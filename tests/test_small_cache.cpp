// SmallCache (the prefill GEMMs' tensor-map cache): hits return the kept value without making it
// again, entries are replaced in turn, a value handed out stays valid when a later get() replaces
// its entry, and a failed make is returned and not kept.
#include <gtest/gtest.h>

#include <array>

#include "moekit/common/small_cache.h"

namespace moekit {
namespace {

struct Key {
  const void* base = nullptr;
  long rows = 0;
  bool operator==(const Key& o) const { return base == o.base && rows == o.rows; }
};
using Value = std::array<long, 16>;  // stands for a 128-byte CUtensorMap

struct Maker {
  int made = 0;
  int fail_rows = -1;
  // The value encodes its key, so a wrong entry shows.
  auto operator()(const Key& k) {
    return [this, k](Value* v) {
      if (k.rows == fail_rows) return 7;
      ++made;
      v->fill(k.rows * 1000 + long(reinterpret_cast<uintptr_t>(k.base) & 0xff));
      return 0;
    };
  }
};

long expected(const Key& k) { return k.rows * 1000 + long(reinterpret_cast<uintptr_t>(k.base) & 0xff); }

TEST(SmallCache, HitsReplacementAndCopies) {
  SmallCache<Key, Value, 4> cache;
  Maker mk;
  static char buf[64];
  const Key a{buf, 10}, b{buf + 16, 10}, c{buf, 11};
  Value v{};
  EXPECT_EQ(cache.get(a, &v, mk(a)), 0);
  EXPECT_EQ(v[0], expected(a));
  EXPECT_EQ(cache.get(a, &v, mk(a)), 0);
  EXPECT_EQ(mk.made, 1);
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.get(b, &v, mk(b)), 0);  // another buffer
  EXPECT_EQ(v[15], expected(b));
  EXPECT_EQ(cache.get(c, &v, mk(c)), 0);  // another row count
  EXPECT_EQ(v[3], expected(c));
  EXPECT_EQ(mk.made, 3);
  // Two gets of one call: the first a hit on the entry the second replaces (a, b, c, d fill the
  // four entries; e then replaces a). The first value must survive.
  const Key d{buf, 12}, e{buf, 13};
  EXPECT_EQ(cache.get(d, &v, mk(d)), 0);
  Value first{}, second{};
  EXPECT_EQ(cache.get(a, &first, mk(a)), 0);  // hit: a sits where the next insertion goes
  EXPECT_EQ(cache.get(e, &second, mk(e)), 0);
  EXPECT_EQ(first[0], expected(a));
  EXPECT_EQ(second[0], expected(e));
  // a was replaced: made again.
  const int made = mk.made;
  EXPECT_EQ(cache.get(a, &v, mk(a)), 0);
  EXPECT_EQ(mk.made, made + 1);
  EXPECT_EQ(v[0], expected(a));
}

TEST(SmallCache, FailuresAreReturnedAndNotKept) {
  SmallCache<Key, Value, 2> cache;
  Maker mk;
  mk.fail_rows = 5;
  static char buf[16];
  const Key bad{buf, 5}, good{buf, 6};
  Value v{};
  v.fill(-1);
  EXPECT_EQ(cache.get(bad, &v, mk(bad)), 7);
  EXPECT_EQ(v[0], -1);  // untouched
  EXPECT_EQ(cache.get(bad, &v, mk(bad)), 7);  // not kept: made (and failed) again
  EXPECT_EQ(cache.hits(), 0);
  EXPECT_EQ(cache.get(good, &v, mk(good)), 0);
  EXPECT_EQ(cache.get(good, &v, mk(good)), 0);
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(v[0], expected(good));
}

}  // namespace
}  // namespace moekit
