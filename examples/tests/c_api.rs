//! The C API as a C program uses it: the built `libvsan.so` / `libvsan.a` and their
//! pkg-config files, the C examples in `examples/c` compiled with gcc against them, run
//! as node 1 of a mirror whose node 2 is a real `vsan-node` process, under valgrind, and
//! the argument checks of `bad_args.c`.
//!
//! The libraries must be in `target/<profile>/` beside the `.pc` files: `cargo test`
//! builds vsan-ffi's cdylib and staticlib as a dependency (in `target/<profile>/deps/`)
//! but copies them up only for `cargo build -p vsan-ffi`, so run
//! `cargo build --release -p vsan-ffi` first; a test fails saying so when they are
//! missing or older than a source they are built from.
//!
//! A missing tool (gcc, pkg-config, readelf, valgrind, make) skips its test with a
//! `SKIP:` line, or fails it when `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::mirror::{CONNECTED, Side, assert_replicas_identical, start_acceptor};
use common::{
    Node, Sig, TOOL_TIMEOUT, TestDir, ToolOutput, assert_same_bytes, find_tool, image, profile_dir,
    read_file_range, require_tool, run_command, toml_str,
};

/// The mirrored disk the example writes to.
const DISK: &str = "vol0";
/// Its size, as both configs give it.
const DISK_SIZE: &str = "\"4MiB\"";
const DISK_BYTES: usize = 4 << 20;
/// What `vsan_example.c` writes: its pattern over `[0, WRITTEN)`.
const WRITTEN: usize = 64 * 1024 + 64 * 4096;
/// How long the example may take as a plain process (it waits up to 60 s for the
/// mirror itself) and under valgrind.
const RUN_TIMEOUT: Duration = Duration::from_secs(90);
const VALGRIND_TIMEOUT: Duration = Duration::from_secs(240);
/// How long node 2 may take to log the connection.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// The exit code valgrind gives a run with errors (the programs use 1 and 2 for theirs).
const VALGRIND_ERROR_EXIT: i32 = 99;

/// The byte `vsan_example.c` writes at disk offset `offset` (its `pattern_byte`).
fn pattern_byte(offset: u64, seed: u64) -> u8 {
    let mut x = (offset / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x >> (8 * (offset % 8))) as u8
}

/// The C sources.
fn c_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("c")
}

/// The committed header's directory.
fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../vsan-ffi/include")
        .canonicalize()
        .expect("vsan-ffi/include exists")
}

/// The profile directory, once the libraries (in `deps/`, where cargo writes them also
/// when it builds vsan-ffi as a dependency of this package, so they are this build's)
/// and the `.pc` files (which name `deps/`) are there; panics saying what is missing.
fn built_tree() -> PathBuf {
    let profile = profile_dir();
    for name in [
        "deps/libvsan.so",
        "deps/libvsan.so.0",
        "deps/libvsan.a",
        "vsan.pc",
        "vsan-static.pc",
    ] {
        let p = profile.join(name);
        assert!(
            p.exists(),
            "{} is missing: vsan-ffi's build (a dependency of this package) makes it",
            p.display()
        );
    }
    profile
}

/// `pkg-config <args>` against the built tree's `.pc` files.
fn pkg_config(profile: &Path, args: &[&str]) -> ToolOutput {
    let mut cmd = Command::new("pkg-config");
    cmd.args(args).env("PKG_CONFIG_PATH", profile);
    let out = run_command(cmd, TOOL_TIMEOUT);
    out.assert_success();
    out
}

