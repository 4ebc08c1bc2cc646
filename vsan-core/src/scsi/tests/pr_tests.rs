//! Persistent reservations through the logical unit and as a pure state.

use super::*;

fn prout(sa: u8, kind: u8, key: u64, sa_key: u64, flags: u8) -> ([u8; 10], Vec<u8>) {
    let mut c = [0u8; 10];
    c[0] = PR_OUT;
    c[1] = sa;
    c[2] = kind;
    c[8] = 24;
    let mut d = vec![0u8; 24];
    d[..8].copy_from_slice(&key.to_be_bytes());
    d[8..16].copy_from_slice(&sa_key.to_be_bytes());
    d[20] = flags;
    (c, d)
}

async fn pr(lu: &LogicalUnit, h: &NexusHandle, sa: u8, kind: u8, key: u64, sa_key: u64) -> Status {
    let (c, d) = prout(sa, kind, key, sa_key, 0);
    run(lu, h, &c, &d).await.status
}

async fn prin(lu: &LogicalUnit, h: &NexusHandle, sa: u8) -> Bytes {
    let r = run(lu, h, &[PR_IN, sa, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]).await;
    good(&r);
    r.data
}

const REGISTER: u8 = 0;
const RESERVE: u8 = 1;
const RELEASE: u8 = 2;
const CLEAR: u8 = 3;
const PREEMPT: u8 = 4;
const PREEMPT_ABORT: u8 = 5;
const REGISTER_IGNORE: u8 = 6;

#[tokio::test]
async fn pr_register_read_keys_and_generation() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    assert_eq!(pr(&lu, &a, REGISTER, 0, 0, 0xA).await, Status::Good);
    assert_eq!(
        pr(&lu, &b, REGISTER_IGNORE, 0, 0x99, 0xB).await,
        Status::Good
    );
    let d = prin(&lu, &a, 0).await;
    assert_eq!(be32(&d, 0), 2, "generation");
    assert_eq!(be32(&d, 4), 16);
    assert_eq!((be64(&d, 8), be64(&d, 16)), (0xA, 0xB));
    // Registering again with the wrong key conflicts; with the right one changes it.
    assert_eq!(
        pr(&lu, &a, REGISTER, 0, 0x5, 0xC).await,
        Status::ReservationConflict
    );
    assert_eq!(pr(&lu, &a, REGISTER, 0, 0xA, 0xC).await, Status::Good);
    // An unregistered nexus with a non-zero key conflicts.
    let c = attach(&lu, "c").await;
    assert_eq!(
        pr(&lu, &c, REGISTER, 0, 0x1, 0x2).await,
        Status::ReservationConflict
    );
    // Unregister.
    assert_eq!(pr(&lu, &a, REGISTER, 0, 0xC, 0).await, Status::Good);
    let d = prin(&lu, &a, 0).await;
    assert_eq!(be32(&d, 4), 8);
    assert_eq!(be32(&d, 0), 4);
    // Truncated READ KEYS keeps the full additional length.
    let r = run(&lu, &a, &[PR_IN, 0, 0, 0, 0, 0, 0, 0, 8, 0], &[]).await;
    assert_eq!(r.data.len(), 8);
    assert_eq!(be32(&r.data, 4), 8);
    // Bad service actions.
    assert_eq!(
        sense_of(&run(&lu, &a, &[PR_IN, 9, 0, 0, 0, 0, 0, 0, 8, 0], &[]).await),
        (5, 0x24, 0)
    );
    let (mut cdb, d) = prout(REGISTER, 0, 0, 1, 0);
    cdb[1] = 9;
    assert_eq!(sense_of(&run(&lu, &a, &cdb, &d).await), (5, 0x24, 0));
    let (mut cdb, d) = prout(REGISTER, 0, 0, 1, 0);
    cdb[8] = 20;
    assert_eq!(sense_of(&run(&lu, &a, &cdb, &d[..20]).await), (5, 0x1A, 0));
}

/// (reg read, reg write, unreg read, unreg write) per type, from SPC-4's tables.
const ACCESS: [(u8, [bool; 4]); 6] = [
    (1, [true, false, true, false]),
    (3, [false, false, false, false]),
    (5, [true, true, true, false]),
    (6, [true, true, false, false]),
    (7, [true, true, true, false]),
    (8, [true, true, false, false]),
];

