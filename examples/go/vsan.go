// Package vsan is a Go binding of libvsan, the C ABI of vsan (synchronously two-way
// mirrored virtual disks), over cgo.
//
// # Building
//
// The package links the static library through pkg-config: vsan-ffi's build script
// writes vsan-static.pc into target/<profile>/, naming the libvsan.a cargo built in
// target/<profile>/deps/. From the root of the vsan tree:
//
//	cargo build --release -p vsan-ffi
//	export PKG_CONFIG_PATH=$PWD/target/release
//	cd examples/go && go vet ./... && go test ./...
//
// It needs Go 1.18 or newer with cgo enabled (CGO_ENABLED=1, the default where a C
// compiler is installed), and pkg-config. The programs carry the library: they need
// no libvsan.so at run time. VSAN_GO_GC_EVERY_CALL=1 in the environment makes every
// call into the library run a garbage collection before and after the C call (a
// test mode; slow).
//
// # Use
//
// OpenNode (or OpenNodeFile) starts a node from a vsan-node TOML configuration: its
// disks, their mirroring to a peer node, their caches. Node.OpenDisk returns a Disk,
// an io.ReaderAt and io.WriterAt over one of the node's disks:
//
//	node, err := vsan.OpenNode(config)
//	...
//	defer node.Close()
//	disk, err := node.OpenDisk("vol0")
//	...
//	defer disk.Close()
//	_, err = disk.WriteAt(block, 0) // acknowledged by both replicas when it returns
//
// Every method is safe for concurrent use by any number of goroutines. Blocking
// methods (ReadAt, WriteAt, Flush, WaitSynced, Node.Close, ...) block the calling
// goroutine in a cgo call, which holds an OS thread while it waits: for deep queues
// use the ...Async methods, which submit one request and return a channel that
// receives its result once. No user code runs on the library's threads (completions
// only copy data and send on the channel), so the library's rule that callbacks must
// not block or make blocking calls (ErrWrongThread) never applies to users of this
// package.
//
// # Alignment and the end of the disk
//
// The library takes offsets and lengths that are multiples of the disk's block size
// (Disk.BlockSize) and no longer than Geometry.MaxIO. The binding adds:
//
//   - ReadAt accepts any offset and length: it splits long reads, and reads the
//     partial blocks at either end of an unaligned request through a bounce buffer.
//     A read reaching past the end of the disk returns the bytes up to the end and
//     io.EOF, as io.ReaderAt requires.
//   - WriteAt and WriteAtFUA require a block-aligned offset and length: an unaligned
//     write returns an error matching ErrInvalidArgument and writes nothing. The
//     binding does no read-modify-write: two writers sharing a block would silently
//     lose each other's bytes. A write reaching past the end of the disk writes
//     nothing and returns an error matching ErrOutOfRange. A write longer than
//     Geometry.MaxIO is split; each part is all or nothing, the whole is not.
//   - The ...Async methods send one request as it is: alignment and range errors come
//     back through the channel.
//
// # Errors
//
// A failed call returns an *Error: the operation, the library's result code (a
// Result) and the detail the library gave for it (vsan_last_error_message, read on
// the thread that made the call). Compare with errors.Is against the Result
// constants:
//
//	if errors.Is(err, vsan.ErrNotFound) { ... }
//
// # Handles and memory
//
// Node and Disk hold the library's handles, which are numbers: a closed handle is
// refused by the library (ErrBadHandle), so a second Close or a call after Close
// returns an error, never a crash. Close releases a handle; a Node or Disk that
// becomes unreachable without Close is released by a finalizer (so close them
// explicitly: Node.Close flushes every disk, and reports when that failed). A Disk
// keeps its Node reachable, and an I/O in flight keeps its Disk reachable.
//
// C never holds a Go pointer past a call: completions find their request through a
// cgo.Handle passed as the callback's userdata; asynchronous reads land in C memory
// (C.malloc) that is copied into the caller's slice just before the result is sent;
// write data is copied by the library before the submitting call returns.
package vsan

