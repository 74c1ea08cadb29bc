/*
 * mxfs.io._engine: run a batch of positional reads or writes through io_uring.
 *
 *   run(ops, write, depth, stall_ms) -> int
 *
 * ops is a sequence of (fd, offset, buffer) triples; every buffer is filled from
 * (or written to) its descriptor at its offset.  Up to `depth` requests are in
 * flight at once; short transfers are resubmitted for the rest; a read that
 * meets end of file zero-fills what is left (a sparse chunk file is shorter
 * than the file it belongs to).  The GIL is released while the ring runs.
 * Returns the bytes transferred; raises OSError with the first errno.
 *
 * When no completion comes for `stall_ms`, every request in flight is asked back
 * (IORING_OP_ASYNC_CANCEL): one the kernel had not started completes -ECANCELED
 * and is done on this thread with pread/pwrite instead; one a device holds cannot
 * be cancelled and is waited for.  On kernel 6.18 a buffered write handed to
 * io-wq once never got a worker, and the daemon waiting for it hung for good.
 * taken_back() counts such requests, so an operator sees that it happens.
 *
 * Built only where liburing is present; mxfs/io/batch.py falls back to a
 * Python thread pool of preadv/pwritev behind the same interface otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <liburing.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int fd;
    long long offset;
    Py_buffer view;
    size_t done;   /* bytes transferred so far */
    int busy;      /* a request for it is in the ring */
} op_t;

static void release_ops(op_t *ops, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (ops[i].view.obj)
            PyBuffer_Release(&ops[i].view);
    free(ops);
}

static int parse_ops(PyObject *seq, int write, op_t **out, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(seq, "ops must be a sequence of (fd, offset, buffer)");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    op_t *ops = calloc(n ? n : 1, sizeof(op_t));
    if (!ops) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *buf;
        if (!PyArg_ParseTuple(item, "iLO", &ops[i].fd, &ops[i].offset, &buf) ||
            PyObject_GetBuffer(buf, &ops[i].view,
                               write ? PyBUF_SIMPLE : (PyBUF_SIMPLE | PyBUF_WRITABLE)) < 0) {
            release_ops(ops, n);
            Py_DECREF(fast);
            return -1;
        }
        if (ops[i].offset < 0) {
            release_ops(ops, n);
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "negative offset");
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = ops;
    *count = n;
    return 0;
}

static void prep(struct io_uring_sqe *sqe, op_t *op, Py_ssize_t index, int write) {
    char *base = (char *)op->view.buf + op->done;
    unsigned len = (unsigned)((op->view.len - op->done) > (1u << 30) ? (1u << 30)
                                                                      : (op->view.len - op->done));
    if (write)
        io_uring_prep_write(sqe, op->fd, base, len, (unsigned long long)(op->offset + op->done));
    else
        io_uring_prep_read(sqe, op->fd, base, len, (unsigned long long)(op->offset + op->done));
    io_uring_sqe_set_data64(sqe, (unsigned long long)index);
    op->busy = 1;
}

static unsigned long long taken_back; /* requests cancelled after a stall, ever */

#define CANCEL_TAG (UINT64_MAX - 1) /* user_data of our cancel requests (liburing keeps UINT64_MAX) */

/* The rest of a transfer the ring gave back, done here.  Returns 0 or an errno. */
static int finish_here(op_t *op, int write, long long *total) {
    while (op->done < (size_t)op->view.len) {
        char *base = (char *)op->view.buf + op->done;
        size_t len = (size_t)op->view.len - op->done;
        off_t at = (off_t)(op->offset + op->done);
        ssize_t res = write ? pwrite(op->fd, base, len, at) : pread(op->fd, base, len, at);
        if (res < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (res == 0) {
            if (write)
                return EIO;
            memset(base, 0, len); /* end of file, as the ring's reads do */
            op->done = (size_t)op->view.len;
            break;
        }
        op->done += (size_t)res;
        *total += res;
    }
    return 0;
}

/* Wait for a completion; after `stall_ms` without one, ask every request back once
 * and go on waiting.  Returns 0, or a negative errno from the ring. */
static int wait_some(struct io_uring *ring, unsigned stall_ms) {
    struct __kernel_timespec ts = {.tv_sec = stall_ms / 1000,
                                   .tv_nsec = (long long)(stall_ms % 1000) * 1000000};
    struct io_uring_cqe *cqe;
    for (;;) {
        int rc = io_uring_submit_and_wait_timeout(ring, &cqe, 1, &ts, NULL);
        if (rc != -ETIME)
            return rc == -EINTR ? 0 : (rc < 0 ? rc : 0);
        struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
        if (sqe) {
            io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY | IORING_ASYNC_CANCEL_ALL);
            io_uring_sqe_set_data64(sqe, CANCEL_TAG);
        }
    }
}