#[tokio::test]
async fn pr_reservation_access_per_type() {
    for (kind, [rr, rw, ur, uw]) in ACCESS {
        let lu = lu();
        let a = attach(&lu, "a").await;
        let b = attach(&lu, "b").await;
        assert_eq!(pr(&lu, &a, REGISTER, 0, 0, 1).await, Status::Good);
        assert_eq!(pr(&lu, &b, REGISTER, 0, 0, 2).await, Status::Good);
        assert_eq!(pr(&lu, &a, RESERVE, kind, 1, 0).await, Status::Good);
        let d = prin(&lu, &a, 1).await;
        assert_eq!(be32(&d, 4), 16);
        let holder_key = if kind >= 7 { 0 } else { 1 };
        assert_eq!(be64(&d, 8), holder_key);
        assert_eq!(d[21], kind);
        let ok = |s: Status| s == Status::Good;
        let w = pattern(1, 1);
        assert!(ok(run(&lu, &a, &rw10(READ_10, 0, 1), &[]).await.status));
        assert!(ok(run(&lu, &a, &rw10(WRITE_10, 0, 1), &w).await.status));
        assert_eq!(
            ok(run(&lu, &b, &rw10(READ_10, 0, 1), &[]).await.status),
            rr,
            "type {kind}"
        );
        assert_eq!(
            ok(run(&lu, &b, &rw10(WRITE_10, 0, 1), &w).await.status),
            rw,
            "type {kind}"
        );
        assert_eq!(pr(&lu, &b, REGISTER, 0, 2, 0).await, Status::Good);
        let r = run(&lu, &b, &rw10(READ_10, 0, 1), &[]).await;
        assert_eq!(ok(r.status), ur, "type {kind}");
        if !ur {
            assert_eq!(r.status, Status::ReservationConflict);
        }
        assert_eq!(
            ok(run(&lu, &b, &rw10(WRITE_10, 0, 1), &w).await.status),
            uw,
            "type {kind}"
        );
        // INQUIRY, READ CAPACITY and TEST UNIT READY are never in conflict.
        good(&run(&lu, &b, &[INQUIRY, 0, 0, 0, 96, 0], &[]).await);
        good(&run(&lu, &b, &[READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).await);
        // RESERVE(6) while a persistent reservation exists conflicts.
        assert_eq!(
            run(&lu, &b, &[RESERVE_6, 0, 0, 0, 0, 0], &[]).await.status,
            Status::ReservationConflict
        );
        // Release with the wrong type is an invalid release.
        let wrong = if kind == 1 { 3 } else { 1 };
        let (c, d) = prout(RELEASE, wrong, 1, 0, 0);
        assert_eq!(sense_of(&run(&lu, &a, &c, &d).await), (5, 0x26, 0x04));
        assert_eq!(pr(&lu, &a, RELEASE, kind, 1, 0).await, Status::Good);
        good(&run(&lu, &b, &rw10(WRITE_10, 0, 1), &w).await);
    }
}

#[tokio::test]
async fn pr_reserve_ownership_and_conflicts() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    pr(&lu, &a, REGISTER, 0, 0, 1).await;
    pr(&lu, &b, REGISTER, 0, 0, 2).await;
    assert_eq!(pr(&lu, &a, RESERVE, 1, 1, 0).await, Status::Good);
    assert_eq!(
        pr(&lu, &a, RESERVE, 1, 1, 0).await,
        Status::Good,
        "same type again"
    );
    assert_eq!(
        pr(&lu, &a, RESERVE, 3, 1, 0).await,
        Status::ReservationConflict
    );
    assert_eq!(
        pr(&lu, &b, RESERVE, 1, 2, 0).await,
        Status::ReservationConflict
    );
    assert_eq!(
        pr(&lu, &a, RESERVE, 1, 7, 0).await,
        Status::ReservationConflict,
        "wrong key"
    );
    // Release by a non-holder is a no-op.
    assert_eq!(pr(&lu, &b, RELEASE, 1, 2, 0).await, Status::Good);
    assert_eq!(be32(&prin(&lu, &a, 1).await, 4), 16);
    // Bad type and scope.
    let (c, d) = prout(RESERVE, 2, 1, 0, 0);
    assert_eq!(sense_of(&run(&lu, &a, &c, &d).await), (5, 0x24, 0));
    let (c, d) = prout(RESERVE, 0x11, 1, 0, 0);
    assert_eq!(sense_of(&run(&lu, &a, &c, &d).await), (5, 0x24, 0));
    // The holder unregistering releases it.
    assert_eq!(pr(&lu, &a, REGISTER, 0, 1, 0).await, Status::Good);
    assert_eq!(be32(&prin(&lu, &b, 1).await, 4), 0);
}

