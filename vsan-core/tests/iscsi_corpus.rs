//! The iSCSI fuzz corpora as a test: every file committed under
//! `fuzz/corpus/iscsi_pdu/` and `fuzz/corpus/iscsi_login/` (see `fuzz/README.md`) is run
//! through the same check its fuzz target runs
//! (`vsan_core::export::iscsi::fuzzing`), and so are the seeds and single-byte
//! mutations of them.
//!
//! The replay is shown not to be vacuous: the PDU corpus decodes every request type,
//! gets Rejects for data digests, bad fields, unsupported opcodes and protocol errors,
//! and loses the framing on a bad header digest; the login corpus reaches normal,
//! discovery and CHAP sessions (one-way and mutual) and refusals with each status the
//! seeds aim at.
//!
//! `write_fuzz_seeds` (ignored) writes the seeds into the corpus directories.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use vsan_core::corpus;
use vsan_core::export::iscsi::fuzzing::{
    LoginOutcome, PduOutcome, check_login, check_pdu, login_seeds, pdu_seeds,
};
use vsan_core::export::iscsi::login::SessionKind;
use vsan_core::export::iscsi::pdu::{opcode, reject_reason};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn inputs(target: &str, seeds: Vec<Vec<u8>>) -> Vec<(PathBuf, Vec<u8>)> {
    let mut all = corpus::files(&corpus_dir(target));
    assert!(!all.is_empty(), "the {target} corpus is empty");
    for (i, s) in seeds.into_iter().enumerate() {
        all.push((PathBuf::from(format!("<{target} seed {i}>")), s));
    }
    let mutated: Vec<(PathBuf, Vec<u8>)> = all
        .iter()
        .flat_map(|(p, b)| {
            corpus::mutations(b, 12, 7)
                .enumerate()
                .map(move |(i, m)| (PathBuf::from(format!("{} mutation {i}", p.display())), m))
        })
        .collect();
    all.extend(mutated);
    all
}

#[test]
fn iscsi_pdu_corpus_replays_and_reaches_every_outcome() {
    let mut requests = BTreeSet::new();
    let mut rejects = BTreeSet::new();
    let (mut fatal, mut replies) = (false, false);
    for (path, bytes) in inputs("iscsi_pdu", pdu_seeds()) {
        let out: PduOutcome = corpus::replay(&path, &bytes, check_pdu);
        requests.extend(out.requests);
        rejects.extend(out.rejects);
        fatal |= out.fatal;
        replies |= !out.replies.is_empty();
    }
    for op in [
        opcode::NOP_OUT,
        opcode::SCSI_COMMAND,
        opcode::TASK_MGMT,
        opcode::LOGIN,
        opcode::TEXT,
        opcode::DATA_OUT,
        opcode::LOGOUT,
        opcode::SNACK,
    ] {
        assert!(requests.contains(&op), "no request with opcode {op:#04x}");
    }
    for reason in [
        reject_reason::DATA_DIGEST_ERROR,
        reject_reason::PROTOCOL_ERROR,
        reject_reason::COMMAND_NOT_SUPPORTED,
        reject_reason::INVALID_PDU_FIELD,
    ] {
        assert!(
            rejects.contains(&reason),
            "no Reject with reason {reason:#04x}"
        );
    }
    assert!(fatal, "no input loses the framing");
    assert!(replies, "no input decodes as a reply");
}

#[test]
fn iscsi_login_corpus_replays_and_reaches_every_outcome() {
    let mut kinds = BTreeSet::new();
    let mut refusals = BTreeSet::new();
    let (mut chap, mut mutual) = (false, false);
    for (path, bytes) in inputs("iscsi_login", login_seeds()) {
        let out: LoginOutcome = corpus::replay(&path, &bytes, check_login);
        if let Some(k) = out.done {
            kinds.insert(match k {
                SessionKind::Discovery => "discovery".to_string(),
                SessionKind::Normal { target } => format!("target {target}"),
            });
        }
        refusals.extend(out.refused);
        chap |= out.chap_passed;
        mutual |= out.mutual_answered;
    }
    for k in ["discovery", "target 0", "target 1", "target 2"] {
        assert!(kinds.contains(k), "no login reaches {k}: {kinds:?}");
    }
    for status in [0x0200, 0x0201, 0x0203, 0x0207, 0x020b] {
        assert!(
            refusals.contains(&status),
            "no refusal {status:#06x}: {refusals:?}"
        );
    }
    assert!(chap && mutual);
}

/// Writes the seeds into the corpus directories (named by content, as cargo-fuzz
/// names its files).
#[test]
#[ignore = "writes into the source tree; run by hand to seed the fuzz corpus"]
fn write_fuzz_seeds() {
    for (target, seeds) in [("iscsi_pdu", pdu_seeds()), ("iscsi_login", login_seeds())] {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        for s in seeds {
            // A stable name from the bytes (FNV-1a, 64 bits, as hex).
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for &b in &s {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
            std::fs::write(dir.join(format!("seed-{h:016x}")), &s).unwrap();
        }
    }
}