/// Split pkg-config output into arguments (it escapes spaces in paths with `\`).
fn split_flags(text: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut cur = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => cur.extend(chars.next()),
            c if c.is_whitespace() => {
                if !cur.is_empty() {
                    args.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        args.push(cur);
    }
    args
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// `pkg-config vsan`: libvsan.so, found through an rpath.
    Shared,
    /// `pkg-config vsan-static`: libvsan.a.
    Static,
}

/// Compile `examples/c/<name>.c` into `dir` with the flags pkg-config gives; returns
/// the program.
fn compile(profile: &Path, dir: &TestDir, name: &str, link: Link) -> PathBuf {
    let package = match link {
        Link::Shared => "vsan",
        Link::Static => "vsan-static",
    };
    let cflags = split_flags(&pkg_config(profile, &["--cflags", package]).stdout);
    let libs = split_flags(&pkg_config(profile, &["--libs", package]).stdout);
    let exe = dir.join(match link {
        Link::Shared => name.to_string(),
        Link::Static => format!("{name}-static"),
    });
    let mut cmd = Command::new("gcc");
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-g"])
        .args(&cflags)
        .arg("-o")
        .arg(&exe)
        .arg(c_dir().join(format!("{name}.c")))
        .args(&libs)
        .arg("-lpthread");
    run_command(cmd, Duration::from_secs(120)).assert_success();
    exe
}

/// `readelf <args> <file>`, required to succeed.
fn readelf(args: &[&str], file: &Path) -> ToolOutput {
    let mut cmd = Command::new("readelf");
    cmd.args(args).arg(file);
    let out = run_command(cmd, TOOL_TIMEOUT);
    out.assert_success();
    out
}

/// Node 1's config: it dials node 2 at `peer`, with its image in `dir`'s data dir.
fn node1_config(dir: &TestDir, peer: &str) -> PathBuf {
    dir.write_config(&format!(
        "[node]\nid = 1\ndata_dir = {}\nthreads = 2\n\n\
         [[peer]]\nid = 2\naddress = {}\ntransport = \"tcp\"\n\n\
         [[disk]]\nname = {}\nsize = {DISK_SIZE}\npeer = 2\n",
        toml_str(dir.data_dir()),
        toml_str(peer),
        toml_str(DISK)
    ))
}

/// Node 2, a `vsan-node` process listening on a free loopback port, and node 1's
/// directory and config dialing it.
fn start_peer(tag: &str) -> (TestDir, Node, TestDir, PathBuf) {
    let dir2 = TestDir::new(&format!("{tag}-n2"));
    let n2 = start_acceptor(&dir2, &Side::new(2, DISK, DISK_SIZE), "127.0.0.1:0");
    let dir1 = TestDir::new(&format!("{tag}-n1"));
    let config = node1_config(&dir1, n2.replication());
    (dir1, n2, dir2, config)
}

/// The example's output has every line of a complete, mirrored run.
fn assert_example_ok(out: &ToolOutput, seed: u64) {
    let text = out.text();
    for needle in [
        format!("vsan library {}", env!("CARGO_PKG_VERSION")),
        format!("disk {DISK}: size={DISK_BYTES} block_size=512"),
        "status (opened): size=4194304 block_size=512 mirrored=yes".to_string(),
        "mirror: connected and in sync with node 2 over tcp".to_string(),
        format!("pattern: seed={seed:#x} bytes=[0,{WRITTEN})"),
        "write+read: OK".to_string(),
        "flush: OK".to_string(),
        "async: 64 writes, 64 reads in flight: OK".to_string(),
        "async flush: OK".to_string(),
        "link=connected peer=2 transport=tcp".to_string(),
        "node closed: OK".to_string(),
        "vsan_example: OK".to_string(),
    ] {
        assert!(out.stdout.contains(&needle), "no {needle:?} in:\n{out}");
    }
    assert!(!text.contains("FAILED"), "{out}");
}

/// Node 2's replica holds the pattern over what the example wrote and zeros after it,
/// and equals node 1's byte for byte.
fn assert_replicas(dir1: &TestDir, dir2: &TestDir, seed: u64) {
    let (img1, img2) = (image(dir1, DISK), image(dir2, DISK));
    let want: Vec<u8> = (0..WRITTEN as u64).map(|o| pattern_byte(o, seed)).collect();
    assert_same_bytes(
        &read_file_range(&img2, 0, WRITTEN),
        &want,
        "node 2's replica against the C program's pattern",
    );
    let rest = read_file_range(&img2, WRITTEN as u64, DISK_BYTES - WRITTEN);
    assert!(
        rest.iter().all(|&b| b == 0),
        "node 2's replica has data past what the C program wrote"
    );
    assert_replicas_identical(&img1, &img2);
}

#[test]
fn the_shared_library_has_its_soname_and_exports_every_function_of_the_header() {
    if !require_tool("readelf") {
        return;
    }
    let profile = built_tree();
    let so = profile.join("deps/libvsan.so");
    let dynamic = readelf(&["-d"], &so);
    assert!(
        dynamic.stdout.contains("Library soname: [libvsan.so.0]"),
        "no SONAME libvsan.so.0:\n{dynamic}"
    );
    let link =
        std::fs::read_link(profile.join("deps/libvsan.so.0")).expect("libvsan.so.0 is a link");
    assert_eq!(link, Path::new("libvsan.so"));

    // Every function vsan.h declares is a defined, global function of the library.
    let header = std::fs::read_to_string(include_dir().join("vsan.h")).expect("read vsan.h");
    let mut declared = Vec::new();
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with("//") || t.starts_with('*') || t.starts_with("/*") {
            continue;
        }
        let mut rest = t;
        while let Some(i) = rest.find("vsan_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            if rest.starts_with('(') && !declared.contains(&name) {
                declared.push(name);
            }
        }
    }
    assert!(declared.len() >= 25, "found only {declared:?} in vsan.h");
    let syms = readelf(&["--dyn-syms", "-W"], &so);
    for name in &declared {
        assert!(
            syms.stdout.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() >= 8 && f[3] == "FUNC" && f[4] == "GLOBAL" && f[6] != "UND" && f[7] == name
            }),
            "libvsan.so does not export {name}, which vsan.h declares"
        );
    }
}

