/* One thread's memory read bandwidth for benchmarks/decode_roofline.py: XOR every 64-bit word of a
 * buffer (integer ops, so -O3 vectorizes the loop into full-width loads with no float reassociation
 * question; the result is returned so the loads are not dropped). */
#include <stdint.h>

uint64_t stream_read(const uint64_t *p, int64_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 ^= p[i]; a1 ^= p[i + 1]; a2 ^= p[i + 2]; a3 ^= p[i + 3];
        a4 ^= p[i + 4]; a5 ^= p[i + 5]; a6 ^= p[i + 6]; a7 ^= p[i + 7];
    }
    for (; i < n; i++) a0 ^= p[i];
    return a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7;
}
