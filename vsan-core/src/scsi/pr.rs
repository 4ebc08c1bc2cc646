//! Persistent reservations (SPC-4 5.13, 6.15, 6.16) as a pure value: [`PrState`] holds
//! the registrations, the reservation and the PR generation; [`PrState::apply`] runs one
//! decoded PERSISTENT RESERVE OUT against it and says what follows (unit attentions,
//! aborted nexuses); [`PrState::encode`] / [`PrState::decode`] give a versioned,
//! checksummed byte form. Nothing here does I/O or looks at a clock, so the same state
//! can be replicated by applying the same operations in the same order (issue 20).
//!
//! Encoding (all integers big-endian), version 1:
//! ```text
//! "VSPR" | version u16 | generation u32 | aptpl u8 | next_id u64
//! | reservation: present u8, type u8, holder id u64 (0 = all registrants)
//! | count u32 | count x { id u64, key u64, rtp u16, flags u8 (1 all_tg_pt, 2 name only),
//!                         port len u16, port bytes, tid len u16, tid bytes }
//! | crc32 (IEEE) of everything before it
//! ```

use super::Nexus;
use super::cdb::{be16, be32, be64, u8_at};
use super::sense::{self, Sense};

/// A persistent reservation type (SPC-4 table 220).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PrType {
    /// WRITE EXCLUSIVE.
    WriteExclusive = 1,
    /// EXCLUSIVE ACCESS.
    ExclusiveAccess = 3,
    /// WRITE EXCLUSIVE – REGISTRANTS ONLY.
    WriteExclusiveRegistrantsOnly = 5,
    /// EXCLUSIVE ACCESS – REGISTRANTS ONLY.
    ExclusiveAccessRegistrantsOnly = 6,
    /// WRITE EXCLUSIVE – ALL REGISTRANTS.
    WriteExclusiveAllRegistrants = 7,
    /// EXCLUSIVE ACCESS – ALL REGISTRANTS.
    ExclusiveAccessAllRegistrants = 8,
}

impl PrType {
    /// The type of a TYPE field value.
    pub fn from_u8(v: u8) -> Option<PrType> {
        Some(match v {
            1 => PrType::WriteExclusive,
            3 => PrType::ExclusiveAccess,
            5 => PrType::WriteExclusiveRegistrantsOnly,
            6 => PrType::ExclusiveAccessRegistrantsOnly,
            7 => PrType::WriteExclusiveAllRegistrants,
            8 => PrType::ExclusiveAccessAllRegistrants,
            _ => return None,
        })
    }

    /// Every registrant holds an ALL REGISTRANTS reservation.
    pub fn all_registrants(self) -> bool {
        matches!(
            self,
            PrType::WriteExclusiveAllRegistrants | PrType::ExclusiveAccessAllRegistrants
        )
    }

    /// Registrants (not only the holder) get access.
    pub fn registrants_access(self) -> bool {
        !matches!(self, PrType::WriteExclusive | PrType::ExclusiveAccess)
    }

    /// Reads from non-holders (unregistered ones, for the registrants types) conflict.
    pub fn exclusive_access(self) -> bool {
        matches!(
            self,
            PrType::ExclusiveAccess
                | PrType::ExclusiveAccessRegistrantsOnly
                | PrType::ExclusiveAccessAllRegistrants
        )
    }
}

/// One registered I_T nexus (or, from SPEC_I_PT with a name-only TransportID, every
/// nexus of an initiator name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Unique within the state; the reservation names its holder by it.
    pub id: u64,
    /// The reservation key.
    pub key: u64,
    /// The initiator port name (or the initiator name when `name_only`).
    pub initiator_port: String,
    /// The TransportID READ FULL STATUS reports.
    pub transport_id: Vec<u8>,
    /// The relative target port it was made through.
    pub relative_target_port: u16,
    /// Registered on every target port (ALL_TG_PT).
    pub all_tg_pt: bool,
    /// `initiator_port` is an initiator name: any ISID matches.
    pub name_only: bool,
}

