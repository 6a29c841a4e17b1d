/* fsdp_restore._screened: the restore check's read of host memory, poisoned and screened window by window.

   pread_screened(fd, buffers, offset, window) reads the bytes from ``offset`` of ``fd`` into ``buffers`` (a
   sequence of (address, nbytes, kind, itemsize), back to back in the file) in windows of about ``window``
   bytes. Each window's floating parts (kind > 0) are first filled with 0xFF bytes (NaN in every float format
   screened here), then read, then screened for NaN: an element the read did not write is still NaN. Returns
   (bytes read, indices of the buffers where a screen found NaN, bytes filled and screened of each buffer).
   It stops early only at the file's end (the rest of that window is filled and screened all the same).

   Why native code (BENCHMARKS.md, session 25): the fill, the read and the screen of one window meet in the
   core's own cache only when windows are a few hundred KB, and per window the Python between the three
   calls cost more than the two passes it saved. The whole loop runs without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { KIND_NONE = 0, KIND_F16 = 1, KIND_BF16 = 2, KIND_F32 = 3, KIND_F64 = 4, KIND_LAST = 4 };
#define MAX_SEGMENTS 1024 /* Linux's UIO_MAXIOV: the most buffers one preadv takes */

typedef struct {
    char *address;
    size_t nbytes;
    int kind;
    size_t itemsize;
} Buffer;

typedef struct {
    char *address;
    size_t nbytes;
    int kind;
    Py_ssize_t buffer;
} Segment;

/* Whether any element holds NaN: a magnitude (the bits below the sign) above the all-ones exponent's. Adding
   (largest magnitude - infinity's) to the magnitude carries into the sign bit exactly for those, so one AND, one
   ADD and one OR per element, OR-ed into an accumulator whose sign bit is tested once: plain SSE2 once unrolled
   (setup.py: -funroll-loops), where a comparison per element ran at under half the speed (BENCHMARKS.md, session
   26). No sum can overflow: the largest magnitude plus the addend stays below the type's top. */
static int has_nan(const char *p, size_t nbytes, int kind) {
    size_t i;
    switch (kind) {
    case KIND_F16: {
        const uint16_t *x = (const uint16_t *)p;
        uint16_t acc = 0;
        for (i = 0; i < nbytes / 2; i++) acc |= (uint16_t)((x[i] & 0x7fffu) + 0x03ffu); /* NaN: above 0x7c00 */
        return (acc >> 15) != 0;
    }
    case KIND_BF16: {
        const uint16_t *x = (const uint16_t *)p;
        uint16_t acc = 0;
        for (i = 0; i < nbytes / 2; i++) acc |= (uint16_t)((x[i] & 0x7fffu) + 0x007fu); /* NaN: above 0x7f80 */
        return (acc >> 15) != 0;
    }
    case KIND_F32: {
        const uint32_t *x = (const uint32_t *)p;
        uint32_t acc = 0;
        for (i = 0; i < nbytes / 4; i++) acc |= (x[i] & 0x7fffffffu) + 0x007fffffu; /* NaN: above 0x7f800000 */
        return (acc >> 31) != 0;
    }
    case KIND_F64: {
        const uint64_t *x = (const uint64_t *)p;
        uint64_t acc = 0;
        for (i = 0; i < nbytes / 8; i++)
            acc |= (x[i] & 0x7fffffffffffffffull) + 0x000fffffffffffffull; /* NaN: above 0x7ff0000000000000 */
        return (acc >> 63) != 0;
    }
    default:
        return 0;
    }
}

/* Read the segments from ``offset``, again where the kernel returns less; returns the bytes read (fewer only at
   the file's end), or -1 with errno set. */
static ssize_t read_segments(int fd, const Segment *segments, int count, off_t offset) {
    struct iovec iov[MAX_SEGMENTS];
    int i, first = 0;
    size_t total = 0;
    for (i = 0; i < count; i++) {
        iov[i].iov_base = segments[i].address;
        iov[i].iov_len = segments[i].nbytes;
    }
    while (first < count) {
        ssize_t got = preadv(fd, iov + first, count - first, offset + (off_t)total);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break;
        total += (size_t)got;
        while (first < count && (size_t)got >= iov[first].iov_len) {
            got -= (ssize_t)iov[first].iov_len;
            first++;
        }
        if (first < count && got > 0) {
            iov[first].iov_base = (char *)iov[first].iov_base + got;
            iov[first].iov_len -= (size_t)got;
        }
    }
    return (ssize_t)total;
}

