//! Command dispatch: the checks every command passes (unit attention, ALUA state,
//! reservations, data-out length) and the SPC commands; the block commands are in
//! `block.rs`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::cdb::*;
use super::inquiry::{self, InquiryInput};
use super::pr::{AccessClass, PrError, PrOut};
use super::sense::{self, Sense};
use super::{AluaState, Command, Direction, LogicalUnit, NexusState, Response, Status, mode};

/// A PERSISTENT RESERVE OUT to replicate: its CDB, its data-out, the forwarding node's
/// token (0 for one issued here), and the link it came on or was applied on.
pub(super) type RawPrOut<'a> = (&'a [u8], &'a [u8], u64, Option<u64>);

/// How a command failed.
pub(super) enum Fail {
    /// CHECK CONDITION with this sense.
    Check(Sense),
    /// RESERVATION CONFLICT.
    Conflict,
}

impl From<Sense> for Fail {
    fn from(s: Sense) -> Fail {
        Fail::Check(s)
    }
}

pub(super) type Res = Result<Response, Fail>;

pub(super) fn good() -> Response {
    Response {
        status: Status::Good,
        sense: Bytes::new(),
        data: Bytes::new(),
    }
}

pub(super) fn good_data(data: impl Into<Bytes>) -> Response {
    Response {
        status: Status::Good,
        sense: Bytes::new(),
        data: data.into(),
    }
}

fn conflict() -> Response {
    Response {
        status: Status::ReservationConflict,
        sense: Bytes::new(),
        data: Bytes::new(),
    }
}

/// The reservation class of a command (SPC-4 table 63, SBC-3 table 13). MODE SENSE is
/// treated as a read (allowed under WRITE EXCLUSIVE), the way common targets do.
fn access_class(cdb: &[u8]) -> AccessClass {
    let op = u8_at(cdb, 0);
    if op == SERVICE_ACTION_IN_16 && service_action(cdb) == SA_GET_LBA_STATUS {
        return AccessClass::Read;
    }
    match op {
        READ_6 | READ_10 | READ_12 | READ_16 | VERIFY_10 | VERIFY_12 | VERIFY_16 | MODE_SENSE_6
        | MODE_SENSE_10 | PRE_FETCH_10 | PRE_FETCH_16 => AccessClass::Read,
        WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 | WRITE_VERIFY_10 | WRITE_VERIFY_12
        | WRITE_VERIFY_16 | WRITE_SAME_10 | WRITE_SAME_16 | UNMAP | COMPARE_AND_WRITE
        | ORWRITE_16 | SYNC_CACHE_10 | SYNC_CACHE_16 | MODE_SELECT_6 | MODE_SELECT_10 => {
            AccessClass::Write
        }
        _ => AccessClass::Always,
    }
}

/// Commands served whatever the ALUA state and under another nexus's SCSI-2 reservation
/// (MAINTENANCE IN: REPORT TARGET PORT GROUPS must work on a transitioning port).
fn always_served(op: u8) -> bool {
    matches!(op, INQUIRY | REPORT_LUNS | REQUEST_SENSE | MAINTENANCE_IN)
}

impl LogicalUnit {
    pub(super) async fn run(&self, nexus: &Arc<NexusState>, command: Command) -> Response {
        // Counted for PREEMPT AND ABORT's wait; reservation commands are not (they
        // wait for the PR lock it holds, and change no data).
        let _running = (!matches!(
            command.cdb.first(),
            Some(&(PR_OUT | PR_IN | RESERVE_6 | RELEASE_6 | RESERVE_10 | RELEASE_10))
        ))
        .then(|| nexus.task_started());
        let mb = self.mode.get();
        let d = mb.d_sense();
        let cdb = &command.cdb[..];
        let dir = match direction(cdb, &self.geometry) {
            Ok(dir) => dir,
            Err(s) => return s.response(d),
        };
        let op = cdb[0];
        // SPC-4 5.14: INQUIRY, REPORT LUNS and REQUEST SENSE neither report nor clear a
        // unit attention.
        if !matches!(op, INQUIRY | REPORT_LUNS | REQUEST_SENSE) {
            if let Some(ua) = nexus.pop_ua() {
                return ua.response(d);
            }
        }
        if !always_served(op) {
            match self.own_alua() {
                AluaState::ActiveOptimized | AluaState::ActiveNonOptimized => {}
                AluaState::Transitioning => return sense::NOT_READY_TRANSITION.response(d),
                AluaState::Standby
                    if !matches!(
                        op,
                        TEST_UNIT_READY
                            | MODE_SENSE_6
                            | MODE_SENSE_10
                            | READ_CAPACITY_10
                            | SERVICE_ACTION_IN_16
                            | PR_IN
                            | PR_OUT
                    ) =>
                {
                    return sense::NOT_READY_STANDBY.response(d);
                }
                AluaState::Standby => {}
                AluaState::Unavailable => return sense::NOT_READY_UNAVAILABLE.response(d),
            }
        }
        if self.reserved.load(Ordering::Acquire) && !self.reservation_allows(nexus, cdb) {
            return conflict();
        }
        let need = match dir {
            Direction::Out(n) => n as usize,
            _ => 0,
        };
        if command.data_out.len() < need {
            return sense::INVALID_FIELD_IN_CDB.response(d);
        }
        let data_out = if need < command.data_out.len() {
            command.data_out.slice(..need)
        } else {
            command.data_out
        };
        match self.dispatch(nexus, cdb, data_out, mb).await {
            Ok(mut r) => {
                if let Direction::In(n) = dir {
                    if r.data.len() > n as usize {
                        r.data.truncate(n as usize);
                    }
                }
                r
            }
            Err(Fail::Check(s)) => s.response(self.mode.get().d_sense()),
            Err(Fail::Conflict) => conflict(),
        }
    }

