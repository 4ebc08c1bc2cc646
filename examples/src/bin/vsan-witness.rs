//! `vsan-witness --listen <addr> [--state FILE]`: the quorum witness of two-node mirrors.
//!
//! Holds no data: per mirrored disk it grants at most one node the right to keep serving
//! while the two nodes cannot reach each other (see `vsan_replica::witness` for the rules
//! and the line protocol). With `--state` its decisions survive a restart; a holder keeps
//! its grant until it releases it, even across witness restarts. If a holder is lost for
//! good, stop the witness, edit or remove the state file, and start it again.
//!
//! Once it listens and has loaded its state it prints `ready witness=<address>` on stdout
//! (the actual port when the address said port 0), then serves until SIGINT/SIGTERM.
//!
//! Exit codes: 0 clean shutdown, 1 runtime failure (including an unreadable, corrupt or
//! unwritable state file, reported before any ready line), 2 bad arguments or an address
//! it cannot listen on (one line on stderr).

use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;
use tracing::{error, info, warn};
use vsan_replica::witness;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "vsan quorum witness: breaks the tie when the two nodes of a mirror lose each other"
)]
struct Args {
    /// Address to listen on, e.g. 127.0.0.1:7900 (port 0 picks a free one).
    #[arg(long)]
    listen: SocketAddr,
    /// File keeping the holders across restarts (written on every change).
    #[arg(long)]
    state: Option<PathBuf>,
}

/// Why the witness stopped other than by a signal.
enum RunError {
    /// Exit 2.
    Args(String),
    /// Exit 1.
    Runtime(String),
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if !e.use_stderr() => {
            // --help, --version: clap prints them and exits 0.
            e.exit()
        }
        Err(e) => {
            eprintln!("vsan-witness: {}", one_line(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vsan-witness: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(RunError::Args(msg)) => {
            eprintln!("vsan-witness: {msg}");
            ExitCode::from(2)
        }
        Err(RunError::Runtime(msg)) => {
            error!("{msg}");
            eprintln!("vsan-witness: {msg}");
            ExitCode::from(1)
        }
    }
}

/// A clap error as one line: its first paragraph (usage and tips dropped), without the
/// `error: ` prefix, whitespace runs collapsed.
fn one_line(rendered: &str) -> String {
    let first = rendered.split("\n\n").next().unwrap_or(rendered);
    let first = first.trim().strip_prefix("error:").unwrap_or(first);
    first.split_whitespace().collect::<Vec<_>>().join(" ")
}

async fn run(args: Args) -> Result<(), RunError> {
    use tokio::signal::unix::{SignalKind, signal};
    // Watch the signals before announcing readiness: a signal right after the ready line
    // must stop the witness cleanly, not kill it.
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| RunError::Runtime(format!("cannot watch SIGINT: {e}")))?;
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| RunError::Runtime(format!("cannot watch SIGTERM: {e}")))?;

    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| RunError::Args(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| RunError::Runtime(format!("cannot read the listening address: {e}")))?;

    let mut serving = tokio::spawn(witness::serve(listener, args.state.clone()));
    // The witness accepts only once its state is loaded, so a PONG from itself means it
    // serves with its past decisions; a bad state file fails before the ready line.
    let answered = tokio::select! {
        served = &mut serving => return Err(ended(served)),
        answered = self_ping(addr) => answered,
    };
    if let Err(e) = answered {
        // Most likely the witness failed and closed its listener just now.
        if let Ok(served) = tokio::time::timeout(Duration::from_secs(1), &mut serving).await {
            return Err(ended(served));
        }
        warn!("cannot ping the witness itself ({e}); announcing it anyway");
    }

    let mut out = std::io::stdout().lock();
    writeln!(out, "ready witness={addr}")
        .and_then(|()| out.flush())
        .map_err(|e| RunError::Runtime(format!("cannot print the ready line: {e}")))?;
    drop(out);
    info!(%addr, state = ?args.state, "vsan-witness ready");

    tokio::select! {
        served = &mut serving => return Err(ended(served)),
        _ = int.recv() => info!("SIGINT received"),
        _ = term.recv() => info!("SIGTERM received"),
    }
    serving.abort();
    info!("vsan-witness stopped");
    Ok(())
}

/// Why the serving task ended (it only ends on error).
fn ended(served: Result<vsan_core::Result<()>, tokio::task::JoinError>) -> RunError {
    RunError::Runtime(match served {
        Ok(Ok(())) => "the witness stopped serving".to_string(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => format!("the witness task failed: {e}"),
    })
}

/// One `PING` round trip to the witness at `addr` (loopback when it listens on every
/// address).
async fn self_ping(addr: SocketAddr) -> std::io::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let mut target = addr;
    if target.ip().is_unspecified() {
        target.set_ip(match addr {
            SocketAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
        });
    }
    let ping = async {
        let mut stream = tokio::net::TcpStream::connect(target).await?;
        stream.write_all(b"PING\n").await?;
        let mut reply = String::new();
        BufReader::new(stream).read_line(&mut reply).await?;
        if reply.trim_end() == "PONG" {
            Ok(())
        } else {
            Err(std::io::Error::other(format!("answered {reply:?}")))
        }
    };
    tokio::time::timeout(Duration::from_secs(5), ping)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}
