package vsan

/*
#include <stdint.h>
#include "vsan.h"

static vsan_result vsango_status(uintptr_t d, vsan_disk_status *out) {
	return vsan_disk_get_status((vsan_disk *)d, out);
}
*/
import "C"

import "runtime"

// LinkState is the state of a disk's link to its peer (VSAN_LINK_*).
type LinkState uint32

// Link states.
const (
	LinkLocal       LinkState = C.VSAN_LINK_LOCAL       // not mirrored
	LinkWaiting     LinkState = C.VSAN_LINK_WAITING     // the peer has not connected yet
	LinkHandshaking LinkState = C.VSAN_LINK_HANDSHAKING // connected, agreeing on who has what
	LinkConnected   LinkState = C.VSAN_LINK_CONNECTED   // mirroring
	LinkDegraded    LinkState = C.VSAN_LINK_DEGRADED    // the peer was lost
)

func (l LinkState) String() string {
	switch l {
	case LinkLocal:
		return "local"
	case LinkWaiting:
		return "waiting"
	case LinkHandshaking:
		return "handshaking"
	case LinkConnected:
		return "connected"
	case LinkDegraded:
		return "degraded"
	}
	return "unknown"
}

// SyncKind is the kind of a resync or verify pass (VSAN_SYNC_*).
type SyncKind uint32

// Sync kinds.
const (
	SyncNone     SyncKind = C.VSAN_SYNC_NONE     // none has started
	SyncBitmap   SyncKind = C.VSAN_SYNC_BITMAP   // resync of the chunks the bitmap marks
	SyncChecksum SyncKind = C.VSAN_SYNC_CHECKSUM // full resync comparing checksums
	SyncVerify   SyncKind = C.VSAN_SYNC_VERIFY   // online verify
)

// SyncRole is this node's role in a pass (VSAN_ROLE_*).
type SyncRole uint32

// Sync roles.
const (
	RoleNone   SyncRole = C.VSAN_ROLE_NONE
	RoleSource SyncRole = C.VSAN_ROLE_SOURCE // this node sends the data
	RoleTarget SyncRole = C.VSAN_ROLE_TARGET // this node receives it
)

// CacheMode is a write-back cache's mode (VSAN_CACHE_*).
type CacheMode uint32

// Cache modes.
const (
	CacheNone         CacheMode = C.VSAN_CACHE_NONE // no cache (status only)
	CacheWriteBack    CacheMode = C.VSAN_CACHE_WRITE_BACK
	CacheWriteThrough CacheMode = C.VSAN_CACHE_WRITE_THROUGH
	CacheWriteAround  CacheMode = C.VSAN_CACHE_WRITE_AROUND
	CachePassThrough  CacheMode = C.VSAN_CACHE_PASS_THROUGH
)

// CacheState is the state of a disk's cache device (VSAN_CACHE_STATE_*).
type CacheState uint32

// Cache states.
const (
	CacheStateNone    CacheState = C.VSAN_CACHE_STATE_NONE
	CacheStateRunning CacheState = C.VSAN_CACHE_STATE_RUNNING
	CacheStateFailed  CacheState = C.VSAN_CACHE_STATE_FAILED
	CacheStateClosed  CacheState = C.VSAN_CACHE_STATE_CLOSED
)

// Status is a snapshot of a disk's state (vsan_disk_get_status). Fields that do not
// apply (mirror fields of a local disk, cache fields of a disk without cache) are
// zero, except Quorum, SyncETASeconds and LastSyncResult, which are -1 ("none").
type Status struct {
	Size      uint64 // bytes
	BlockSize uint32 // bytes
	Mirrored  bool   // the disk is mirrored to a peer
	Cached    bool   // the disk has a write-back cache

	Link          LinkState
	PeerID        uint32 // 0 when not mirrored
	Transport     string // "tcp", "quic", "shm", "tcp*4", ...; empty without a link
	LocalDetached bool   // the local replica failed; I/O goes through the peer
	Diverged      bool   // this replica has writes the peer lacks
	Inconsistent  bool   // unfinished sync target: needs the peer for reads
	Syncing       bool   // a resync or verify runs
	Suspended     bool   // requests are held until quorum or the peer returns
	Quorum        int32  // 1 may serve alone, 0 may not, -1 no witness
	DirtyChunks   uint64 // chunks marked out of sync with the peer
	Generation    uint64 // this replica's current generation id
	LocalDataLost uint64 // times the local replica lost acknowledged data

	SyncKind             SyncKind // the running (or last) pass
	SyncRole             SyncRole
	SyncTotalBytes       uint64 // bytes the running pass goes through (0 when none)
	SyncDoneBytes        uint64
	SyncTransferredBytes uint64 // bytes sent over the link so far
	SyncRate             uint64 // bytes per second
	SyncETASeconds       int64  // -1 when unknown
	LastSyncResult       int32  // -1 none yet, 0 interrupted, 1 completed
	LastSyncMismatches   uint64 // blocks the last verify found different

	CacheMode          CacheMode
	CacheState         CacheState
	CacheLostBlocks    uint64
	CacheReadHits      uint64
	CacheReadMisses    uint64
	CacheDirtyBytes    uint64
	CacheLogBytes      uint64
	CacheDestagedBytes uint64
}

// Status returns a snapshot of the disk's state.
func (d *Disk) Status() (Status, error) {
	var s C.vsan_disk_status
	err := call("disk status", func() C.vsan_result { return C.vsango_status(C.uintptr_t(d.h), &s) })
	runtime.KeepAlive(d)
	if err != nil {
		return Status{}, err
	}
	return Status{
		Size:                 uint64(s.size),
		BlockSize:            uint32(s.block_size),
		Mirrored:             bool(s.mirrored),
		Cached:               bool(s.cached),
		Link:                 LinkState(s.link),
		PeerID:               uint32(s.peer_id),
		Transport:            C.GoString(&s.transport[0]),
		LocalDetached:        bool(s.local_detached),
		Diverged:             bool(s.diverged),
		Inconsistent:         bool(s.inconsistent),
		Syncing:              bool(s.syncing),
		Suspended:            bool(s.suspended),
		Quorum:               int32(s.quorum),
		DirtyChunks:          uint64(s.dirty_chunks),
		Generation:           uint64(s.generation),
		LocalDataLost:        uint64(s.local_data_lost),
		SyncKind:             SyncKind(s.sync_kind),
		SyncRole:             SyncRole(s.sync_role),
		SyncTotalBytes:       uint64(s.sync_total_bytes),
		SyncDoneBytes:        uint64(s.sync_done_bytes),
		SyncTransferredBytes: uint64(s.sync_transferred_bytes),
		SyncRate:             uint64(s.sync_rate),
		SyncETASeconds:       int64(s.sync_eta_s),
		LastSyncResult:       int32(s.last_sync_result),
		LastSyncMismatches:   uint64(s.last_sync_mismatches),
		CacheMode:            CacheMode(s.cache_mode),
		CacheState:           CacheState(s.cache_state),
		CacheLostBlocks:      uint64(s.cache_lost_blocks),
		CacheReadHits:        uint64(s.cache_read_hits),
		CacheReadMisses:      uint64(s.cache_read_misses),
		CacheDirtyBytes:      uint64(s.cache_dirty_bytes),
		CacheLogBytes:        uint64(s.cache_log_bytes),
		CacheDestagedBytes:   uint64(s.cache_destaged_bytes),
	}, nil
}
