//! The deterministic simulation of a mirrored pair (see `vsan_proptests::sim` for what is
//! simulated and checked), run over many seeds. A plain program (`harness = false`): it
//! prints what it ran under a plain `cargo test`, and a failing part panics (exit 101).
//!
//! - `seeds`: seeds `SIM_SEED_BASE..+SIM_SEEDS` (default 0..10000) on every core; prints
//!   how many ran and what they did. With `SOAK=<minutes>` it runs new seeds (from a
//!   random base, printed) for that long instead.
//! - `replay`: `SIM_SEED=<seed>` replays one seed, printing its trace (without it, seed 1
//!   is replayed with its trace kept in memory).
//! - `regressions`: seeds that once found bugs, kept as tests.
//! - `scsi_seeds`: the SCSI runs (`sim::scsi`), seeds `SIM_SEED_BASE..+SIM_SCSI_SEEDS`
//!   (default 0..2000); `SIM_SCSI=1` makes `replay` replay a SCSI seed.
//! - `scsi_shuffled`: the same seeds with the units' tasks woken at one instant polled
//!   in a seeded order (`sim::run_scsi_shuffled`); `SIM_SCSI=shuffled` replays one.
//! - `a_lying_disk_is_caught`: the harness can fail: a data device that acknowledges
//!   flushes without making anything durable loses acknowledged writes, and some seed
//!   shows it.
//!
//! A failure prints the seed and the command that replays it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vsan_proptests::sim::{self, Failure, Outcome, Sabotage};

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

#[derive(Default)]
struct Totals {
    runs: u64,
    writes: u64,
    writes_ok: u64,
    reads: u64,
    faults: u64,
    sim_time: Duration,
    events: u64,
    scsi: sim::scsi::Stats,
}

impl Totals {
    fn add(&mut self, o: &Outcome) {
        self.runs += 1;
        self.writes += o.writes as u64;
        self.writes_ok += o.writes_ok as u64;
        self.reads += o.reads;
        self.faults += u64::from(o.faults);
        self.sim_time += o.sim_time;
        self.events += o.events;
        self.scsi.caw_won += o.scsi.caw_won;
        self.scsi.caw_miscompared += o.scsi.caw_miscompared;
        self.scsi.conflicts += o.scsi.conflicts;
        self.scsi.pr_good += o.scsi.pr_good;
    }
}

/// Run seeds from `next` through `run` until `more` says stop, on every core; returns
/// the totals and the failures (at most a few: the run stops at the first).
fn run_seeds(
    next: &AtomicU64,
    more: &(dyn Fn(u64) -> bool + Sync),
    run: &(dyn Fn(u64) -> Result<Outcome, Failure> + Sync),
) -> (Totals, Vec<Failure>) {
    let totals = Mutex::new(Totals::default());
    let failures = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads() {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if !more(seed) {
                        break;
                    }
                    match run(seed) {
                        Ok(o) => totals.lock().unwrap().add(&o),
                        Err(f) => {
                            stop.store(true, Ordering::Relaxed);
                            failures.lock().unwrap().push(f);
                        }
                    }
                }
            });
        }
    });
    (totals.into_inner().unwrap(), failures.into_inner().unwrap())
}

/// The failures, each with its seed and replay command.
fn report(failures: &[Failure]) -> String {
    failures.iter().map(|f| f.to_string()).collect()
}

/// Seeds run by default.
const DEFAULT_SEEDS: u64 = 10_000;

fn seeds() {
    let started = Instant::now();
    let (totals, failures, what) = if let Some(minutes) = env_u64("SOAK") {
        let base = env_u64("SIM_SEED_BASE").unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        });
        println!("simulation soak: {minutes} minute(s), seeds from {base}");
        let until = started + Duration::from_secs(minutes * 60);
        let next = AtomicU64::new(base);
        let (t, f) = run_seeds(&next, &|_| Instant::now() < until, &sim::run);
        (t, f, format!("soak from seed {base}"))
    } else {
        let base = env_u64("SIM_SEED_BASE").unwrap_or(0);
        let count = env_u64("SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
        let next = AtomicU64::new(base);
        let end = base + count;
        let (t, f) = run_seeds(&next, &|s| s < end, &sim::run);
        (t, f, format!("seeds {base}..{end}"))
    };
    let took = started.elapsed();
    println!(
        "simulation: {} seeds passed ({what}) in {:.1} s on {} threads: {} writes ({} acknowledged), \
         {} reads checked, {} faults injected, {:.0} s simulated, {} events",
        totals.runs,
        took.as_secs_f64(),
        threads(),
        totals.writes,
        totals.writes_ok,
        totals.reads,
        totals.faults,
        totals.sim_time.as_secs_f64(),
        totals.events
    );
    assert!(failures.is_empty(), "{}", report(&failures));
    assert!(totals.runs > 0, "no seed ran");
    assert!(
        totals.writes_ok > 0 && totals.reads > 0 && totals.faults > 0,
        "the runs did no work"
    );
}

