package vsan

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"
)

const (
	diskName   = "vol0"
	diskSize   = 8 << 20
	syncWithin = 30 * time.Second
)

// tomlString quotes s as a TOML basic string.
func tomlString(s string) string {
	return strconv.Quote(s) // test paths hold no characters where Go and TOML differ
}

// localConfig is a node with one unmirrored disk in RAM.
func localConfig(dir string, size int) string {
	return fmt.Sprintf(`[node]
id = 1
data_dir = %s
threads = 2

[[disk]]
name = %q
size = %d
backing = "mem"
`, tomlString(dir), diskName, size)
}

// mirrorConfig is node id's side of disk vol0 mirrored with the other node over tcp.
// Node 2 listens on listen; node 1 dials peerAddr. backing is "mem" or "file".
func mirrorConfig(id int, dir, listen, peerAddr, backing string) string {
	peer := 3 - id
	var s strings.Builder
	fmt.Fprintf(&s, "[node]\nid = %d\ndata_dir = %s\nthreads = 2\npeer_timeout_ms = 5000\n", id, tomlString(dir))
	if listen != "" {
		fmt.Fprintf(&s, "listen = %s\n", tomlString(listen))
	}
	fmt.Fprintf(&s, "\n[[peer]]\nid = %d\naddress = %s\ntransport = \"tcp\"\n", peer, tomlString(peerAddr))
	fmt.Fprintf(&s, "\n[[disk]]\nname = %q\nsize = %d\nbacking = %q\npeer = %d\n", diskName, diskSize, backing, peer)
	return s.String()
}

