/* zlib's crc32, folded with carry-less multiplication (PCLMULQDQ) where the CPU has it.
 *
 * Why: every byte fsdp_restore writes, saves or verifies is checksummed, and zlib's own crc32 (a table loop, about
 * 2 GB/s per core on the hosts measured, BENCHMARKS.md) is a pass of its own over the data. The folding method
 * is Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction" (Gopal et al., 2009):
 * four 128-bit lanes folded 64 bytes at a time, then into one lane, then a Barrett reduction to 32 bits. The
 * constants are x^k mod P for the reflected polynomial 0xEDB88320 (k = 4*128+32 and 4*128-32 for the 64-byte
 * fold, 128+32 and 128-32 for the 16-byte one, 64 for the last fold), mu = x^64 div P, and P itself; the tests
 * compare this with zlib.crc32 on every length up to a few hundred bytes and on random buffers.
 *
 * Same contract as zlib.crc32(data, value): the running crc32 of data after value. Fewer than 64 bytes, and the
 * last 0-15 bytes, go through a byte table. Built by pip as an optional extension (setup.py); where it is not
 * built, or the CPU lacks PCLMULQDQ/SSE4.1 (`has_pclmul`), checksum.crc32 is zlib's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

static uint32_t table[256];

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
}

/* the crc register (not complemented) after bytes */
static uint32_t bytewise(uint32_t state, const unsigned char *p, size_t n) {
    while (n--) state = table[(state ^ *p++) & 0xFF] ^ (state >> 8);
    return state;
}

#ifdef HAVE_X86
__attribute__((target("pclmul,sse4.1")))
static uint32_t folded(uint32_t state, const unsigned char *p, size_t n) {
    /* n >= 64: returns the register after the first n & ~15 bytes; the caller does the rest */
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL); /* mu (high), P (low) */
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);

    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 0));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)state));
    p += 64;
    n -= 64;
    while (n >= 64) {
        __m128i t1 = _mm_clmulepi64_si128(x1, k1k2, 0x00), t2 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        __m128i t3 = _mm_clmulepi64_si128(x3, k1k2, 0x00), t4 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, t1), _mm_loadu_si128((const __m128i *)(p + 0)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, t2), _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, t3), _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, t4), _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    /* four lanes into one */
    __m128i t;
    t = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), t), x2);
    t = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), t), x3);
    t = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), t), x4);
    while (n >= 16) {
        t = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x11), t),
                           _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    /* 128 -> 64 bits (and 32 zero bits appended) */
    t = _mm_clmulepi64_si128(x1, k3k4, 0x10); /* x1.low * k4 */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
    /* 64 -> 32 bits of fold */
    __m128i x2b = _mm_srli_si128(x1, 4);
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00);
    x1 = _mm_xor_si128(x1, x2b);
    /* Barrett reduction to 32 bits */
    x2b = x1;
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10); /* * mu */
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x00); /* * P */
    x1 = _mm_xor_si128(x1, x2b);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static int pclmul = 0;
#endif

static uint32_t crc32_of(uint32_t crc, const unsigned char *p, size_t n) {
    uint32_t state = crc ^ 0xFFFFFFFFu;
#ifdef HAVE_X86
    if (pclmul && n >= 64) {
        size_t head = n & ~(size_t)15;
        state = folded(state, p, head);
        p += head;
        n -= head;
    }
#endif
    return bytewise(state, p, n) ^ 0xFFFFFFFFu;
}

static PyObject *crc32(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "y*|k", &view, &value)) return NULL;
    uint32_t crc;
    if (view.len >= 65536) { /* (as zlib.crc32: other threads run meanwhile) */
        Py_BEGIN_ALLOW_THREADS
        crc = crc32_of((uint32_t)value, (const unsigned char *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = crc32_of((uint32_t)value, (const unsigned char *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *has_pclmul(PyObject *self, PyObject *args) {
#ifdef HAVE_X86
    return PyBool_FromLong(pclmul);
#else
    return PyBool_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"crc32", crc32, METH_VARARGS, "crc32(data, value=0) -> zlib's crc32 of data after value."},
    {"has_pclmul", has_pclmul, METH_NOARGS, "Whether the folded (PCLMULQDQ) crc32 runs on this CPU."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32", NULL, -1, methods};

PyMODINIT_FUNC PyInit__crc32(void) {
    make_table();
#ifdef HAVE_X86
    __builtin_cpu_init();
    pclmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    return PyModule_Create(&module);
}
