//! State-machine property tests: a generated sequence of operations (reads, writes, FUA
//! writes, flushes, discards, write_zeroes, bad input, injected errors, power cuts,
//! reopening) runs against a device and the [`DiskModel`] side by side. After every step
//! the result (bytes or error kind) and the whole device image must match the model; after
//! a power cut the image must be one the model allows.
//!
//! On failure proptest prints the minimal sequence of steps and records its seed under
//! `proptest-regressions/`.

use std::path::PathBuf;

use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestCaseError};
use vsan_core::{
    BlockDevice, ErrorKind, FaultConfig, FaultyDevice, FileDevice, FileOptions, Geometry, IoFlags,
    MemDevice, OpKind, PowerCut,
};
use vsan_proptests::DiskModel;

const BS: u64 = 512;
const BLOCKS: u64 = 64;
const SIZE: u64 = BS * BLOCKS;
/// Maximum request of the in-memory devices, in blocks (FileDevice has the default 32 MiB).
const MAX_BLOCKS: u64 = 8;

/// One generated operation.
#[derive(Debug, Clone)]
enum Step {
    Read {
        offset: u64,
        len: u64,
    },
    Write {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Flush,
    /// FaultyDevice only: this write-like request fails with an injected error (unless it
    /// is bad input, which is refused first) and must change nothing.
    Injected {
        op: OpKind,
        offset: u64,
        len: u64,
        fua: bool,
    },
    /// FaultyDevice only.
    PowerCut(PowerCut),
    /// FileDevice only: close and open the file again.
    Reopen,
}

/// Offsets: mostly valid block offsets, plus the edges and garbage.
fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        32 => (0..BLOCKS).prop_map(|b| b * BS),
        1 => 0..SIZE + 2 * BS,
        1 => (0..3u64).prop_map(|k| SIZE + k * BS),
        1 => (1..4u64).prop_map(|k| u64::MAX - k * BS + 1),
        1 => any::<u64>(),
    ]
}

/// Lengths that a write can carry: mostly valid, plus zero, misaligned and oversized.
fn write_len() -> impl Strategy<Value = u64> {
    prop_oneof![
        32 => (1..=MAX_BLOCKS).prop_map(|b| b * BS),
        1 => Just(0),
        1 => 1..(MAX_BLOCKS + 2) * BS,
        1 => (MAX_BLOCKS + 1..=BLOCKS + 2).prop_map(|b| b * BS),
    ]
}