#[test]
fn pkg_config_points_at_the_committed_header_and_the_built_libraries() {
    if !require_tool("pkg-config") {
        return;
    }
    let profile = built_tree();
    let profile_s = profile.join("deps").display().to_string();
    let version = pkg_config(&profile, &["--modversion", "vsan"]);
    assert_eq!(version.stdout.trim(), env!("CARGO_PKG_VERSION"));
    let version = pkg_config(&profile, &["--modversion", "vsan-static"]);
    assert_eq!(version.stdout.trim(), env!("CARGO_PKG_VERSION"));

    for package in ["vsan", "vsan-static"] {
        let cflags = split_flags(&pkg_config(&profile, &["--cflags", package]).stdout);
        let includes: Vec<PathBuf> = cflags
            .iter()
            .filter_map(|f| f.strip_prefix("-I"))
            .map(|d| Path::new(d).canonicalize().expect("the include dir exists"))
            .collect();
        assert_eq!(
            includes,
            vec![include_dir()],
            "{package}: --cflags {cflags:?} is not the committed header's directory"
        );
        assert!(includes[0].join("vsan.h").is_file());
    }

    let shared = split_flags(&pkg_config(&profile, &["--libs", "vsan"]).stdout);
    for want in [
        format!("-L{profile_s}"),
        format!("-Wl,-rpath,{profile_s}"),
        "-lvsan".to_string(),
    ] {
        assert!(
            shared.contains(&want),
            "vsan: --libs {shared:?} lacks {want}"
        );
    }
    let stat = split_flags(&pkg_config(&profile, &["--libs", "vsan-static"]).stdout);
    let archive = profile.join("deps/libvsan.a").display().to_string();
    assert!(
        stat.contains(&archive),
        "vsan-static: --libs {stat:?} lacks {archive}"
    );
    assert!(
        !stat.iter().any(|f| f == "-lvsan"),
        "vsan-static links the shared library: {stat:?}"
    );
    assert!(stat.iter().any(|f| f == "-lpthread"), "{stat:?}");
}

#[test]
fn the_header_compiles_on_its_own() {
    if !require_tool("gcc") {
        return;
    }
    let dir = TestDir::new("c-header");
    let src = dir.join("only_the_header.c");
    std::fs::write(
        &src,
        "#include <vsan.h>\nint main(void) { return vsan_version() == 0; }\n",
    )
    .expect("write the source");
    let mut compilers = vec![("gcc", vec!["-std=c11"])];
    if find_tool("g++") {
        compilers.push(("g++", vec!["-x", "c++", "-std=c++17"]));
    }
    for (cc, lang) in compilers {
        let mut cmd = Command::new(cc);
        cmd.args(&lang)
            .args(["-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I"])
            .arg(include_dir())
            .arg(&src);
        let out = run_command(cmd, TOOL_TIMEOUT);
        assert!(
            out.status.success(),
            "vsan.h does not compile with {cc} on its own:\n{out}"
        );
    }
}