impl Registration {
    /// Whether `n` is (one of) the nexus(es) this registration is for.
    pub fn matches(&self, n: &Nexus) -> bool {
        let port_ok = if self.name_only {
            n.initiator_port
                .strip_prefix(self.initiator_port.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(','))
        } else {
            n.initiator_port == self.initiator_port
        };
        port_ok && (self.all_tg_pt || n.relative_target_port == self.relative_target_port)
    }
}

/// The reservation, when there is one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Its type (scope is always LU_SCOPE).
    pub kind: PrType,
    /// The holder's registration id; 0 for the ALL REGISTRANTS types.
    pub holder: u64,
}

/// The PERSISTENT RESERVE OUT service actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrAction {
    /// REGISTER.
    Register,
    /// RESERVE.
    Reserve,
    /// RELEASE.
    Release,
    /// CLEAR.
    Clear,
    /// PREEMPT.
    Preempt,
    /// PREEMPT AND ABORT.
    PreemptAndAbort,
    /// REGISTER AND IGNORE EXISTING KEY.
    RegisterAndIgnore,
}

/// A decoded PERSISTENT RESERVE OUT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrOut {
    /// The service action.
    pub action: PrAction,
    /// The TYPE field (checked by the actions that use it).
    pub kind: u8,
    /// The SCOPE field.
    pub scope: u8,
    /// RESERVATION KEY.
    pub key: u64,
    /// SERVICE ACTION RESERVATION KEY.
    pub sa_key: u64,
    /// SPEC_I_PT.
    pub spec_i_pt: bool,
    /// ALL_TG_PT.
    pub all_tg_pt: bool,
    /// APTPL.
    pub aptpl: bool,
    /// The TransportIDs given with SPEC_I_PT.
    pub transport_ids: Vec<TransportId>,
}

/// An iSCSI TransportID from a SPEC_I_PT parameter list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportId {
    /// The initiator port name (format 01b) or initiator name (format 00b).
    pub name: String,
    /// Format 00b: the name alone, every ISID of it.
    pub name_only: bool,
    /// The TransportID as sent (READ FULL STATUS reports it).
    pub raw: Vec<u8>,
}

/// Why a PERSISTENT RESERVE OUT failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrError {
    /// RESERVATION CONFLICT status.
    Conflict,
    /// CHECK CONDITION with this sense.
    Check(Sense),
}

/// What a successful PERSISTENT RESERVE OUT implies beyond the state change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrEffects {
    /// The state changed (persist it before completing).
    pub changed: bool,
    /// Unit attentions for the nexuses a registration names.
    pub unit_attentions: Vec<(Registration, Sense)>,
    /// Nexuses whose tasks PREEMPT AND ABORT aborts.
    pub aborts: Vec<Registration>,
}

/// Why a state file did not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a PR state at all.
    #[error("bad magic")]
    Magic,
    /// A version this code does not know.
    #[error("unknown version {0}")]
    Version(u16),
    /// The checksum does not match.
    #[error("checksum mismatch")]
    Crc,
    /// Cut short or inconsistent.
    #[error("truncated or malformed")]
    Malformed,
}

/// Whether a command reads or changes the medium, for the conflict rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessClass {
    /// Allowed whatever the reservation (INQUIRY, REPORT LUNS, READ CAPACITY, ...).
    Always,
    /// Reads: conflict under the EXCLUSIVE ACCESS types only.
    Read,
    /// Writes and everything SPC-4 lists as conflicting under every type.
    Write,
}

const MAGIC: &[u8; 4] = b"VSPR";
const VERSION: u16 = 1;
/// The most registrations kept (INSUFFICIENT REGISTRATION RESOURCES past it).
pub const MAX_REGISTRATIONS: usize = 256;

/// The persistent reservation state of one logical unit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrState {
    /// PRgeneration.
    pub generation: u32,
    /// Activate persist through power loss (the last APTPL given).
    pub aptpl: bool,
    /// Registrations, in the order they were made.
    pub registrations: Vec<Registration>,
    /// The reservation.
    pub reservation: Option<Reservation>,
    next_id: u64,
}

