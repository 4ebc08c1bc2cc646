//! The Go binding in `examples/go` (package `vsan` over cgo, linking `libvsan.a` through
//! `pkg-config vsan-static`): `gofmt -l` and `go vet` clean, then its tests (two nodes
//! in one Go process mirroring over loopback tcp, 64 goroutines at once, finalizers,
//! errors, the io.ReaderAt contract), then the same tests with a collection around every
//! call into the library (`VSAN_GO_GC_EVERY_CALL=1`) and under the race detector.
//!
//! The library is the one cargo built for this test run: vsan-ffi is a dependency of
//! this package, so its staticlib is in `target/<profile>/deps/`, which the `.pc` files
//! beside it name. Go's build cache and temporary files live under the target
//! directory, not in `$HOME`; `-count=1` keeps Go from reusing a test result of an
//! older library, and a digest of the header in `CGO_CFLAGS` keeps it from reusing a
//! package compiled against an older header (Go does not hash headers outside the
//! package).
//!
//! Needs go (1.18 or newer), a C compiler and pkg-config: without them the test prints
//! a `SKIP:` line, or fails when `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{TestDir, ToolOutput, find_tool, profile_dir, require_tool, run_command};

/// Limits for one go command (the first build compiles the package; the race build
/// may compile the standard library with instrumentation).
const VET_TIMEOUT: Duration = Duration::from_secs(180);
const TEST_TIMEOUT: Duration = Duration::from_secs(240);
const RACE_TIMEOUT: Duration = Duration::from_secs(420);

/// The Go module.
fn go_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("go")
}

/// The committed header the package compiles against.
fn header() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../vsan-ffi/include/vsan.h")
}

/// The profile directory, once `vsan-static.pc` is there and the `libvsan.a` it names
/// exists; panics saying what is missing.
fn built_tree() -> PathBuf {
    let profile = profile_dir();
    let pc = profile.join("vsan-static.pc");
    let text = std::fs::read_to_string(&pc).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; vsan-ffi's build script (vsan-ffi is a dependency of this \
             package) writes it",
            pc.display()
        )
    });
    let libdir = text
        .lines()
        .find_map(|l| l.strip_prefix("libdir="))
        .unwrap_or_else(|| panic!("{} has no libdir= line:\n{text}", pc.display()));
    let lib = Path::new(libdir).join("libvsan.a");
    assert!(
        lib.is_file(),
        "{} (named by {}) is missing: cargo builds it with vsan-ffi",
        lib.display(),
        pc.display()
    );
    profile
}

/// Where Go keeps its build cache and GOPATH: under the target directory.
fn go_home(profile: &Path) -> PathBuf {
    profile
        .parent()
        .map(|target| target.join("go"))
        .unwrap_or_else(|| profile.join("go"))
}

/// A hex digest of the header, for `CGO_CFLAGS`.
fn header_digest() -> String {
    let text = std::fs::read(header()).expect("read vsan-ffi/include/vsan.h");
    format!("{:08x}", crc32fast::hash(&text))
}

/// The go tool in `examples/go`, offline, with its caches under the target directory
/// and its temporary files in `tmp`.
fn go(profile: &Path, tmp: &TestDir, args: &[&str]) -> Command {
    let home = go_home(profile);
    let mut cmd = Command::new("go");
    cmd.args(args)
        .current_dir(go_dir())
        .env("PKG_CONFIG_PATH", profile)
        .env("CGO_ENABLED", "1")
        .env(
            "CGO_CFLAGS",
            format!("-g -O2 -DVSAN_HEADER_CRC32=0x{}", header_digest()),
        )
        .env("GOCACHE", home.join("cache"))
        .env("GOPATH", home.join("path"))
        .env("GOFLAGS", "-mod=readonly")
        .env("GOPROXY", "off")
        .env("GOWORK", "off")
        .env("GO111MODULE", "on")
        .env("GOTOOLCHAIN", "local")
        .env("TMPDIR", tmp.path())
        .env_remove("VSAN_GO_GC_EVERY_CALL");
    cmd
}

/// Run a prepared command within `limit`, failing with its output unless it exits 0;
/// says how long it took (`note` says what the command line does not show).
fn run_go(cmd: Command, limit: Duration, note: &str) -> ToolOutput {
    let start = Instant::now();
    let out = run_command(cmd, limit);
    eprintln!("{}{note} ({:.1?})", out.command, start.elapsed());
    out.assert_success();
    out
}

/// The C compiler cgo uses (`go env CC`) is installed.
fn require_cc(profile: &Path, tmp: &TestDir) -> bool {
    let out = run_go(go(profile, tmp, &["env", "CC"]), VET_TIMEOUT, "");
    let cc = out
        .stdout
        .split_whitespace()
        .next()
        .unwrap_or("gcc")
        .to_string();
    require_tool(&cc)
}

#[test]
fn go_binding_vets_and_passes_its_tests() {
    if !require_tool("go") || !require_tool("pkg-config") {
        return;
    }
    let profile = built_tree();
    let tmp = TestDir::new("go-api");
    if !require_cc(&profile, &tmp) {
        return;
    }

    if find_tool("gofmt") {
        let mut cmd = Command::new("gofmt");
        cmd.arg("-l").arg(".").current_dir(go_dir());
        let out = run_go(cmd, VET_TIMEOUT, "");
        assert!(
            out.stdout.trim().is_empty(),
            "gofmt would reformat these files:\n{out}"
        );
    }
    run_go(go(&profile, &tmp, &["vet", "./..."]), VET_TIMEOUT, "");

    let test = ["test", "-count=1", "-timeout=200s", "-v", "./..."];
    let out = run_go(go(&profile, &tmp, &test), TEST_TIMEOUT, "");
    assert!(
        out.stdout.contains("--- PASS: TestConcurrentIO") && out.stdout.contains("ok "),
        "the Go tests did not run as expected:\n{out}"
    );

    // Every test again, with runtime.GC() before and after each call into the library.
    let mut cmd = go(&profile, &tmp, &test);
    cmd.env("VSAN_GO_GC_EVERY_CALL", "1");
    run_go(cmd, TEST_TIMEOUT, " [VSAN_GO_GC_EVERY_CALL=1]");

    // And under the race detector (cgo and -race work together on linux/amd64 and
    // arm64, where the Go distribution ships the race runtime).
    if race_supported() {
        let race = ["test", "-race", "-count=1", "-timeout=380s", "./..."];
        let out = run_go(go(&profile, &tmp, &race), RACE_TIMEOUT, "");
        assert!(
            !out.text().contains("WARNING: DATA RACE"),
            "the race detector reported a race:\n{out}"
        );
    } else {
        eprintln!("SKIP: go test -race (no race detector for this platform)");
    }
}

/// Whether Go has a race detector here.
fn race_supported() -> bool {
    cfg!(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    ))
}