    /// The reservation checks, taken only while some reservation exists.
    fn reservation_allows(&self, nexus: &NexusState, cdb: &[u8]) -> bool {
        let op = u8_at(cdb, 0);
        if let Some(holder) = &*self.scsi2.lock() {
            if *holder != nexus.nexus && !always_served(op) && !matches!(op, RELEASE_6 | RELEASE_10)
            {
                return false;
            }
        }
        self.pr.read().allows(&nexus.nexus, access_class(cdb))
    }

    async fn dispatch(
        &self,
        nexus: &Arc<NexusState>,
        cdb: &[u8],
        data: Bytes,
        mb: mode::ModeBits,
    ) -> Res {
        match cdb[0] {
            TEST_UNIT_READY | START_STOP_UNIT | PREVENT_ALLOW => Ok(good()),
            REQUEST_SENSE => {
                let desc = u8_at(cdb, 1) & 0x01 != 0;
                let s = nexus.pop_ua().unwrap_or(sense::NO_SENSE);
                Ok(good_data(s.encode(desc)))
            }
            INQUIRY => {
                let input = InquiryInput {
                    identity: &self.config.identity,
                    port: &self.config.port,
                    geometry: self.geometry,
                };
                Ok(good_data(inquiry::inquiry(cdb, &input)?))
            }
            MODE_SENSE_6 | MODE_SENSE_10 => Ok(good_data(mode::sense_data(
                cdb,
                mb,
                self.geometry,
                self.config.read_only,
            )?)),
            MODE_SELECT_6 | MODE_SELECT_10 => {
                let new = mode::select(cdb, &data, mb, self.geometry)?;
                if new != mb {
                    self.mode.set(new);
                    for n in self.others(nexus.id) {
                        n.push_ua(sense::UA_MODE_CHANGED);
                    }
                }
                Ok(good())
            }
            RESERVE_6 | RESERVE_10 => {
                if cdb[0] == RESERVE_10 && u8_at(cdb, 1) & 0x12 != 0 {
                    return Err(sense::INVALID_FIELD_IN_CDB.into()); // third party, LONGID
                }
                self.scsi2_op(&nexus.nexus, true).await.map(|()| good())
            }
            RELEASE_6 | RELEASE_10 => self.scsi2_op(&nexus.nexus, false).await.map(|()| good()),
            READ_CAPACITY_10 => {
                if u8_at(cdb, 8) & 0x01 == 0 && be32(cdb, 2) != 0 {
                    return Err(sense::INVALID_FIELD_IN_CDB.into());
                }
                let last = self.blocks() - 1;
                let mut out = [0u8; 8];
                out[..4].copy_from_slice(&u32::try_from(last).unwrap_or(u32::MAX).to_be_bytes());
                out[4..].copy_from_slice(&self.geometry.block_size().to_be_bytes());
                Ok(good_data(Bytes::copy_from_slice(&out)))
            }
            SERVICE_ACTION_IN_16 => match service_action(cdb) {
                SA_READ_CAPACITY_16 => {
                    let mut out = [0u8; 32];
                    out[..8].copy_from_slice(&(self.blocks() - 1).to_be_bytes());
                    out[8..12].copy_from_slice(&self.geometry.block_size().to_be_bytes());
                    out[14] = 0x80 | 0x40; // LBPME, LBPRZ
                    Ok(good_data(Bytes::copy_from_slice(&out)))
                }
                _ => self.get_lba_status(cdb).await,
            },
            REPORT_LUNS => report_luns(cdb, 1),
            MAINTENANCE_IN => match service_action(cdb) {
                SA_REPORT_TPGS => self.report_tpgs(cdb),
                SA_REPORT_OPCODES => report_opcodes(cdb),
                _ => {
                    let repd = u8_at(cdb, 2) & 0x80 != 0;
                    let mut out = vec![0xDA, 0, 0, 0];
                    if repd {
                        out[3] = 0x0C;
                        out.resize(16, 0);
                    }
                    Ok(good_data(out))
                }
            },
            PR_IN => {
                let out = self
                    .pr
                    .read()
                    .read(service_action(cdb), self.ptpl_capable())?;
                Ok(good_data(out))
            }
            PR_OUT => self.pr_out(nexus, cdb, &data).await,
            _ => self.block_command(cdb, data, mb).await,
        }
    }

