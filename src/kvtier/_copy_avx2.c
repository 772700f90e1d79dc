/* kvtier._copy's hashing kernels (copy_kernels.h) compiled with AVX2, for CPUs that have it:
 * _copy.c calls them only when the CPU says so. Elsewhere this file adds nothing. */
#if defined(__GNUC__) && defined(__x86_64__)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#pragma GCC target("avx2")
#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include "third_party/xxhash.h"
#include <emmintrin.h>
#include <xmmintrin.h>

#define KV_NAME(x) x##_avx2
#define KV_KERNEL __attribute__((visibility("hidden")))
#include "copy_kernels.h"
#endif
