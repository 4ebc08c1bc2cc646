//! The login phase of one connection (RFC 7143 sections 6, 11.12, 11.13, 13), sans-IO:
//! [`Login::step`] takes one Login Request and gives the Login Response to send.
//!
//! ```text
//!            AuthMethod, CHAP_*            operational keys
//!  (start) ──► security (CSG 0) ──T──► operational (CSG 1) ──T──► full feature (3)
//!       └──────────────(skip security: no CHAP)─────┘   └──T (0 → 3)──────────┘
//! ```
//!
//! The first request must name the initiator (InitiatorName) and, for a normal session,
//! a configured target (TargetName); SessionType=Discovery needs no target. A target
//! with CHAP refuses AuthMethod=None. Operational keys are negotiated with the RFC's
//! defaults, ranges and result functions; unknown keys get NotUnderstood, bad values
//! Reject, keys that do not apply Irrelevant. We support one connection per session
//! (MaxConnections=1) and ErrorRecoveryLevel=0, so a login with a non-zero TSIH (adding
//! a connection to a session) is refused.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::Chap;
use super::chap::{ChapAuth, is_chap_key};
use super::keys::{self, Pair, TextBuilder, answer, bool_str, parse_bool, parse_number};
use super::pdu::{DEFAULT_MAX_DATA_SEGMENT, LoginReq, LoginResp, MAX_DATA_SEGMENT_FIELD};

/// The operational (and declarative) keys negotiated only at login (RFC 7143 section
/// 13): at login each may be negotiated once; in the full-feature phase a Text request
/// carrying one is answered Reject.
pub(super) const OPERATIONAL_KEYS: &[&str] = &[
    "HeaderDigest",
    "DataDigest",
    "MaxConnections",
    "InitialR2T",
    "ImmediateData",
    "MaxRecvDataSegmentLength",
    "MaxBurstLength",
    "FirstBurstLength",
    "DefaultTime2Wait",
    "DefaultTime2Retain",
    "MaxOutstandingR2T",
    "DataPDUInOrder",
    "DataSequenceInOrder",
    "ErrorRecoveryLevel",
    "OFMarker",
    "IFMarker",
    "OFMarkInt",
    "IFMarkInt",
    "InitiatorAlias",
];

/// The longest login text taken across C-bit continuations.
pub const MAX_LOGIN_TEXT: usize = 64 << 10;

/// Login status (Status-Class << 8 | Status-Detail, RFC 7143 11.13.5).
pub mod status {
    /// Login is proceeding OK.
    pub const SUCCESS: u16 = 0x0000;
    /// Miscellaneous initiator error.
    pub const INITIATOR_ERROR: u16 = 0x0200;
    /// Authentication failure.
    pub const AUTH_FAILURE: u16 = 0x0201;
    /// Authorization failure.
    pub const AUTHORIZATION_FAILURE: u16 = 0x0202;
    /// The target name was not found.
    pub const NOT_FOUND: u16 = 0x0203;
    /// Unsupported version.
    pub const UNSUPPORTED_VERSION: u16 = 0x0205;
    /// Too many connections.
    pub const TOO_MANY_CONNECTIONS: u16 = 0x0206;
    /// A required parameter is missing.
    pub const MISSING_PARAMETER: u16 = 0x0207;
    /// Session type not supported.
    pub const SESSION_TYPE_NOT_SUPPORTED: u16 = 0x0209;
    /// Session does not exist.
    pub const SESSION_DOES_NOT_EXIST: u16 = 0x020a;
    /// Invalid request during login.
    pub const INVALID_DURING_LOGIN: u16 = 0x020b;
    /// Target hardware or software error.
    pub const TARGET_ERROR: u16 = 0x0300;
}

/// One target a login may name.
#[derive(Clone, Debug)]
pub struct LoginTarget {
    /// The iSCSI name.
    pub name: String,
    /// The TargetAlias sent at login, if any.
    pub alias: Option<String>,
    /// CHAP required to log in, if any.
    pub chap: Option<Chap>,
    /// This target's portal group tag, where it differs from
    /// [`LoginConfig::portal_group_tag`] (the two nodes of a mirrored disk give their
    /// ports of the same target distinct tags).
    pub portal_group_tag: Option<u16>,
}