#[tokio::test]
async fn pr_release_of_registrants_only_raises_reservations_released() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    pr(&lu, &a, REGISTER, 0, 0, 1).await;
    pr(&lu, &b, REGISTER, 0, 0, 2).await;
    pr(&lu, &a, RESERVE, 5, 1, 0).await;
    assert_eq!(pr(&lu, &a, RELEASE, 5, 1, 0).await, Status::Good);
    let r = run(&lu, &b, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x04));
    good(&run(&lu, &a, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn pr_clear_removes_everything_with_reservations_preempted() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    pr(&lu, &a, REGISTER, 0, 0, 1).await;
    pr(&lu, &b, REGISTER, 0, 0, 2).await;
    pr(&lu, &a, RESERVE, 3, 1, 0).await;
    assert_eq!(
        pr(&lu, &b, CLEAR, 0, 9, 0).await,
        Status::ReservationConflict
    );
    assert_eq!(pr(&lu, &b, CLEAR, 0, 2, 0).await, Status::Good);
    assert_eq!(be32(&prin(&lu, &b, 0).await, 4), 0);
    assert_eq!(be32(&prin(&lu, &b, 1).await, 4), 0);
    let r = run(&lu, &a, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x03));
    good(&run(&lu, &b, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn pr_preempt_takes_the_reservation_and_preempt_and_abort_aborts() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    let c = attach(&lu, "c").await;
    pr(&lu, &a, REGISTER, 0, 0, 1).await;
    pr(&lu, &b, REGISTER, 0, 0, 2).await;
    pr(&lu, &c, REGISTER, 0, 0, 3).await;
    pr(&lu, &a, RESERVE, 1, 1, 0).await;
    let wa = a.aborts();
    assert_eq!(pr(&lu, &b, PREEMPT_ABORT, 3, 2, 1).await, Status::Good);
    assert_eq!(wa.borrow().count, 1);
    let d = prin(&lu, &b, 1).await;
    assert_eq!((be64(&d, 8), d[21]), (2, 3));
    let keys = prin(&lu, &b, 0).await;
    assert_eq!(be32(&keys, 4), 16);
    let r = run(&lu, &a, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x05));
    // Preempting a key nobody has conflicts; key 0 without a reservation holder
    // match is an invalid field.
    assert_eq!(
        pr(&lu, &b, PREEMPT, 3, 2, 0x77).await,
        Status::ReservationConflict
    );
    let (cdb, d) = prout(PREEMPT, 3, 2, 0, 0);
    assert_eq!(sense_of(&run(&lu, &b, &cdb, &d).await), (5, 0x26, 0));
    // Preempt a non-holder's registration only.
    assert_eq!(pr(&lu, &b, PREEMPT, 3, 2, 3).await, Status::Good);
    assert_eq!(be32(&prin(&lu, &b, 0).await, 4), 8);
    // The unregistered cannot preempt (once its unit attentions are cleared).
    let r = run(&lu, &c, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x04));
    let r = run(&lu, &c, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x05));
    assert_eq!(
        pr(&lu, &c, PREEMPT, 3, 3, 2).await,
        Status::ReservationConflict
    );
}