/// Lengths of reads, discards and write_zeroes: also ones no buffer could hold.
fn any_len() -> impl Strategy<Value = u64> {
    prop_oneof![
        16 => write_len(),
        1 => (MAX_BLOCKS + 1..=BLOCKS).prop_map(|b| b * BS),
        1 => (1..3u64).prop_map(|k| u64::MAX - k * BS + 1),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Plain,
    Faulty,
    File,
}

fn step(kind: Kind) -> BoxedStrategy<Step> {
    let common = prop_oneof![
        6 => (offset(), any_len()).prop_map(|(offset, len)| Step::Read { offset, len }),
        8 => (offset(), write_len(), prop::bool::weighted(0.2))
            .prop_map(|(offset, len, fua)| Step::Write { offset, len, fua }),
        2 => (offset(), any_len()).prop_map(|(offset, len)| Step::Discard { offset, len }),
        2 => (offset(), any_len(), any::<bool>())
            .prop_map(|(offset, len, fua)| Step::WriteZeroes { offset, len, fua }),
        2 => Just(Step::Flush),
    ];
    match kind {
        Kind::Plain => common.boxed(),
        Kind::File => prop_oneof![20 => common, 1 => Just(Step::Reopen)].boxed(),
        Kind::Faulty => prop_oneof![
            20 => common,
            2 => (
                prop::sample::select(vec![OpKind::Write, OpKind::Discard, OpKind::WriteZeroes]),
                offset(),
                write_len(),
                any::<bool>(),
            )
                .prop_map(|(op, offset, len, fua)| Step::Injected { op, offset, len, fua }),
            2 => prop_oneof![
                Just(PowerCut::DropUnflushed),
                Just(PowerCut::KeepUnflushed),
                any::<u64>().prop_map(|seed| PowerCut::Tear { seed }),
            ]
            .prop_map(Step::PowerCut),
        ]
        .boxed(),
    }
}

/// Write data unique to this step and block, so a stale or misplaced block shows.
fn data(step: usize, offset: u64, len: u64) -> Bytes {
    let mut out = vec![0u8; len as usize];
    for (i, chunk) in out.chunks_mut(BS as usize).enumerate() {
        let tag = ((step as u64) << 32) | (offset / BS + i as u64);
        for (j, byte) in chunk.iter_mut().enumerate() {
            *byte = (tag.rotate_left(j as u32 % 64) as u8) ^ (j as u8) ^ (step as u8);
        }
        let n = chunk.len().min(8);
        chunk[..n].copy_from_slice(&tag.to_le_bytes()[..n]);
    }
    Bytes::from(out)
}

/// The devices under test: a closed set, so an enum.
enum Target {
    Mem(MemDevice),
    File {
        dev: FileDevice,
        path: PathBuf,
        _dir: tempfile::TempDir,
    },
    Faulty(FaultyDevice<MemDevice>),
    FaultyFile {
        dev: FaultyDevice<FileDevice>,
        _dir: tempfile::TempDir,
    },
}

impl Target {
    fn mem_geometry() -> Geometry {
        Geometry::with_max_io(SIZE, BS as u32, (MAX_BLOCKS * BS) as u32).unwrap()
    }

    fn new_file() -> (FileDevice, PathBuf, tempfile::TempDir) {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let path = dir.path().join("disk.img");
        let dev = FileOptions::new().create(SIZE).open(&path).unwrap();
        (dev, path, dir)
    }

    fn dev(&self) -> &dyn BlockDevice {
        match self {
            Target::Mem(d) => d,
            Target::File { dev, .. } => dev,
            Target::Faulty(d) => d,
            Target::FaultyFile { dev: d, .. } => d,
        }
    }

    async fn power_cut(&self, cut: PowerCut) -> vsan_core::Result<()> {
        match self {
            Target::Faulty(d) => d.power_cut(cut).await,
            Target::FaultyFile { dev: d, .. } => d.power_cut(cut).await,
            _ => unreachable!("power cuts are generated for FaultyDevice only"),
        }
    }

    fn set_faults(&self, faults: Option<FaultConfig>) {
        match (self, faults) {
            (Target::Faulty(d), Some(f)) => d.set_faults(f),
            (Target::Faulty(d), None) => d.clear_faults(),
            (Target::FaultyFile { dev: d, .. }, Some(f)) => d.set_faults(f),
            (Target::FaultyFile { dev: d, .. }, None) => d.clear_faults(),
            _ => unreachable!("faults are generated for FaultyDevice only"),
        }
    }
}

async fn image(dev: &dyn BlockDevice) -> Result<Vec<u8>, TestCaseError> {
    let g = dev.geometry();
    let chunk = u64::from(g.max_io()).min(g.size());
    let mut out = Vec::with_capacity(g.size() as usize);
    let mut pos = 0;
    while pos < g.size() {
        let n = chunk.min(g.size() - pos);
        let got = dev
            .read(pos, n as usize)
            .await
            .map_err(|e| TestCaseError::fail(format!("reading the image: {e}")))?;
        out.extend_from_slice(&got);
        pos += n;
    }
    Ok(out)
}

fn same<T: PartialEq + std::fmt::Debug>(
    i: usize,
    step: &Step,
    got: Result<T, ErrorKind>,
    want: Result<T, ErrorKind>,
) -> Result<(), TestCaseError> {
    if got != want {
        let show = |r: &Result<T, ErrorKind>| match r {
            Ok(v) => format!("Ok({:.200})", format!("{v:?}")),
            Err(k) => format!("Err({k:?})"),
        };
        return Err(TestCaseError::fail(format!(
            "step {i} {step:?}: device answered {}, model {}",
            show(&got),
            show(&want)
        )));
    }
    Ok(())
}

async fn run(mut target: Target, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut model = DiskModel::new(SIZE, BS as u32, target.dev().geometry().max_io());
    let kind = |r: vsan_core::Result<()>| r.map_err(|e| e.kind());
    for (i, step) in steps.iter().enumerate() {
        let flags = |fua: bool| if fua { IoFlags::FUA } else { IoFlags::empty() };
        match *step {
            Step::Read { offset, len } => {
                let got = target.dev().read(offset, len as usize).await;
                let got = got.map(|b| b.to_vec()).map_err(|e| e.kind());
                same(i, step, got, model.read(offset, len))?;
            }
            Step::Write { offset, len, fua } => {
                let d = data(i, offset, len);
                let got = kind(target.dev().write(offset, d.clone(), flags(fua)).await);
                same(i, step, got, model.write(offset, &d, fua))?;
            }
            Step::Discard { offset, len } => {
                let got = kind(target.dev().discard(offset, len, IoFlags::empty()).await);
                same(i, step, got, model.discard(offset, len))?;
            }
            Step::WriteZeroes { offset, len, fua } => {
                let got = kind(target.dev().write_zeroes(offset, len, flags(fua)).await);
                same(i, step, got, model.write_zeroes(offset, len, fua))?;
            }
            Step::Flush => {
                same(i, step, kind(target.dev().flush().await), Ok(()))?;
                model.flush();
            }
            Step::Injected {
                op,
                offset,
                len,
                fua,
            } => {
                target.set_faults(Some(
                    FaultConfig::new()
                        .ops(&[op])
                        .limit(1)
                        .kind(ErrorKind::NoSpace),
                ));
                let dev = target.dev();
                let (got, valid) = match op {
                    OpKind::Write => (
                        dev.write(offset, data(i, offset, len), flags(fua)).await,
                        model.check(true, offset, len),
                    ),
                    OpKind::Discard => (
                        dev.discard(offset, len, IoFlags::empty()).await,
                        model.check(false, offset, len),
                    ),
                    _ => (
                        dev.write_zeroes(offset, len, flags(fua)).await,
                        model.check(false, offset, len),
                    ),
                };
                target.set_faults(None);
                // Bad input is refused first; good input gets the injected error.
                let want = Err(valid.err().unwrap_or(ErrorKind::NoSpace));
                same(i, step, kind(got), want)?;
            }
            Step::PowerCut(cut) => {
                target
                    .power_cut(cut)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {i} {step:?}: {e}")))?;
                match cut {
                    PowerCut::DropUnflushed => model.power_cut_drop(),
                    PowerCut::KeepUnflushed => model.power_cut_keep(),
                    PowerCut::Tear { .. } => {
                        let img = image(target.dev()).await?;
                        model
                            .check_torn(&img)
                            .map_err(|e| TestCaseError::fail(format!("step {i} {step:?}: {e}")))?;
                        model.adopt(&img);
                    }
                }
            }
            Step::Reopen => {
                if let Target::File { dev, path, .. } = &mut target {
                    *dev = FileDevice::open(&*path)
                        .map_err(|e| TestCaseError::fail(format!("reopen: {e}")))?;
                }
            }
        }
        // The whole device, every step: bad input and injected errors changed nothing,
        // and nothing outside a request's range moved.
        let img = image(target.dev()).await?;
        if img != model.volatile_image() {
            let bad = img
                .chunks(BS as usize)
                .zip(model.volatile_image().chunks(BS as usize))
                .position(|(a, b)| a != b);
            return Err(TestCaseError::fail(format!(
                "after step {i} {step:?}: block {bad:?} differs from the model"
            )));
        }
    }
    // What was flushed is in the file after closing it; the FaultyDevice's inner device
    // holds exactly the durable image once nothing is in flight.
    match &target {
        Target::File { path, .. } => {
            let dev = FileDevice::open(path).unwrap();
            prop_assert!(image(&dev).await? == model.volatile_image());
        }
        Target::Faulty(d) => prop_assert!(image(d.inner()).await? == model.durable_image()),
        Target::FaultyFile { dev: d, .. } => {
            prop_assert!(image(d.inner()).await? == model.durable_image())
        }
        Target::Mem(_) => {}
    }
    Ok(())
}

fn block_on(
    fut: impl std::future::Future<Output = Result<(), TestCaseError>>,
) -> Result<(), TestCaseError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(fut)
}