impl PrOut {
    /// Decode a PERSISTENT RESERVE OUT CDB and its parameter list.
    pub fn decode(cdb: &[u8], data: &[u8]) -> Result<PrOut, Sense> {
        let action = match u8_at(cdb, 1) & 0x1F {
            0 => PrAction::Register,
            1 => PrAction::Reserve,
            2 => PrAction::Release,
            3 => PrAction::Clear,
            4 => PrAction::Preempt,
            5 => PrAction::PreemptAndAbort,
            6 => PrAction::RegisterAndIgnore,
            _ => return Err(sense::INVALID_FIELD_IN_CDB),
        };
        let len = be32(cdb, 5) as usize;
        if data.len() < len.min(24) || len < 24 {
            return Err(sense::PARAM_LIST_LENGTH);
        }
        let flags = u8_at(data, 20);
        let spec_i_pt = flags & 0x08 != 0;
        if !spec_i_pt && len != 24 {
            return Err(sense::PARAM_LIST_LENGTH);
        }
        let mut transport_ids = Vec::new();
        if spec_i_pt {
            if !matches!(action, PrAction::Register) {
                return Err(sense::INVALID_FIELD_IN_PARAM);
            }
            let tlen = be32(data, 24) as usize;
            let body = data.get(28..).unwrap_or(&[]);
            if len < 28 || tlen > body.len() || 28 + tlen != len {
                return Err(sense::PARAM_LIST_LENGTH);
            }
            let mut rest = &body[..tlen];
            while !rest.is_empty() {
                let (id, used) = parse_transport_id(rest).ok_or(sense::INVALID_FIELD_IN_PARAM)?;
                transport_ids.push(id);
                rest = rest.get(used..).unwrap_or(&[]);
            }
        }
        Ok(PrOut {
            action,
            kind: u8_at(cdb, 2) & 0x0F,
            scope: u8_at(cdb, 2) >> 4,
            key: be64(data, 0),
            sa_key: be64(data, 8),
            spec_i_pt,
            all_tg_pt: flags & 0x04 != 0,
            aptpl: flags & 0x01 != 0,
            transport_ids,
        })
    }
}

/// An iSCSI TransportID (SPC-4 7.6.4.6): format 00b (name) or 01b (name,i,0x ISID).
/// Returns the name/port, whether it is a name only, the raw bytes, and bytes used.
fn parse_transport_id(b: &[u8]) -> Option<(TransportId, usize)> {
    let format = u8_at(b, 0) >> 6;
    if u8_at(b, 0) & 0x0F != 5 || format > 1 {
        return None;
    }
    let add = be16(b, 2) as usize;
    let total = 4 + add;
    let raw = b.get(..total)?;
    let name_bytes = raw.get(4..)?;
    let end = name_bytes
        .iter()
        .position(|&c| c == 0)
        .unwrap_or(name_bytes.len());
    let name = std::str::from_utf8(&name_bytes[..end]).ok()?;
    if name.is_empty() {
        return None;
    }
    let name_only = format == 0;
    if !name_only && !name.contains(",i,0x") {
        return None;
    }
    Some((
        TransportId {
            name: name.to_string(),
            name_only,
            raw: raw.to_vec(),
        },
        total,
    ))
}

fn ua(reg: &Registration, s: Sense) -> (Registration, Sense) {
    (reg.clone(), s)
}

impl PrState {
    /// No registrations, no reservation.
    pub fn new() -> PrState {
        PrState::default()
    }

    /// The registration of `n`, if it is registered.
    pub fn registration(&self, n: &Nexus) -> Option<&Registration> {
        self.registrations.iter().find(|r| r.matches(n))
    }

    /// Whether `n` holds the reservation (every registrant does for ALL REGISTRANTS).
    pub fn is_holder(&self, n: &Nexus) -> bool {
        match (self.reservation, self.registration(n)) {
            (Some(res), Some(reg)) => res.kind.all_registrants() || res.holder == reg.id,
            _ => false,
        }
    }

    /// Whether a command of `class` from `n` may run (SPC-4 table 63, SBC-3 table 13).
    pub fn allows(&self, n: &Nexus, class: AccessClass) -> bool {
        let Some(res) = self.reservation else {
            return true;
        };
        if class == AccessClass::Always || self.is_holder(n) {
            return true;
        }
        let registered = self.registration(n).is_some();
        if registered && res.kind.registrants_access() {
            return true;
        }
        class == AccessClass::Read && !res.kind.exclusive_access()
    }