static PyObject *pread_screened(PyObject *self, PyObject *args) {
    int fd;
    PyObject *sequence;
    long long offset;
    Py_ssize_t window;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOLn", &fd, &sequence, &offset, &window)) return NULL;
    if (offset < 0 || window <= 0) {
        PyErr_SetString(PyExc_ValueError, "pread_screened: negative offset or window not positive");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(sequence, "pread_screened: buffers must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Buffer *buffers = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Buffer));
    unsigned char *flagged = PyMem_Calloc(n ? (size_t)n : 1, 1);
    size_t *screened = PyMem_Calloc(n ? (size_t)n : 1, sizeof(size_t));
    Segment *segments = PyMem_Calloc(MAX_SEGMENTS, sizeof(Segment));
    if (buffers == NULL || flagged == NULL || screened == NULL || segments == NULL) {
        Py_DECREF(fast);
        PyMem_Free(buffers);
        PyMem_Free(flagged);
        PyMem_Free(screened);
        PyMem_Free(segments);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long address;
        Py_ssize_t nbytes, itemsize;
        int kind;
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyArg_ParseTuple(item, "Knin;pread_screened: each buffer is (address, nbytes, kind, itemsize)",
                              &address, &nbytes, &kind, &itemsize)) {
            goto fail;
        }
        /* (signed sizes, range-checked by the parser: a negative one would wrap to a huge unsigned length) */
        if (kind < KIND_NONE || kind > KIND_LAST || nbytes < 0 || itemsize <= 0 || nbytes % itemsize) {
            PyErr_Format(PyExc_ValueError, "pread_screened: buffer %zd: kind %d, %zd bytes of %zd-byte items",
                         i, kind, nbytes, itemsize);
            goto fail;
        }
        buffers[i].address = (char *)(uintptr_t)address;
        buffers[i].nbytes = (size_t)nbytes;
        buffers[i].kind = kind;
        buffers[i].itemsize = (size_t)itemsize;
    }
    Py_DECREF(fast);
    fast = NULL;

    size_t done = 0;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t b = 0; /* the buffer the next window starts in, and where in it */
    size_t at = 0;
    while (b < n) {
        int count = 0;
        size_t size = 0;
        /* a window: parts of consecutive buffers, at most ``window`` bytes, cut on an item's boundary */
        while (b < n && count < MAX_SEGMENTS && size < (size_t)window) {
            size_t rest = buffers[b].nbytes - at;
            size_t take = rest < (size_t)window - size ? rest : (size_t)window - size;
            if (take < rest) take -= take % buffers[b].itemsize;
            if (take == 0 && rest > 0) {
                if (count > 0) break;
                take = rest < buffers[b].itemsize ? rest : buffers[b].itemsize;
            }
            if (take > 0) {
                segments[count].address = buffers[b].address + at;
                segments[count].nbytes = take;
                segments[count].kind = buffers[b].kind;
                segments[count].buffer = b;
                count++;
                size += take;
                at += take;
            }
            if (at == buffers[b].nbytes) {
                b++;
                at = 0;
            } else {
                break;
            }
        }
        if (count == 0) continue; /* only empty buffers: passed over above */
        for (int s = 0; s < count; s++)
            if (segments[s].kind != KIND_NONE) memset(segments[s].address, 0xFF, segments[s].nbytes);
        ssize_t got = read_segments(fd, segments, count, (off_t)(offset + (long long)done));
        if (got < 0) {
            error = errno;
            break;
        }
        for (int s = 0; s < count; s++) {
            if (segments[s].kind == KIND_NONE) continue;
            if (!flagged[segments[s].buffer] && has_nan(segments[s].address, segments[s].nbytes, segments[s].kind))
                flagged[segments[s].buffer] = 1;
            screened[segments[s].buffer] += segments[s].nbytes;
        }
        done += (size_t)got;
        if ((size_t)got < size) break; /* the file's end */
    }
    Py_END_ALLOW_THREADS
    if (error) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    PyObject *indices = PyList_New(0), *counts = PyList_New(n);
    if (indices == NULL || counts == NULL) {
        Py_XDECREF(indices);
        Py_XDECREF(counts);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *count = PyLong_FromSize_t(screened[i]);
        if (count == NULL) {
            Py_DECREF(indices);
            Py_DECREF(counts);
            goto fail;
        }
        PyList_SET_ITEM(counts, i, count);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!flagged[i]) continue;
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL || PyList_Append(indices, index) < 0) {
            Py_XDECREF(index);
            Py_DECREF(indices);
            Py_DECREF(counts);
            goto fail;
        }
        Py_DECREF(index);
    }
    PyMem_Free(buffers);
    PyMem_Free(flagged);
    PyMem_Free(screened);
    PyMem_Free(segments);
    return Py_BuildValue("(KNN)", (unsigned long long)done, indices, counts);

fail:
    Py_XDECREF(fast);
    PyMem_Free(buffers);
    PyMem_Free(flagged);
    PyMem_Free(screened);
    PyMem_Free(segments);
    return NULL;
}

static PyMethodDef methods[] = {
    {"pread_screened", pread_screened, METH_VARARGS,
     "pread_screened(fd, buffers, offset, window) -> (bytes read, flagged buffer indices, bytes screened per buffer)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_screened", NULL, -1, methods};

PyMODINIT_FUNC PyInit__screened(void) { return PyModule_Create(&module); }
