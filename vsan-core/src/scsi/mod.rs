//! The SCSI command layer (SPC-4 / SBC-3) over a [`BlockDevice`]: CDB decoding, sense
//! data, INQUIRY and its VPD pages, mode pages, unit attentions, reservations (SCSI-2 and
//! persistent), COMPARE AND WRITE. It knows nothing of iSCSI: a transport (the iSCSI
//! target in [`crate::export::iscsi`], later others) registers each I_T nexus with
//! [`LogicalUnit::attach`], asks [`LogicalUnit::inspect`] how much data a CDB moves,
//! collects the data-out, and runs [`LogicalUnit::execute`].
//!
//! ```text
//!  transport (iSCSI)  --inspect(cdb)-->  Direction (how much data to collect)
//!                     --execute(nexus, Command)-->  Response (status, sense, data)
//!        LogicalUnit
//!          |- cdb.rs      opcodes, total field readers, data directions
//!          |- exec.rs     dispatch: unit attentions, ALUA, reservations, SPC commands
//!          |- block.rs    SBC commands: READ/WRITE/VERIFY/UNMAP/WRITE SAME/CAW
//!          |- inquiry.rs  standard INQUIRY and VPD pages
//!          |- mode.rs     mode pages (WCE, D_SENSE, SWP, TAS) in one atomic byte
//!          |- pr.rs       PrState: persistent reservations as a pure, encodable value
//!          |- lock.rs     the stripe lock that makes COMPARE AND WRITE atomic
//!          |- owner.rs    which node may run CAWs on a stripe, across the pair
//!          |- peer.rs     what the two nodes' units tell each other
//!          `- sense.rs    sense data and the device error mapping
//! ```
//!
//! The I/O path (READ/WRITE) allocates nothing beyond the data `Bytes`: pending unit
//! attentions and reservations are each one atomic flag test when there are none, and
//! writes take one stripe of the COMPARE AND WRITE lock shared.
//!
//! Choices where the standards leave room (each checked against what libiscsi's
//! `iscsi-test-cu` expects):
//! - every new nexus starts with UNIT ATTENTION 29/00 (the code libiscsi's helpers
//!   tolerate); a LOGICAL UNIT RESET raises 29/03 on every nexus, the issuer's too;
//! - the checks run in this order: CDB fields, unit attention (not for INQUIRY, REPORT
//!   LUNS, REQUEST SENSE), ALUA state, reservation conflict, data-out length, the
//!   command's own checks (range before any I/O: a refused command changes nothing);
//! - MODE SENSE counts as a read for the reservation rules, TEST UNIT READY, READ
//!   CAPACITY, REPORT LUNS, INQUIRY and the MAINTENANCE IN reports are always allowed;
//! - SCSI-2 RESERVE conflicts while a persistent reservation exists; it is released by
//!   RELEASE from its holder, the end of the holder's nexus and any reset;
//! - WRITE SAME with UNMAP deallocates whatever its pattern; a zero pattern without
//!   UNMAP writes zeroes; WSNZ is set (0 blocks is an invalid field);
//! - GET LBA STATUS reports blocks that read as zeros as deallocated (with LBPRZ the two
//!   cannot be told apart), the rest mapped;
//! - persistent reservation state without APTPL is written to the state file too (so a
//!   replica has it) but dropped when the unit is created again (a power on).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};

use crate::device::{BlockDevice, Geometry};
use crate::error::{Error, ErrorKind, Result};

mod block;
pub mod cdb;
mod exec;
mod inquiry;
mod lock;
mod mode;
mod owner;
pub mod peer;
pub mod pr;
pub mod sense;
#[cfg(test)]
mod tests;

pub use peer::{BackgroundTask, PeerLink, ScsiPeer};
pub use pr::{PrState, PrType, Registration, Reservation};
pub use sense::{Sense, SenseKey};

