//! A real Linux guest under `qemu-system-x86_64` whose only disk is a vhost-user-blk
//! device, for tests that want a kernel nobody here wrote as the front end.
//!
//! ```text
//!  host                                   guest (TCG, 256 MiB, one vCPU per queue)
//!  /boot/vmlinuz-*  ───────────────────▶  kernel, console on ttyS0 = qemu's stdout
//!  initramfs (newc cpio, built here) ──▶  /init: mount proc/sys/devtmpfs, insmod the
//!    /bin/busybox (static)                 virtio-pci, virtio-blk and ext4 modules,
//!    /lib/modules/*.ko                     run /workload.sh between two markers,
//!    /workload.sh (the test's)             poweroff -f
//!  vhost-user socket ◀── memfd memory ──▶  /dev/vda
//! ```
//!
//! The guest runs the stock kernel of this host's distribution (`/boot/vmlinuz-*`, the
//! newest one with a `/lib/modules/<version>` dir) and loads the modules the disk and
//! ext2 need, in the dependency order `modules.dep` gives, skipping the ones
//! `modules.builtin` lists. The initramfs is an uncompressed newc cpio written by
//! [`Cpio`]; the kernel takes it as is. The workload prints `KEY=value` lines, which
//! [`GuestRun::values`] collects from between a begin and an end marker that carry a
//! random nonce, so nothing the kernel prints can pass for them.
//!
//! The guest runs under TCG unless `VSAN_GUEST_ACCEL=kvm`: a boot takes about 10 s. A
//! missing piece (qemu, a readable kernel with modules, a static busybox) skips the
//! test with a `SKIP:` line, or fails it when `VSAN_REQUIRE_INTEROP=1`, as
//! [`require_tool`] does. `VSAN_GUEST_KERNEL` names another kernel image (its modules
//! are looked for in `/lib/modules/<what follows "vmlinuz-">`), `VSAN_GUEST_BUSYBOX`
//! another busybox.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use super::{ProcessGuard, TestDir, require_tool, strip_ansi};

/// How long one boot, workload and poweroff may take under TCG (about 10 s alone; the
/// margin is for a loaded CI machine running other tests at the same time).
pub const GUEST_TIMEOUT: Duration = Duration::from_secs(240);

/// How long qemu may take to exit once the workload has printed its end marker.
const POWEROFF_TIMEOUT: Duration = Duration::from_secs(30);

/// The guest's memory; vhost-user needs it shared with the backend (a memfd).
const GUEST_MEMORY_MIB: u32 = 256;

/// The modules the guest loads (with what they depend on): the PCI transport, the
/// virtio block driver, ext4 (which also mounts ext2) and the crc32c it asks for.
const WANTED_MODULES: &[&str] = &["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"];

/// Where the qemu binary is looked for.
const QEMU: &str = "qemu-system-x86_64";

/// Everything from this host a guest is made of: the kernel, the modules in load order,
/// and busybox.
#[derive(Debug)]
pub struct GuestKit {
    kernel: PathBuf,
    busybox: PathBuf,
    busybox_bytes: Vec<u8>,
    /// `(name, contents)`, dependencies first; decompressed.
    modules: Vec<(String, Vec<u8>)>,
}

/// A missing piece: a SKIP line and `None`, or a panic under `VSAN_REQUIRE_INTEROP=1`.
fn unavailable<T>(what: &str) -> Option<T> {
    if std::env::var("VSAN_REQUIRE_INTEROP").is_ok_and(|v| v == "1") {
        panic!("{what}, and VSAN_REQUIRE_INTEROP=1 requires a guest");
    }
    eprintln!("SKIP: {what}");
    None
}