    /// Run one PERSISTENT RESERVE OUT from `from`. `aptpl_ok`: whether this unit can
    /// persist through power loss (a state file exists). On error nothing changed.
    pub fn apply(
        &mut self,
        from: &Nexus,
        op: &PrOut,
        aptpl_ok: bool,
    ) -> Result<PrEffects, PrError> {
        let mut next = self.clone();
        let effects = next.apply_inner(from, op, aptpl_ok)?;
        *self = next;
        Ok(effects)
    }

    fn new_registration(
        &mut self,
        key: u64,
        port: String,
        tid: Vec<u8>,
        rtp: u16,
        all: bool,
        name_only: bool,
    ) -> Registration {
        self.next_id += 1;
        Registration {
            id: self.next_id,
            key,
            initiator_port: port,
            transport_id: tid,
            relative_target_port: rtp,
            all_tg_pt: all,
            name_only,
        }
    }

    fn apply_inner(
        &mut self,
        from: &Nexus,
        op: &PrOut,
        aptpl_ok: bool,
    ) -> Result<PrEffects, PrError> {
        let mut fx = PrEffects::default();
        let mine = self.registration(from).cloned();
        match op.action {
            PrAction::Register | PrAction::RegisterAndIgnore => {
                let ignore = op.action == PrAction::RegisterAndIgnore;
                if op.aptpl && !aptpl_ok {
                    return Err(PrError::Check(sense::INVALID_FIELD_IN_PARAM));
                }
                match mine {
                    None => {
                        if !ignore && op.key != 0 {
                            return Err(PrError::Conflict);
                        }
                        if op.sa_key == 0 {
                            return Ok(fx);
                        }
                        let mut new = vec![self.new_registration(
                            op.sa_key,
                            from.initiator_port.clone(),
                            from.transport_id.to_vec(),
                            from.relative_target_port,
                            op.all_tg_pt,
                            false,
                        )];
                        for t in &op.transport_ids {
                            let probe = Nexus {
                                initiator_port: t.name.clone(),
                                transport_id: bytes::Bytes::new(),
                                relative_target_port: from.relative_target_port,
                            };
                            if self.registration(&probe).is_some() {
                                return Err(PrError::Check(sense::INVALID_FIELD_IN_PARAM));
                            }
                            let r = self.new_registration(
                                op.sa_key,
                                t.name.clone(),
                                t.raw.clone(),
                                from.relative_target_port,
                                op.all_tg_pt,
                                t.name_only,
                            );
                            new.push(r);
                        }
                        if self.registrations.len() + new.len() > MAX_REGISTRATIONS {
                            return Err(PrError::Check(sense::INSUFFICIENT_REGISTRATION));
                        }
                        self.registrations.extend(new);
                    }
                    Some(reg) => {
                        if !ignore && op.key != reg.key {
                            return Err(PrError::Conflict);
                        }
                        if op.spec_i_pt {
                            return Err(PrError::Check(sense::INVALID_FIELD_IN_PARAM));
                        }
                        if op.sa_key == 0 {
                            self.unregister(&reg, &mut fx);
                        } else if let Some(r) =
                            self.registrations.iter_mut().find(|r| r.id == reg.id)
                        {
                            r.key = op.sa_key;
                        }
                    }
                }
                self.aptpl = op.aptpl;
                self.generation = self.generation.wrapping_add(1);
                fx.changed = true;
            }
            PrAction::Reserve => {
                let reg = self.check_key(mine, op.key)?;
                let kind = self.check_scope_type(op)?;
                match self.reservation {
                    None => {
                        self.reservation = Some(Reservation {
                            kind,
                            holder: if kind.all_registrants() { 0 } else { reg.id },
                        });
                        fx.changed = true;
                    }
                    Some(res) => {
                        let holder = res.kind.all_registrants() || res.holder == reg.id;
                        if !holder || res.kind != kind {
                            return Err(PrError::Conflict);
                        }
                    }
                }
            }
            PrAction::Release => {
                let reg = self.check_key(mine, op.key)?;
                let Some(res) = self.reservation else {
                    return Ok(fx);
                };
                if !(res.kind.all_registrants() || res.holder == reg.id) {
                    return Ok(fx);
                }
                if op.scope != 0 || op.kind != res.kind as u8 {
                    return Err(PrError::Check(sense::INVALID_RELEASE));
                }
                self.reservation = None;
                fx.changed = true;
                if res.kind.registrants_access() {
                    for r in self.registrations.iter().filter(|r| r.id != reg.id) {
                        fx.unit_attentions
                            .push(ua(r, sense::UA_RESERVATIONS_RELEASED));
                    }
                }
            }
            PrAction::Clear => {
                let reg = self.check_key(mine, op.key)?;
                for r in self.registrations.iter().filter(|r| r.id != reg.id) {
                    fx.unit_attentions
                        .push(ua(r, sense::UA_RESERVATIONS_PREEMPTED));
                }
                self.registrations.clear();
                self.reservation = None;
                self.generation = self.generation.wrapping_add(1);
                fx.changed = true;
            }
            PrAction::Preempt | PrAction::PreemptAndAbort => {
                let reg = self.check_key(mine, op.key)?;
                let abort = op.action == PrAction::PreemptAndAbort;
                self.preempt(&reg, op, abort, &mut fx)?;
                self.generation = self.generation.wrapping_add(1);
                fx.changed = true;
            }
        }
        Ok(fx)
    }

