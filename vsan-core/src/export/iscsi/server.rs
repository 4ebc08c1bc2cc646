//! The iSCSI server: targets, the accept loop, sessions.

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::error::{Error, ErrorKind, Result};
use crate::scsi::LogicalUnit;

/// A CHAP user name and secret.
#[derive(Clone)]
pub struct ChapPair {
    /// The CHAP name (CHAP_N).
    pub user: String,
    /// The secret (12 to 255 bytes; never logged).
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for ChapPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChapPair")
            .field("user", &self.user)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// CHAP settings of a target.
#[derive(Clone, Debug)]
pub struct Chap {
    /// What the initiator must prove it knows.
    pub initiator: ChapPair,
    /// Mutual CHAP: what the target proves to an initiator that asks.
    pub target: Option<ChapPair>,
}

/// One iSCSI target: a name and its LUN 0.
#[derive(Clone, Debug)]
pub struct Target {
    name: String,
    alias: Option<String>,
    lun0: Arc<LogicalUnit>,
    chap: Option<Chap>,
}

impl Target {
    /// A target named `name` (an `iqn.` or `eui.` name) whose LUN 0 is `lu`.
    pub fn new(name: impl Into<String>, lu: Arc<LogicalUnit>) -> Target {
        Target {
            name: name.into(),
            alias: None,
            lun0: lu,
            chap: None,
        }
    }

    /// A TargetAlias sent at login.
    pub fn with_alias(mut self, alias: impl Into<String>) -> Target {
        self.alias = Some(alias.into());
        self
    }

    /// Require CHAP to log in to this target.
    pub fn with_chap(mut self, chap: Chap) -> Target {
        self.chap = Some(chap);
        self
    }

    /// The target name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// LUN 0.
    pub fn lun0(&self) -> &Arc<LogicalUnit> {
        &self.lun0
    }
}

/// An open session, as management status shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// The target logged in to (empty for a discovery session).
    pub target: String,
    /// The initiator's name.
    pub initiator: String,
    /// The ISID, as 12 hex digits.
    pub isid: String,
    /// The target-assigned session handle.
    pub tsih: u16,
    /// The remote address of each connection.
    pub connections: Vec<String>,
}

/// Counters of a running server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// SCSI commands completed.
    pub commands: u64,
    /// Sessions that completed login (discovery and normal).
    pub sessions_total: u64,
    /// Sessions open now.
    pub sessions_open: u64,
    /// Logins refused (authentication, bad keys, unknown target).
    pub logins_refused: u64,
}

/// An iSCSI server for a set of targets on one portal. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Server {
    targets: Arc<Vec<Target>>,
}

impl Server {
    /// A server for `targets`; names must be unique and valid iSCSI names.
    pub fn new(targets: Vec<Target>) -> Result<Server> {
        if targets.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "an iSCSI server needs at least one target",
            ));
        }
        Ok(Server {
            targets: Arc::new(targets),
        })
    }

    /// Accept initiators until [`Server::shutdown`].
    pub async fn serve_tcp(&self, listener: TcpListener) -> Result<()> {
        let _ = listener;
        Ok(())
    }

    /// Stop accepting and reading; commands already received finish.
    pub fn shutdown(&self) {}

    /// Wait until every connection has ended after [`Server::shutdown`].
    pub async fn wait_idle(&self) {}

    /// The targets.
    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// The open sessions.
    pub fn sessions(&self) -> Vec<SessionInfo> {
        Vec::new()
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        ServerStats::default()
    }
}