/// The identity of a logical unit, the same on every node that serves the same disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuIdentity {
    /// 16 bytes derived from the disk's id; the NAA and T10 designators of VPD page 0x83
    /// are built from them.
    pub id: [u8; 16],
    /// The unit serial number (VPD page 0x80): printable ASCII.
    pub serial: String,
    /// T10 vendor identification (8 characters, space padded on the wire).
    pub vendor: String,
    /// Product identification (16 characters).
    pub product: String,
    /// Product revision level (4 characters).
    pub revision: String,
}

impl LuIdentity {
    /// The identity of the disk known by `disk_id` (a name or id string that is the same
    /// on every node): a hash of it gives `id` and `serial`.
    pub fn from_disk_id(disk_id: &str) -> LuIdentity {
        use sha2::Digest;
        let h = sha2::Sha256::digest(disk_id.as_bytes());
        let mut id = [0u8; 16];
        for (d, s) in id.iter_mut().zip(h.iter()) {
            *d = *s;
        }
        let serial = id[..8].iter().map(|b| format!("{b:02x}")).collect();
        LuIdentity {
            id,
            serial,
            vendor: "VSAN".into(),
            product: "vsan disk".into(),
            revision: "0001".into(),
        }
    }
}

/// The target port a logical unit is reached through on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetPort {
    /// The SCSI target port name (iSCSI: `<target iqn>,t,0x<tpgt as 4 hex digits>`).
    pub name: String,
    /// The relative target port identifier (1 or more), unique per port of the LU.
    pub relative_id: u16,
    /// The target port group this port belongs to (for ALUA).
    pub group: u16,
}

/// An I_T nexus: an initiator port talking to a target port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Nexus {
    /// The SCSI initiator port name (iSCSI: `<initiator name>,i,0x<ISID as 12 hex digits>`).
    pub initiator_port: String,
    /// The initiator's TransportID as READ FULL STATUS reports it and SPEC_I_PT parses
    /// it (iSCSI: format code 01b, the initiator port name).
    pub transport_id: Bytes,
    /// The relative target port identifier the nexus came in through.
    pub relative_target_port: u16,
}

/// How a logical unit is set up.
#[derive(Clone, Debug)]
pub struct LuConfig {
    /// Its identity.
    pub identity: LuIdentity,
    /// This node's target port.
    pub port: TargetPort,
    /// Refuse every command that changes the medium (DATA PROTECT, WRITE PROTECTED).
    pub read_only: bool,
    /// Where the persistent reservation state (and saved mode pages) are kept, replaced
    /// atomically on each change; `None` keeps them in memory only (APTPL refused).
    pub state_file: Option<PathBuf>,
}

/// The data direction and length of a command, from its CDB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// No data moves.
    None,
    /// The target sends this many bytes at most (READ, INQUIRY, ...).
    In(u32),
    /// The initiator sends this many bytes (WRITE, MODE SELECT, ...).
    Out(u32),
}

/// SCSI status codes (SAM-5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// GOOD.
    Good = 0x00,
    /// CHECK CONDITION: sense data describes the problem.
    CheckCondition = 0x02,
    /// CONDITION MET.
    ConditionMet = 0x04,
    /// BUSY.
    Busy = 0x08,
    /// RESERVATION CONFLICT.
    ReservationConflict = 0x18,
    /// TASK SET FULL.
    TaskSetFull = 0x28,
    /// ACA ACTIVE.
    AcaActive = 0x30,
    /// TASK ABORTED.
    TaskAborted = 0x40,
}

/// A command as the transport hands it over, its data-out collected.
#[derive(Clone, Debug)]
pub struct Command {
    /// The CDB (6 to 16 bytes or more; trailing bytes beyond the opcode's length are
    /// ignored).
    pub cdb: Bytes,
    /// Everything the initiator sent for it (empty for reads).
    pub data_out: Bytes,
    /// The initiator's expected data-in length: data beyond it is cut by the transport.
    pub expected_in: u32,
}