    pub(super) fn blocks(&self) -> u64 {
        self.geometry.size() / u64::from(self.geometry.block_size())
    }

    /// SCSI-2 RESERVE (`reserve`) or RELEASE from `from` on this node's state.
    pub(super) fn scsi2_local(&self, from: &super::Nexus, reserve: bool) -> Result<(), Fail> {
        let mut s2 = self.scsi2.lock();
        if reserve {
            // SPC-2 5.5.1: RESERVE while a persistent reservation is in effect conflicts.
            if self.pr.read().reservation.is_some() {
                return Err(Fail::Conflict);
            }
            match &*s2 {
                Some(h) if h != from => return Err(Fail::Conflict),
                _ => *s2 = Some(from.clone()),
            }
        } else if s2.as_ref() == Some(from) {
            *s2 = None;
        }
        drop(s2);
        self.update_reserved();
        Ok(())
    }

    async fn pr_out(&self, nexus: &Arc<NexusState>, cdb: &[u8], data: &[u8]) -> Res {
        let op = PrOut::decode(cdb, data)?;
        if self
            .scsi2
            .lock()
            .as_ref()
            .is_some_and(|h| *h != nexus.nexus)
        {
            return Err(Fail::Conflict);
        }
        let outcome = match self.forward_pr_out(&nexus.nexus, cdb, data).await {
            super::peer::Forwarded::Done(r) => r,
            super::peer::Forwarded::Here { lost } => {
                let r = self
                    .apply_pr_out(
                        &nexus.nexus,
                        Some(nexus.id),
                        &op,
                        Some((cdb, data, 0, None)),
                    )
                    .await;
                match r {
                    // The resolver may have applied it before the link went: a refusal
                    // here does not say it did not happen.
                    Err(_) if lost => Err(PrError::Check(sense::INTERNAL_FAILURE)),
                    r => r,
                }
            }
        };
        match outcome {
            Ok(()) => Ok(good()),
            Err(PrError::Conflict) => Err(Fail::Conflict),
            Err(PrError::Check(s)) => Err(s.into()),
        }
    }

    /// Whether the PR state survives a power loss here (APTPL can be honoured).
    fn ptpl_capable(&self) -> bool {
        self.config.state_file.is_some() || self.pr_store.read().is_some()
    }

    /// Apply a PERSISTENT RESERVE OUT that came through another node (issue 20: the
    /// mirror delivers every node's PR OUT to every node in one order): the same state
    /// change as where it was issued, and the unit attentions and aborts it implies for
    /// the nexuses attached here. `from` is the issuing nexus, wherever it is.
    pub async fn apply_replicated_pr_out(
        &self,
        from: &super::Nexus,
        op: &PrOut,
    ) -> Result<(), PrError> {
        self.apply_pr_out(from, None, op, None).await
    }

