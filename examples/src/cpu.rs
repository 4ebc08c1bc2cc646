//! CPU time (user + system) from `/proc`: of a process, or of this process's threads by
//! name. The benchmarks report CPU per I/O beside IOPS, because on shared cores it holds
//! where IOPS do not.

use std::io;
use std::path::Path;

/// User plus system CPU time of process `pid` so far, in seconds (all its threads), from
/// `/proc/<pid>/stat`.
pub fn process_seconds(pid: u32) -> io::Result<f64> {
    stat_seconds(&Path::new("/proc").join(pid.to_string()).join("stat"))
}

/// User plus system CPU time so far, in seconds, of this process's threads whose name
/// starts with `prefix` (a runtime's `thread_name`; Linux keeps 15 bytes of it). Threads
/// that ended are not counted: take both readings while they run.
pub fn threads_seconds(prefix: &str) -> io::Result<f64> {
    let mut total = 0.0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        // A thread may end between the listing and the reads: skip it then.
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end().starts_with(prefix)
            && let Ok(s) = stat_seconds(&dir.join("stat"))
        {
            total += s;
        }
    }
    Ok(total)
}

/// utime + stime of a `stat` file of `/proc`, in seconds.
fn stat_seconds(path: &Path) -> io::Result<f64> {
    let stat = std::fs::read_to_string(path)?;
    // The command name (field 2) is in parentheses and may hold spaces: count fields
    // from the last ')'.
    let rest = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .ok_or_else(|| io::Error::other(format!("unexpected {}: {stat}", path.display())))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, utime field 14, stime field 15.
    let tick = |n: usize| -> io::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no field {n} in {}", path.display())))
    };
    let ticks = tick(14)? + tick(15)?;
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as f64 } else { 100.0 };
    Ok(ticks as f64 / hz)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_named_thread_shows_its_cpu_time() {
        let busy = std::thread::Builder::new()
            .name("cpu-test-busy".into())
            .spawn(|| {
                let (tx, rx) = std::sync::mpsc::channel::<f64>();
                let t = std::time::Instant::now();
                let mut x = 0u64;
                while t.elapsed() < std::time::Duration::from_millis(300) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
                std::hint::black_box(x);
                // Read while this thread still runs.
                let _ = tx.send(threads_seconds("cpu-test-busy").unwrap_or(0.0));
                rx.recv().unwrap_or(0.0)
            })
            .expect("spawn");
        let seen = busy.join().expect("join");
        assert!(seen >= 0.1, "a thread that spun 300 ms shows {seen} s");
        assert_eq!(threads_seconds("no-such-thread-name").ok(), Some(0.0));
        assert!(process_seconds(std::process::id()).is_ok_and(|s| s >= seen));
    }
}
