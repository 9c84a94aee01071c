// Picks ATen's vector width from what the compiler was told the CPU has (setup.py builds once per tier of
// tokenmill/isa.py, -march=x86-64-v3 / -v4, or -march=native), so the same source becomes AVX2, AVX-512 or NEON
// code. Include before any ATen header.
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#define TOKENMILL_STR2(x) #x
#define TOKENMILL_STR(x) TOKENMILL_STR2(x)

// For the small lambdas inside kernels' inner loops (one block's work): GCC does not always inline them, and a
// call per block keeps the accumulators in memory (measured: the int8-activation GGUF kernel ran 2-3x slower).
#if defined(__GNUC__)
#define TOKENMILL_INLINE __attribute__((always_inline))
#else
#define TOKENMILL_INLINE
#endif
