package vsan

/*
#include <stdint.h>
#include <stdlib.h>
#include "vsan.h"

// The completion callback (complete.c); userdata carries a cgo.Handle.
extern void vsango_complete(void *userdata, vsan_result result, uint64_t tag);

static vsan_result vsango_submit_read(uintptr_t d, uint64_t off, void *buf, size_t len, uintptr_t h) {
	return vsan_disk_submit_read((vsan_disk *)d, off, buf, len, vsango_complete, (void *)h, 0);
}

static vsan_result vsango_submit_write(uintptr_t d, uint64_t off, const void *buf, size_t len, uint32_t flags, uintptr_t h) {
	return vsan_disk_submit_write((vsan_disk *)d, off, buf, len, flags, vsango_complete, (void *)h, 0);
}

static vsan_result vsango_submit_flush(uintptr_t d, uintptr_t h) {
	return vsan_disk_submit_flush((vsan_disk *)d, vsango_complete, (void *)h, 0);
}

static vsan_result vsango_submit_discard(uintptr_t d, uint64_t off, uint64_t len, uint32_t flags, uintptr_t h) {
	return vsan_disk_submit_discard((vsan_disk *)d, off, len, flags, vsango_complete, (void *)h, 0);
}

static vsan_result vsango_submit_write_zeroes(uintptr_t d, uint64_t off, uint64_t len, uint32_t flags, uintptr_t h) {
	return vsan_disk_submit_write_zeroes((vsan_disk *)d, off, len, flags, vsango_complete, (void *)h, 0);
}
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"unsafe"
)

// request is one asynchronous I/O in flight. C holds only a cgo.Handle of it.
type request struct {
	op   string
	disk *Disk // keeps the disk (and its node) reachable until the completion
	// Reads: the caller's slice, and the C memory the library fills (copied into dst
	// on success, freed on completion).
	dst  []byte
	cbuf unsafe.Pointer
	// Receives the one result; buffered, so the completion never blocks.
	done chan error
}

func newRequest(op string, d *Disk) *request {
	return &request{op: op, disk: d, done: make(chan error, 1)}
}

// finish delivers the result: copies a read's data, frees its C buffer, sends.
func (r *request) finish(err error) {
	if r.cbuf != nil {
		if err == nil {
			copy(r.dst, unsafe.Slice((*byte)(r.cbuf), len(r.dst)))
		}
		C.free(r.cbuf)
		r.cbuf = nil
	}
	r.done <- err
}

// submit hands r to the library through f. The completion (vsanGoComplete) may run
// before f returns, on this thread. A refused submission never calls back: its error
// is delivered here.
func (r *request) submit(f func(h C.uintptr_t) C.vsan_result) <-chan error {
	h := cgo.NewHandle(r)
	err := call(r.op, func() C.vsan_result { return f(C.uintptr_t(h)) })
	runtime.KeepAlive(r.disk)
	if err != nil {
		h.Delete()
		r.finish(err)
	}
	return r.done
}

// failed is a request refused before it reached the library.
func failed(err error) <-chan error {
	c := make(chan error, 1)
	c <- err
	return c
}

// ReadAtAsync submits one read of len(p) bytes at off into p. The returned channel
// receives the result once; p is filled before that and must not be touched until
// then. One request as it is: off and len(p) block-aligned, len(p) at most
// Geometry.MaxIO, inside the disk (else the error comes through the channel: no
// short reads, no io.EOF).
func (d *Disk) ReadAtAsync(p []byte, off int64) <-chan error {
	if len(p) == 0 || off < 0 {
		return failed(argError("read", ErrInvalidArgument, "empty read or negative offset (%d bytes at %d)", len(p), off))
	}
	r := newRequest("read", d)
	r.dst = p
	r.cbuf = C.malloc(C.size_t(len(p)))
	return r.submit(func(h C.uintptr_t) C.vsan_result {
		return C.vsango_submit_read(C.uintptr_t(d.h), C.uint64_t(off), r.cbuf, C.size_t(len(p)), h)
	})
}

// WriteAtAsync submits one write of p at off (flags: 0 or FUA); the channel receives
// the result once both replicas acknowledged it. The library copies p before this
// call returns: p may be reused at once. Same request rules as ReadAtAsync.
func (d *Disk) WriteAtAsync(p []byte, off int64, flags IOFlags) <-chan error {
	if len(p) == 0 || off < 0 {
		return failed(argError("write", ErrInvalidArgument, "empty write or negative offset (%d bytes at %d)", len(p), off))
	}
	r := newRequest("write", d)
	return r.submit(func(h C.uintptr_t) C.vsan_result {
		// p is only read during this call (the library copies it).
		return C.vsango_submit_write(C.uintptr_t(d.h), C.uint64_t(off), unsafe.Pointer(&p[0]), C.size_t(len(p)), C.uint32_t(flags), h)
	})
}

// FlushAsync submits a flush; the channel receives the result once every write
// acknowledged before it is durable.
func (d *Disk) FlushAsync() <-chan error {
	r := newRequest("flush", d)
	return r.submit(func(h C.uintptr_t) C.vsan_result {
		return C.vsango_submit_flush(C.uintptr_t(d.h), h)
	})
}

// DiscardAsync submits a discard of length bytes at off.
func (d *Disk) DiscardAsync(off, length int64, flags IOFlags) <-chan error {
	if off < 0 || length < 0 {
		return failed(argError("discard", ErrInvalidArgument, "negative offset %d or length %d", off, length))
	}
	r := newRequest("discard", d)
	return r.submit(func(h C.uintptr_t) C.vsan_result {
		return C.vsango_submit_discard(C.uintptr_t(d.h), C.uint64_t(off), C.uint64_t(length), C.uint32_t(flags), h)
	})
}

// WriteZeroesAsync submits a zeroing of length bytes at off.
func (d *Disk) WriteZeroesAsync(off, length int64, flags IOFlags) <-chan error {
	if off < 0 || length < 0 {
		return failed(argError("write zeroes", ErrInvalidArgument, "negative offset %d or length %d", off, length))
	}
	r := newRequest("write zeroes", d)
	return r.submit(func(h C.uintptr_t) C.vsan_result {
		return C.vsango_submit_write_zeroes(C.uintptr_t(d.h), C.uint64_t(off), C.uint64_t(length), C.uint32_t(flags), h)
	})
}