fn replay() {
    let (seed, print) = match env_u64("SIM_SEED") {
        Some(s) => (s, true),
        None => (1, false),
    };
    let r = if std::env::var("SIM_SCSI").is_ok_and(|v| v == "shuffled") {
        sim::run_scsi_shuffled(seed, print)
    } else if std::env::var_os("SIM_SCSI").is_some() {
        sim::run_scsi(seed, print)
    } else {
        sim::run_with(seed, Sabotage::None, print)
    };
    match r {
        Ok(o) => println!("seed {seed} passed: {o:?}"),
        Err(f) => panic!("{f}"),
    }
}

/// SCSI seeds run by default.
const DEFAULT_SCSI_SEEDS: u64 = 2_000;

/// The SCSI simulation (`sim::scsi`): seeds `SIM_SEED_BASE..+SIM_SCSI_SEEDS` (default
/// 0..2000).
fn scsi_seeds() {
    scsi_runs(&|seed| sim::run_scsi(seed, false));
}

/// [`scsi_seeds`] with the tasks of one instant polled in a seeded order.
fn scsi_shuffled() {
    scsi_runs(&|seed| sim::run_scsi_shuffled(seed, false));
}

fn scsi_runs(run: &(dyn Fn(u64) -> Result<sim::Outcome, sim::Failure> + Sync)) {
    let started = Instant::now();
    let base = env_u64("SIM_SEED_BASE").unwrap_or(0);
    let count = env_u64("SIM_SCSI_SEEDS").unwrap_or(DEFAULT_SCSI_SEEDS);
    let next = AtomicU64::new(base);
    let end = base + count;
    let (totals, failures) = run_seeds(&next, &|s| s < end, run);
    let stats = totals.scsi;
    println!(
        "simulation: {} SCSI seeds passed (seeds {base}..{end}) in {:.1} s: {} writes ({} \
         acknowledged), {} reads checked, {} faults, {} COMPARE AND WRITEs won, {} \
         miscompared, {} reservation conflicts, {} PR OUTs acknowledged",
        totals.runs,
        started.elapsed().as_secs_f64(),
        totals.writes,
        totals.writes_ok,
        totals.reads,
        totals.faults,
        stats.caw_won,
        stats.caw_miscompared,
        stats.conflicts,
        stats.pr_good
    );
    assert!(failures.is_empty(), "{}", report(&failures));
    assert!(totals.runs > 0, "no seed ran");
    assert!(
        stats.caw_won > 0 && stats.caw_miscompared > 0 && stats.conflicts > 0 && stats.pr_good > 0,
        "the SCSI runs did not exercise what they check: {stats:?}"
    );
}

/// Seeds that catch a defect, with the patch in `proptests/sabotage/` that puts the
/// defect back (`proptests/sabotage/run.sh <patch>` shows the seed failing; TESTING.md
/// says what each was). On the real code they must pass.
const REGRESSIONS: &[(u64, &str)] = &[
    (1, "no-peer-ack-wait"),
    (2, "fixed-restarted-node-serves-unproven"),
    (4, "no-bitmap-marks"),
    (15, "fixed-failure-alone-distrusts-only-copy"),
    (36, "fixed-sync-timer-spins"),
    (62, "fixed-incomplete-target-acks-alone"),
    (107, "fixed-inconsistent-read-without-grant"),
    (142, "fixed-target-read-before-source-bitmap"),
    (152, "fixed-write-failed-alone-acked-by-peer"),
    (1005, "fixed-resolver-acks-before-winner"),
    (1324, "fixed-peer-detached-not-announced"),
    (2698, "fixed-first-sync-target-stuck"),
    (3046, "fixed-detached-target-waits-forever"),
    (15365, "fixed-flush-on-incomplete-copy"),
    (26478, "fixed-source-fails-as-resync-ends"),
    (28966, "fixed-resent-write-not-marked"),
];

