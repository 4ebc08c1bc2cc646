//! Shared pieces of the vsan example programs (`vsan-node`, `vsan-demo`, `vsan-bench`).
#![deny(missing_docs)]
pub mod cache_bench;
pub mod cpu;
pub mod ffi_bench;
pub mod iscsi_bench;
pub mod latency;
pub mod mgmt_client;
pub mod nbd_load;
pub mod pattern;
pub mod resync_bench;
pub mod tgtd;
pub mod transport_bench;
pub mod vhost_bench;
pub mod vhost_client;

/// The node configuration and the transports it builds, now in the library (`vsan::node`).
pub use vsan::node::{config, transports};

/// A work directory `<target>/<name>` beside the running binary's target directory
/// (`target/release/vsan-demo` -> `target/<name>`), or `target/<name>` relative to the
/// current directory when that cannot be found.
pub fn target_work_dir(name: &str) -> std::path::PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(|t| t.join(name)))
        .unwrap_or_else(|| std::path::Path::new("target").join(name))
}

/// Stop child processes the way a service manager would: SIGTERM to all (so a
/// `vsan-node` drains, flushes and exits cleanly), up to 10 s for them to exit, then
/// SIGKILL to whatever is left; every child is reaped.
pub fn terminate_children(children: &mut [std::process::Child]) {
    use std::time::{Duration, Instant};
    for child in children.iter() {
        let pid = rustix::process::Pid::from_child(child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for child in children.iter_mut() {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