#[tokio::test]
async fn pr_report_capabilities_and_full_status() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let caps = prin(&lu, &a, 2).await;
    assert_eq!(be16(&caps, 0), 8);
    assert_eq!(caps[2] & 0x01, 0, "no APTPL without a state file");
    assert_eq!(caps[3] & 0x80, 0x80, "TMV");
    assert_eq!((caps[4], caps[5]), (0xEA, 0x01));
    pr(&lu, &a, REGISTER, 0, 0, 0x42).await;
    pr(&lu, &a, RESERVE, 1, 0x42, 0).await;
    let d = prin(&lu, &a, 3).await;
    assert_eq!(be64(&d, 8), 0x42);
    assert_eq!(d[20] & 0x01, 1, "R_HOLDER");
    assert_eq!(d[21], 1);
    assert_eq!(be16(&d, 26), 1, "relative target port");
    let tid_len = be32(&d, 28) as usize;
    assert_eq!(&d[32..32 + tid_len], &a.nexus().transport_id[..]);
    // APTPL refused without a state file.
    let (c, data) = prout(REGISTER, 0, 0x42, 0x43, 0x01);
    assert_eq!(sense_of(&run(&lu, &a, &c, &data).await), (5, 0x26, 0));
}

#[tokio::test]
async fn pr_spec_i_pt_registers_the_named_initiators() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    let tid = b.nexus().transport_id.clone();
    let (mut c, mut d) = prout(REGISTER, 0, 0, 0x10, 0x08);
    d.extend_from_slice(&(tid.len() as u32).to_be_bytes());
    d.extend_from_slice(&tid);
    c[5..9].copy_from_slice(&(d.len() as u32).to_be_bytes());
    good(&run(&lu, &a, &c, &d).await);
    let keys = prin(&lu, &a, 0).await;
    assert_eq!(be32(&keys, 4), 16);
    // b is registered with the same key: it can reserve.
    assert_eq!(pr(&lu, &b, RESERVE, 1, 0x10, 0).await, Status::Good);
}

#[tokio::test]
async fn pr_state_persists_and_reloads_with_aptpl() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lu.state");
    let dev = device();
    {
        let lu = LogicalUnit::new(dev.clone(), config(Some(path.clone()))).unwrap();
        let a = attach(&lu, "a").await;
        let (c, d) = prout(REGISTER, 0, 0, 0x51, 0x01);
        good(&run(&lu, &a, &c, &d).await);
        assert_eq!(pr(&lu, &a, RESERVE, 5, 0x51, 0).await, Status::Good);
        assert_eq!(prin(&lu, &a, 2).await[3] & 0x01, 1, "PTPL_A");
    }
    let lu = LogicalUnit::new(dev.clone(), config(Some(path.clone()))).unwrap();
    let st = lu.pr_state();
    assert_eq!(st.registrations.len(), 1);
    assert_eq!(st.registrations[0].key, 0x51);
    assert_eq!(
        st.reservation.map(|r| r.kind),
        Some(PrType::WriteExclusiveRegistrantsOnly)
    );
    // The holder comes back through a new nexus and still holds it.
    let a = attach(&lu, "a").await;
    good(&run(&lu, &a, &rw10(WRITE_10, 0, 1), &pattern(1, 1)).await);
    let b = attach(&lu, "b").await;
    assert_eq!(
        run(&lu, &b, &rw10(WRITE_10, 0, 1), &pattern(1, 1))
            .await
            .status,
        Status::ReservationConflict
    );
    // Without APTPL the state does not survive a restart.
    let (c, d) = prout(REGISTER, 0, 0x51, 0x52, 0x00);
    good(&run(&lu, &a, &c, &d).await);
    drop((a, b, lu));
    let lu = LogicalUnit::new(dev.clone(), config(Some(path.clone()))).unwrap();
    assert!(lu.pr_state().registrations.is_empty());
    // A corrupt file is a typed error.
    std::fs::write(&path, b"VSPR\x00\x01garbage").unwrap();
    let e = LogicalUnit::new(dev.clone(), config(Some(path.clone()))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    std::fs::write(&path, b"nonsense").unwrap();
    let e = LogicalUnit::new(dev, config(Some(path))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
}

#[test]
fn pr_state_encoding_round_trips_and_detects_damage() {
    let mut st = PrState::new();
    let a = nexus("a");
    let b = nexus("b");
    let op = |action, kind, key, sa_key| pr::PrOut {
        action,
        kind,
        scope: 0,
        key,
        sa_key,
        spec_i_pt: false,
        all_tg_pt: false,
        aptpl: true,
        transport_ids: vec![],
    };
    st.apply(&a, &op(pr::PrAction::Register, 0, 0, 7), true)
        .unwrap();
    st.apply(&b, &op(pr::PrAction::Register, 0, 0, 8), true)
        .unwrap();
    st.apply(&a, &op(pr::PrAction::Reserve, 6, 7, 0), true)
        .unwrap();
    let bytes = st.encode();
    assert_eq!(PrState::decode(&bytes).unwrap(), st);
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x40;
        assert!(PrState::decode(&bad).is_err(), "flip at {i}");
    }
    for n in 0..bytes.len() {
        assert!(PrState::decode(&bytes[..n]).is_err());
    }
    // A failed operation changes nothing.
    let before = st.clone();
    assert_eq!(
        st.apply(&b, &op(pr::PrAction::Reserve, 6, 99, 0), true),
        Err(pr::PrError::Conflict)
    );
    assert_eq!(st, before);
}