/*
#cgo pkg-config: vsan-static
#include <stdint.h>
#include <stdlib.h>
#include "vsan.h"

// Handles cross between Go and C as uintptr_t: the library's handles are numbers,
// not addresses, so Go keeps them as numbers. (A *C.vsan_node would do too, since
// cgo marks incomplete C structs not-in-heap and the runtime ignores pointers to
// them; uintptr does not depend on that.)

static vsan_result vsango_node_new_from_toml(const char *toml, uintptr_t *out) {
	vsan_node *n = NULL;
	vsan_result r = vsan_node_new_from_toml(toml, &n);
	if (r == VSAN_OK) *out = (uintptr_t)n;
	return r;
}

static vsan_result vsango_node_new_from_file(const char *path, uintptr_t *out) {
	vsan_node *n = NULL;
	vsan_result r = vsan_node_new_from_file(path, &n);
	if (r == VSAN_OK) *out = (uintptr_t)n;
	return r;
}

static vsan_result vsango_node_free(uintptr_t n) { return vsan_node_free((vsan_node *)n); }

static vsan_result vsango_node_replication_address(uintptr_t n, char *buf, size_t len, size_t *out_len) {
	return vsan_node_replication_address((vsan_node *)n, buf, len, out_len);
}

static vsan_result vsango_disk_open(uintptr_t n, const char *name, uintptr_t *out) {
	vsan_disk *d = NULL;
	vsan_result r = vsan_disk_open((vsan_node *)n, name, &d);
	if (r == VSAN_OK) *out = (uintptr_t)d;
	return r;
}

static vsan_result vsango_disk_free(uintptr_t d) { return vsan_disk_free((vsan_disk *)d); }

static vsan_result vsango_disk_geometry(uintptr_t d, vsan_geometry *out) {
	return vsan_disk_geometry((vsan_disk *)d, out);
}

static vsan_result vsango_disk_wait_synced(uintptr_t d, uint32_t timeout_ms) {
	return vsan_disk_wait_synced((vsan_disk *)d, timeout_ms);
}

static vsan_result vsango_disk_verify(uintptr_t d) { return vsan_disk_verify((vsan_disk *)d); }

static vsan_result vsango_disk_discard_my_data(uintptr_t d) {
	return vsan_disk_discard_my_data((vsan_disk *)d);
}

static vsan_result vsango_disk_set_cache_mode(uintptr_t d, uint32_t mode) {
	return vsan_disk_set_cache_mode((vsan_disk *)d, mode);
}

static vsan_result vsango_disk_read(uintptr_t d, uint64_t off, void *buf, size_t len) {
	return vsan_disk_read((vsan_disk *)d, off, buf, len);
}

static vsan_result vsango_disk_write(uintptr_t d, uint64_t off, const void *buf, size_t len, uint32_t flags) {
	return vsan_disk_write((vsan_disk *)d, off, buf, len, flags);
}

static vsan_result vsango_disk_flush(uintptr_t d) { return vsan_disk_flush((vsan_disk *)d); }

static vsan_result vsango_disk_discard(uintptr_t d, uint64_t off, uint64_t len, uint32_t flags) {
	return vsan_disk_discard((vsan_disk *)d, off, len, flags);
}

static vsan_result vsango_disk_write_zeroes(uintptr_t d, uint64_t off, uint64_t len, uint32_t flags) {
	return vsan_disk_write_zeroes((vsan_disk *)d, off, len, flags);
}
*/
import "C"

import (
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"
)

// Version is the library's version ("0.1.0").
func Version() string {
	return C.GoString(C.vsan_version())
}

// Result is a vsan_result code other than VSAN_OK. It is an error; an *Error returned
// by this package unwraps to one, so errors.Is(err, ErrNotFound) tells the code.
type Result int32