#[test]
fn the_c_example_mirrors_through_a_vsan_node_peer() {
    if !require_tool("gcc") || !require_tool("pkg-config") || !require_tool("readelf") {
        return;
    }
    let profile = built_tree();
    let build = TestDir::new("c-example-build");
    let exe = compile(&profile, &build, "vsan_example", Link::Shared);
    // Linked as a program outside the tree would be: through the SONAME, found by rpath.
    let dynamic = readelf(&["-d"], &exe);
    assert!(
        dynamic.stdout.contains("Shared library: [libvsan.so.0]"),
        "{dynamic}"
    );
    assert!(
        dynamic.stdout.contains(&profile.display().to_string()),
        "{dynamic}"
    );

    let seed: u64 = 0x1234_5678_9abc_def0;
    let (dir1, n2, dir2, config) = start_peer("c-example");
    let mut cmd = Command::new(&exe);
    // As a program outside the tree runs: cargo's LD_LIBRARY_PATH (which names
    // target/<profile>, where an older libvsan.so may lie) must not pick the library.
    cmd.env_remove("LD_LIBRARY_PATH");
    cmd.arg(&config)
        .arg(DISK)
        .arg(format!("{seed:#x}"))
        .current_dir(dir1.path());
    let out = run_command(cmd, RUN_TIMEOUT);
    assert!(
        out.status.success(),
        "the C example failed:\n{out}\n--- node 2's log ---\n{}",
        n2.log()
    );
    assert_example_ok(&out, seed);
    n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    n2.stop_clean(Sig::TERM);
    assert_replicas(&dir1, &dir2, seed);
}

/// valgrind's verdict on a run whose log is `log`: no errors, nothing definitely or
/// indirectly lost.
///
/// "Possibly lost" blocks are not errors: a pointer into the middle of a block is all
/// valgrind finds for them, and the library's handle registry is a static hashbrown map,
/// whose table pointer points into its allocation (past the buckets) by design; every
/// such record must come from hashbrown. "Still reachable" blocks are the statics and
/// thread-locals of the Rust runtime and of tokio, freed at exit by the OS.
fn assert_valgrind_clean(out: &ToolOutput, log: &Path) {
    let text = std::fs::read_to_string(log).expect("read the valgrind log");
    let verdict = format!("{out}\n--- valgrind ---\n{text}");
    assert_ne!(
        out.status.code(),
        Some(VALGRIND_ERROR_EXIT),
        "valgrind found errors:\n{verdict}"
    );
    assert!(
        out.status.success(),
        "the program failed under valgrind:\n{verdict}"
    );
    assert!(text.contains("ERROR SUMMARY: 0 errors"), "{verdict}");
    if !text.contains("All heap blocks were freed") {
        for kind in ["definitely lost: 0 bytes", "indirectly lost: 0 bytes"] {
            assert!(text.contains(kind), "not {kind}:\n{verdict}");
        }
    }
    // Each loss record is a paragraph (lines `==<pid>== ...`): its title, then its stack.
    let body: Vec<&str> = text.lines().map(strip_pid).collect();
    for record in body.join("\n").split("\n\n") {
        if record.contains("are possibly lost in loss record") {
            assert!(
                record.contains("hashbrown"),
                "a possibly lost block that is not a hash table's:\n{record}\n\n{verdict}"
            );
        }
    }
}

/// A valgrind log line without its `==<pid>== ` prefix.
fn strip_pid(line: &str) -> &str {
    line.strip_prefix("==")
        .and_then(|rest| rest.find("==").map(|i| &rest[i + 2..]))
        .map_or(line, |rest| rest.strip_prefix(' ').unwrap_or(rest))
}

fn valgrind(exe: &Path, args: &[OsString], log: &Path, cwd: &Path) -> ToolOutput {
    let mut cmd = Command::new("valgrind");
    cmd.env_remove("LD_LIBRARY_PATH");
    cmd.arg(format!("--error-exitcode={VALGRIND_ERROR_EXIT}"))
        .args([
            "--leak-check=full",
            "--errors-for-leak-kinds=definite,indirect",
            "--show-leak-kinds=definite,indirect,possible",
        ])
        .arg(format!("--log-file={}", log.display()))
        .arg(exe)
        .args(args)
        .current_dir(cwd);
    run_command(cmd, VALGRIND_TIMEOUT)
}