#[tokio::test]
async fn random_cdbs_never_panic() {
    use rand::{Rng, SeedableRng};
    let lu = lu();
    let h = lu.attach(nexus("a"));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(19);
    let ops: Vec<u8> = SUPPORTED.iter().map(|i| i.opcode).collect();
    for i in 0..20000 {
        let len = rng.random_range(0..=16);
        let mut cdb: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if i % 2 == 0 && !cdb.is_empty() {
            cdb[0] = ops[rng.random_range(0..ops.len())];
        }
        // Keep the transfers small so the loop stays quick.
        if cdb.len() > 9 && rng.random_bool(0.8) {
            for b in &mut cdb[2..] {
                *b &= 0x03;
            }
        }
        let dir = lu.inspect(&cdb);
        let data_len = match dir {
            Ok(Direction::Out(n)) => (n as usize).min(1 << 16),
            _ => rng.random_range(0..64),
        };
        let data: Vec<u8> = (0..data_len).map(|_| rng.random()).collect();
        let r = lu
            .execute(
                &h,
                Command {
                    cdb: Bytes::from(cdb),
                    data_out: Bytes::from(data),
                    expected_in: 4096,
                },
            )
            .await;
        if r.status == Status::CheckCondition {
            assert!(r.sense.len() >= 8);
        }
    }
}

#[test]
fn random_pr_operations_keep_the_state_consistent() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(20);
    let nexuses: Vec<Nexus> = (0..4).map(|i| nexus(&format!("n{i}"))).collect();
    let actions = [
        pr::PrAction::Register,
        pr::PrAction::Reserve,
        pr::PrAction::Release,
        pr::PrAction::Clear,
        pr::PrAction::Preempt,
        pr::PrAction::PreemptAndAbort,
        pr::PrAction::RegisterAndIgnore,
    ];
    let mut st = PrState::new();
    for _ in 0..20000 {
        let from = &nexuses[rng.random_range(0..nexuses.len())];
        let op = pr::PrOut {
            action: actions[rng.random_range(0..actions.len())],
            kind: rng.random_range(0..10),
            scope: u8::from(rng.random_bool(0.05)),
            key: rng.random_range(0..4),
            sa_key: rng.random_range(0..4),
            spec_i_pt: false,
            all_tg_pt: rng.random_bool(0.1),
            aptpl: rng.random_bool(0.5),
            transport_ids: vec![],
        };
        let before = st.clone();
        match st.apply(from, &op, true) {
            Ok(fx) => {
                if !fx.changed {
                    assert_eq!(st.registrations, before.registrations);
                }
            }
            Err(_) => assert_eq!(st, before, "a failed operation changed the state"),
        }
        // Invariants: a single-holder reservation names a registration; nexuses are
        // registered at most once; the encoding round-trips.
        if let Some(res) = st.reservation {
            if !res.kind.all_registrants() {
                assert!(st.registrations.iter().any(|r| r.id == res.holder));
            } else {
                assert!(!st.registrations.is_empty());
            }
        }
        for n in &nexuses {
            assert!(st.registrations.iter().filter(|r| r.matches(n)).count() <= 1);
        }
        assert_eq!(PrState::decode(&st.encode()).unwrap(), st);
    }
}