/// What a command ended with.
#[derive(Clone, Debug)]
pub struct Response {
    /// The status.
    pub status: Status,
    /// Sense data (fixed or descriptor format per the control mode page's D_SENSE); empty
    /// unless CHECK CONDITION.
    pub sense: Bytes,
    /// The data-in (may be longer than the initiator expects: the transport cuts it and
    /// reports the residual).
    pub data: Bytes,
}

/// Task management functions that reach the logical unit (ABORT TASK is the transport's:
/// it owns the tasks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskFunction {
    /// ABORT TASK SET: the nexus's own tasks.
    AbortTaskSet,
    /// CLEAR TASK SET: every nexus's tasks on this LU.
    ClearTaskSet,
    /// LOGICAL UNIT RESET.
    LunReset,
    /// TARGET WARM RESET.
    TargetWarmReset,
    /// TARGET COLD RESET.
    TargetColdReset,
    /// CLEAR ACA.
    ClearAca,
}

/// A logical unit: a [`BlockDevice`] with its SCSI state.
pub struct LogicalUnit {
    device: Arc<dyn BlockDevice>,
    config: LuConfig,
    geometry: Geometry,
    mode: mode::ModeState,
    nexuses: Mutex<Vec<Arc<NexusState>>>,
    next_nexus: AtomicU64,
    /// Set while a persistent or SCSI-2 reservation exists: the I/O path tests only this.
    reserved: AtomicBool,
    pr: RwLock<PrState>,
    /// Serialises PERSISTENT RESERVE OUT (apply, persist, publish).
    pr_out: tokio::sync::Mutex<()>,
    /// The nexus holding a SCSI-2 reservation (on either node, with a peer).
    scsi2: Mutex<Option<Nexus>>,
    locks: lock::StripeLock,
    groups: RwLock<Vec<PortGroup>>,
    /// Where PR state goes instead of the state file, when set.
    pr_store: RwLock<Option<Arc<dyn PrStore>>>,
    /// This node's group's [`AluaState`], for the per-command check.
    own_state: AtomicU8,
    /// The other node serving this unit, if any (peer.rs).
    peer: RwLock<Option<Arc<dyn ScsiPeer>>>,
    /// Which stripes this node owns or granted to the other, for COMPARE AND WRITE
    /// (owner.rs).
    owner: owner::Ownership,
    /// The token of the next PERSISTENT RESERVE OUT this node forwards to the other.
    next_forward: AtomicU64,
    /// This node's forwarded PERSISTENT RESERVE OUTs whose `PrApply` came back (peer.rs).
    applied_forwards: Mutex<std::collections::HashSet<u64>>,
    /// No reservation state was settled with the other node since this unit was made.
    pr_fresh: AtomicBool,
}

/// Where the persistent reservation state is kept. By default a logical unit writes
/// [`LuConfig::state_file`]; a mirror (issue 20) sets its own with
/// [`LogicalUnit::set_pr_store`] to carry the state with the data, in the same order.
pub trait PrStore: Send + Sync {
    /// Make `state` durable (and replicated, for a mirror); a PERSISTENT RESERVE OUT
    /// completes only after this does, and fails with HARDWARE ERROR if it fails.
    fn save<'a>(&'a self, state: &'a PrState) -> crate::device::IoFuture<'a, ()>;
}

/// An asymmetric access state (SPC-4 5.16.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AluaState {
    /// Active/optimized.
    ActiveOptimized = 0x0,
    /// Active/non-optimized.
    ActiveNonOptimized = 0x1,
    /// Standby: commands that access the medium get NOT READY 04/0B.
    Standby = 0x2,
    /// Unavailable: NOT READY 04/0C.
    Unavailable = 0x3,
    /// Transitioning: NOT READY 04/0A (retry).
    Transitioning = 0xF,
}