// openLocal opens a node with one RAM disk, closed (and checked) at the end of the
// test, and the disk.
func openLocal(t *testing.T, size int) (*Node, *Disk) {
	t.Helper()
	n, err := OpenNode(localConfig(t.TempDir(), size))
	if err != nil {
		t.Fatalf("open node: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil && !errors.Is(err, ErrBadHandle) {
			t.Errorf("close node: %v", err)
		}
	})
	d, err := n.OpenDisk(diskName)
	if err != nil {
		t.Fatalf("open disk: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return n, d
}

// pair is two nodes in this process mirroring vol0 to each other over loopback tcp.
type pair struct {
	n1, n2 *Node
	d1, d2 *Disk
}

// openPair starts node 2 listening on a port of its choosing, then node 1 dialing
// it, and waits until both sides are connected and in sync. Everything is closed at
// the end of the test, node 1 first.
func openPair(t *testing.T, backing string) *pair {
	t.Helper()
	dir1, dir2 := t.TempDir(), t.TempDir()
	var p pair
	var err error
	// Node 2 never dials (the lower id does); the address it is given is not used.
	p.n2, err = OpenNode(mirrorConfig(2, dir2, "127.0.0.1:0", "127.0.0.1:1", backing))
	if err != nil {
		t.Fatalf("open node 2: %v", err)
	}
	t.Cleanup(func() {
		if err := p.n2.Close(); err != nil {
			t.Errorf("close node 2: %v", err)
		}
	})
	addr, err := p.n2.ReplicationAddress()
	if err != nil {
		t.Fatalf("node 2's replication address: %v", err)
	}
	if !strings.HasPrefix(addr, "127.0.0.1:") || strings.HasSuffix(addr, ":0") {
		t.Fatalf("node 2 listens on %q, want 127.0.0.1:<port>", addr)
	}
	p.n1, err = OpenNode(mirrorConfig(1, dir1, "", addr, backing))
	if err != nil {
		t.Fatalf("open node 1: %v", err)
	}
	t.Cleanup(func() {
		if err := p.n1.Close(); err != nil {
			t.Errorf("close node 1: %v", err)
		}
	})
	if _, err := p.n1.ReplicationAddress(); !errors.Is(err, ErrNotFound) {
		t.Errorf("node 1 does not listen: ReplicationAddress gave %v, want ErrNotFound", err)
	}
	for _, x := range []struct {
		n *Node
		d **Disk
	}{{p.n1, &p.d1}, {p.n2, &p.d2}} {
		d, err := x.n.OpenDisk(diskName)
		if err != nil {
			t.Fatalf("open disk: %v", err)
		}
		t.Cleanup(func() { d.Close() })
		if err := d.WaitSynced(syncWithin); err != nil {
			t.Fatalf("wait synced: %v", err)
		}
		*x.d = d
	}
	return &p
}

// pattern fills n bytes that depend on seed and position.
func pattern(seed int64, n int) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

// readAll reads the whole disk.
func readAll(t *testing.T, d *Disk) []byte {
	t.Helper()
	b := make([]byte, d.Size())
	if n, err := d.ReadAt(b, 0); n != len(b) || (err != nil && err != io.EOF) {
		t.Fatalf("read the whole disk: %d bytes, %v", n, err)
	}
	return b
}

func sameBytes(t *testing.T, got, want []byte, what string) {
	t.Helper()
	if bytes.Equal(got, want) {
		return
	}
	if len(got) != len(want) {
		t.Fatalf("%s: %d bytes, want %d", what, len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("%s: first difference at byte %d (got %#02x, want %#02x)", what, i, got[i], want[i])
		}
	}
}

func wantCode(t *testing.T, err error, code Result, what string) {
	t.Helper()
	if !errors.Is(err, code) {
		t.Fatalf("%s: got %v, want an error matching %v (%d)", what, err, code, int32(code))
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("%s: %v is not a *vsan.Error", what, err)
	}
	if e.Code != code || e.Op == "" {
		t.Fatalf("%s: %#v", what, e)
	}
}

// TestInterfaces: Disk is an io.ReaderAt and io.WriterAt.
func TestInterfaces(t *testing.T) {
	var _ io.ReaderAt = (*Disk)(nil)
	var _ io.WriterAt = (*Disk)(nil)
	var _ error = ErrBadHandle
	var _ error = (*Error)(nil)
	if v := Version(); v == "" {
		t.Fatal("empty version")
	}
	if ErrNotFound.Error() != "not found" {
		t.Fatalf("ErrNotFound reads %q", ErrNotFound.Error())
	}
}

// TestMirroredRoundTrip: writes through node 1 read back through node 1 and, byte for
// byte, through node 2 (the writes are mirrored synchronously); flush, discard, FUA,
// zeroing; status; verify. File-backed images.
func TestMirroredRoundTrip(t *testing.T) {
	p := openPair(t, "file")
	d1, d2 := p.d1, p.d2
	if d1.Size() != diskSize || d2.Size() != diskSize || d1.BlockSize() != 512 {
		t.Fatalf("geometry %+v / %+v", d1.Geometry(), d2.Geometry())
	}
	g := d1.Geometry()
	if g.MaxIO < g.BlockSize {
		t.Fatalf("max io %d", g.MaxIO)
	}

	want := make([]byte, diskSize)
	data := pattern(1, 256<<10)
	if n, err := d1.WriteAt(data, 64<<10); n != len(data) || err != nil {
		t.Fatalf("write: %d, %v", n, err)
	}
	copy(want[64<<10:], data)
	// Longer than one request (a copy of the handle with a smaller limit, so a small
	// disk shows it): the binding splits it, both ways.
	small := *d1
	small.geom.MaxIO = 16 << 10
	big := pattern(2, 3*(16<<10)+4096)
	if n, err := small.WriteAtFUA(big, 1<<20); n != len(big) || err != nil {
		t.Fatalf("FUA write of %d bytes: %d, %v", len(big), n, err)
	}
	copy(want[1<<20:], big)
	bigBack := make([]byte, len(big)+1000)
	if n, err := small.ReadAt(bigBack, 1<<20-500); n != len(bigBack) || err != nil {
		t.Fatalf("long unaligned read: %d, %v", n, err)
	}
	sameBytes(t, bigBack, want[1<<20-500:1<<20-500+len(bigBack)], "long unaligned read")
	if err := d1.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := d1.WriteZeroes(96<<10, 8192, 0); err != nil {
		t.Fatal(err)
	}
	copy(want[96<<10:], make([]byte, 8192))
	if err := d1.WriteZeroes(100<<10, 4096, FUA); err != nil {
		t.Fatal(err)
	}
	copy(want[100<<10:], make([]byte, 4096))
	// A discarded range reads back as zeros or its old data: rewrite it afterwards.
	if err := d1.Discard(4<<20, 64<<10, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := d1.WriteAt(pattern(3, 64<<10), 4<<20); err != nil {
		t.Fatal(err)
	}
	copy(want[4<<20:], pattern(3, 64<<10))

	sameBytes(t, readAll(t, d1), want, "node 1's disk")
	sameBytes(t, readAll(t, d2), want, "node 2's disk (mirrored)")

	// Node 2 writes too; node 1 sees it.
	back := pattern(4, 8192)
	if _, err := d2.WriteAt(back, diskSize-8192); err != nil {
		t.Fatal(err)
	}
	copy(want[diskSize-8192:], back)
	sameBytes(t, readAll(t, d1), want, "node 1's disk after node 2 wrote")

	for i, d := range []*Disk{d1, d2} {
		st, err := d.Status()
		if err != nil {
			t.Fatal(err)
		}
		if !st.Mirrored || st.Link != LinkConnected || st.PeerID != uint32(2-i) ||
			st.Transport != "tcp" || st.Size != diskSize || st.BlockSize != 512 || st.Cached {
			t.Fatalf("node %d: status %+v", i+1, st)
		}
	}

	// An online verify finds the replicas equal.
	if err := d1.Verify(); err != nil {
		t.Fatalf("verify: %v", err)
	}
	deadline := time.Now().Add(syncWithin)
	for {
		st, err := d1.Status()
		if err != nil {
			t.Fatal(err)
		}
		if !st.Syncing && st.SyncKind == SyncVerify && st.LastSyncResult >= 0 {
			if st.LastSyncResult != 1 || st.LastSyncMismatches != 0 {
				t.Fatalf("verify ended: %+v", st)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("verify did not end: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReaderAtSemantics: unaligned reads, short reads at the end with io.EOF, and the
// io.ReaderAt contract as testing/iotest checks it; unaligned writes are refused.
func TestReaderAtSemantics(t *testing.T) {
	const size = 1 << 20
	_, d := openLocal(t, size)
	want := pattern(5, size)
	if _, err := d.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	rounds, tail := 200, int64(96<<10)
	if atomic.LoadInt32(&gcEveryCall) != 0 {
		// Two collections per call (and iotest's byte-sized reads): keep it short.
		rounds, tail = 20, 128
	}
	rng := rand.New(rand.NewSource(6))
	for i := 0; i < rounds; i++ {
		off := rng.Int63n(size)
		l := rng.Intn(3*512 + 1)
		if i%10 == 0 {
			l = rng.Intn(256 << 10)
		}
		b := make([]byte, l)
		n, err := d.ReadAt(b, off)
		end := off + int64(l)
		if end > size {
			if err != io.EOF || int64(n) != size-off {
				t.Fatalf("ReadAt(%d bytes, %d) past the end: %d, %v", l, off, n, err)
			}
			end = size
		} else if err != nil || n != l {
			t.Fatalf("ReadAt(%d bytes, %d): %d, %v", l, off, n, err)
		}
		sameBytes(t, b[:n], want[off:end], fmt.Sprintf("ReadAt(%d bytes, %d)", l, off))
	}
	b := make([]byte, 4096)
	if n, err := d.ReadAt(b, size); n != 0 || err != io.EOF {
		t.Fatalf("ReadAt at the end: %d, %v", n, err)
	}
	if n, err := d.ReadAt(b, size+12345); n != 0 || err != io.EOF {
		t.Fatalf("ReadAt past the end: %d, %v", n, err)
	}
	if n, err := d.ReadAt(nil, size+1); n != 0 || err != nil {
		t.Fatalf("empty ReadAt: %d, %v", n, err)
	}
	if n, err := d.ReadAt(b, size-100); n != 100 || err != io.EOF {
		t.Fatalf("ReadAt across the end: %d, %v", n, err)
	}
	sameBytes(t, b[:100], want[size-100:], "the last 100 bytes")
	_, err := d.ReadAt(b, -1)
	wantCode(t, err, ErrInvalidArgument, "negative offset")

	// The io.ReaderAt contract as testing/iotest checks it, over the last 96 KiB:
	// through a section reader that ends where the disk does, and through one that
	// goes on (without Seek), so that the disk's own io.EOF ends the reads.
	if err := iotest.TestReader(io.NewSectionReader(d, size-tail, tail), want[size-tail:]); err != nil {
		t.Fatal(err)
	}
	if err := iotest.TestReader(noSeek{io.NewSectionReader(d, size-tail, 1<<40)}, want[size-tail:]); err != nil {
		t.Fatal(err)
	}
	// And a whole copy through io.Copy (32 KiB reads).
	var out bytes.Buffer
	if n, err := io.Copy(&out, io.NewSectionReader(d, 0, 1<<40)); n != size || err != nil {
		t.Fatalf("io.Copy: %d, %v", n, err)
	}
	sameBytes(t, out.Bytes(), want, "io.Copy")

	// Writes must be aligned and inside the disk; nothing is written otherwise.
	n, err := d.WriteAt(make([]byte, 512), 100)
	if n != 0 {
		t.Fatalf("unaligned write wrote %d", n)
	}
	wantCode(t, err, ErrInvalidArgument, "unaligned offset")
	_, err = d.WriteAt(make([]byte, 700), 0)
	wantCode(t, err, ErrInvalidArgument, "unaligned length")
	_, err = d.WriteAt(make([]byte, 4096), size-512)
	wantCode(t, err, ErrOutOfRange, "write across the end")
	err = d.WriteZeroes(size, 512, 0)
	wantCode(t, err, ErrOutOfRange, "zeroing past the end")
	err = d.Discard(1, 512, 0)
	wantCode(t, err, ErrInvalidArgument, "unaligned discard")
	if n, err := d.WriteAt(nil, 0); n != 0 || err != nil {
		t.Fatalf("empty write: %d, %v", n, err)
	}
	sameBytes(t, readAll(t, d), want, "the disk after refused writes")
}

// noSeek is a section reader without its Seek method.
type noSeek struct{ r *io.SectionReader }

func (s noSeek) Read(p []byte) (int, error)              { return s.r.Read(p) }
func (s noSeek) ReadAt(p []byte, off int64) (int, error) { return s.r.ReadAt(p, off) }

// TestAsync: the channel API on a mirrored pair, errors through the channel included.
func TestAsync(t *testing.T) {
	p := openPair(t, "mem")
	d1 := p.d1
	const bs = 4096
	want := make([]byte, diskSize)
	var chans []<-chan error
	for i := 0; i < 64; i++ {
		b := pattern(int64(100+i), bs)
		chans = append(chans, d1.WriteAtAsync(b, int64(i)*bs, IOFlags(i%2)))
		// The library copied b: scribbling on it now changes nothing.
		copy(want[i*bs:], b)
		for j := range b {
			b[j] = 0xee
		}
	}
	for i, c := range chans {
		if err := <-c; err != nil {
			t.Fatalf("async write %d: %v", i, err)
		}
	}
	if err := <-d1.FlushAsync(); err != nil {
		t.Fatal(err)
	}
	bufs := make([][]byte, 64)
	chans = chans[:0]
	for i := range bufs {
		bufs[i] = make([]byte, bs)
		chans = append(chans, d1.ReadAtAsync(bufs[i], int64(i)*bs))
	}
	for i, c := range chans {
		if err := <-c; err != nil {
			t.Fatalf("async read %d: %v", i, err)
		}
		sameBytes(t, bufs[i], want[i*bs:(i+1)*bs], fmt.Sprintf("async read %d", i))
	}
	if err := <-d1.WriteZeroesAsync(0, 2*bs, FUA); err != nil {
		t.Fatal(err)
	}
	copy(want, make([]byte, 2*bs))
	if err := <-d1.DiscardAsync(1<<20, 64<<10, 0); err != nil {
		t.Fatal(err)
	}
	sameBytes(t, readAll(t, p.d2), want, "node 2's disk")

	// Bad requests (which the library refuses at submission) come back through the
	// channel too, with the library's message.
	b := make([]byte, bs)
	err := <-d1.ReadAtAsync(b, diskSize)
	wantCode(t, err, ErrOutOfRange, "async read past the end")
	err = <-d1.ReadAtAsync(b[:100], 0)
	wantCode(t, err, ErrInvalidArgument, "unaligned async read")
	if err.(*Error).Message == "" {
		t.Error("no message with the refused submission's error")
	}
	err = <-d1.WriteAtAsync(b, 3, 0)
	wantCode(t, err, ErrInvalidArgument, "unaligned async write")
	err = <-d1.ReadAtAsync(nil, 0)
	wantCode(t, err, ErrInvalidArgument, "empty async read")
	err = <-d1.WriteAtAsync(b, -bs, 0)
	wantCode(t, err, ErrInvalidArgument, "negative offset")
}

// TestConcurrentIO: 64 goroutines at once on node 1, each on its own region: sync and
// async writes, reads back (aligned and not), then the whole disk through node 2.
func TestConcurrentIO(t *testing.T) {
	p := openPair(t, "mem")
	concurrentIO(t, p, 64, 2)
}

func concurrentIO(t *testing.T, p *pair, workers, rounds int) {
	t.Helper()
	d1 := p.d1
	region := diskSize / workers
	want := make([]byte, diskSize)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			base := w * region
			mine := want[base : base+region]
			for r := 0; r < rounds; r++ {
				data := pattern(int64(w*1000+r), region)
				half := region / 2
				// First half: one blocking write; second half: async writes of 4 KiB.
				if _, err := d1.WriteAt(data[:half], int64(base)); err != nil {
					t.Errorf("worker %d: write: %v", w, err)
					return
				}
				var chans []<-chan error
				for o := half; o < region; o += 4096 {
					chans = append(chans, d1.WriteAtAsync(data[o:o+4096], int64(base+o), 0))
				}
				for _, c := range chans {
					if err := <-c; err != nil {
						t.Errorf("worker %d: async write: %v", w, err)
						return
					}
				}
				copy(mine, data)
				got := make([]byte, region)
				if n, err := d1.ReadAt(got[:half], int64(base)); n != half || err != nil {
					t.Errorf("worker %d: read: %d, %v", w, n, err)
					return
				}
				chans = chans[:0]
				for o := half; o < region; o += 4096 {
					chans = append(chans, d1.ReadAtAsync(got[o:o+4096], int64(base+o)))
				}
				for _, c := range chans {
					if err := <-c; err != nil {
						t.Errorf("worker %d: async read: %v", w, err)
						return
					}
				}
				if !bytes.Equal(got, mine) {
					t.Errorf("worker %d round %d: read back differs", w, r)
					return
				}
				// An unaligned read inside the region.
				u := make([]byte, 3000)
				if n, err := d1.ReadAt(u, int64(base+777)); n != len(u) || err != nil || !bytes.Equal(u, mine[777:777+3000]) {
					t.Errorf("worker %d: unaligned read: %d, %v", w, n, err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	sameBytes(t, readAll(t, p.d2), want, "node 2's disk")
	sameBytes(t, readAll(t, d1), want, "node 1's disk")
}

// setGCEveryCall turns on a GC before and after every call into the library for
// the rest of the test.
func setGCEveryCall(t *testing.T) {
	old := atomic.SwapInt32(&gcEveryCall, 1)
	t.Cleanup(func() { atomic.StoreInt32(&gcEveryCall, old) })
}

// TestGCEveryCall: blocking and asynchronous I/O with a GC around every call (and
// the garbage of other goroutines), so any Go memory the C side used without the
// binding keeping it alive would be found. VSAN_GO_GC_EVERY_CALL=1 turns the same
// mode on for every test.
func TestGCEveryCall(t *testing.T) {
	setGCEveryCall(t)
	p := openPair(t, "mem")
	stop := make(chan struct{})
	var churn sync.WaitGroup
	churn.Add(1)
	go func() {
		defer churn.Done()
		var keep [][]byte
		for {
			select {
			case <-stop:
				return
			default:
			}
			keep = append(keep, make([]byte, 64<<10))
			if len(keep) > 64 {
				keep = nil
			}
			runtime.Gosched()
		}
	}()
	concurrentIO(t, p, 8, 1)
	d, err := p.n1.OpenDisk(diskName)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Status(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	close(stop)
	churn.Wait()
}

// TestFinalizers: a Disk and a Node dropped without Close are released by their
// finalizers (the library then refuses their handles), also while an async read is
// in flight; double Close and calls after Close return ErrBadHandle.
func TestFinalizers(t *testing.T) {
	nodes0, disks0 := atomic.LoadInt64(&finalizedNodes), atomic.LoadInt64(&finalizedDisks)
	var nodeH, diskH uintptr
	var pending <-chan error
	got := make([]byte, 4096)
	want := pattern(7, 4096)
	func() {
		n, err := OpenNode(localConfig(t.TempDir(), 1<<20))
		if err != nil {
			t.Fatal(err)
		}
		d, err := n.OpenDisk(diskName)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.WriteAt(want, 8192); err != nil {
			t.Fatal(err)
		}
		// A second handle, closed explicitly: its finalizer is gone.
		d2, err := n.OpenDisk(diskName)
		if err != nil {
			t.Fatal(err)
		}
		if err := d2.Close(); err != nil {
			t.Fatal(err)
		}
		wantCode(t, d2.Close(), ErrBadHandle, "second close of a disk")
		_, err = d2.ReadAt(got, 0)
		wantCode(t, err, ErrBadHandle, "read after close")
		pending = d.ReadAtAsync(got, 8192)
		nodeH, diskH = n.h, d.h
	}()
	// The request in flight keeps the disk (and node) reachable until it completes.
	if err := <-pending; err != nil {
		t.Fatalf("async read of a dropped disk: %v", err)
	}
	sameBytes(t, got, want, "async read of a dropped disk")
	deadline := time.Now().Add(20 * time.Second)
	for atomic.LoadInt64(&finalizedNodes) == nodes0 || atomic.LoadInt64(&finalizedDisks) == disks0 {
		if time.Now().After(deadline) {
			t.Fatalf("finalizers did not run (nodes %d, disks %d)", atomic.LoadInt64(&finalizedNodes)-nodes0, atomic.LoadInt64(&finalizedDisks)-disks0)
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	// The handles were released: the library refuses them now.
	stale := &Disk{h: diskH, geom: Geometry{Size: 1 << 20, BlockSize: 512, MaxIO: 1 << 20}}
	_, err := stale.ReadAt(got, 0)
	wantCode(t, err, ErrBadHandle, "read through a finalized disk's handle")
	wantCode(t, stale.Close(), ErrBadHandle, "close of a finalized disk")
	wantCode(t, (&Node{h: nodeH}).Close(), ErrBadHandle, "close of a finalized node")

	// Use after Node.Close: the node's disks are gone too.
	n, err := OpenNode(localConfig(t.TempDir(), 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	d, err := n.OpenDisk(diskName)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	wantCode(t, n.Close(), ErrBadHandle, "second close of a node")
	_, err = d.ReadAt(got, 0)
	wantCode(t, err, ErrBadHandle, "read after the node closed")
	wantCode(t, <-d.ReadAtAsync(got, 0), ErrBadHandle, "async read after the node closed")
	wantCode(t, d.Flush(), ErrBadHandle, "flush after the node closed")
	_, err = n.OpenDisk(diskName)
	wantCode(t, err, ErrBadHandle, "open disk after the node closed")
	wantCode(t, d.Close(), ErrBadHandle, "disk close after the node closed")

	// A disk handle left open when its node closed: its finalizer meets a handle the
	// library already invalidated, which must not matter.
	disks := atomic.LoadInt64(&finalizedDisks)
	func() {
		n, err := OpenNode(localConfig(t.TempDir(), 1<<20))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := n.OpenDisk(diskName); err != nil {
			t.Fatal(err)
		}
		if err := n.Close(); err != nil {
			t.Fatal(err)
		}
	}()
	for atomic.LoadInt64(&finalizedDisks) == disks {
		if time.Now().After(deadline) {
			t.Fatal("the disk's finalizer did not run")
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}

// TestErrors: configuration errors carry the library's message; unknown disks,
// operations a local disk does not support.
func TestErrors(t *testing.T) {
	_, err := OpenNode("this is [not toml")
	wantCode(t, err, ErrInvalidArgument, "garbage config")
	if err.(*Error).Message == "" {
		t.Fatal("no message for a bad config")
	}
	dir := t.TempDir()
	_, err = OpenNode(strings.Replace(localConfig(dir, 1<<20), "size = 1048576", `size = "banana"`, 1))
	wantCode(t, err, ErrInvalidArgument, "bad size")
	if !strings.Contains(err.Error(), "size") {
		t.Fatalf("the message does not name the key: %v", err)
	}
	_, err = OpenNodeFile(filepath.Join(dir, "missing.toml"))
	wantCode(t, err, ErrNotFound, "missing config file")

	path := filepath.Join(dir, "node.toml")
	if err := os.WriteFile(path, []byte(localConfig(dir, 1<<20)), 0o600); err != nil {
		t.Fatal(err)
	}
	n, err := OpenNodeFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	_, err = n.OpenDisk("nope")
	wantCode(t, err, ErrNotFound, "unknown disk")
	if !strings.Contains(err.Error(), "nope") {
		t.Fatalf("the message does not name the disk: %v", err)
	}
	_, err = n.ReplicationAddress()
	wantCode(t, err, ErrNotFound, "address of a node that does not listen")
	d, err := n.OpenDisk(diskName)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	wantCode(t, d.WaitSynced(time.Second), ErrNotSupported, "wait synced without a peer")
	wantCode(t, d.Verify(), ErrNotSupported, "verify without a peer")
	wantCode(t, d.DiscardMyData(), ErrNotSupported, "discard my data without a peer")
	wantCode(t, d.SetCacheMode(CacheWriteThrough), ErrNotSupported, "cache mode without a cache")
	st, err := d.Status()
	if err != nil {
		t.Fatal(err)
	}
	if st.Mirrored || st.Cached || st.Link != LinkLocal || st.Transport != "" || st.Size != 1<<20 ||
		st.Quorum != -1 || st.LastSyncResult != -1 || st.SyncETASeconds != -1 {
		t.Fatalf("local disk status %+v", st)
	}
}