// The library's result codes (vsan.h): compare with errors.Is.
const (
	ErrInvalidArgument Result = C.VSAN_ERR_INVALID_ARGUMENT // malformed argument (misaligned, bad config)
	ErrOutOfRange      Result = C.VSAN_ERR_OUT_OF_RANGE     // past the end of the disk
	ErrIO              Result = C.VSAN_ERR_IO               // the storage failed
	ErrNotSupported    Result = C.VSAN_ERR_NOT_SUPPORTED    // not supported by this disk or now
	ErrReadOnly        Result = C.VSAN_ERR_READ_ONLY        // the disk is read-only
	ErrClosed          Result = C.VSAN_ERR_CLOSED           // the disk or node was shut down
	ErrTimeout         Result = C.VSAN_ERR_TIMEOUT          // did not complete in time
	ErrCorrupt         Result = C.VSAN_ERR_CORRUPT          // stored data failed a check
	ErrProtocol        Result = C.VSAN_ERR_PROTOCOL         // a peer broke the protocol
	ErrInUse           Result = C.VSAN_ERR_IN_USE           // already in use
	ErrNotFound        Result = C.VSAN_ERR_NOT_FOUND        // something named does not exist
	ErrNoSpace         Result = C.VSAN_ERR_NO_SPACE         // the backing store is full
	ErrNoQuorum        Result = C.VSAN_ERR_NO_QUORUM        // no peer and no quorum
	ErrWrongState      Result = C.VSAN_ERR_WRONG_STATE      // refused in the current state
	ErrNullPointer     Result = C.VSAN_ERR_NULL_POINTER     // a required pointer was NULL
	ErrOverflow        Result = C.VSAN_ERR_OVERFLOW         // an offset or length overflows
	ErrBadHandle       Result = C.VSAN_ERR_BAD_HANDLE       // closed (or never valid) handle
	ErrPanic           Result = C.VSAN_ERR_PANIC            // the library panicked (a bug)
	ErrBufferTooSmall  Result = C.VSAN_ERR_BUFFER_TOO_SMALL // an output buffer is too small
	ErrMisaligned      Result = C.VSAN_ERR_MISALIGNED       // a misaligned output pointer
	ErrWrongThread     Result = C.VSAN_ERR_WRONG_THREAD     // blocking call in a callback
)

// Error is the library's static description of the code ("not found").
func (r Result) Error() string {
	return C.GoString(C.vsan_result_str(C.vsan_result(r)))
}

// Error is a failed call: what was asked, the library's code, and its detail.
type Error struct {
	// Op names the call ("open node", "read", ...).
	Op string
	// Code is the result code.
	Code Result
	// Message is the detail (the library's last-error message for the call, or the
	// binding's own reason); may be empty.
	Message string
}

func (e *Error) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("vsan: %s: %s", e.Op, e.Code.Error())
	}
	return fmt.Sprintf("vsan: %s: %s: %s", e.Op, e.Code.Error(), e.Message)
}

// Unwrap returns the code, for errors.Is.
func (e *Error) Unwrap() error { return e.Code }

// gcEveryCall makes every call into the library run runtime.GC() before and after
// the C call (VSAN_GO_GC_EVERY_CALL=1, or the tests), to shake out pointers the Go
// side forgot to keep alive.
var gcEveryCall int32 // atomic; 1: on (sync/atomic functions, for Go 1.18)

func init() {
	if os.Getenv("VSAN_GO_GC_EVERY_CALL") == "1" {
		atomic.StoreInt32(&gcEveryCall, 1)
	}
}

func maybeGC() {
	if atomic.LoadInt32(&gcEveryCall) != 0 {
		runtime.GC()
	}
}

// lastMessage reads the calling thread's last-error message. The caller must be on
// the thread that made the failed call (locked, or inside a callback).
func lastMessage() string {
	var buf [512]C.char
	var n C.size_t
	r := C.vsan_last_error_message(&buf[0], C.size_t(len(buf)), &n)
	if r == C.VSAN_ERR_BUFFER_TOO_SMALL {
		big := make([]C.char, int(n)+1)
		if C.vsan_last_error_message(&big[0], C.size_t(len(big)), &n) == C.VSAN_OK {
			return C.GoString(&big[0])
		}
		return ""
	}
	if r != C.VSAN_OK {
		return ""
	}
	return C.GoString(&buf[0])
}

// call runs one C call on a locked OS thread and, when it fails, reads its message
// on that same thread (the message is per thread).
func call(op string, f func() C.vsan_result) error {
	maybeGC()
	runtime.LockOSThread()
	r := f()
	maybeGC()
	var err error
	if r != C.VSAN_OK {
		err = &Error{Op: op, Code: Result(r), Message: lastMessage()}
	}
	runtime.UnlockOSThread()
	return err
}

func argError(op string, code Result, format string, args ...any) error {
	return &Error{Op: op, Code: code, Message: fmt.Sprintf(format, args...)}
}

// finalized counts handles released by finalizers (for the tests).
var finalizedNodes, finalizedDisks int64 // atomic

// Node is an open vsan node: its disks, their mirrors and caches, and the threads
// that run them. Close it when done.
type Node struct {
	h uintptr
}