/// What this target accepts; negotiation never goes past these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The MaxRecvDataSegmentLength we declare (default 262144).
    pub max_recv_data_segment_length: u32,
    /// Our largest MaxBurstLength (default 16 MiB).
    pub max_burst_length: u32,
    /// Our largest FirstBurstLength (default 256 KiB).
    pub first_burst_length: u32,
    /// Our largest MaxOutstandingR2T (default 16).
    pub max_outstanding_r2t: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_recv_data_segment_length: 262_144,
            max_burst_length: 16 << 20,
            first_burst_length: 256 << 10,
            max_outstanding_r2t: 16,
        }
    }
}

/// Everything a login needs to know about the portal.
#[derive(Clone, Debug)]
pub struct LoginConfig {
    /// The targets on the portal.
    pub targets: Vec<LoginTarget>,
    /// The portal group tag (TargetPortalGroupTag).
    pub portal_group_tag: u16,
    /// Negotiation limits.
    pub limits: Limits,
}

impl LoginConfig {
    /// The portal group tag of target `index`: its own, or the portal's.
    pub fn tag_of(&self, index: usize) -> u16 {
        self.targets
            .get(index)
            .and_then(|t| t.portal_group_tag)
            .unwrap_or(self.portal_group_tag)
    }
}

/// What the login asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionKind {
    /// SessionType=Discovery: Text requests (SendTargets) only.
    Discovery,
    /// A normal session on a target.
    Normal {
        /// Index in [`LoginConfig::targets`].
        target: usize,
    },
}

/// The operational parameters of a session, as negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionParams {
    /// HeaderDigest=CRC32C.
    pub header_digest: bool,
    /// DataDigest=CRC32C.
    pub data_digest: bool,
    /// Ours: the largest data segment we accept.
    pub max_recv_data_segment_length: u32,
    /// The initiator's MaxRecvDataSegmentLength: the largest we may send.
    pub max_xmit_data_segment_length: u32,
    /// MaxBurstLength.
    pub max_burst_length: u32,
    /// FirstBurstLength (never over MaxBurstLength).
    pub first_burst_length: u32,
    /// InitialR2T.
    pub initial_r2t: bool,
    /// ImmediateData.
    pub immediate_data: bool,
    /// MaxOutstandingR2T.
    pub max_outstanding_r2t: u32,
    /// DataPDUInOrder (always Yes: we ask for it).
    pub data_pdu_in_order: bool,
    /// DataSequenceInOrder (always Yes: we ask for it).
    pub data_sequence_in_order: bool,
    /// DefaultTime2Wait.
    pub default_time2wait: u16,
    /// DefaultTime2Retain.
    pub default_time2retain: u16,
    /// ErrorRecoveryLevel (always 0).
    pub error_recovery_level: u8,
    /// MaxConnections (always 1).
    pub max_connections: u16,
}

impl Default for SessionParams {
    /// The RFC 7143 defaults.
    fn default() -> SessionParams {
        SessionParams {
            header_digest: false,
            data_digest: false,
            max_recv_data_segment_length: DEFAULT_MAX_DATA_SEGMENT,
            max_xmit_data_segment_length: DEFAULT_MAX_DATA_SEGMENT,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            initial_r2t: true,
            immediate_data: true,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            default_time2wait: 2,
            default_time2retain: 20,
            error_recovery_level: 0,
            max_connections: 1,
        }
    }
}

/// The outcome of a successful login.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Discovery or normal, and which target.
    pub kind: SessionKind,
    /// InitiatorName.
    pub initiator_name: String,
    /// InitiatorAlias, if sent.
    pub initiator_alias: Option<String>,
    /// ISID.
    pub isid: [u8; 6],
    /// The TSIH given to the session.
    pub tsih: u16,
    /// The connection's CID.
    pub cid: u16,
    /// The negotiated parameters.
    pub params: SessionParams,
}