impl GuestKit {
    /// Find qemu, the kernel, its modules and busybox, or skip (see the module doc).
    pub fn find() -> Option<GuestKit> {
        if !require_tool(QEMU) {
            return None;
        }
        let kernel = match std::env::var_os("VSAN_GUEST_KERNEL") {
            Some(k) => PathBuf::from(k),
            None => newest_kernel()?,
        };
        if let Err(e) = std::fs::File::open(&kernel) {
            return unavailable(&format!(
                "cannot read the guest kernel {} ({e}; some distributions keep it 0600)",
                kernel.display()
            ));
        }
        let Some(module_dir) = module_dir(&kernel) else {
            return unavailable(&format!(
                "no /lib/modules dir for the guest kernel {}",
                kernel.display()
            ));
        };
        let modules = match load_order(&module_dir, WANTED_MODULES) {
            Ok(paths) => paths,
            Err(why) => return unavailable(&why),
        };
        let mut contents = Vec::with_capacity(modules.len());
        for (name, path) in modules {
            match module_bytes(&path) {
                Ok(bytes) => contents.push((name, bytes)),
                Err(why) => return unavailable(&why),
            }
        }
        let busybox = std::env::var_os("VSAN_GUEST_BUSYBOX")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/bin/busybox"));
        let busybox_bytes = match std::fs::read(&busybox) {
            Ok(b) => b,
            Err(e) => return unavailable(&format!("no busybox at {} ({e})", busybox.display())),
        };
        if !is_static_elf64(&busybox_bytes) {
            return unavailable(&format!(
                "{} is not a static x86-64 busybox (install busybox-static)",
                busybox.display()
            ));
        }
        Some(GuestKit {
            kernel,
            busybox,
            busybox_bytes,
            modules: contents,
        })
    }

    /// The kernel image the guest boots.
    pub fn kernel(&self) -> &Path {
        &self.kernel
    }

    /// The busybox that is the guest's whole userland (`/bin/busybox` there): its bytes
    /// are known on both sides, so a workload can write them and the host compare.
    pub fn busybox(&self) -> &[u8] {
        &self.busybox_bytes
    }

    /// The names of the modules the guest loads, in order.
    pub fn module_names(&self) -> Vec<&str> {
        self.modules.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The initramfs for `workload`, with these markers around it.
    fn initramfs(&self, workload: &str, markers: &Markers) -> Vec<u8> {
        let mut cpio = Cpio::default();
        for dir in [
            "bin",
            "dev",
            "proc",
            "sys",
            "tmp",
            "mnt",
            "lib",
            "lib/modules",
        ] {
            cpio.dir(dir);
        }
        // The kernel opens /dev/console for init's stdio before init runs (devtmpfs is
        // not mounted yet), so the node has to be in the archive.
        cpio.char_device("dev/console", 0o600, 5, 1);
        cpio.file("bin/busybox", 0o755, &self.busybox_bytes);
        for (name, bytes) in &self.modules {
            cpio.file(&format!("lib/modules/{name}.ko"), 0o644, bytes);
        }
        cpio.file("workload.sh", 0o755, workload.as_bytes());
        cpio.file("init", 0o755, self.init_script(markers).as_bytes());
        cpio.finish()
    }

    fn init_script(&self, markers: &Markers) -> String {
        let modules = self.module_names().join(" ");
        format!(
            r#"#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox --install -s /bin
export PATH=/bin
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {modules}; do
    insmod /lib/modules/$m.ko || echo "insmod $m failed"
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do usleep 100000; i=$((i + 1)); done
echo "{begin}"
sh -e -o pipefail /workload.sh 2>&1
echo "{end} rc=$?"
sync
poweroff -f
"#,
            begin = markers.begin,
            end = markers.end,
        )
    }
}

/// The newest `/boot/vmlinuz-<version>` that has a `/lib/modules/<version>`.
fn newest_kernel() -> Option<PathBuf> {
    let entries = match std::fs::read_dir("/boot") {
        Ok(e) => e,
        Err(e) => return unavailable(&format!("cannot list /boot ({e})")),
    };
    let mut kernels: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let version = name.strip_prefix("vmlinuz-")?.to_string();
            Some((version, e.path()))
        })
        .filter(|(v, _)| Path::new("/lib/modules").join(v).is_dir())
        .collect();
    kernels.sort_by_key(|(v, _)| version_key(v));
    match kernels.pop() {
        Some((_, path)) => Some(path),
        None => unavailable("no /boot/vmlinuz-* with modules in /lib/modules"),
    }
}

/// `6.1.0-57-amd64` as comparable parts: numbers compare as numbers, and sort before
/// words.
fn version_key(v: &str) -> Vec<(u8, u64, String)> {
    v.split(|c: char| !c.is_ascii_alphanumeric())
        .map(|part| match part.parse::<u64>() {
            Ok(n) => (0, n, String::new()),
            Err(_) => (1, 0, part.to_string()),
        })
        .collect()
}

