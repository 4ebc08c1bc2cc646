//! A TCP fault proxy for tests: put it between two nodes (or a node and the witness) and
//! cut the link on demand.
//!
//! ```text
//!   client ──> Proxy (127.0.0.1:random) ──> target
//!                 cut():  every proxied connection is reset, new ones are closed at once
//!                 heal(): new connections are proxied again
//! ```
//!
//! It runs on its own thread with its own single-threaded tokio runtime, so plain
//! `#[test]` functions can use it. [`Proxy::cut`] returns only once every live connection
//! is reset, so a test needs no sleep to know the link is down.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::thread::{self, JoinHandle};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// What the test thread asks of the proxy's runtime; each carries a channel to confirm.
enum Command {
    /// Close every proxied connection now.
    Cut(std_mpsc::Sender<()>),
}

/// A running proxy; dropping it stops it and closes every connection.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    /// Dropping it tells the runtime to stop.
    commands: Option<mpsc::UnboundedSender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listen on `127.0.0.1:0` and forward every connection to `target` (a loopback
    /// address: tests never leave the machine).
    pub fn start(target: SocketAddr) -> Proxy {
        assert!(
            target.ip().is_loopback(),
            "the proxy only forwards to loopback, not {target}"
        );
        let listener = StdListener::bind("127.0.0.1:0").expect("proxy: bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("proxy: local address");
        listener
            .set_nonblocking(true)
            .expect("proxy: non-blocking listener");
        let cut = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::unbounded_channel();
        let flag = Arc::clone(&cut);
        let thread = thread::Builder::new()
            .name(format!("proxy-{addr}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy: tokio runtime");
                rt.block_on(run(listener, target, flag, rx));
            })
            .expect("proxy: spawn its thread");
        Proxy {
            addr,
            cut,
            commands: Some(tx),
            thread: Some(thread),
        }
    }

    /// The address clients connect to instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Reset every proxied connection at once, and from now on accept and immediately
    /// close new ones. Returns once the live connections are closed.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        let (done, wait) = std_mpsc::channel();
        let sent = self
            .commands
            .as_ref()
            .is_some_and(|c| c.send(Command::Cut(done)).is_ok());
        assert!(sent, "proxy {} is not running", self.addr);
        wait.recv()
            .unwrap_or_else(|_| panic!("proxy {} stopped while cutting", self.addr));
    }

    /// Proxy new connections again (the ones cut stay closed).
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Whether the link is cut.
    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Closing the command channel ends the runtime's loop; dropping the runtime then
        // drops every connection task and its sockets.
        self.commands.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn run(
    listener: StdListener,
    target: SocketAddr,
    cut: Arc<AtomicBool>,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let listener = TcpListener::from_std(listener).expect("proxy: register the listener");
    // Bumped on every cut; each connection watches it.
    let (cuts, _) = watch::channel(0u64);
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                // Checked here, on the loop that also handles Cut: a connection accepted
                // before a cut is reset by it, one accepted after sees the flag.
                if cut.load(Ordering::SeqCst) {
                    reset(client);
                } else {
                    conns.spawn(pipe(client, target, cuts.subscribe()));
                }
            }
            command = commands.recv() => match command {
                Some(Command::Cut(done)) => {
                    cuts.send_modify(|n| *n += 1);
                    // Each connection resets its sockets and ends; wait for all of them.
                    while conns.join_next().await.is_some() {}
                    let _ = done.send(());
                }
                None => return,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Close `stream` with a reset rather than an orderly FIN, as a broken link would.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Forward bytes both ways between `client` and a new connection to `target` until both
/// directions are done (then close normally), or until a cut (then reset both).
async fn pipe(mut client: TcpStream, target: SocketAddr, mut cut: watch::Receiver<u64>) {
    let _ = client.set_nodelay(true);
    let mut upstream = None;
    let was_cut = tokio::select! {
        _ = forward(&mut client, target, &mut upstream) => false,
        _ = cut.changed() => true,
    };
    if was_cut {
        reset(client);
        if let Some(upstream) = upstream {
            reset(upstream);
        }
    }
}

async fn forward(client: &mut TcpStream, target: SocketAddr, upstream: &mut Option<TcpStream>) {
    let Ok(stream) = TcpStream::connect(target).await else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let upstream = upstream.insert(stream);
    let _ = tokio::io::copy_bidirectional(client, upstream).await;
}