// OpenNode starts a node from a vsan-node TOML configuration ([node], [[peer]],
// [[disk]]): creates or opens every disk's image and metadata and starts mirroring
// (dialing or waiting for peers). A bad configuration returns an error matching
// ErrInvalidArgument whose message names the key.
func OpenNode(configTOML string) (*Node, error) {
	s := C.CString(configTOML)
	defer C.free(unsafe.Pointer(s))
	var h C.uintptr_t
	err := call("open node", func() C.vsan_result { return C.vsango_node_new_from_toml(s, &h) })
	if err != nil {
		return nil, err
	}
	return newNode(uintptr(h)), nil
}

// OpenNodeFile is OpenNode with the configuration read from a file (ErrNotFound when
// it does not exist).
func OpenNodeFile(path string) (*Node, error) {
	s := C.CString(path)
	defer C.free(unsafe.Pointer(s))
	var h C.uintptr_t
	err := call("open node", func() C.vsan_result { return C.vsango_node_new_from_file(s, &h) })
	if err != nil {
		return nil, err
	}
	return newNode(uintptr(h)), nil
}

func newNode(h uintptr) *Node {
	n := &Node{h: h}
	runtime.SetFinalizer(n, func(n *Node) {
		// Closing a node waits for its I/O and stops its threads: not on the one
		// finalizer goroutine.
		h := n.h
		go func() {
			C.vsango_node_free(C.uintptr_t(h))
			atomic.AddInt64(&finalizedNodes, 1)
		}()
	})
	return n
}

// Close shuts the node down: waits for the calls and I/O in flight (up to 30 s),
// flushes every disk, closes the mirrors and caches, and stops the node's threads.
// The node's Disks are unusable afterwards (ErrBadHandle). An error (ErrIO) means a
// final flush failed and data may not be durable; the node is closed all the same.
// A second Close returns an error matching ErrBadHandle.
func (n *Node) Close() error {
	runtime.SetFinalizer(n, nil)
	err := call("close node", func() C.vsan_result { return C.vsango_node_free(C.uintptr_t(n.h)) })
	runtime.KeepAlive(n)
	return err
}

// ReplicationAddress is where the node listens for its peers (node.listen, with the
// actual port when the configuration said port 0). ErrNotFound when it does not
// listen.
func (n *Node) ReplicationAddress() (string, error) {
	buf := make([]C.char, 256)
	var l C.size_t
	for {
		err := call("replication address", func() C.vsan_result {
			return C.vsango_node_replication_address(C.uintptr_t(n.h), &buf[0], C.size_t(len(buf)), &l)
		})
		runtime.KeepAlive(n)
		if e, ok := err.(*Error); ok && e.Code == ErrBufferTooSmall {
			buf = make([]C.char, int(l)+1)
			continue
		}
		if err != nil {
			return "", err
		}
		return C.GoStringN(&buf[0], C.int(l)), nil
	}
}

// OpenDisk opens the node's disk called name (ErrNotFound when there is none). A disk
// may be opened more than once; close each Disk.
func (n *Node) OpenDisk(name string) (*Disk, error) {
	s := C.CString(name)
	defer C.free(unsafe.Pointer(s))
	var h C.uintptr_t
	err := call("open disk", func() C.vsan_result { return C.vsango_disk_open(C.uintptr_t(n.h), s, &h) })
	runtime.KeepAlive(n)
	if err != nil {
		return nil, err
	}
	var g C.vsan_geometry
	err = call("disk geometry", func() C.vsan_result { return C.vsango_disk_geometry(h, &g) })
	if err != nil {
		C.vsango_disk_free(h)
		return nil, err
	}
	d := &Disk{
		h:    uintptr(h),
		node: n,
		name: name,
		geom: Geometry{Size: int64(g.size), BlockSize: int64(g.block_size), MaxIO: int64(g.max_io)},
	}
	runtime.SetFinalizer(d, func(d *Disk) {
		C.vsango_disk_free(C.uintptr_t(d.h))
		atomic.AddInt64(&finalizedDisks, 1)
	})
	return d, nil
}

// Geometry is a disk's size and block sizes.
type Geometry struct {
	// Size in bytes (a multiple of BlockSize).
	Size int64
	// BlockSize: offsets and lengths of I/O are multiples of it.
	BlockSize int64
	// MaxIO is the longest single request the library takes, in bytes.
	MaxIO int64
}

