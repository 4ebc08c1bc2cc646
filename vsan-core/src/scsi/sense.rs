//! Sense data (SPC-4 4.5): the key/ASC/ASCQ triple a CHECK CONDITION carries, encoded in
//! fixed (0x70) or descriptor (0x72) format as the control mode page's D_SENSE selects,
//! and the mapping of [`ErrorKind`]s from the device to sense.

use bytes::{BufMut, Bytes, BytesMut};

use super::{Response, Status};
use crate::error::ErrorKind;

/// Sense keys (SPC-4 table 28).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SenseKey {
    /// NO SENSE.
    NoSense = 0x0,
    /// NOT READY.
    NotReady = 0x2,
    /// MEDIUM ERROR.
    MediumError = 0x3,
    /// HARDWARE ERROR.
    HardwareError = 0x4,
    /// ILLEGAL REQUEST.
    IllegalRequest = 0x5,
    /// UNIT ATTENTION.
    UnitAttention = 0x6,
    /// DATA PROTECT.
    DataProtect = 0x7,
    /// ABORTED COMMAND.
    AbortedCommand = 0xB,
    /// MISCOMPARE.
    Miscompare = 0xE,
}

impl SenseKey {
    /// The key for its code, if it is one of these.
    pub fn from_u8(v: u8) -> Option<SenseKey> {
        use SenseKey::*;
        [
            NoSense,
            NotReady,
            MediumError,
            HardwareError,
            IllegalRequest,
            UnitAttention,
            DataProtect,
            AbortedCommand,
            Miscompare,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }
}

/// One sense condition: key, additional sense code and qualifier, and the INFORMATION
/// field when there is one (MISCOMPARE's byte offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sense {
    /// The sense key.
    pub key: SenseKey,
    /// ASC.
    pub asc: u8,
    /// ASCQ.
    pub ascq: u8,
    /// The INFORMATION field (VALID set) when present.
    pub information: Option<u64>,
}

impl Sense {
    /// A condition without INFORMATION.
    pub const fn new(key: SenseKey, asc: u8, ascq: u8) -> Sense {
        Sense {
            key,
            asc,
            ascq,
            information: None,
        }
    }

    /// The same condition with the INFORMATION field set.
    pub const fn with_information(mut self, info: u64) -> Sense {
        self.information = Some(info);
        self
    }

    /// The additional sense code and qualifier as one value (`0x2400`).
    pub const fn code(&self) -> u16 {
        ((self.asc as u16) << 8) | self.ascq as u16
    }

    /// The sense bytes: descriptor format when `descriptor`, else fixed.
    pub fn encode(&self, descriptor: bool) -> Bytes {
        if descriptor {
            let mut b = BytesMut::with_capacity(20);
            b.put_u8(0x72);
            b.put_u8(self.key as u8);
            b.put_u8(self.asc);
            b.put_u8(self.ascq);
            b.put_slice(&[0, 0, 0]);
            match self.information {
                Some(info) => {
                    b.put_u8(12);
                    // Information descriptor (type 0): VALID, reserved, 8 bytes.
                    b.put_slice(&[0x00, 0x0A, 0x80, 0x00]);
                    b.put_u64(info);
                }
                None => b.put_u8(0),
            }
            b.freeze()
        } else {
            let mut b = [0u8; 18];
            b[0] = 0x70;
            b[2] = self.key as u8;
            if let Some(info) = self.information {
                // The fixed format holds 4 bytes of INFORMATION; VALID only when it fits.
                if let Ok(v) = u32::try_from(info) {
                    b[0] |= 0x80;
                    b[3..7].copy_from_slice(&v.to_be_bytes());
                }
            }
            b[7] = 10;
            b[12] = self.asc;
            b[13] = self.ascq;
            Bytes::copy_from_slice(&b)
        }
    }

    /// A CHECK CONDITION response carrying this sense.
    pub fn response(&self, descriptor: bool) -> Response {
        Response {
            status: Status::CheckCondition,
            sense: self.encode(descriptor),
            data: Bytes::new(),
        }
    }
}

use SenseKey::*;