    fn check_key(&self, mine: Option<Registration>, key: u64) -> Result<Registration, PrError> {
        match mine {
            Some(r) if r.key == key => Ok(r),
            _ => Err(PrError::Conflict),
        }
    }

    fn check_scope_type(&self, op: &PrOut) -> Result<PrType, PrError> {
        if op.scope != 0 {
            return Err(PrError::Check(sense::INVALID_FIELD_IN_CDB));
        }
        PrType::from_u8(op.kind).ok_or(PrError::Check(sense::INVALID_FIELD_IN_CDB))
    }

    fn unregister(&mut self, reg: &Registration, fx: &mut PrEffects) {
        self.registrations.retain(|r| r.id != reg.id);
        if let Some(res) = self.reservation {
            let lost = if res.kind.all_registrants() {
                self.registrations.is_empty()
            } else {
                res.holder == reg.id
            };
            if lost {
                self.reservation = None;
                if res.kind.registrants_access() && !res.kind.all_registrants() {
                    for r in &self.registrations {
                        fx.unit_attentions
                            .push(ua(r, sense::UA_RESERVATIONS_RELEASED));
                    }
                }
            }
        }
    }

    /// Remove every registration with `key` except `keep`'s; their nexuses get
    /// REGISTRATIONS PREEMPTED (and are aborted for PREEMPT AND ABORT).
    fn remove_key(&mut self, key: u64, keep: u64, abort: bool, fx: &mut PrEffects) -> usize {
        let mut n = 0;
        let removed: Vec<Registration> = self
            .registrations
            .iter()
            .filter(|r| r.key == key && r.id != keep)
            .cloned()
            .collect();
        for r in removed {
            self.registrations.retain(|x| x.id != r.id);
            fx.unit_attentions
                .push(ua(&r, sense::UA_REGISTRATIONS_PREEMPTED));
            if abort {
                fx.aborts.push(r);
            }
            n += 1;
        }
        n
    }