    /// Apply a PERSISTENT RESERVE OUT from `from` (`local`: its nexus id when it is
    /// attached here) under the PR lock; `raw` (its CDB, data-out, the forwarding
    /// node's token, and the link a forwarded command came on) when this node must
    /// replicate it: to the other node when this is
    /// the resolver, or as a change made alone otherwise (see `peer.rs`). A change made
    /// alone is committed through the mirror first ([`Self::go_alone`]): refused there
    /// (or with the link back meanwhile: NOT READY, retry), the command fails and
    /// nothing changes.
    pub(super) async fn apply_pr_out(
        &self,
        from: &super::Nexus,
        local: Option<u64>,
        op: &PrOut,
        raw: Option<RawPrOut<'_>>,
    ) -> Result<(), PrError> {
        let _serial = self.pr_out.lock().await;
        let mut next = self.pr.read().clone();
        let fx = next.apply(from, op, self.ptpl_capable())?;
        let alone = raw.and_then(|_| self.pr_out_alone());
        // The link it is applied on (a forwarded one: the link it came on).
        let raw = raw.map(|(cdb, data, token, came_on)| {
            (cdb, data, token, came_on.or(Some(self.peer_link_id())))
        });
        if let Some(peer) = &alone
            && fx.changed
        {
            self.go_alone(peer.as_ref()).await.map_err(|e| {
                tracing::warn!("a reservation change without the other node was refused: {e}");
                PrError::Check(sense::from_error(e.kind(), sense::Access::Write))
            })?;
        }
        if fx.changed {
            if let Err(e) = self.persist(&next).await {
                tracing::warn!("persistent reservation state not saved: {e}");
                return Err(PrError::Check(sense::INTERNAL_FAILURE));
            }
            *self.pr.write() = next;
        }
        self.update_reserved();
        let mut aborted = Vec::new();
        if !fx.unit_attentions.is_empty() || !fx.aborts.is_empty() {
            let tas = self.mode.get().tas();
            let all = self.nexuses.lock().clone();
            // The issuer raises nothing on itself, wherever it is attached.
            for n in all
                .iter()
                .filter(|n| Some(n.id) != local && n.nexus != *from)
            {
                for (reg, s) in &fx.unit_attentions {
                    if reg.matches(&n.nexus) {
                        n.push_ua(*s);
                    }
                }
                if fx.aborts.iter().any(|r| r.matches(&n.nexus)) {
                    n.bump_aborts(tas, false);
                    aborted.push(Arc::clone(n));
                }
            }
        }
        // PREEMPT AND ABORT completes only once the tasks it aborted here have ended
        // (SPC-4 5.13.11.2.4: a write of a preempted initiator must not land after it);
        // the other node's `PrApply` waits for its own the same way before answering.
        for n in aborted {
            n.idle().await;
        }
        if let Some(raw) = raw
            && alone.is_none()
            && (fx.changed || !fx.unit_attentions.is_empty() || !fx.aborts.is_empty())
        {
            self.replicate_pr_out(from, raw, fx.changed).await?;
        }
        Ok(())
    }

    /// Replace the persistent reservation state with `state` (one a peer or a resync
    /// brings: issue 20), saved to the state file first. Ordered with PERSISTENT
    /// RESERVE OUT commands; unit attentions for what changed are the caller's to
    /// raise.
    pub async fn install_pr_state(&self, state: super::PrState) -> crate::error::Result<()> {
        let _serial = self.pr_out.lock().await;
        self.persist(&state)
            .await
            .map_err(|e| crate::error::Error::io("save persistent reservation state", e))?;
        *self.pr.write() = state;
        self.update_reserved();
        Ok(())
    }

    /// Write the state file: a temporary file, fsync, rename over, fsync the directory.
    pub(super) async fn persist(&self, state: &super::PrState) -> std::io::Result<()> {
        let store = self.pr_store.read().clone();
        if let Some(store) = store {
            return store
                .save(state)
                .await
                .map_err(|e| std::io::Error::other(e.to_string()));
        }
        let Some(path) = self.config.state_file.clone() else {
            return Ok(());
        };
        let bytes = state.encode();
        tokio::task::spawn_blocking(move || write_atomically(&path, &bytes))
            .await
            .map_err(std::io::Error::other)?
    }

    fn report_tpgs(&self, cdb: &[u8]) -> Res {
        let format = u8_at(cdb, 1) >> 5;
        if format > 1 {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        let mut out = vec![0u8; 4];
        if format == 1 {
            out.extend_from_slice(&[0x10, 0, 0, 0]);
        }
        for g in self.groups.read().iter() {
            let pref = 0;
            out.push(pref | g.state as u8);
            // T_SUP, U_SUP, S_SUP, AN_SUP, AO_SUP.
            out.push(0x80 | 0x08 | 0x04 | 0x02 | 0x01);
            out.extend_from_slice(&g.id.to_be_bytes());
            out.push(0);
            out.push(0);
            out.push(0);
            out.push(g.relative_ports.len().min(255) as u8);
            for p in g.relative_ports.iter().take(255) {
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&p.to_be_bytes());
            }
        }
        let len = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&len.to_be_bytes());
        Ok(good_data(out))
    }
}

pub(super) fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