/// `/lib/modules/<version>` for a kernel named `vmlinuz-<version>`.
fn module_dir(kernel: &Path) -> Option<PathBuf> {
    let name = kernel.file_name()?.to_str()?;
    let dir = Path::new("/lib/modules").join(name.strip_prefix("vmlinuz-")?);
    dir.join("modules.dep").is_file().then_some(dir)
}

/// A module's name as the kernel knows it: the file name without `.ko[.xz|.zst|.gz]`,
/// with `-` as `_`.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// `wanted` and everything they depend on, as `(name, path)` in an order that loads
/// each module after its dependencies; built-in modules are left out.
fn load_order(dir: &Path, wanted: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
    let read = |file: &str| {
        std::fs::read_to_string(dir.join(file))
            .map_err(|e| format!("cannot read {}: {e}", dir.join(file).display()))
    };
    let builtin: HashSet<String> = read("modules.builtin")?.lines().map(module_name).collect();
    // name -> (path relative to dir, dependency names)
    let mut deps: HashMap<String, (String, Vec<String>)> = HashMap::new();
    for line in read("modules.dep")?.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        let needs = rest.split_whitespace().map(module_name).collect();
        deps.insert(module_name(path), (path.to_string(), needs));
    }

    fn visit(
        name: &str,
        deps: &HashMap<String, (String, Vec<String>)>,
        builtin: &HashSet<String>,
        seen: &mut HashSet<String>,
        out: &mut Vec<(String, String)>,
    ) -> Result<(), String> {
        if builtin.contains(name) || !seen.insert(name.to_string()) {
            return Ok(());
        }
        let (path, needs) = deps
            .get(name)
            .ok_or_else(|| format!("the guest kernel has no module {name}, built in or not"))?;
        for n in needs {
            visit(n, deps, builtin, seen, out)?;
        }
        out.push((name.to_string(), path.clone()));
        Ok(())
    }

    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for name in wanted {
        visit(name, &deps, &builtin, &mut seen, &mut out)?;
    }
    Ok(out
        .into_iter()
        .map(|(name, path)| (name, dir.join(path)))
        .collect())
}

/// A module file's contents, decompressed with the matching tool when it is compressed
/// (busybox's insmod takes only plain ELF).
fn module_bytes(path: &Path) -> Result<Vec<u8>, String> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        "xz"
    } else if name.ends_with(".ko.zst") {
        "zstd"
    } else if name.ends_with(".ko.gz") {
        "gzip"
    } else {
        return std::fs::read(path).map_err(|e| format!("cannot read {name}: {e}"));
    };
    // A local file through a decompressor: it cannot hang on anything outside.
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {tool} to decompress {name}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{tool} -dc {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out.stdout)
}

/// Whether `elf` is a 64-bit little-endian x86-64 executable with no program
/// interpreter, i.e. one that runs in a guest with no libc.
fn is_static_elf64(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    const EM_X86_64: u16 = 62;
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
    };
    // e_ident: magic, ELFCLASS64, ELFDATA2LSB.
    if elf.get(0..6) != Some(b"\x7fELF\x02\x01") || u16_at(0x12) != Some(EM_X86_64) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    let Ok(phoff) = usize::try_from(phoff) else {
        return false;
    };
    (0..usize::from(phnum)).all(|i| {
        let at = phoff + i * usize::from(phentsize);
        u32_at(at).is_some_and(|p_type| p_type != PT_INTERP)
    })
}

/// A newc ("070701") cpio archive, the format the kernel unpacks into its initial
/// rootfs: per entry a header of thirteen 8-digit hex fields, the NUL-terminated name
/// padded to 4 bytes, the data padded to 4 bytes; a `TRAILER!!!` entry ends it.
#[derive(Debug, Default)]
pub struct Cpio {
    bytes: Vec<u8>,
    next_ino: u32,
}

impl Cpio {
    const S_IFDIR: u32 = 0o040_000;
    const S_IFREG: u32 = 0o100_000;
    const S_IFCHR: u32 = 0o020_000;

    /// A directory (its parents must come first).
    pub fn dir(&mut self, name: &str) {
        self.entry(name, Self::S_IFDIR | 0o755, 2, (0, 0), &[]);
    }

