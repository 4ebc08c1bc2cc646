//! The iSCSI keys: a disk's portal (`iscsi`) and target name (`iscsi_target`), and CHAP
//! (`iscsi_chap_*`) per disk or, as a default for every disk, in `[node]`.
//!
//! CHAP comes in two pairs, each a user name and a secret given inline or in a file:
//! the initiator's (`iscsi_chap_user` + `iscsi_chap_secret` / `_file`: what an
//! initiator must prove it knows) and, for mutual CHAP, the target's
//! (`iscsi_chap_target_user` + `iscsi_chap_target_secret` / `_file`: what the target
//! proves to an initiator that asks). Each pair of a disk's target is the disk's own
//! when the disk gives any of its keys, else the node's. Secrets are 12 to 255 bytes,
//! and the target's differs from the initiator's; they are never logged, shown in status
//! or in `Debug`.

use std::path::PathBuf;

use vsan_core::export::iscsi::{Chap, ChapPair};

use super::values::chap_secret_problem;
use super::{Config, ConfigError, DiskSection, NodeSection, Secret, check_iscsi_name, err};

/// What a disk's default target name starts with; the disk's name follows.
pub const DEFAULT_TARGET_PREFIX: &str = "iqn.2026-12.io.vsan:";

impl DiskSection {
    /// The target's iSCSI name: `iscsi_target`, else `iqn.2026-12.io.vsan:<name>` with the
    /// disk's name in lower case and `_` written `-` (iSCSI names have neither upper
    /// case nor `_`), the same on both nodes of a mirrored disk.
    pub fn iscsi_target_name(&self) -> String {
        match &self.iscsi_target {
            Some(t) => t.clone(),
            None => format!(
                "{DEFAULT_TARGET_PREFIX}{}",
                self.name.to_ascii_lowercase().replace('_', "-")
            ),
        }
    }

    /// Which of the disk's iSCSI keys are set (by name).
    fn iscsi_keys_given(&self) -> Vec<&'static str> {
        [
            ("iscsi_target", self.iscsi_target.is_some()),
            ("iscsi_chap_user", self.iscsi_chap_user.is_some()),
            ("iscsi_chap_secret", self.iscsi_chap_secret.is_some()),
            (
                "iscsi_chap_secret_file",
                self.iscsi_chap_secret_file.is_some(),
            ),
            (
                "iscsi_chap_target_user",
                self.iscsi_chap_target_user.is_some(),
            ),
            (
                "iscsi_chap_target_secret",
                self.iscsi_chap_target_secret.is_some(),
            ),
            (
                "iscsi_chap_target_secret_file",
                self.iscsi_chap_target_secret_file.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(k, set)| set.then_some(k))
        .collect()
    }

    fn chap_keys(&self, i: usize, target: bool) -> PairKeys<'_> {
        let at = format!("disk[{i}].");
        if target {
            PairKeys {
                at,
                prefix: "iscsi_chap_target",
                user: self.iscsi_chap_target_user.as_ref(),
                secret: self.iscsi_chap_target_secret.as_ref(),
                secret_file: self.iscsi_chap_target_secret_file.as_ref(),
            }
        } else {
            PairKeys {
                at,
                prefix: "iscsi_chap",
                user: self.iscsi_chap_user.as_ref(),
                secret: self.iscsi_chap_secret.as_ref(),
                secret_file: self.iscsi_chap_secret_file.as_ref(),
            }
        }
    }
}

impl NodeSection {
    fn chap_keys(&self, target: bool) -> PairKeys<'_> {
        let at = "node.".to_string();
        if target {
            PairKeys {
                at,
                prefix: "iscsi_chap_target",
                user: self.iscsi_chap_target_user.as_ref(),
                secret: self.iscsi_chap_target_secret.as_ref(),
                secret_file: self.iscsi_chap_target_secret_file.as_ref(),
            }
        } else {
            PairKeys {
                at,
                prefix: "iscsi_chap",
                user: self.iscsi_chap_user.as_ref(),
                secret: self.iscsi_chap_secret.as_ref(),
                secret_file: self.iscsi_chap_secret_file.as_ref(),
            }
        }
    }
}

/// One CHAP pair's keys as one section (a disk or the node) gives them.
struct PairKeys<'a> {
    /// The section, as a key prefix: `disk[0].` or `node.`.
    at: String,
    /// `iscsi_chap` (the initiator's pair) or `iscsi_chap_target` (mutual CHAP).
    prefix: &'static str,
    user: Option<&'a String>,
    secret: Option<&'a Secret>,
    secret_file: Option<&'a PathBuf>,
}