impl AluaState {
    fn from_u8(v: u8) -> AluaState {
        match v {
            0x0 => AluaState::ActiveOptimized,
            0x1 => AluaState::ActiveNonOptimized,
            0x2 => AluaState::Standby,
            0x3 => AluaState::Unavailable,
            _ => AluaState::Transitioning,
        }
    }
}

/// A target port group as REPORT TARGET PORT GROUPS reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortGroup {
    /// The target port group id.
    pub id: u16,
    /// Its state.
    pub state: AluaState,
    /// The relative target port ids in it.
    pub relative_ports: Vec<u16>,
}

/// The per-nexus state the LU keeps: unit attentions and the abort counter.
#[derive(Debug)]
struct NexusState {
    id: u64,
    nexus: Nexus,
    ua: Mutex<VecDeque<Sense>>,
    ua_pending: AtomicBool,
    aborts: tokio::sync::watch::Sender<Aborts>,
    /// Commands of this nexus running in the unit now, and a wake-up when none is
    /// (sent only while someone waits: `waiters`, so a command's end costs one atomic
    /// decrement and one load on the I/O path).
    running: AtomicU64,
    waiters: AtomicU64,
    idle: tokio::sync::Notify,
}

/// One command of a nexus running (see [`NexusState::task_started`]).
struct Running<'a>(&'a NexusState);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        // SeqCst against `idle`'s increment of `waiters` and load of `running`: one of
        // the two sees the other's write.
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1
            && self.0.waiters.load(Ordering::SeqCst) > 0
        {
            self.0.idle.notify_waiters();
        }
    }
}

/// At most this many unit attentions queue per nexus; older ones are dropped first.
const MAX_UA: usize = 16;

impl NexusState {
    fn push_ua(&self, s: Sense) {
        let mut q = self.ua.lock();
        if q.contains(&s) {
            return;
        }
        if q.len() >= MAX_UA {
            q.pop_front();
        }
        q.push_back(s);
        self.ua_pending.store(true, Ordering::Release);
    }

    fn pop_ua(&self) -> Option<Sense> {
        if !self.ua_pending.load(Ordering::Acquire) {
            return None;
        }
        let mut q = self.ua.lock();
        let s = q.pop_front();
        if q.is_empty() {
            self.ua_pending.store(false, Ordering::Release);
        }
        s
    }

    /// Count a command as running until the guard drops (also when its future is
    /// dropped).
    fn task_started(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::AcqRel);
        Running(self)
    }

    /// Wait until no command of this nexus runs.
    async fn idle(&self) {
        struct Waiting<'a>(&'a AtomicU64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiters);
        loop {
            let woken = self.idle.notified();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            if self.running.load(Ordering::SeqCst) == 0 {
                return;
            }
            woken.await;
        }
    }

    fn bump_aborts(&self, tas: bool, cleared: bool) {
        self.aborts.send_modify(|a| {
            a.count += 1;
            a.tas = tas;
            a.cleared = cleared;
        });
    }
}

impl std::fmt::Debug for LogicalUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogicalUnit")
            .field("identity", &self.config.identity)
            .finish_non_exhaustive()
    }
}

/// A registered I_T nexus: its unit attentions and the aborts aimed at its tasks. Dropping
/// it ends the nexus (its persistent reservation registrations stay).
#[derive(Debug)]
pub struct NexusHandle {
    lu: Arc<LogicalUnit>,
    nexus: Nexus,
    state: Arc<NexusState>,
}

impl Drop for NexusHandle {
    fn drop(&mut self) {
        self.lu.detach(self.state.id);
    }
}

impl NexusHandle {
    /// The nexus.
    pub fn nexus(&self) -> &Nexus {
        &self.nexus
    }

    /// The logical unit.
    pub fn lu(&self) -> &Arc<LogicalUnit> {
        &self.lu
    }