// Disk is an open disk of a node: an io.ReaderAt and io.WriterAt (see the package
// documentation for alignment), with flush, discard, zeroing, status and the
// mirror's controls. Safe for concurrent use.
type Disk struct {
	h    uintptr
	node *Node // keeps the node reachable while the disk is
	name string
	geom Geometry
}

var (
	_ io.ReaderAt = (*Disk)(nil)
	_ io.WriterAt = (*Disk)(nil)
)

// IOFlags modify writes, discards and zeroing.
type IOFlags uint32

// FUA (force unit access): the write is durable on both replicas when it completes.
const FUA IOFlags = C.VSAN_IO_FUA

// Name is the disk's name in its node's configuration.
func (d *Disk) Name() string { return d.name }

// Geometry is the disk's size and block sizes.
func (d *Disk) Geometry() Geometry { return d.geom }

// Size is the disk's size in bytes.
func (d *Disk) Size() int64 { return d.geom.Size }

// BlockSize is the disk's logical block size in bytes.
func (d *Disk) BlockSize() int64 { return d.geom.BlockSize }

// Close releases this handle (the disk stays open in its node). I/O submitted
// through it still completes. A second Close, or any call after it, returns an
// error matching ErrBadHandle.
func (d *Disk) Close() error {
	runtime.SetFinalizer(d, nil)
	err := call("close disk", func() C.vsan_result { return C.vsango_disk_free(C.uintptr_t(d.h)) })
	runtime.KeepAlive(d)
	return err
}

// maxChunk is the longest request to send: MaxIO rounded down to whole blocks.
func (d *Disk) maxChunk() int64 {
	bs := d.geom.BlockSize
	m := d.geom.MaxIO - d.geom.MaxIO%bs
	if m <= 0 {
		m = 1 << 20
	}
	return m
}

// read reads whole blocks at an aligned offset, at most MaxIO of them.
func (d *Disk) read(p []byte, off int64) error {
	err := call("read", func() C.vsan_result {
		return C.vsango_disk_read(C.uintptr_t(d.h), C.uint64_t(off), unsafe.Pointer(&p[0]), C.size_t(len(p)))
	})
	runtime.KeepAlive(d)
	return err
}

// ReadAt reads len(p) bytes at off: any offset and length (partial blocks go
// through a bounce buffer). It returns n < len(p) only with an error: io.EOF when the
// read reaches past the end of the disk (n is what lay before the end), or the
// library's error (n is what was read before it).
func (d *Disk) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, argError("read", ErrInvalidArgument, "negative offset %d", off)
	}
	if len(p) == 0 {
		return 0, nil
	}
	size := d.geom.Size
	if off >= size {
		return 0, io.EOF
	}
	want := int64(len(p))
	eof := false
	if want > size-off {
		want = size - off
		eof = true
	}
	bs := d.geom.BlockSize
	chunk := d.maxChunk()
	var done int64
	for done < want {
		pos := off + done
		left := want - done
		if pos%bs == 0 && left >= bs {
			// Whole blocks straight into p.
			l := left - left%bs
			if l > chunk {
				l = chunk
			}
			if err := d.read(p[done:done+l], pos); err != nil {
				return int(done), err
			}
			done += l
			continue
		}
		// A partial block at either end: read the block, copy the part asked for.
		start := pos - pos%bs
		block := make([]byte, bs)
		if err := d.read(block, start); err != nil {
			return int(done), err
		}
		done += int64(copy(p[done:want], block[pos-start:]))
	}
	if eof {
		return int(done), io.EOF
	}
	return int(done), nil
}

// checkRange checks a write-like request: aligned, inside the disk.
func (d *Disk) checkRange(op string, off, length int64) error {
	bs := d.geom.BlockSize
	if off < 0 || length < 0 {
		return argError(op, ErrInvalidArgument, "negative offset %d or length %d", off, length)
	}
	if off%bs != 0 || length%bs != 0 {
		return argError(op, ErrInvalidArgument,
			"offset %d and length %d must be multiples of the block size %d (the binding does no read-modify-write)",
			off, length, bs)
	}
	if off > d.geom.Size || length > d.geom.Size-off {
		return argError(op, ErrOutOfRange, "%d bytes at %d reach past the end of the disk (%d bytes)",
			length, off, d.geom.Size)
	}
	return nil
}