    /// A regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, Self::S_IFREG | perm, 1, (0, 0), data);
    }

    /// A character device node (no privilege needed: the kernel makes it).
    pub fn char_device(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, Self::S_IFCHR | perm, 1, (major, minor), &[]);
    }

    /// The archive, with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[]);
        self.bytes
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) {
        let ino = self.next_ino;
        self.next_ino += 1;
        let size = u32::try_from(data.len()).expect("a cpio entry is under 4 GiB");
        let name_size = u32::try_from(name.len() + 1).expect("a short name");
        let fields = [
            ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, name_size, 0,
        ];
        self.bytes.extend_from_slice(b"070701");
        for f in fields {
            self.bytes.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.bytes.len() % 4 != 0 {
            self.bytes.push(0);
        }
    }
}

/// The lines that frame the workload's output, with a nonce no other text has.
#[derive(Debug, Clone)]
struct Markers {
    begin: String,
    end: String,
}

impl Markers {
    fn new() -> Markers {
        let nonce: u64 = rand::random();
        Markers {
            begin: format!("VSAN-GUEST-BEGIN-{nonce:016x}"),
            end: format!("VSAN-GUEST-END-{nonce:016x}"),
        }
    }
}

/// One boot of a guest on a vhost-user-blk socket.
#[derive(Debug)]
pub struct Guest<'k> {
    kit: &'k GuestKit,
    socket: PathBuf,
    queues: u16,
    workload: String,
    timeout: Duration,
}

impl<'k> Guest<'k> {
    /// A guest whose disk is the vhost-user-blk backend on `socket`, running `workload`
    /// (a busybox `sh` script, run with `-e -o pipefail`; `/dev/vda` is the disk).
    pub fn new(kit: &'k GuestKit, socket: &Path, workload: &str) -> Guest<'k> {
        Guest {
            kit,
            socket: socket.to_path_buf(),
            queues: 1,
            workload: workload.to_string(),
            timeout: GUEST_TIMEOUT,
        }
    }

    /// Ask the backend for `n` queues. The guest gets a vCPU per queue, since Linux's
    /// virtio-blk uses no more queues than CPUs; vCPU `i` submits on queue `i`.
    pub fn queues(mut self, n: u16) -> Guest<'k> {
        self.queues = n;
        self
    }

    /// Boot, run the workload and wait for the guest to power off; the initramfs is
    /// written into `dir`. Panics (showing the console) when it takes longer than
    /// [`GUEST_TIMEOUT`]; qemu is killed then, and if the test panics while it runs.
    pub fn boot(&self, dir: &TestDir) -> GuestRun {
        let markers = Markers::new();
        let initramfs = dir.join("initramfs.cpio");
        std::fs::write(&initramfs, self.kit.initramfs(&self.workload, &markers))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", initramfs.display()));

        let kvm = std::env::var("VSAN_GUEST_ACCEL").is_ok_and(|v| v == "kvm");
        let mut cmd = Command::new(QEMU);
        cmd.args(["-accel", if kvm { "kvm" } else { "tcg" }]);
        if kvm {
            cmd.args(["-cpu", "host"]);
        }
        cmd.args(["-m", &GUEST_MEMORY_MIB.to_string()])
            .args(["-smp", &self.queues.to_string()])
            .args(["-nodefaults", "-no-user-config", "-no-reboot", "-nographic"])
            .args(["-serial", "stdio"])
            .arg("-kernel")
            .arg(&self.kit.kernel)
            .arg("-initrd")
            .arg(&initramfs)
            .args(["-append", "console=ttyS0 panic=-1 quiet"])
            .args([
                "-object",
                &format!("memory-backend-memfd,id=mem,size={GUEST_MEMORY_MIB}M,share=on"),
            ])
            .args(["-numa", "node,memdev=mem"])
            .args([
                "-chardev",
                &format!(
                    "socket,id=vu0,path={}",
                    self.socket.to_str().expect("test paths are UTF-8")
                ),
            ])
            .args([
                "-device",
                &format!("vhost-user-blk-pci,chardev=vu0,num-queues={}", self.queues),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());

        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {QEMU}: {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let mut process = ProcessGuard::new(child, None);
        let (console, ended) = watch(stdout, Some(markers.end.clone()));
        let (qemu_log, _) = watch(stderr, None);
        let text = |buf: &Arc<Mutex<Vec<u8>>>| {
            let bytes = buf.lock().unwrap_or_else(|e| e.into_inner());
            strip_ansi(&String::from_utf8_lossy(&bytes))
        };

        // Until the end marker, or qemu closing its stdout (it exited).
        if let Err(mpsc::RecvTimeoutError::Timeout) = ended.recv_timeout(self.timeout) {
            drop(process);
            panic!(
                "the guest did not finish within {:?}\n--- console ---\n{}\n--- qemu ---\n{}",
                self.timeout,
                text(&console),
                text(&qemu_log)
            );
        }
        let status = process.wait(POWEROFF_TIMEOUT);
        let elapsed = started.elapsed();
        let run = GuestRun {
            console: text(&console),
            qemu_log: text(&qemu_log),
            elapsed,
            markers,
        };
        assert!(
            status.is_some(),
            "qemu did not exit within {POWEROFF_TIMEOUT:?} of the workload's end\n{run}"
        );
        run
    }
}

/// Collect `pipe` on a thread; the receiver hears once a line holding `end` has
/// arrived, and disconnects when the pipe ends.
fn watch(
    mut pipe: impl Read + Send + 'static,
    end: Option<String>,
) -> (Arc<Mutex<Vec<u8>>>, mpsc::Receiver<()>) {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&buf);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        let mut told = false;
        loop {
            let n = match pipe.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut all = sink.lock().unwrap_or_else(|e| e.into_inner());
            all.extend_from_slice(&chunk[..n]);
            if let Some(end) = end.as_deref().filter(|_| !told) {
                let text = String::from_utf8_lossy(&all);
                if text.find(end).is_some_and(|at| text[at..].contains('\n')) {
                    told = true;
                    let _ = tx.send(());
                }
            }
        }
    });
    (buf, rx)
}