/// NO SENSE, NO ADDITIONAL SENSE INFORMATION.
pub const NO_SENSE: Sense = Sense::new(NoSense, 0x00, 0x00);
/// INVALID COMMAND OPERATION CODE.
pub const INVALID_OPCODE: Sense = Sense::new(IllegalRequest, 0x20, 0x00);
/// LOGICAL BLOCK ADDRESS OUT OF RANGE.
pub const LBA_OUT_OF_RANGE: Sense = Sense::new(IllegalRequest, 0x21, 0x00);
/// INVALID FIELD IN CDB.
pub const INVALID_FIELD_IN_CDB: Sense = Sense::new(IllegalRequest, 0x24, 0x00);
/// LOGICAL UNIT NOT SUPPORTED.
pub const LUN_NOT_SUPPORTED: Sense = Sense::new(IllegalRequest, 0x25, 0x00);
/// INVALID FIELD IN PARAMETER LIST.
pub const INVALID_FIELD_IN_PARAM: Sense = Sense::new(IllegalRequest, 0x26, 0x00);
/// INVALID RELEASE OF PERSISTENT RESERVATION.
pub const INVALID_RELEASE: Sense = Sense::new(IllegalRequest, 0x26, 0x04);
/// PARAMETER LIST LENGTH ERROR.
pub const PARAM_LIST_LENGTH: Sense = Sense::new(IllegalRequest, 0x1A, 0x00);
/// INSUFFICIENT REGISTRATION RESOURCES.
pub const INSUFFICIENT_REGISTRATION: Sense = Sense::new(IllegalRequest, 0x55, 0x04);
/// WRITE PROTECTED.
pub const WRITE_PROTECTED: Sense = Sense::new(DataProtect, 0x27, 0x00);
/// SPACE ALLOCATION FAILED WRITE PROTECT.
pub const SPACE_ALLOCATION_FAILED: Sense = Sense::new(DataProtect, 0x27, 0x07);
/// MISCOMPARE DURING VERIFY OPERATION.
pub const MISCOMPARE_VERIFY: Sense = Sense::new(Miscompare, 0x1D, 0x00);
/// WRITE ERROR.
pub const WRITE_ERROR: Sense = Sense::new(MediumError, 0x0C, 0x00);
/// UNRECOVERED READ ERROR.
pub const READ_ERROR: Sense = Sense::new(MediumError, 0x11, 0x00);
/// INTERNAL TARGET FAILURE.
pub const INTERNAL_FAILURE: Sense = Sense::new(HardwareError, 0x44, 0x00);
/// LOGICAL UNIT COMMUNICATION TIME-OUT.
pub const TIMEOUT: Sense = Sense::new(AbortedCommand, 0x08, 0x01);
/// LOGICAL UNIT NOT READY, ASYMMETRIC ACCESS STATE TRANSITION.
pub const NOT_READY_TRANSITION: Sense = Sense::new(NotReady, 0x04, 0x0A);
/// LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN STANDBY STATE.
pub const NOT_READY_STANDBY: Sense = Sense::new(NotReady, 0x04, 0x0B);
/// LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN UNAVAILABLE STATE.
pub const NOT_READY_UNAVAILABLE: Sense = Sense::new(NotReady, 0x04, 0x0C);
/// SAVING PARAMETERS NOT SUPPORTED.
pub const SAVING_NOT_SUPPORTED: Sense = Sense::new(IllegalRequest, 0x39, 0x00);
/// POWER ON, RESET, OR BUS DEVICE RESET OCCURRED.
pub const UA_RESET: Sense = Sense::new(UnitAttention, 0x29, 0x00);
/// POWER ON OCCURRED.
pub const UA_POWER_ON: Sense = Sense::new(UnitAttention, 0x29, 0x01);
/// SCSI BUS RESET OCCURRED (a hard reset: TARGET WARM RESET).
pub const UA_BUS_RESET: Sense = Sense::new(UnitAttention, 0x29, 0x02);
/// BUS DEVICE RESET FUNCTION OCCURRED.
pub const UA_BUS_DEVICE_RESET: Sense = Sense::new(UnitAttention, 0x29, 0x03);
/// MODE PARAMETERS CHANGED.
pub const UA_MODE_CHANGED: Sense = Sense::new(UnitAttention, 0x2A, 0x01);
/// RESERVATIONS PREEMPTED.
pub const UA_RESERVATIONS_PREEMPTED: Sense = Sense::new(UnitAttention, 0x2A, 0x03);
/// RESERVATIONS RELEASED.
pub const UA_RESERVATIONS_RELEASED: Sense = Sense::new(UnitAttention, 0x2A, 0x04);
/// REGISTRATIONS PREEMPTED.
pub const UA_REGISTRATIONS_PREEMPTED: Sense = Sense::new(UnitAttention, 0x2A, 0x05);
/// ASYMMETRIC ACCESS STATE CHANGED.
pub const UA_ALUA_CHANGED: Sense = Sense::new(UnitAttention, 0x2A, 0x06);
/// CAPACITY DATA HAS CHANGED.
pub const UA_CAPACITY_CHANGED: Sense = Sense::new(UnitAttention, 0x2A, 0x09);
/// COMMANDS CLEARED BY ANOTHER INITIATOR.
pub const UA_COMMANDS_CLEARED: Sense = Sense::new(UnitAttention, 0x2F, 0x00);