    fn preempt(
        &mut self,
        me: &Registration,
        op: &PrOut,
        abort: bool,
        fx: &mut PrEffects,
    ) -> Result<(), PrError> {
        match self.reservation {
            None => {
                if op.sa_key == 0 {
                    return Err(PrError::Check(sense::INVALID_FIELD_IN_PARAM));
                }
                if self.remove_key(op.sa_key, me.id, abort, fx) == 0
                    && !self.registrations.iter().any(|r| r.key == op.sa_key)
                {
                    return Err(PrError::Conflict);
                }
            }
            Some(res) if res.kind.all_registrants() => {
                if op.sa_key == 0 {
                    let kind = self.check_scope_type(op)?;
                    let others: Vec<u64> = self
                        .registrations
                        .iter()
                        .filter(|r| r.id != me.id)
                        .map(|r| r.key)
                        .collect();
                    for k in others {
                        self.remove_key(k, me.id, abort, fx);
                    }
                    self.reservation = Some(Reservation {
                        kind,
                        holder: if kind.all_registrants() { 0 } else { me.id },
                    });
                } else if self.remove_key(op.sa_key, me.id, abort, fx) == 0
                    && !self.registrations.iter().any(|r| r.key == op.sa_key)
                {
                    return Err(PrError::Conflict);
                }
            }
            Some(res) => {
                let holder_key = self
                    .registrations
                    .iter()
                    .find(|r| r.id == res.holder)
                    .map(|r| r.key);
                if holder_key == Some(op.sa_key) {
                    let kind = self.check_scope_type(op)?;
                    self.remove_key(op.sa_key, me.id, abort, fx);
                    if kind != res.kind {
                        for r in self.registrations.iter().filter(|r| r.id != me.id) {
                            fx.unit_attentions
                                .push(ua(r, sense::UA_RESERVATIONS_RELEASED));
                        }
                    }
                    self.reservation = Some(Reservation {
                        kind,
                        holder: if kind.all_registrants() { 0 } else { me.id },
                    });
                } else {
                    if op.sa_key == 0 {
                        return Err(PrError::Check(sense::INVALID_FIELD_IN_PARAM));
                    }
                    if self.remove_key(op.sa_key, me.id, abort, fx) == 0
                        && !self.registrations.iter().any(|r| r.key == op.sa_key)
                    {
                        return Err(PrError::Conflict);
                    }
                }
            }
        }
        Ok(())
    }

    /// Forget everything but what APTPL keeps (a power on).
    pub fn power_on(&mut self) {
        if !self.aptpl {
            let generation = self.generation;
            *self = PrState::default();
            self.generation = generation;
        }
    }