/// The same for the SCSI runs (`sim::run_scsi`; `SIM_PARTS=scsi_seeds` in run.sh).
const SCSI_REGRESSIONS: &[(u64, &str)] = &[
    (1, "scsi-pr-one-node"),
    (1, "scsi-caw-local-only"),
    (1, "fixed-preempt-and-abort-does-not-wait"),
    (362, "fixed-pr-alone-after-link-returned"),
    (13, "fixed-forward-lost-refusal-definite"),
    (85, "fixed-pr-alone-without-commit"),
    (37, "fixed-forwarded-pr-applied-twice"),
    (232, "fixed-pr-decided-by-running-sync"),
    (18, "fixed-held-writes-land-after-fence"),
    (11, "fixed-waiting-write-admitted-on-old-link"),
    (1643, "fixed-caw-admitted-on-old-link"),
    (16977, "fixed-forwarded-pr-out-applied-over-new-link"),
    (16977, "fixed-pr-out-over-new-link-acked"),
    (1, "scsi-caw-writes-ignore-grants"),
    (1, "scsi-caw-grant-without-drain"),
    (1, "scsi-caw-revoke-without-wait"),
    (17, "scsi-caw-revoke-clears-newer-grant"),
];

/// The same for the SCSI runs with the tasks of an instant in a seeded order
/// (`sim::run_scsi_shuffled`; `SIM_PARTS=scsi_shuffled` in run.sh).
const SCSI_SHUFFLED_REGRESSIONS: &[(u64, &str)] = &[
    (1, "scsi-caw-void-grant-kept"),
    (8115, "fixed-flush-alone-ends-while-connected"),
];

fn regressions() {
    for &(seed, patch) in REGRESSIONS {
        if let Err(f) = sim::run(seed) {
            panic!("seed {seed} (kept for {patch}.patch): {f}");
        }
    }
    for &(seed, patch) in SCSI_REGRESSIONS {
        if let Err(f) = sim::run_scsi(seed, false) {
            panic!("SCSI seed {seed} (kept for {patch}.patch): {f}");
        }
    }
    for &(seed, patch) in SCSI_SHUFFLED_REGRESSIONS {
        if let Err(f) = sim::run_scsi_shuffled(seed, false) {
            panic!("shuffled SCSI seed {seed} (kept for {patch}.patch): {f}");
        }
    }
}

fn a_lying_disk_is_caught() {
    let next = AtomicU64::new(0);
    let (totals, failures) = run_seeds(&next, &|s| s < 3000, &|seed| {
        sim::run_with(seed, Sabotage::LyingFlush, false)
    });
    let Some(f) = failures.first() else {
        panic!(
            "{} seeds with a data device that ignores flushes all passed: the checks are blind",
            totals.runs
        );
    };
    println!("caught after {} passing seeds: {f}", totals.runs);
    // The same seed passes on an honest disk, so it is the lie that was caught.
    if let Err(honest) = sim::run(f.seed) {
        panic!("seed {} also fails without the sabotage: {honest}", f.seed);
    }
}

/// The parts of this binary, by name.
const PARTS: [(&str, fn()); 6] = [
    ("seeds", seeds),
    ("scsi_seeds", scsi_seeds),
    ("scsi_shuffled", scsi_shuffled),
    ("replay", replay),
    ("regressions", regressions),
    ("a_lying_disk_is_caught", a_lying_disk_is_caught),
];

/// A plain `main` (`harness = false` in Cargo.toml), so the seed count and totals are
/// printed under a plain `cargo test` (the test harness would capture them). Arguments
/// that do not start with `-` select parts by substring, as test filters do; options
/// cargo passes (`--nocapture`, `--quiet`, ...) are ignored.
fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut ran = 0;
    for (name, part) in PARTS {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        println!("simulation: {name} ...");
        part();
        println!("simulation: {name} ok");
        ran += 1;
    }
    println!("simulation: {ran} part(s) passed");
}