/// `cases` cases in release builds (about 8 s in all on two cores), a quarter of that in
/// debug builds, or `PROPTEST_CASES` when set (for a long soak). A failing case's seed is
/// saved beside this file (`device_model.proptest-regressions`) and replayed first on the
/// next run.
fn config(cases: u32) -> ProptestConfig {
    let default = ProptestConfig::default();
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() {
        default.cases
    } else if cfg!(debug_assertions) {
        cases / 4
    } else {
        cases
    };
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..default
    }
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn mem_device_matches_model(steps in prop::collection::vec(step(Kind::Plain), 1..64)) {
        block_on(run(Target::Mem(MemDevice::new(Target::mem_geometry())), &steps))?;
    }

    #[test]
    fn faulty_mem_device_matches_model(
        steps in prop::collection::vec(step(Kind::Faulty), 1..80),
    ) {
        let dev = FaultyDevice::new(MemDevice::new(Target::mem_geometry()));
        block_on(run(Target::Faulty(dev), &steps))?;
    }
}

proptest! {
    // Every flush and FUA write is an fdatasync: fewer cases.
    #![proptest_config(config(256))]

    #[test]
    fn file_device_matches_model(steps in prop::collection::vec(step(Kind::File), 1..48)) {
        let (dev, path, dir) = Target::new_file();
        block_on(run(Target::File { dev, path, _dir: dir }, &steps))?;
    }

    #[test]
    fn faulty_file_device_matches_model(
        steps in prop::collection::vec(step(Kind::Faulty), 1..48),
    ) {
        let (dev, _path, dir) = Target::new_file();
        let dev = FaultyDevice::new(dev);
        block_on(run(Target::FaultyFile { dev, _dir: dir }, &steps))?;
    }
}