#[test]
fn the_c_example_linked_statically_is_clean_under_valgrind() {
    if !require_tool("gcc") || !require_tool("pkg-config") || !require_tool("valgrind") {
        return;
    }
    let profile = built_tree();
    let build = TestDir::new("c-valgrind-build");
    let exe = compile(&profile, &build, "vsan_example", Link::Static);

    let seed: u64 = 0x0dd5_eed0;
    let (dir1, n2, dir2, config) = start_peer("c-valgrind");
    let log = build.join("valgrind.log");
    let out = valgrind(
        &exe,
        &[
            config.into_os_string(),
            DISK.into(),
            format!("{seed:#x}").into(),
        ],
        &log,
        dir1.path(),
    );
    assert_valgrind_clean(&out, &log);
    assert_example_ok(&out, seed);
    n2.stop_clean(Sig::TERM);
    assert_replicas(&dir1, &dir2, seed);
}

/// bad_args ran every check and all passed.
fn assert_bad_args_ok(out: &ToolOutput) {
    let failed: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("FAIL"))
        .collect();
    assert!(failed.is_empty(), "checks failed: {failed:#?}\n{out}");
    let summary = out
        .stdout
        .lines()
        .find(|l| l.starts_with("bad_args: ") && l.contains(" checks, "))
        .unwrap_or_else(|| panic!("no summary line:\n{out}"));
    let checks: u32 = summary
        .trim_start_matches("bad_args: ")
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {summary:?}"));
    assert!(checks >= 250, "only {checks} checks ran:\n{out}");
    assert!(summary.ends_with(", 0 failed"), "{summary}\n{out}");
    assert!(out.stdout.contains("\nbad_args: OK"), "{out}");
    assert!(out.status.success(), "{out}");
}

#[test]
fn bad_args_gets_the_documented_code_for_every_misuse() {
    if !require_tool("gcc") || !require_tool("pkg-config") {
        return;
    }
    let profile = built_tree();
    let dir = TestDir::new("c-bad-args");
    let exe = compile(&profile, &dir, "bad_args", Link::Shared);
    let data = dir.join("data");
    std::fs::create_dir(&data).expect("create the data dir");
    let mut cmd = Command::new(&exe);
    // As a program outside the tree runs: cargo's LD_LIBRARY_PATH (which names
    // target/<profile>, where an older libvsan.so may lie) must not pick the library.
    cmd.env_remove("LD_LIBRARY_PATH");
    cmd.arg(&data);
    assert_bad_args_ok(&run_command(cmd, RUN_TIMEOUT));
}

#[test]
fn bad_args_is_clean_under_valgrind() {
    if !require_tool("gcc") || !require_tool("pkg-config") || !require_tool("valgrind") {
        return;
    }
    let profile = built_tree();
    let dir = TestDir::new("c-bad-args-valgrind");
    let exe = compile(&profile, &dir, "bad_args", Link::Static);
    let data = dir.join("data");
    std::fs::create_dir(&data).expect("create the data dir");
    let log = dir.join("valgrind.log");
    let out = valgrind(&exe, &[data.into_os_string()], &log, dir.path());
    assert_valgrind_clean(&out, &log);
    assert_bad_args_ok(&out);
}

#[test]
fn the_makefile_builds_both_programs_shared_and_static() {
    if !require_tool("make") || !require_tool("gcc") || !require_tool("pkg-config") {
        return;
    }
    let profile = built_tree();
    let dir = TestDir::new("c-make");
    let mut cmd = Command::new("make");
    cmd.arg("-C")
        .arg(c_dir())
        .arg(format!("OUT={}", dir.path().display()))
        .arg(format!("PKG_CONFIG_PATH={}", profile.display()))
        .args(["all", "static"]);
    run_command(cmd, Duration::from_secs(180)).assert_success();
    for name in [
        "vsan_example",
        "bad_args",
        "vsan_example-static",
        "bad_args-static",
    ] {
        assert!(dir.join(name).is_file(), "make built no {name}");
    }
    // The usage line, from both link modes.
    for name in ["vsan_example", "vsan_example-static"] {
        let out = run_command(Command::new(dir.join(name)), TOOL_TIMEOUT);
        assert_eq!(out.status.code(), Some(2), "{out}");
        assert!(out.stderr.contains("usage:"), "{out}");
    }
}