// WriteAt writes p at off, returning once the write is acknowledged (on a mirrored
// disk: by both replicas while they are connected). off and len(p) must be multiples
// of the block size; see the package documentation.
func (d *Disk) WriteAt(p []byte, off int64) (int, error) {
	return d.writeAt("write", p, off, 0)
}

// WriteAtFUA is WriteAt with force unit access: the data is durable on stable
// storage (of both replicas) when it returns.
func (d *Disk) WriteAtFUA(p []byte, off int64) (int, error) {
	return d.writeAt("write", p, off, FUA)
}

func (d *Disk) writeAt(op string, p []byte, off int64, flags IOFlags) (int, error) {
	if err := d.checkRange(op, off, int64(len(p))); err != nil {
		return 0, err
	}
	chunk := d.maxChunk()
	var done int64
	for done < int64(len(p)) {
		l := int64(len(p)) - done
		if l > chunk {
			l = chunk
		}
		q := p[done : done+l]
		// The library only reads q during the call.
		err := call(op, func() C.vsan_result {
			return C.vsango_disk_write(C.uintptr_t(d.h), C.uint64_t(off+done), unsafe.Pointer(&q[0]), C.size_t(l), C.uint32_t(flags))
		})
		runtime.KeepAlive(d)
		if err != nil {
			return int(done), err
		}
		done += l
	}
	return int(done), nil
}

// Flush makes every write acknowledged before it durable (on both replicas).
func (d *Disk) Flush() error {
	err := call("flush", func() C.vsan_result { return C.vsango_disk_flush(C.uintptr_t(d.h)) })
	runtime.KeepAlive(d)
	return err
}

// Discard trims length bytes at off (block-aligned): they may read back as zeros or
// as their old data.
func (d *Disk) Discard(off, length int64, flags IOFlags) error {
	if err := d.checkRange("discard", off, length); err != nil {
		return err
	}
	err := call("discard", func() C.vsan_result {
		return C.vsango_disk_discard(C.uintptr_t(d.h), C.uint64_t(off), C.uint64_t(length), C.uint32_t(flags))
	})
	runtime.KeepAlive(d)
	return err
}

// WriteZeroes writes zeros over length bytes at off (block-aligned).
func (d *Disk) WriteZeroes(off, length int64, flags IOFlags) error {
	if err := d.checkRange("write zeroes", off, length); err != nil {
		return err
	}
	err := call("write zeroes", func() C.vsan_result {
		return C.vsango_disk_write_zeroes(C.uintptr_t(d.h), C.uint64_t(off), C.uint64_t(length), C.uint32_t(flags))
	})
	runtime.KeepAlive(d)
	return err
}

// WaitSynced waits up to timeout until a mirrored disk is connected to its peer and
// no resync runs. ErrTimeout when it is not by then; ErrNotSupported for a disk
// without a peer.
func (d *Disk) WaitSynced(timeout time.Duration) error {
	ms := timeout.Milliseconds()
	if ms < 0 {
		ms = 0
	}
	if ms > math.MaxUint32 {
		ms = math.MaxUint32
	}
	err := call("wait synced", func() C.vsan_result {
		return C.vsango_disk_wait_synced(C.uintptr_t(d.h), C.uint32_t(ms))
	})
	runtime.KeepAlive(d)
	return err
}

// Verify starts an online verify of a mirrored disk from this node (the replicas
// are compared by checksum, differences repaired from this node) and returns once it
// has started; Status tells its progress and outcome.
func (d *Disk) Verify() error {
	err := call("verify", func() C.vsan_result { return C.vsango_disk_verify(C.uintptr_t(d.h)) })
	runtime.KeepAlive(d)
	return err
}

// DiscardMyData resolves a split brain by discarding this node's changes: on the
// next connection this replica takes the peer's data.
func (d *Disk) DiscardMyData() error {
	err := call("discard my data", func() C.vsan_result { return C.vsango_disk_discard_my_data(C.uintptr_t(d.h)) })
	runtime.KeepAlive(d)
	return err
}

// SetCacheMode switches a cached disk's cache mode (ErrNotSupported without a
// cache).
func (d *Disk) SetCacheMode(mode CacheMode) error {
	err := call("set cache mode", func() C.vsan_result {
		return C.vsango_disk_set_cache_mode(C.uintptr_t(d.h), C.uint32_t(mode))
	})
	runtime.KeepAlive(d)
	return err
}