impl PairKeys<'_> {
    fn given(&self) -> bool {
        self.user.is_some() || self.secret.is_some() || self.secret_file.is_some()
    }

    /// The full key of `what` (`user`, `secret`, `secret_file`) of this pair.
    fn key(&self, what: &str) -> String {
        format!("{}{}_{what}", self.at, self.prefix)
    }

    /// A user name and exactly one of secret and secret file; an inline secret of the
    /// right length.
    fn check(&self) -> Result<(), ConfigError> {
        let Some(user) = self.user else {
            return Err(err(
                self.key("user"),
                format!(
                    "a CHAP secret needs its user name: set {}_user",
                    self.prefix
                ),
            ));
        };
        if user.is_empty() || user.len() > 255 || user.chars().any(char::is_control) {
            return Err(err(
                self.key("user"),
                "must be 1 to 255 bytes without control characters",
            ));
        }
        match (self.secret, self.secret_file) {
            (Some(_), Some(_)) => Err(err(
                self.key("secret"),
                format!(
                    "give the secret or a file holding it ({}_secret_file), not both",
                    self.prefix
                ),
            )),
            (None, None) => Err(err(
                self.key("secret"),
                format!(
                    "a CHAP user needs a secret: set {0}_secret or {0}_secret_file",
                    self.prefix
                ),
            )),
            (Some(s), None) => match chap_secret_problem(s.0.len()) {
                Some(m) => Err(err(self.key("secret"), m)),
                None => Ok(()),
            },
            (None, Some(p)) if p.as_os_str().is_empty() => {
                Err(err(self.key("secret_file"), "is empty"))
            }
            (None, Some(_)) => Ok(()),
        }
    }

    /// The pair, with its secret read from its file when it has one (already
    /// [`check`](Self::check)ed).
    fn read(&self) -> Result<ChapPair, ConfigError> {
        self.check()?;
        let user = self.user.cloned().unwrap_or_default();
        let secret = match (self.secret, self.secret_file) {
            (Some(s), _) => s.0.clone(),
            (None, Some(path)) => {
                let key = self.key("secret_file");
                let mut bytes = std::fs::read(path)
                    .map_err(|e| err(&key, format!("cannot read {}: {e}", path.display())))?;
                if bytes.last() == Some(&b'\n') {
                    bytes.pop();
                    if bytes.last() == Some(&b'\r') {
                        bytes.pop();
                    }
                }
                if let Some(m) = chap_secret_problem(bytes.len()) {
                    return Err(err(key, format!("{}: {m}", path.display())));
                }
                bytes
            }
            (None, None) => Vec::new(),
        };
        Ok(ChapPair { user, secret })
    }
}

impl Config {
    /// The keys disk `i`'s pair (`target`: the mutual one) comes from: the disk's when it
    /// gives any of them, else the node's when it does, else none.
    fn chap_pair_keys<'a>(
        &'a self,
        i: usize,
        d: &'a DiskSection,
        target: bool,
    ) -> Option<PairKeys<'a>> {
        let own = d.chap_keys(i, target);
        if own.given() {
            return Some(own);
        }
        let node = self.node.chap_keys(target);
        node.given().then_some(node)
    }

    /// The iSCSI keys of the node and of every disk: portals that parse, valid and
    /// distinct target names, CHAP pairs that are complete, mutual CHAP only with the
    /// initiator's pair and with another secret, and no iSCSI key on a disk without a
    /// portal. (Secret files are read when the node starts.)
    pub(super) fn check_iscsi(&self) -> Result<(), ConfigError> {
        for target in [false, true] {
            let keys = self.node.chap_keys(target);
            if keys.given() {
                keys.check()?;
            }
        }
        let mut names: Vec<(String, usize)> = Vec::new();
        for (i, d) in self.disk.iter().enumerate() {
            let key = |k: &str| format!("disk[{i}].{k}");
            let Some(portal) = &d.iscsi else {
                if let Some(k) = d.iscsi_keys_given().first() {
                    return Err(err(
                        key(k),
                        "only with `iscsi` (the disk's portal address); the disk has none",
                    ));
                }
                continue;
            };
            if portal.parse::<std::net::SocketAddr>().is_err() {
                return Err(err(
                    key("iscsi"),
                    format!("{portal:?} is not an address such as \"127.0.0.1:3260\""),
                ));
            }
            let name = d.iscsi_target_name();
            if let Err(m) = check_iscsi_name(&name) {
                return Err(match d.iscsi_target {
                    Some(_) => err(key("iscsi_target"), m),
                    None => err(
                        key("name"),
                        format!(
                            "the default iSCSI target name {name:?} is not valid ({m}): set \
                             iscsi_target"
                        ),
                    ),
                });
            }
            if let Some((_, j)) = names.iter().find(|(n, _)| *n == name) {
                return Err(err(
                    key("iscsi_target"),
                    format!("{name:?} is also disk[{j}]'s target: each disk needs its own"),
                ));
            }
            names.push((name, i));
            for target in [false, true] {
                let keys = d.chap_keys(i, target);
                if keys.given() {
                    keys.check()?;
                }
            }
            let initiator = self.chap_pair_keys(i, d, false);
            if let Some(mutual) = self.chap_pair_keys(i, d, true) {
                let Some(initiator) = initiator else {
                    return Err(err(
                        mutual.key("user"),
                        "mutual CHAP needs the initiator's pair too (iscsi_chap_user and a \
                         secret): the target proves itself only to an initiator that proved \
                         itself first",
                    ));
                };
                if let (Some(a), Some(b)) = (initiator.secret, mutual.secret)
                    && a == b
                {
                    return Err(err(mutual.key("secret"), same_secret()));
                }
            }
        }
        Ok(())
    }

    /// The CHAP settings of disk `i`'s target, secrets read from their files: `None`
    /// when neither the disk nor the node gives CHAP.
    pub fn iscsi_chap(&self, i: usize) -> Result<Option<Chap>, ConfigError> {
        let Some(d) = self.disk.get(i) else {
            return Ok(None);
        };
        let Some(initiator) = self.chap_pair_keys(i, d, false) else {
            return Ok(None);
        };
        let initiator_pair = initiator.read()?;
        let target = match self.chap_pair_keys(i, d, true) {
            None => None,
            Some(keys) => {
                let pair = keys.read()?;
                if pair.secret == initiator_pair.secret {
                    let which = if keys.secret.is_some() {
                        "secret"
                    } else {
                        "secret_file"
                    };
                    return Err(err(keys.key(which), same_secret()));
                }
                Some(pair)
            }
        };
        Ok(Some(Chap {
            initiator: initiator_pair,
            target,
        }))
    }
}

fn same_secret() -> &'static str {
    "the target's CHAP secret must differ from the initiator's: with one secret for both \
     directions, anyone can log in by reflecting the target's own challenge back at it"
}