fn report_luns(cdb: &[u8], count: u32) -> Res {
    if u8_at(cdb, 2) > 2 {
        return Err(sense::INVALID_FIELD_IN_CDB.into());
    }
    if be32(cdb, 6) < 16 {
        return Err(sense::INVALID_FIELD_IN_CDB.into());
    }
    let count = count.min(16384);
    let mut out = Vec::with_capacity(8 + count as usize * 8);
    out.extend_from_slice(&(count * 8).to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    for lun in 0..count {
        let mut l = [0u8; 8];
        if lun < 256 {
            l[1] = lun as u8;
        } else {
            // Flat space addressing.
            l[0] = 0x40 | ((lun >> 8) as u8 & 0x3F);
            l[1] = lun as u8;
        }
        out.extend_from_slice(&l);
    }
    Ok(good_data(out))
}

const TIMEOUTS: [u8; 12] = [0, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 30];

fn report_opcodes(cdb: &[u8]) -> Res {
    let rctd = u8_at(cdb, 2) & 0x80 != 0;
    let options = u8_at(cdb, 2) & 0x07;
    let opcode = u8_at(cdb, 3);
    let sa = be16(cdb, 4);
    let one = |info: Option<&OpInfo>| -> Vec<u8> {
        let mut out = vec![0u8; 4];
        match info {
            Some(i) => {
                out[1] = (u8::from(rctd) << 7) | 0x03;
                out[2..4].copy_from_slice(&(i.usage.len() as u16).to_be_bytes());
                out.extend_from_slice(i.usage);
                if rctd {
                    out.extend_from_slice(&TIMEOUTS);
                }
            }
            None => out[1] = 0x01,
        }
        out
    };
    let sa8 = u8::try_from(sa).ok();
    match options {
        0 => {
            let mut out = vec![0u8; 4];
            for i in SUPPORTED {
                out.push(i.opcode);
                out.push(0);
                out.extend_from_slice(&u16::from(i.sa.unwrap_or(0)).to_be_bytes());
                out.push(0);
                out.push((u8::from(rctd) << 1) | u8::from(i.sa.is_some()));
                out.extend_from_slice(&(i.usage.len() as u16).to_be_bytes());
                if rctd {
                    out.extend_from_slice(&TIMEOUTS);
                }
            }
            let len = (out.len() - 4) as u32;
            out[..4].copy_from_slice(&len.to_be_bytes());
            Ok(good_data(out))
        }
        1 => {
            if has_service_actions(opcode) {
                return Err(sense::INVALID_FIELD_IN_CDB.into());
            }
            Ok(good_data(one(lookup(opcode, None))))
        }
        2 => {
            if !has_service_actions(opcode) {
                return Err(sense::INVALID_FIELD_IN_CDB.into());
            }
            Ok(good_data(one(sa8.and_then(|s| lookup(opcode, Some(s))))))
        }
        3 => {
            let info = if has_service_actions(opcode) {
                sa8.and_then(|s| lookup(opcode, Some(s)))
            } else if sa == 0 {
                lookup(opcode, None)
            } else {
                None
            };
            Ok(good_data(one(info)))
        }
        _ => Err(sense::INVALID_FIELD_IN_CDB.into()),
    }
}

pub(super) fn missing_lun(command: &Command, lun_count: u32) -> Response {
    let cdb = &command.cdb[..];
    let alloc = |r: Res, n: usize| -> Response {
        match r {
            Ok(mut r) => {
                r.data.truncate(n);
                r
            }
            Err(Fail::Check(s)) => s.response(false),
            Err(Fail::Conflict) => conflict(),
        }
    };
    match cdb.first() {
        Some(&INQUIRY) => {
            let evpd = u8_at(cdb, 1) & 0x01 != 0;
            let mut out = if evpd {
                vec![0x7F, u8_at(cdb, 2), 0, 0]
            } else {
                let mut v = vec![0x7F, 0, 0x06, 0x12, 31];
                v.resize(36, 0);
                v
            };
            out.truncate(usize::from(be16(cdb, 3)));
            good_data(out)
        }
        Some(&REPORT_LUNS) => alloc(report_luns(cdb, lun_count), be32(cdb, 6) as usize),
        Some(&REQUEST_SENSE) => {
            let desc = u8_at(cdb, 1) & 0x01 != 0;
            let mut d = sense::LUN_NOT_SUPPORTED.encode(desc);
            d.truncate(usize::from(u8_at(cdb, 4)));
            good_data(d)
        }
        _ => sense::LUN_NOT_SUPPORTED.response(false),
    }
}