    /// Bumped whenever something outside this nexus's own commands aborted its tasks
    /// (CLEAR TASK SET or a reset from another nexus, PREEMPT AND ABORT): the transport
    /// ends every task of the nexus that was running when the value changed, without a
    /// response (or with TASK ABORTED where TAS says so, see [`Aborts::tas`]).
    pub fn aborts(&self) -> tokio::sync::watch::Receiver<Aborts> {
        self.state.aborts.subscribe()
    }

    /// Queue a unit attention for this nexus (the transport's own conditions).
    pub fn raise_unit_attention(&self, sense: Sense) {
        self.state.push_ua(sense);
    }
}

/// The abort counter of a nexus; see [`NexusHandle::aborts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Aborts {
    /// How many times the nexus's tasks were aborted from outside.
    pub count: u64,
    /// Whether aborted tasks should be answered with TASK ABORTED status (the control
    /// mode page's TAS bit) rather than not at all.
    pub tas: bool,
    /// Whether the latest abort was another nexus's CLEAR TASK SET: with `tas` off, a
    /// nexus that lost tasks to it raises COMMANDS CLEARED BY ANOTHER INITIATOR
    /// ([`sense::UA_COMMANDS_CLEARED`]) on itself (SAM-5), which only the transport can
    /// decide, since only it knows whether it had tasks.
    pub cleared: bool,
}

