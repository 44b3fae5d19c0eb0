#ifndef AIDN_WORKER_ENGINE_SIMD_H_
#define AIDN_WORKER_ENGINE_SIMD_H_

// AIDN_VECTOR_CLONES on a hot loop's function: binaries target the baseline
// x86-64 ISA (SSE2) and must run on any x86-64, so such functions are also
// compiled for AVX2 and AVX-512 and the dynamic loader picks the widest the
// CPU has (GCC/Clang function multiversioning through an ifunc). The loops
// are written in fixed blocks of 16 so that -O2 vectorises every clone.
//
// Every clone rounds exactly as the baseline: vectorising an elementwise
// loop does not reorder its float operations, and the engine is compiled
// with -ffp-contract=off, so the AVX-512 clone (whose ISA includes FMA)
// does not fuse a multiply and an add that the baseline rounds twice.

// Clang (the fuzzing build, scripts/fuzz.sh) does not clone function
// templates yet: it gets the baseline code alone. Neither does the
// ThreadSanitizer build (scripts/tsan.sh): GCC instruments the ifunc
// resolver, which the loader runs before TSan's runtime exists.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(__SANITIZE_THREAD__)
#define AIDN_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AIDN_VECTOR_CLONES
#endif

#endif  // AIDN_WORKER_ENGINE_SIMD_H_
