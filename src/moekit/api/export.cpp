// libmoekit.so: the public API (include/moekit/moekit.hpp), whole-archived from moekit_runtime;
// only what MOEKIT_API marks is exported. This file only gives the library a source of its own.
#include "moekit/moekit.hpp"