/// What kind of medium access failed, for the MEDIUM ERROR ASC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A read (READ, VERIFY, the read half of COMPARE AND WRITE).
    Read,
    /// A write (WRITE, UNMAP, WRITE SAME, SYNCHRONIZE CACHE).
    Write,
}

/// The sense a device error maps to.
///
/// | kind | sense |
/// |---|---|
/// | `OutOfRange` | ILLEGAL REQUEST 21/00 |
/// | `InvalidArgument`, `NotSupported` | ILLEGAL REQUEST 24/00 |
/// | `Io`, `Corrupt` | MEDIUM ERROR 11/00 (read) or 0C/00 (write) |
/// | `ReadOnly` | DATA PROTECT 27/00 |
/// | `NoSpace` | DATA PROTECT 27/07 |
/// | `WrongState` | NOT READY 04/0A (transition: retry, maybe on another path) |
/// | `NoQuorum`, `Closed` | NOT READY 04/0C (port unavailable: use another path) |
/// | `Timeout` | ABORTED COMMAND 08/01 (retry) |
/// | anything else | HARDWARE ERROR 44/00 |
pub fn from_error(kind: ErrorKind, access: Access) -> Sense {
    match kind {
        ErrorKind::OutOfRange => LBA_OUT_OF_RANGE,
        ErrorKind::InvalidArgument | ErrorKind::NotSupported => INVALID_FIELD_IN_CDB,
        ErrorKind::Io | ErrorKind::Corrupt => match access {
            Access::Read => READ_ERROR,
            Access::Write => WRITE_ERROR,
        },
        ErrorKind::ReadOnly => WRITE_PROTECTED,
        ErrorKind::NoSpace => SPACE_ALLOCATION_FAILED,
        ErrorKind::WrongState => NOT_READY_TRANSITION,
        ErrorKind::NoQuorum | ErrorKind::Closed => NOT_READY_UNAVAILABLE,
        ErrorKind::Timeout => TIMEOUT,
        _ => INTERNAL_FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_format_layout() {
        let s = MISCOMPARE_VERIFY.with_information(513).encode(false);
        assert_eq!(s.len(), 18);
        assert_eq!(s[0], 0xF0);
        assert_eq!(s[2], 0x0E);
        assert_eq!(&s[3..7], &513u32.to_be_bytes());
        assert_eq!(s[7], 10);
        assert_eq!((s[12], s[13]), (0x1D, 0x00));
        let s = INVALID_FIELD_IN_CDB.encode(false);
        assert_eq!(s[0], 0x70);
        assert_eq!((s[2], s[12], s[13]), (5, 0x24, 0));
    }

    #[test]
    fn descriptor_format_layout() {
        let s = MISCOMPARE_VERIFY.with_information(7).encode(true);
        assert_eq!(&s[..4], &[0x72, 0x0E, 0x1D, 0x00]);
        assert_eq!(s[7], 12);
        assert_eq!(&s[8..12], &[0, 0x0A, 0x80, 0]);
        assert_eq!(&s[12..20], &7u64.to_be_bytes());
        let s = LBA_OUT_OF_RANGE.encode(true);
        assert_eq!(&s[..], &[0x72, 5, 0x21, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn device_errors_map_to_sense() {
        assert_eq!(from_error(ErrorKind::Io, Access::Write), WRITE_ERROR);
        assert_eq!(from_error(ErrorKind::Io, Access::Read), READ_ERROR);
        assert_eq!(
            from_error(ErrorKind::NoSpace, Access::Write),
            SPACE_ALLOCATION_FAILED
        );
        assert_eq!(
            from_error(ErrorKind::NoQuorum, Access::Read),
            NOT_READY_UNAVAILABLE
        );
        assert_eq!(
            from_error(ErrorKind::Protocol, Access::Read),
            INTERNAL_FAILURE
        );
    }
}