#[tokio::test]
async fn an_installed_pr_state_is_enforced_and_reported() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    // Build the state another node would have replicated: a holds WE.
    let mut st = PrState::new();
    let reg = |key| pr::PrOut {
        action: pr::PrAction::Register,
        kind: 0,
        scope: 0,
        key: 0,
        sa_key: key,
        spec_i_pt: false,
        all_tg_pt: false,
        aptpl: false,
        transport_ids: vec![],
    };
    st.apply(a.nexus(), &reg(0xA), false).unwrap();
    let mut res = reg(0);
    res.action = pr::PrAction::Reserve;
    res.key = 0xA;
    res.kind = 1;
    st.apply(a.nexus(), &res, false).unwrap();
    lu.install_pr_state(st.clone()).await.unwrap();
    assert_eq!(lu.pr_state(), st);
    assert_eq!(be64(&prin(&lu, &b, 0).await, 8), 0xA);
    let w = pattern(1, 1);
    assert_eq!(
        run(&lu, &b, &rw10(WRITE_10, 0, 1), &w).await.status,
        Status::ReservationConflict
    );
    good(&run(&lu, &a, &rw10(WRITE_10, 0, 1), &w).await);
    lu.install_pr_state(PrState::new()).await.unwrap();
    good(&run(&lu, &b, &rw10(WRITE_10, 0, 1), &w).await);
}

#[tokio::test]
async fn a_replicated_pr_out_raises_the_unit_attentions_here() {
    // Node 2's view: b is attached here; a registered and preempts through node 1.
    let lu = lu();
    let b = attach(&lu, "b").await;
    let a_remote = nexus("a");
    assert_eq!(pr(&lu, &b, REGISTER, 0, 0, 2).await, Status::Good);
    let op = |action, key, sa_key| pr::PrOut {
        action,
        kind: 1,
        scope: 0,
        key,
        sa_key,
        spec_i_pt: false,
        all_tg_pt: false,
        aptpl: false,
        transport_ids: vec![],
    };
    lu.apply_replicated_pr_out(&a_remote, &op(pr::PrAction::Register, 0, 1))
        .await
        .unwrap();
    lu.apply_replicated_pr_out(&a_remote, &op(pr::PrAction::Reserve, 1, 0))
        .await
        .unwrap();
    let wb = b.aborts();
    lu.apply_replicated_pr_out(&a_remote, &op(pr::PrAction::PreemptAndAbort, 1, 2))
        .await
        .unwrap();
    assert_eq!(wb.borrow().count, 1);
    let r = run(&lu, &b, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x05));
    assert_eq!(
        run(&lu, &b, &rw10(WRITE_10, 0, 1), &pattern(1, 1))
            .await
            .status,
        Status::ReservationConflict
    );
    assert_eq!(
        lu.apply_replicated_pr_out(&a_remote, &op(pr::PrAction::Clear, 9, 0))
            .await,
        Err(pr::PrError::Conflict)
    );
}

#[tokio::test]
async fn a_pr_store_replaces_the_state_file_and_its_failure_fails_the_command() {
    struct Store(
        parking_lot::Mutex<Vec<PrState>>,
        std::sync::atomic::AtomicBool,
    );
    impl PrStore for Store {
        fn save<'a>(&'a self, state: &'a PrState) -> crate::device::IoFuture<'a, ()> {
            let fail = self.1.load(std::sync::atomic::Ordering::Relaxed);
            if !fail {
                self.0.lock().push(state.clone());
            }
            Box::pin(async move {
                if fail {
                    Err(crate::Error::new(ErrorKind::Io, "peer gone"))
                } else {
                    Ok(())
                }
            })
        }
    }
    let lu = lu();
    let store = Arc::new(Store(Default::default(), Default::default()));
    lu.set_pr_store(store.clone());
    let a = attach(&lu, "a").await;
    assert_eq!(prin(&lu, &a, 2).await[2] & 0x01, 1, "PTPL_C with a store");
    let (c, d) = prout(REGISTER, 0, 0, 5, 0x01);
    good(&run(&lu, &a, &c, &d).await);
    assert_eq!(store.0.lock().len(), 1);
    assert!(store.0.lock()[0].aptpl);
    store.1.store(true, std::sync::atomic::Ordering::Relaxed);
    let r = run(
        &lu,
        &a,
        &prout(REGISTER, 0, 5, 6, 0).0,
        &prout(REGISTER, 0, 5, 6, 0).1,
    )
    .await;
    assert_eq!(sense_of(&r), (4, 0x44, 0));
    assert_eq!(
        lu.pr_state().registrations[0].key,
        5,
        "unchanged when not saved"
    );
}
