/* minipaged's CPU kernels, built as one translation unit by minipaged/cpu/build.py.
 *
 *   paged_attention.c  paged decode attention straight from the pages; the K/V write
 *   fused_ops.c        a Llama layer's element-wise ops: RMSNorm (+ residual), SiLU(gate) * up, RoPE
 *   gguf_matmul.c      y = x @ W^T with W kept as the GGUF file's 4/8-bit blocks
 *   decode_step.c      a decode step's decoder layers in one call (uses all of the above)
 *
 * Each file uses what the files before it define, so they are compiled together, here. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int minipaged_decode_abi(void) { return 7; }

/* 1 when the build uses OpenMP (the kernels split their work over the cores), else 0. */
int minipaged_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

#include "paged_attention.c"
#include "fused_ops.c"
#include "gguf_matmul.c"
#include "decode_step.c"