    /// PERSISTENT RESERVE IN data for a service action; `ptpl_c`: APTPL is supported.
    pub fn read(&self, sa: u8, ptpl_c: bool) -> Result<Vec<u8>, Sense> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&self.generation.to_be_bytes());
        match sa {
            0 => {
                let len = (self.registrations.len() * 8) as u32;
                out.extend_from_slice(&len.to_be_bytes());
                for r in &self.registrations {
                    out.extend_from_slice(&r.key.to_be_bytes());
                }
            }
            1 => match self.reservation {
                None => out.extend_from_slice(&0u32.to_be_bytes()),
                Some(res) => {
                    out.extend_from_slice(&16u32.to_be_bytes());
                    let key = if res.kind.all_registrants() {
                        0
                    } else {
                        self.registrations
                            .iter()
                            .find(|r| r.id == res.holder)
                            .map_or(0, |r| r.key)
                    };
                    out.extend_from_slice(&key.to_be_bytes());
                    out.extend_from_slice(&[0, 0, 0, 0, 0, res.kind as u8, 0, 0]);
                }
            },
            2 => {
                out.clear();
                out.extend_from_slice(&8u16.to_be_bytes());
                // CRH=0, SIP_C, ATP_C, PTPL_C.
                out.push(0x08 | 0x04 | u8::from(ptpl_c));
                // TMV, ALLOW COMMANDS = 001b? leave 000b, PTPL_A.
                out.push(0x80 | u8::from(self.aptpl));
                // WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX | EX_AC_AR.
                out.push(0x80 | 0x40 | 0x20 | 0x08 | 0x02);
                out.push(0x01);
                out.extend_from_slice(&[0, 0]);
            }
            3 => {
                let mut body = Vec::new();
                for r in &self.registrations {
                    let holder = self
                        .reservation
                        .is_some_and(|res| res.kind.all_registrants() || res.holder == r.id);
                    body.extend_from_slice(&r.key.to_be_bytes());
                    body.extend_from_slice(&[0; 4]);
                    body.push((u8::from(r.all_tg_pt) << 1) | u8::from(holder));
                    body.push(match self.reservation {
                        Some(res) if holder => res.kind as u8,
                        _ => 0,
                    });
                    body.extend_from_slice(&[0; 4]);
                    body.extend_from_slice(&r.relative_target_port.to_be_bytes());
                    body.extend_from_slice(&(r.transport_id.len() as u32).to_be_bytes());
                    body.extend_from_slice(&r.transport_id);
                }
                out.extend_from_slice(&(body.len() as u32).to_be_bytes());
                out.extend_from_slice(&body);
            }
            _ => return Err(sense::INVALID_FIELD_IN_CDB),
        }
        Ok(out)
    }

    /// The byte form (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.registrations.len() * 96);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_be_bytes());
        b.extend_from_slice(&self.generation.to_be_bytes());
        b.push(u8::from(self.aptpl));
        b.extend_from_slice(&self.next_id.to_be_bytes());
        match self.reservation {
            Some(r) => {
                b.push(1);
                b.push(r.kind as u8);
                b.extend_from_slice(&r.holder.to_be_bytes());
            }
            None => b.extend_from_slice(&[0; 10]),
        }
        b.extend_from_slice(&(self.registrations.len() as u32).to_be_bytes());
        for r in &self.registrations {
            b.extend_from_slice(&r.id.to_be_bytes());
            b.extend_from_slice(&r.key.to_be_bytes());
            b.extend_from_slice(&r.relative_target_port.to_be_bytes());
            b.push(u8::from(r.all_tg_pt) | (u8::from(r.name_only) << 1));
            let port = r.initiator_port.as_bytes();
            let port = &port[..port.len().min(u16::MAX as usize)];
            b.extend_from_slice(&(port.len() as u16).to_be_bytes());
            b.extend_from_slice(port);
            let tid = &r.transport_id[..r.transport_id.len().min(u16::MAX as usize)];
            b.extend_from_slice(&(tid.len() as u16).to_be_bytes());
            b.extend_from_slice(tid);
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_be_bytes());
        b
    }

    /// Decode [`PrState::encode`]'s bytes; total: any input gives a state or an error.
    pub fn decode(b: &[u8]) -> Result<PrState, DecodeError> {
        if b.len() < 4 || &b[..4] != MAGIC {
            return Err(DecodeError::Magic);
        }
        let (body, crc) = b.split_at(b.len().checked_sub(4).ok_or(DecodeError::Malformed)?);
        let version = be16(body, 4);
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        if crc32fast::hash(body) != be32(crc, 0) {
            return Err(DecodeError::Crc);
        }
        let mut r = Reader { b: body, at: 6 };
        let generation = r.u32()?;
        let aptpl = r.u8()? != 0;
        let next_id = r.u64()?;
        let present = r.u8()?;
        let kind = r.u8()?;
        let holder = r.u64()?;
        let reservation = match present {
            0 => None,
            1 => Some(Reservation {
                kind: PrType::from_u8(kind).ok_or(DecodeError::Malformed)?,
                holder,
            }),
            _ => return Err(DecodeError::Malformed),
        };
        let count = r.u32()? as usize;
        if count > MAX_REGISTRATIONS {
            return Err(DecodeError::Malformed);
        }
        let mut registrations = Vec::with_capacity(count);
        for _ in 0..count {
            let id = r.u64()?;
            let key = r.u64()?;
            let rtp = r.u16()?;
            let flags = r.u8()?;
            let plen = r.u16()? as usize;
            let port = std::str::from_utf8(r.take(plen)?)
                .map_err(|_| DecodeError::Malformed)?
                .to_string();
            let tlen = r.u16()? as usize;
            let tid = r.take(tlen)?.to_vec();
            if id == 0 || id > next_id {
                return Err(DecodeError::Malformed);
            }
            registrations.push(Registration {
                id,
                key,
                initiator_port: port,
                transport_id: tid,
                relative_target_port: rtp,
                all_tg_pt: flags & 1 != 0,
                name_only: flags & 2 != 0,
            });
        }
        if r.at != body.len() {
            return Err(DecodeError::Malformed);
        }
        if let Some(res) = reservation {
            if !res.kind.all_registrants() && !registrations.iter().any(|x| x.id == res.holder) {
                return Err(DecodeError::Malformed);
            }
        }
        Ok(PrState {
            generation,
            aptpl,
            registrations,
            reservation,
            next_id,
        })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(n).ok_or(DecodeError::Malformed)?;
        let s = self.b.get(self.at..end).ok_or(DecodeError::Malformed)?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(be16(self.take(2)?, 0))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(be32(self.take(4)?, 0))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(be64(self.take(8)?, 0))
    }
}