/// The reservation state saved in the state file at `path` (as saved: before the power
/// on of a start); `None` when there is no such file. A file that does not decode is an
/// [`ErrorKind::Corrupt`] error.
pub fn read_state_file(path: &std::path::Path) -> Result<Option<PrState>> {
    match std::fs::read(path) {
        Ok(bytes) => PrState::decode(&bytes).map(Some).map_err(|e| {
            Error::with_source(
                ErrorKind::Corrupt,
                format!("SCSI state file {}", path.display()),
                e,
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(
            format!("read SCSI state file {}", path.display()),
            e,
        )),
    }
}

impl LogicalUnit {
    /// A logical unit over `device`; loads the state file when there is one (a file
    /// that does not decode is an [`ErrorKind::Corrupt`] error).
    pub fn new(device: Arc<dyn BlockDevice>, config: LuConfig) -> Result<Arc<LogicalUnit>> {
        let mut pr = PrState::new();
        if let Some(saved) = config
            .state_file
            .as_deref()
            .map(read_state_file)
            .transpose()?
        {
            pr = saved.unwrap_or_default();
            // A power on: only APTPL state survives it.
            pr.power_on();
        }
        let geometry = device.geometry();
        let groups = vec![PortGroup {
            id: config.port.group,
            state: AluaState::ActiveOptimized,
            relative_ports: vec![config.port.relative_id],
        }];
        let reserved = pr.reservation.is_some();
        Ok(Arc::new(LogicalUnit {
            device,
            geometry,
            mode: mode::ModeState::default(),
            nexuses: Mutex::new(Vec::new()),
            next_nexus: AtomicU64::new(1),
            reserved: AtomicBool::new(reserved),
            pr: RwLock::new(pr),
            pr_out: tokio::sync::Mutex::new(()),
            scsi2: Mutex::new(None),
            locks: lock::StripeLock::default(),
            groups: RwLock::new(groups),
            pr_store: RwLock::new(None),
            own_state: AtomicU8::new(AluaState::ActiveOptimized as u8),
            peer: RwLock::new(None),
            owner: owner::Ownership::default(),
            next_forward: AtomicU64::new(1),
            applied_forwards: Mutex::new(std::collections::HashSet::new()),
            pr_fresh: AtomicBool::new(true),
            config,
        }))
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    /// Whether sense data is in descriptor format now (the control mode page's D_SENSE).
    pub fn descriptor_sense(&self) -> bool {
        self.mode.get().d_sense()
    }

    /// This node's target port.
    pub fn port(&self) -> &TargetPort {
        &self.config.port
    }

    /// The identity.
    pub fn identity(&self) -> &LuIdentity {
        &self.config.identity
    }

    /// The configuration.
    pub fn config(&self) -> &LuConfig {
        &self.config
    }

    /// A copy of the persistent reservation state (to replicate or inspect it).
    pub fn pr_state(&self) -> PrState {
        self.pr.read().clone()
    }

    /// Keep the persistent reservation state in `store` instead of the state file (APTPL
    /// is then offered).
    pub fn set_pr_store(&self, store: Arc<dyn PrStore>) {
        *self.pr_store.write() = Some(store);
    }

    /// The target port groups REPORT TARGET PORT GROUPS reports.
    pub fn port_groups(&self) -> Vec<PortGroup> {
        self.groups.read().clone()
    }

    /// Replace the target port groups (issue 20: both nodes' groups, their states from
    /// the mirror). This node's group (`LuConfig::port.group`) decides what commands
    /// are served here. A change raises ASYMMETRIC ACCESS STATE CHANGED on every nexus.
    pub fn set_port_groups(&self, groups: Vec<PortGroup>) {
        let own = groups
            .iter()
            .find(|g| g.id == self.config.port.group)
            .map_or(AluaState::ActiveOptimized, |g| g.state);
        let changed = {
            let mut g = self.groups.write();
            let changed = *g != groups;
            *g = groups;
            changed
        };
        self.own_state.store(own as u8, Ordering::Release);
        if changed {
            for n in self.nexuses.lock().iter() {
                n.push_ua(sense::UA_ALUA_CHANGED);
            }
        }
    }

    fn own_alua(&self) -> AluaState {
        AluaState::from_u8(self.own_state.load(Ordering::Acquire))
    }

    /// Register an I_T nexus (a login). Its first command that is not INQUIRY, REPORT
    /// LUNS or REQUEST SENSE gets the POWER ON, RESET, OR BUS DEVICE RESET OCCURRED unit
    /// attention.
    pub fn attach(self: &Arc<Self>, nexus: Nexus) -> NexusHandle {
        let state = Arc::new(NexusState {
            id: self.next_nexus.fetch_add(1, Ordering::Relaxed),
            nexus: nexus.clone(),
            ua: Mutex::new(VecDeque::new()),
            ua_pending: AtomicBool::new(false),
            aborts: tokio::sync::watch::channel(Aborts::default()).0,
            running: AtomicU64::new(0),
            waiters: AtomicU64::new(0),
            idle: tokio::sync::Notify::new(),
        });
        state.push_ua(sense::UA_RESET);
        self.nexuses.lock().push(state.clone());
        NexusHandle {
            lu: self.clone(),
            nexus,
            state,
        }
    }

    /// The end of a nexus: its SCSI-2 reservation goes, its registrations stay.
    fn detach(&self, id: u64) {
        let mut gone = None;
        self.nexuses.lock().retain(|n| {
            if n.id == id {
                gone = Some(n.nexus.clone());
            }
            n.id != id
        });
        let Some(gone) = gone else {
            return;
        };
        let mut s2 = self.scsi2.lock();
        let held = s2.as_ref() == Some(&gone);
        if held {
            *s2 = None;
        }
        drop(s2);
        self.update_reserved();
        if held {
            // The other node learns it too (its release runs in the background).
            self.scsi2_released_here(gone);
        }
    }

    fn update_reserved(&self) {
        let any = self.scsi2.lock().is_some() || self.pr.read().reservation.is_some();
        self.reserved.store(any, Ordering::Release);
    }

    /// Every attached nexus but `except`.
    fn others(&self, except: u64) -> Vec<Arc<NexusState>> {
        self.nexuses
            .lock()
            .iter()
            .filter(|n| n.id != except)
            .cloned()
            .collect()
    }

    /// What data the CDB moves; `Err` carries the CHECK CONDITION to answer at once
    /// (an unknown opcode, a bad field) without collecting any data.
    pub fn inspect(&self, cdb: &[u8]) -> std::result::Result<Direction, Response> {
        cdb::direction(cdb, &self.geometry).map_err(|s| s.response(self.mode.get().d_sense()))
    }

    /// Run a command for `nexus`.
    pub async fn execute(&self, nexus: &NexusHandle, command: Command) -> Response {
        self.run(&nexus.state, command).await
    }

    /// Run a task management function from `nexus` (raises the unit attentions it
    /// implies and bumps [`NexusHandle::aborts`] of the other nexuses it aborts). The
    /// transport ends `nexus`'s own tasks itself.
    ///
    /// | function | effect |
    /// |---|---|
    /// | ABORT TASK SET | none |
    /// | CLEAR TASK SET | the other nexuses' tasks aborted (with TAS off, each that had some raises UA 2F/00, see [`Aborts::cleared`]) |
    /// | LOGICAL UNIT RESET | others' tasks aborted, UA 29/03 on every nexus (the issuer's too), SCSI-2 reservation released |
    /// | TARGET WARM RESET | as LU reset with UA 29/02, not on the issuer |
    /// | TARGET COLD RESET | as LU reset with UA 29/01 (not on the issuer), mode pages to defaults, PR state without APTPL cleared |
    /// | CLEAR ACA | `NotSupported` (no ACA is offered) |
    ///
    /// With a peer ([`LogicalUnit::set_peer`]) the other node's nexuses see the same
    /// effects: the transport runs [`LogicalUnit::peer_task_management`] and answers
    /// after it.
    pub fn task_management(&self, nexus: &NexusHandle, function: TaskFunction) -> Result<()> {
        if function == TaskFunction::ClearAca {
            return Err(Error::new(ErrorKind::NotSupported, "CLEAR ACA: no ACA"));
        }
        self.reset_effects(Some(&nexus.state), function);
        Ok(())
    }

    /// The effects of a task management function on this node's nexuses; `issuer` is
    /// the issuing nexus when it is attached here (none: it came through the other
    /// node).
    fn reset_effects(&self, issuer: Option<&NexusState>, function: TaskFunction) {
        let me = issuer.map(|n| n.id);
        let tas = self.mode.get().tas();
        let (ua, abort) = match function {
            TaskFunction::AbortTaskSet | TaskFunction::ClearAca => return,
            TaskFunction::ClearTaskSet => (None, true),
            TaskFunction::LunReset => (Some(sense::UA_BUS_DEVICE_RESET), true),
            TaskFunction::TargetWarmReset => (Some(sense::UA_BUS_RESET), true),
            TaskFunction::TargetColdReset => (Some(sense::UA_POWER_ON), true),
        };
        if ua.is_some() {
            *self.scsi2.lock() = None;
        }
        if function == TaskFunction::TargetColdReset {
            self.mode.reset();
            self.pr.write().power_on();
        }
        self.update_reserved();
        // A LU reset's unit attention goes to every nexus, the issuer's too (SAM-3 6.2;
        // libiscsi's MultipathIO.Reset looks for it on every path). A target reset's
        // goes to the others only: the issuer knows, and for a cold reset its
        // connection is dropped anyway.
        if let (Some(s), TaskFunction::LunReset, Some(i)) = (ua, function, issuer) {
            i.push_ua(s);
        }
        let others: Vec<Arc<NexusState>> = match me {
            Some(me) => self.others(me),
            None => self.nexuses.lock().clone(),
        };
        for n in others {
            if let Some(s) = ua {
                n.push_ua(s);
            }
            if abort {
                n.bump_aborts(tas, function == TaskFunction::ClearTaskSet);
            }
        }
    }
}

/// The answer to a command sent to a LUN that does not exist: INQUIRY gets a
/// peripheral qualifier of 011b, REPORT LUNS and REQUEST SENSE work, everything else
/// gets ILLEGAL REQUEST, LOGICAL UNIT NOT SUPPORTED.
pub fn missing_lun(command: &Command, lun_count: u32) -> Response {
    exec::missing_lun(command, lun_count)
}