/// What to do after one Login Request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoginStep {
    /// Send the response and wait for the next Login Request.
    Continue(LoginResp),
    /// Send the response (the final one, T=1 into full feature phase); the session starts.
    Done(LoginResp, Negotiated),
    /// Send the response (a failure status), then close the connection.
    Refuse(LoginResp),
}

/// Where the login stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// No request yet.
    Start,
    /// In the given CSG (0 or 1).
    In(u8),
    /// Finished or refused: any further request is refused.
    Over,
}

/// Security state.
#[derive(Debug)]
enum Auth {
    /// AuthMethod not agreed yet.
    Undecided,
    /// AuthMethod=None agreed (or not needed).
    None,
    /// CHAP in progress or done.
    Chap(Box<ChapAuth>),
}

/// A refusal with its status.
struct Refusal(u16, &'static str);

/// The login state of one connection. Its `Debug` leaves out the login text (it may
/// hold a CHAP response) and the CHAP state.
pub struct Login {
    config: Arc<LoginConfig>,
    new_tsih: u16,
    stage: Stage,
    isid: [u8; 6],
    cid: u16,
    pending: BytesMut,
    initiator_name: String,
    initiator_alias: Option<String>,
    kind: Option<SessionKind>,
    auth: Auth,
    /// Operational keys negotiated so far (a second offer is an initiator error).
    seen: Vec<String>,
    declared_mrdsl: bool,
    params: SessionParams,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("stage", &self.stage)
            .field("initiator_name", &self.initiator_name)
            .field("kind", &self.kind)
            .field("auth", &self.auth)
            .field("pending_text_len", &self.pending.len())
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Login {
    /// A login on a new connection; `new_tsih` is what a new session gets.
    pub fn new(config: Arc<LoginConfig>, new_tsih: u16) -> Login {
        Login {
            config,
            new_tsih,
            stage: Stage::Start,
            isid: [0; 6],
            cid: 0,
            pending: BytesMut::new(),
            initiator_name: String::new(),
            initiator_alias: None,
            kind: None,
            auth: Auth::Undecided,
            seen: Vec::new(),
            declared_mrdsl: false,
            params: SessionParams::default(),
        }
    }

    /// The response to a PDU other than a Login Request during login (status 0x020b);
    /// the connection is then closed.
    pub fn refuse_invalid_during_login(&mut self, itt: u32) -> LoginResp {
        self.stage = Stage::Over;
        LoginResp {
            itt,
            isid: self.isid,
            status_class: (status::INVALID_DURING_LOGIN >> 8) as u8,
            status_detail: status::INVALID_DURING_LOGIN as u8,
            ..Default::default()
        }
    }

    /// One Login Request in, one Login Response out.
    pub fn step(&mut self, req: &LoginReq) -> LoginStep {
        match self.try_step(req) {
            Ok(step) => step,
            Err(Refusal(code, why)) => {
                tracing::debug!(
                    status = format_args!("{code:#06x}"),
                    initiator = %self.initiator_name,
                    "iSCSI login refused: {why}"
                );
                self.stage = Stage::Over;
                LoginStep::Refuse(self.response(req, false, 0, code, Bytes::new()))
            }
        }
    }

    fn response(
        &self,
        req: &LoginReq,
        transit: bool,
        nsg: u8,
        code: u16,
        data: Bytes,
    ) -> LoginResp {
        LoginResp {
            transit,
            cont: false,
            csg: if code == 0 { req.csg } else { 0 },
            nsg: if transit { nsg } else { 0 },
            version_max: 0,
            version_active: 0,
            isid: req.isid,
            tsih: if transit && nsg == 3 {
                self.new_tsih
            } else {
                0
            },
            itt: req.itt,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            status_class: (code >> 8) as u8,
            status_detail: code as u8,
            data,
        }
    }

    fn try_step(&mut self, req: &LoginReq) -> Result<LoginStep, Refusal> {
        let first = match self.stage {
            Stage::Over => return Err(Refusal(status::INITIATOR_ERROR, "login already over")),
            Stage::Start => true,
            Stage::In(_) => false,
        };
        if first {
            if req.version_min > 0 {
                return Err(Refusal(status::UNSUPPORTED_VERSION, "Version-min above 0"));
            }
            if req.tsih != 0 {
                // Adding a connection to (or reinstating one of) an existing session:
                // with MaxConnections=1 and ErrorRecoveryLevel=0 no session takes one.
                return Err(Refusal(
                    status::SESSION_DOES_NOT_EXIST,
                    "a non-zero TSIH (no multiple connections per session)",
                ));
            }
            if !matches!(req.csg, 0 | 1) {
                return Err(Refusal(status::INITIATOR_ERROR, "first CSG not 0 or 1"));
            }
            self.isid = req.isid;
            self.cid = req.cid;
        } else {
            if req.isid != self.isid || req.tsih != 0 || req.cid != self.cid {
                return Err(Refusal(
                    status::INITIATOR_ERROR,
                    "ISID, TSIH or CID changed",
                ));
            }
            if self.stage != Stage::In(req.csg) {
                return Err(Refusal(status::INITIATOR_ERROR, "CSG out of sequence"));
            }
        }
        if req.cont && req.transit {
            return Err(Refusal(status::INITIATOR_ERROR, "both C and T bits"));
        }
        if req.transit && !matches!((req.csg, req.nsg), (0, 1) | (0, 3) | (1, 3)) {
            return Err(Refusal(status::INITIATOR_ERROR, "invalid stage transition"));
        }
        if self.pending.len() + req.data.len() > MAX_LOGIN_TEXT {
            return Err(Refusal(status::INITIATOR_ERROR, "login text too long"));
        }
        self.pending.extend_from_slice(&req.data);
        if req.cont {
            // More text follows: an empty response asks for it.
            self.stage = Stage::In(req.csg);
            return Ok(LoginStep::Continue(self.response(
                req,
                false,
                0,
                0,
                Bytes::new(),
            )));
        }
        let text = std::mem::take(&mut self.pending).freeze();
        // The first whole text (C-bit pieces joined) carries the declarations.
        let first = self.kind.is_none();
        let pairs = keys::parse(&text)
            .map_err(|_| Refusal(status::INITIATOR_ERROR, "malformed login text"))?;
        let mut out = TextBuilder::new();
        let mut rest: Vec<&Pair> = Vec::new();
        let declarative = |p: &Pair| -> Result<bool, Refusal> {
            match p.key.as_str() {
                "InitiatorName" | "TargetName" | "SessionType" if !first => Err(Refusal(
                    status::INITIATOR_ERROR,
                    "InitiatorName, TargetName or SessionType after the first request",
                )),
                "InitiatorName" | "TargetName" | "SessionType" => Ok(true),
                _ => Ok(false),
            }
        };
        for p in &pairs {
            if !declarative(p)? {
                rest.push(p);
            }
        }
        if first {
            self.start(&pairs, &mut out)?;
        }
        let target_chap = self.target_chap();
        if req.csg == 0 {
            self.security(&rest, &target_chap, &mut out)?;
        } else {
            if matches!(self.auth, Auth::Undecided) {
                // Security skipped: allowed only where no authentication is required.
                if target_chap.is_some() {
                    return Err(Refusal(
                        status::AUTH_FAILURE,
                        "security negotiation skipped on a CHAP target",
                    ));
                }
                self.auth = Auth::None;
            }
            if matches!(&self.auth, Auth::Chap(c) if !c.done()) {
                return Err(Refusal(
                    status::AUTH_FAILURE,
                    "operational stage before CHAP",
                ));
            }
            for p in &rest {
                if p.key == "AuthMethod" || is_chap_key(&p.key) {
                    return Err(Refusal(
                        status::INITIATOR_ERROR,
                        "security keys in the operational stage",
                    ));
                }
                self.operational(p, &mut out)?;
            }
            if !self.declared_mrdsl {
                self.declared_mrdsl = true;
                self.params.max_recv_data_segment_length =
                    self.config.limits.max_recv_data_segment_length;
                out.push(
                    "MaxRecvDataSegmentLength",
                    &self.config.limits.max_recv_data_segment_length.to_string(),
                );
            }
        }
        if out.as_bytes().len() > DEFAULT_MAX_DATA_SEGMENT as usize {
            // The initiator takes 8192 bytes per PDU during login, and we do not split
            // answers over C-bit responses: only a flood of keys gets here.
            return Err(Refusal(
                status::INITIATOR_ERROR,
                "too many keys to answer in one response",
            ));
        }
        let authenticated = match &self.auth {
            Auth::None => true,
            Auth::Chap(c) => c.done(),
            Auth::Undecided => target_chap.is_none(),
        };
        if req.transit && req.csg == 0 && !authenticated {
            if target_chap.is_some() && matches!(self.auth, Auth::Undecided) {
                return Err(Refusal(status::AUTH_FAILURE, "no AuthMethod offered"));
            }
            // Stay in the security stage until CHAP is through.
            self.stage = Stage::In(0);
            return Ok(LoginStep::Continue(self.response(
                req,
                false,
                0,
                0,
                out.finish(),
            )));
        }
        if matches!(self.auth, Auth::Undecided) && req.transit {
            self.auth = Auth::None;
        }
        if !req.transit {
            self.stage = Stage::In(req.csg);
            return Ok(LoginStep::Continue(self.response(
                req,
                false,
                0,
                0,
                out.finish(),
            )));
        }
        if req.nsg == 1 {
            self.stage = Stage::In(1);
            return Ok(LoginStep::Continue(self.response(
                req,
                true,
                1,
                0,
                out.finish(),
            )));
        }
        self.stage = Stage::Over;
        let resp = self.response(req, true, 3, 0, out.finish());
        let Some(kind) = self.kind else {
            return Err(Refusal(status::TARGET_ERROR, "no session kind"));
        };
        let mut params = self.params;
        params.first_burst_length = params.first_burst_length.min(params.max_burst_length);
        Ok(LoginStep::Done(
            resp,
            Negotiated {
                kind,
                initiator_name: self.initiator_name.clone(),
                initiator_alias: self.initiator_alias.clone(),
                isid: self.isid,
                tsih: self.new_tsih,
                cid: self.cid,
                params,
            },
        ))
    }

    /// The first request's declarations: who the initiator is, what it wants.
    fn start(&mut self, pairs: &[Pair], out: &mut TextBuilder) -> Result<(), Refusal> {
        let get = |k: &str| pairs.iter().find(|p| p.key == k).map(|p| p.value.as_str());
        let name = get("InitiatorName")
            .filter(|n| !n.is_empty())
            .ok_or(Refusal(status::MISSING_PARAMETER, "no InitiatorName"))?;
        self.initiator_name = name.to_string();
        let kind = match get("SessionType").unwrap_or("Normal") {
            "Discovery" => SessionKind::Discovery,
            "Normal" => {
                let target = get("TargetName")
                    .filter(|n| !n.is_empty())
                    .ok_or(Refusal(status::MISSING_PARAMETER, "no TargetName"))?;
                let index = self
                    .config
                    .targets
                    .iter()
                    .position(|t| t.name.eq_ignore_ascii_case(target))
                    .ok_or(Refusal(status::NOT_FOUND, "unknown TargetName"))?;
                SessionKind::Normal { target: index }
            }
            _ => {
                return Err(Refusal(
                    status::SESSION_TYPE_NOT_SUPPORTED,
                    "unknown SessionType",
                ));
            }
        };
        self.kind = Some(kind);
        if let SessionKind::Normal { target } = kind {
            out.push(
                "TargetPortalGroupTag",
                &self.config.tag_of(target).to_string(),
            );
            if let Some(alias) = self
                .config
                .targets
                .get(target)
                .and_then(|t| t.alias.clone())
            {
                out.push("TargetAlias", &alias);
            }
        }
        Ok(())
    }

    /// The CHAP settings the login must pass (none for discovery).
    fn target_chap(&self) -> Option<Chap> {
        match self.kind {
            Some(SessionKind::Normal { target }) => {
                self.config.targets.get(target).and_then(|t| t.chap.clone())
            }
            _ => None,
        }
    }

    fn security(
        &mut self,
        pairs: &[&Pair],
        chap: &Option<Chap>,
        out: &mut TextBuilder,
    ) -> Result<(), Refusal> {
        let mut chap_keys: Vec<&Pair> = Vec::new();
        for p in pairs {
            if p.key == "AuthMethod" {
                if !matches!(self.auth, Auth::Undecided) {
                    return Err(Refusal(status::INITIATOR_ERROR, "AuthMethod renegotiated"));
                }
                let offered: Vec<&str> = p.value.split(',').collect();
                match chap {
                    Some(c) if offered.contains(&"CHAP") => {
                        out.push("AuthMethod", "CHAP");
                        self.auth = Auth::Chap(Box::new(ChapAuth::new(c.clone())));
                    }
                    Some(_) => {
                        return Err(Refusal(
                            status::AUTH_FAILURE,
                            "CHAP required but not offered",
                        ));
                    }
                    None if offered.contains(&"None") => {
                        out.push("AuthMethod", "None");
                        self.auth = Auth::None;
                    }
                    None => {
                        return Err(Refusal(
                            status::AUTH_FAILURE,
                            "only authentication methods this target has no secret for",
                        ));
                    }
                }
            } else if is_chap_key(&p.key) {
                chap_keys.push(p);
            } else {
                self.operational(p, out)?;
            }
        }
        match &mut self.auth {
            Auth::Chap(c) => c.step(&chap_keys, out).map_err(|e| {
                tracing::debug!("iSCSI CHAP failed: {e}");
                Refusal(status::AUTH_FAILURE, "CHAP failed")
            }),
            _ if !chap_keys.is_empty() => Err(Refusal(
                status::AUTH_FAILURE,
                "CHAP keys without AuthMethod=CHAP",
            )),
            _ => Ok(()),
        }
    }

    /// Negotiates one operational key, writing the answer (if any) to `out`.
    fn operational(&mut self, p: &Pair, out: &mut TextBuilder) -> Result<(), Refusal> {
        let key = p.key.as_str();
        let v = p.value.as_str();
        let known = OPERATIONAL_KEYS.contains(&key);
        if known {
            if self.seen.iter().any(|k| k == key) {
                return Err(Refusal(status::INITIATOR_ERROR, "key negotiated twice"));
            }
            self.seen.push(key.to_string());
        }
        let discovery = self.kind == Some(SessionKind::Discovery);
        let lim = self.config.limits;
        let max24 = u64::from(MAX_DATA_SEGMENT_FIELD);
        let mut reply = |k: &str, v: &str| {
            out.push(k, v);
        };
        let number = |min: u64, max: u64| parse_number(v, min, max);
        match key {
            "HeaderDigest" | "DataDigest" => {
                let pick = v.split(',').find(|x| matches!(*x, "CRC32C" | "None"));
                match pick {
                    Some(x) => {
                        let on = x == "CRC32C";
                        if key == "HeaderDigest" {
                            self.params.header_digest = on;
                        } else {
                            self.params.data_digest = on;
                        }
                        reply(key, x);
                    }
                    None => reply(key, answer::REJECT),
                }
            }
            "MaxConnections" => match number(1, 65535) {
                Some(_) => reply(key, "1"),
                None => reply(key, answer::REJECT),
            },
            "ErrorRecoveryLevel" => match number(0, 2) {
                Some(_) => reply(key, "0"),
                None => reply(key, answer::REJECT),
            },
            "InitialR2T" | "ImmediateData" | "DataPDUInOrder" | "DataSequenceInOrder"
                if discovery =>
            {
                reply(key, answer::IRRELEVANT)
            }
            "MaxBurstLength" | "FirstBurstLength" | "MaxOutstandingR2T" if discovery => {
                reply(key, answer::IRRELEVANT)
            }
            // OR with our No: the initiator's value.
            "InitialR2T" => match parse_bool(v) {
                Some(b) => {
                    self.params.initial_r2t = b;
                    reply(key, bool_str(b));
                }
                None => reply(key, answer::REJECT),
            },
            // AND with our Yes: the initiator's value.
            "ImmediateData" => match parse_bool(v) {
                Some(b) => {
                    self.params.immediate_data = b;
                    reply(key, bool_str(b));
                }
                None => reply(key, answer::REJECT),
            },
            // OR with our Yes: Yes.
            "DataPDUInOrder" | "DataSequenceInOrder" => match parse_bool(v) {
                Some(_) => reply(key, "Yes"),
                None => reply(key, answer::REJECT),
            },
            // AND with our No: No (markers are not supported).
            "OFMarker" | "IFMarker" => match parse_bool(v) {
                Some(_) => reply(key, "No"),
                None => reply(key, answer::REJECT),
            },
            "OFMarkInt" | "IFMarkInt" => reply(key, answer::IRRELEVANT),
            // Declarative: the most the initiator takes in one PDU from us. A bad value
            // is ignored (the default 8192 stays): answering it would put a second
            // MaxRecvDataSegmentLength, beside our own declaration, in one response.
            "MaxRecvDataSegmentLength" => match number(512, max24) {
                Some(n) => self.params.max_xmit_data_segment_length = n as u32,
                None => tracing::debug!("iSCSI login: bad MaxRecvDataSegmentLength ignored"),
            },
            "MaxBurstLength" => match number(512, max24) {
                Some(n) => {
                    let r = (n as u32).min(lim.max_burst_length);
                    self.params.max_burst_length = r;
                    reply(key, &r.to_string());
                }
                None => reply(key, answer::REJECT),
            },
            "FirstBurstLength" => match number(512, max24) {
                Some(n) => {
                    let r = (n as u32).min(lim.first_burst_length);
                    self.params.first_burst_length = r;
                    reply(key, &r.to_string());
                }
                None => reply(key, answer::REJECT),
            },
            "MaxOutstandingR2T" => match number(1, 65535) {
                Some(n) => {
                    let r = (n as u32).min(lim.max_outstanding_r2t.max(1));
                    self.params.max_outstanding_r2t = r;
                    reply(key, &r.to_string());
                }
                None => reply(key, answer::REJECT),
            },
            // Maximum with our 0: the initiator's value.
            "DefaultTime2Wait" => match number(0, 3600) {
                Some(n) => {
                    self.params.default_time2wait = n as u16;
                    reply(key, &n.to_string());
                }
                None => reply(key, answer::REJECT),
            },
            // Minimum with our 20.
            "DefaultTime2Retain" => match number(0, 3600) {
                Some(n) => {
                    let r = n.min(20) as u16;
                    self.params.default_time2retain = r;
                    reply(key, &r.to_string());
                }
                None => reply(key, answer::REJECT),
            },
            "InitiatorAlias" => self.initiator_alias = Some(v.to_string()),
            // Keys only a target sends: an initiator sending one is in error (and an
            // answer could clash with our own TargetAlias or TargetPortalGroupTag).
            "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" => {
                return Err(Refusal(status::INITIATOR_ERROR, "a target-only key"));
            }
            // Only in the full feature phase.
            "SendTargets" => reply(key, answer::IRRELEVANT),
            // Anything else, X- extensions included, and the keys of RFC 7143's
            // extensions we do not implement (iSCSIProtocolLevel, TaskReporting).
            _ => reply(key, answer::NOT_UNDERSTOOD),
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "login_tests.rs"]
mod tests;