/// What one boot printed.
#[derive(Debug)]
pub struct GuestRun {
    /// The serial console (the kernel's messages and the workload's output).
    pub console: String,
    /// qemu's own stderr.
    pub qemu_log: String,
    /// From starting qemu to its exit.
    pub elapsed: Duration,
    markers: Markers,
}

impl GuestRun {
    /// The workload's output: the lines between the markers.
    pub fn output(&self) -> &str {
        let Some(start) = self.console.find(&self.markers.begin) else {
            panic!("the guest never started its workload\n{self}");
        };
        let body = &self.console[start + self.markers.begin.len()..];
        let Some(end) = body.find(&self.markers.end) else {
            panic!("the workload never finished\n{self}");
        };
        &body[..end]
    }

    /// The workload's exit status, from the end marker.
    pub fn exit_code(&self) -> Option<i32> {
        let at = self.console.find(&self.markers.end)? + self.markers.end.len();
        let line = self.console[at..].lines().next()?;
        line.trim().strip_prefix("rc=")?.parse().ok()
    }

    /// Panic (showing the console) unless the workload ran to its end and exited 0.
    pub fn assert_ok(&self) -> &GuestRun {
        assert_eq!(self.exit_code(), Some(0), "the workload failed\n{self}");
        self
    }

    /// The `KEY=value` lines of the workload's output (`KEY` in capitals, digits and
    /// `_`; the value trimmed); a later line overwrites an earlier one.
    pub fn values(&self) -> HashMap<String, String> {
        parse_values(self.output())
    }

    /// The value of `key`; panics (showing the console) when the workload printed none.
    pub fn value(&self, key: &str) -> String {
        self.values()
            .remove(key)
            .unwrap_or_else(|| panic!("the workload printed no {key}=\n{self}"))
    }

    /// A numeric value of `key`.
    pub fn value_u64(&self, key: &str) -> u64 {
        let v = self.value(key);
        v.parse()
            .unwrap_or_else(|_| panic!("{key}={v} is not a number\n{self}"))
    }
}

impl fmt::Display for GuestRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "--- console ({:?}) ---", self.elapsed)?;
        writeln!(f, "{}", self.console.trim_end())?;
        write!(f, "--- qemu ---\n{}", self.qemu_log.trim_end())
    }
}

/// `KEY=value` lines of `text` (see [`GuestRun::values`]).
pub fn parse_values(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|line| {
            let (key, value) = line.trim().split_once('=')?;
            let is_key = key.starts_with(|c: char| c.is_ascii_uppercase())
                && key
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            is_key.then(|| (key.to_string(), value.trim().to_string()))
        })
        .collect()
}