/* Runs without the GIL.  Returns 0 or a positive errno. */
static int run_ring(op_t *ops, Py_ssize_t n, int write, unsigned depth, unsigned stall_ms,
                    long long *total) {
    struct io_uring ring;
    /* room for a cancel request beside a full ring */
    int err = -io_uring_queue_init(depth + 1, &ring, 0);
    if (err)
        return err;
    Py_ssize_t next = 0, inflight = 0;
    int first_error = 0;
    *total = 0;
    while (next < n || inflight) {
        /* fill the ring */
        while (next < n && inflight < (Py_ssize_t)depth && !first_error) {
            if (ops[next].view.len == 0) {
                next++;
                continue;
            }
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            if (!sqe)
                break;
            prep(sqe, &ops[next], next, write);
            next++;
            inflight++;
        }
        if (!inflight)
            break;
        int rc = wait_some(&ring, stall_ms);
        if (rc < 0) {
            first_error = first_error ? first_error : -rc;
            break;
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&ring, head, cqe) {
            seen++;
            if (io_uring_cqe_get_data64(cqe) == CANCEL_TAG)
                continue; /* how many it found: each answers for itself */
            op_t *op = &ops[io_uring_cqe_get_data64(cqe)];
            op->busy = 0;
            inflight--;
            int res = cqe->res;
            if (res == -ECANCELED) {
                __atomic_fetch_add(&taken_back, 1, __ATOMIC_RELAXED);
                int e = first_error ? 0 : finish_here(op, write, total);
                if (e && !first_error)
                    first_error = e;
                continue;
            }
            if (res == -EINTR || res == -EAGAIN) {
                res = 0; /* resubmit below */
            } else if (res < 0) {
                if (!first_error)
                    first_error = -res;
                continue;
            } else if (res == 0 && !write) {
                /* end of file: the rest reads as zeros */
                memset((char *)op->view.buf + op->done, 0, op->view.len - op->done);
                *total += 0;
                op->done = op->view.len;
                continue;
            }
            op->done += (size_t)res;
            *total += res;
            if (op->done < (size_t)op->view.len && !first_error) {
                struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
                if (sqe) {
                    prep(sqe, op, op - ops, write);
                    inflight++;
                } else if (!first_error) {
                    first_error = EBUSY;
                }
            }
        }
        io_uring_cq_advance(&ring, seen);
        if (first_error && !inflight)
            break;
    }
    /* drain what is still in flight before the buffers go back to Python */
    while (inflight > 0) {
        struct io_uring_cqe *cqe;
        if (wait_some(&ring, stall_ms) < 0 || io_uring_peek_cqe(&ring, &cqe) < 0)
            break;
        if (io_uring_cqe_get_data64(cqe) != CANCEL_TAG)
            inflight--;
        io_uring_cqe_seen(&ring, cqe);
    }
    io_uring_queue_exit(&ring);
    return first_error;
}

static PyObject *engine_run(PyObject *self, PyObject *args) {
    PyObject *seq;
    int write = 0;
    unsigned depth = 32, stall_ms = 10000;
    if (!PyArg_ParseTuple(args, "O|pII", &seq, &write, &depth, &stall_ms))
        return NULL;
    if (stall_ms < 1) {
        PyErr_SetString(PyExc_ValueError, "stall_ms must be at least 1");
        return NULL;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_SetString(PyExc_ValueError, "depth must be within 1..4096");
        return NULL;
    }
    op_t *ops;
    Py_ssize_t n;
    if (parse_ops(seq, write, &ops, &n) < 0)
        return NULL;
    long long total = 0;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = run_ring(ops, n, write, depth, stall_ms, &total);
    Py_END_ALLOW_THREADS
    release_ops(ops, n);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(total);
}

static PyObject *engine_probe(PyObject *self, PyObject *unused) {
    struct io_uring ring;
    int err = io_uring_queue_init(2, &ring, 0);
    if (err < 0) {
        errno = -err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    io_uring_queue_exit(&ring);
    Py_RETURN_NONE;
}

static PyObject *engine_taken_back(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&taken_back, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"run", engine_run, METH_VARARGS,
     "run(ops, write=False, depth=32, stall_ms=10000) -> bytes transferred"},
    {"taken_back", engine_taken_back, METH_NOARGS,
     "requests this process's rings cancelled after a stall and did on a thread"},
    {"probe", engine_probe, METH_NOARGS, "raise OSError if io_uring cannot be used here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mxfs.io._engine",
    "Batched positional reads and writes through io_uring (see native/engine.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__engine(void) { return PyModule_Create(&module); }
