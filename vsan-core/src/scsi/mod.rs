//! The SCSI command layer (SPC-4 / SBC-3) over a [`BlockDevice`]: CDB decoding, sense
//! data, INQUIRY and its VPD pages, mode pages, unit attentions, reservations (SCSI-2 and
//! persistent), COMPARE AND WRITE. It knows nothing of iSCSI: a transport (the iSCSI
//! target in [`crate::export::iscsi`], later others) registers each I_T nexus with
//! [`LogicalUnit::attach`], asks [`LogicalUnit::inspect`] how much data a CDB moves,
//! collects the data-out, and runs [`LogicalUnit::execute`].
//!
//! SKELETON: the API the iSCSI target and the node are written against; the bodies are
//! filled in by the SCSI work.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;

use crate::device::BlockDevice;
use crate::error::Result;

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
        let _ = disk_id;
        LuIdentity {
            id: [0; 16],
            serial: String::new(),
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
        tokio::sync::watch::channel(Aborts::default()).1
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
}

impl LogicalUnit {
    /// A logical unit over `device`; loads the state file when there is one.
    pub fn new(device: Arc<dyn BlockDevice>, config: LuConfig) -> Result<Arc<LogicalUnit>> {
        Ok(Arc::new(LogicalUnit { device, config }))
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    /// This node's target port.
    pub fn port(&self) -> &TargetPort {
        &self.config.port
    }

    /// The identity.
    pub fn identity(&self) -> &LuIdentity {
        &self.config.identity
    }

    /// Register an I_T nexus (a login). Its first command that is not INQUIRY, REPORT
    /// LUNS or REQUEST SENSE gets the POWER ON, RESET, OR BUS DEVICE RESET OCCURRED unit
    /// attention.
    pub fn attach(self: &Arc<Self>, nexus: Nexus) -> NexusHandle {
        NexusHandle {
            lu: self.clone(),
            nexus,
        }
    }

    /// What data the CDB moves; `Err` carries the CHECK CONDITION to answer at once
    /// (an unknown opcode, a bad field) without collecting any data.
    pub fn inspect(&self, cdb: &[u8]) -> std::result::Result<Direction, Response> {
        let _ = cdb;
        Ok(Direction::None)
    }

    /// Run a command for `nexus`.
    pub async fn execute(&self, nexus: &NexusHandle, command: Command) -> Response {
        let _ = (nexus, command);
        Response {
            status: Status::Good,
            sense: Bytes::new(),
            data: Bytes::new(),
        }
    }

    /// Run a task management function from `nexus` (raises the unit attentions it
    /// implies and bumps [`NexusHandle::aborts`] of the other nexuses it aborts). The
    /// transport ends `nexus`'s own tasks itself.
    pub fn task_management(&self, nexus: &NexusHandle, function: TaskFunction) -> Result<()> {
        let _ = (nexus, function);
        Ok(())
    }
}

/// The answer to a command sent to a LUN that does not exist: INQUIRY gets a
/// peripheral qualifier of 011b, REPORT LUNS and REQUEST SENSE work, everything else
/// gets ILLEGAL REQUEST, LOGICAL UNIT NOT SUPPORTED.
pub fn missing_lun(command: &Command, lun_count: u32) -> Response {
    let _ = (command, lun_count);
    Response {
        status: Status::CheckCondition,
        sense: Bytes::new(),
        data: Bytes::new(),
    }
}
