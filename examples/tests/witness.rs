//! The quorum witness as a real `vsan-witness` process, driven by `WitnessClient`s for
//! nodes 1 and 2 and by raw protocol lines: who gets a disk when the mirror link is cut,
//! that a decision survives a witness restart with `--state`, that garbage is answered
//! with `ERR` and does not stop the service, and that a node learns quickly when the
//! witness cannot be reached. Also checks the fault proxy the mirror tests cut links with.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener, TcpStream as StdStream};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::witness::{VSAN_WITNESS, Witness};
use common::{TestDir, run_command};
use vsan_core::ErrorKind;
use vsan_replica::witness::WitnessClient;

/// How long a raw-protocol read may block before the test fails instead of hanging.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A runtime for the async client.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `claim`, requiring the witness to answer.
fn claim(rt: &tokio::runtime::Runtime, client: &WitnessClient, disk: &str) -> bool {
    rt.block_on(client.claim(disk))
        .unwrap_or_else(|e| panic!("claim {disk} at {}: {e}", client.addr()))
}

/// `release`, requiring the witness to answer.
fn release(rt: &tokio::runtime::Runtime, client: &WitnessClient, disk: &str) {
    rt.block_on(client.release(disk))
        .unwrap_or_else(|e| panic!("release {disk} at {}: {e}", client.addr()))
}

#[test]
fn one_holder_per_disk_until_it_releases() {
    let dir = TestDir::new("witness-claims");
    let witness = Witness::start(&dir, None);
    let rt = runtime();
    let (n1, n2) = (witness.client(1), witness.client(2));

    assert!(claim(&rt, &n1, "vol0"), "first claim is granted");
    assert!(
        claim(&rt, &n1, "vol0"),
        "the holder's claim is granted again"
    );
    assert!(!claim(&rt, &n2, "vol0"), "the other node is denied");

    // A release by a node that does not hold the disk changes nothing.
    release(&rt, &n2, "vol0");
    assert!(
        !claim(&rt, &n2, "vol0"),
        "still denied after its own release"
    );

    // Disks are independent.
    assert!(claim(&rt, &n2, "vol1"));
    assert!(!claim(&rt, &n1, "vol1"));

    // Released (twice: idempotent), the disk goes to whoever claims first.
    release(&rt, &n1, "vol0");
    release(&rt, &n1, "vol0");
    assert!(claim(&rt, &n2, "vol0"), "granted once the holder released");
    assert!(!claim(&rt, &n1, "vol0"), "the former holder is now denied");

    witness.stop();
}

#[test]
fn holders_survive_a_restart_with_state() {
    let dir = TestDir::new("witness-state");
    let state = dir.join("holders");
    let rt = runtime();

    let witness = Witness::start(&dir, Some(&state));
    assert!(claim(&rt, &witness.client(1), "vol0"));
    assert!(claim(&rt, &witness.client(2), "vol1"));
    witness.stop();

    // Restarted (on a new port), it keeps both decisions.
    let witness = Witness::start(&dir, Some(&state));
    let (n1, n2) = (witness.client(1), witness.client(2));
    assert!(!claim(&rt, &n2, "vol0"), "vol0 still held by node 1");
    assert!(!claim(&rt, &n1, "vol1"), "vol1 still held by node 2");
    assert!(claim(&rt, &n1, "vol0"), "node 1 still holds vol0");
    release(&rt, &n1, "vol0");
    witness.stop();

    // The release was persisted too.
    let witness = Witness::start(&dir, Some(&state));
    assert!(claim(&rt, &witness.client(2), "vol0"), "vol0 was released");
    assert!(!claim(&rt, &witness.client(1), "vol1"));
    witness.stop();

    // The operator escape: with the state file removed while stopped, nobody holds
    // anything any more.
    std::fs::remove_file(&state).expect("remove the state file");
    let witness = Witness::start(&dir, Some(&state));
    assert!(claim(&rt, &witness.client(1), "vol1"));
    witness.stop();
}

/// One raw protocol connection.
struct Raw {
    reader: BufReader<StdStream>,
    writer: StdStream,
}

impl Raw {
    fn connect(addr: &str) -> Raw {
        let stream = StdStream::connect(addr).expect("connect to the witness");
        stream
            .set_read_timeout(Some(IO_TIMEOUT))
            .expect("set a read timeout");
        let writer = stream.try_clone().expect("clone the stream");
        Raw {
            reader: BufReader::new(stream),
            writer,
        }
    }

    /// Send `request` (a newline is added) and return the reply line without newline.
    fn ask(&mut self, request: &[u8]) -> String {
        self.writer.write_all(request).expect("send a request");
        self.writer.write_all(b"\n").expect("send a request");
        let mut reply = String::new();
        self.reader.read_line(&mut reply).expect("read a reply");
        assert!(
            reply.ends_with('\n'),
            "no complete reply to {:?}: {reply:?}",
            String::from_utf8_lossy(&request[..request.len().min(40)])
        );
        reply.trim_end().to_string()
    }
}

#[test]
fn malformed_lines_get_err_and_the_witness_keeps_serving() {
    let dir = TestDir::new("witness-garbage");
    let witness = Witness::start(&dir, None);
    let mut raw = Raw::connect(witness.addr());

    let long = vec![b'x'; 5000];
    let garbage: [&[u8]; 10] = [
        b"HELLO",
        b"",
        b"claim 1 vol0",
        b"CLAIM",
        b"CLAIM 1",
        b"CLAIM one vol0",
        b"CLAIM 1 vol0 extra",
        b"RELEASE 99999999999 vol0",
        b"CLAIM 1 \xff\xfe",
        &long,
    ];
    for request in garbage {
        let reply = raw.ask(request);
        assert!(
            reply.starts_with("ERR "),
            "{:?} got {reply:?}",
            String::from_utf8_lossy(&request[..request.len().min(40)])
        );
    }
    // The same connection still works, and so does the protocol.
    assert_eq!(raw.ask(b"PING"), "PONG");
    assert_eq!(raw.ask(b"CLAIM 1 vol0\r"), "GRANTED");
    assert_eq!(raw.ask(b"CLAIM 2 vol0"), "DENIED 1");
    assert_eq!(raw.ask(b"RELEASE 2 vol0"), "OK");

    // A client that hangs up mid-line does not disturb anyone else.
    let mut rude = StdStream::connect(witness.addr()).expect("connect");
    rude.write_all(b"CLAIM 2 vo").expect("send half a line");
    drop(rude);

    let rt = runtime();
    assert!(!claim(&rt, &witness.client(2), "vol0"));
    assert!(claim(&rt, &witness.client(1), "vol0"));
    witness.stop();
}

#[test]
fn an_unreachable_witness_is_an_error_within_a_second() {
    let rt = runtime();

    // Nothing listens: refused at once.
    let closed = StdListener::bind("127.0.0.1:0").expect("bind");
    let addr = closed.local_addr().expect("local address");
    drop(closed);
    let start = Instant::now();
    let err = rt
        .block_on(WitnessClient::new(addr.to_string(), 1).claim("vol0"))
        .expect_err("claim against a closed port");
    assert!(start.elapsed() < Duration::from_millis(1500), "{err}");

    // A listener that never answers (the kernel completes the connect): the client's
    // 1 s limit ends the wait.
    let silent = StdListener::bind("127.0.0.1:0").expect("bind");
    let client = WitnessClient::new(silent.local_addr().expect("addr").to_string(), 1);
    let start = Instant::now();
    let err = rt
        .block_on(client.claim("vol0"))
        .expect_err("claim against a silent witness");
    let took = start.elapsed();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(1500),
        "took {took:?}"
    );
    let err = rt
        .block_on(client.release("vol0"))
        .expect_err("release against a silent witness");
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");

    // A witness that stopped: refused as well.
    let dir = TestDir::new("witness-stopped");
    let witness = Witness::start(&dir, None);
    let client = witness.client(1);
    witness.stop();
    let start = Instant::now();
    rt.block_on(client.claim("vol0"))
        .expect_err("claim against a stopped witness");
    assert!(start.elapsed() < Duration::from_millis(1500));
}

#[test]
fn bad_arguments_exit_2_with_one_line() {
    let held = StdListener::bind("127.0.0.1:0").expect("bind");
    let busy = held.local_addr().expect("addr").to_string();
    let cases: [&[&str]; 4] = [
        &[],
        &["--listen", "not-an-address"],
        &["--listen", "127.0.0.1:0", "--bogus"],
        &["--listen", &busy],
    ];
    for args in cases {
        let mut cmd = Command::new(VSAN_WITNESS);
        cmd.args(args);
        let out = run_command(cmd, Duration::from_secs(10));
        assert_eq!(out.status.code(), Some(2), "{out}");
        assert_eq!(out.stderr.trim_end().lines().count(), 1, "{out}");
        assert!(out.stderr.starts_with("vsan-witness: "), "{out}");
        assert!(out.stdout.is_empty(), "{out}");
    }
}

#[test]
fn a_corrupt_state_file_fails_the_start_before_ready() {
    let dir = TestDir::new("witness-corrupt");
    let state = dir.join("holders");
    std::fs::write(&state, "vol0 one\n").expect("write a corrupt state file");
    let mut cmd = Command::new(VSAN_WITNESS);
    cmd.args(["--listen", "127.0.0.1:0", "--state"])
        .arg(&state)
        .env("NO_COLOR", "1");
    let out = run_command(cmd, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert!(out.stdout.is_empty(), "announced ready anyway:\n{out}");
    assert!(out.stderr.contains("line 1"), "{out}");
    // The file is left for the operator to fix.
    assert_eq!(
        std::fs::read_to_string(&state).expect("state file"),
        "vol0 one\n"
    );
}

/// An echo server on its own runtime; reports on `closed` each time a connection ends.
fn echo_server(closed: mpsc::Sender<()>) -> (SocketAddr, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind the echo server");
    let addr = listener.local_addr().expect("echo address");
    rt.spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let closed = closed.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = closed.send(());
            });
        }
    });
    (addr, rt)
}

/// Whether `stream` is dead: a read gives end-of-stream or a reset, not a timeout.
fn is_closed(stream: &mut StdStream) -> bool {
    let mut buf = [0u8; 16];
    match stream.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

fn echo_once(stream: &mut StdStream, msg: &[u8]) {
    stream.write_all(msg).expect("write through the proxy");
    let mut got = vec![0u8; msg.len()];
    stream.read_exact(&mut got).expect("read the echo");
    assert_eq!(got, msg);
}

fn connect(addr: SocketAddr) -> StdStream {
    let s = StdStream::connect(addr).expect("connect to the proxy");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("read timeout");
    s
}

#[test]
fn proxy_cut_breaks_live_and_new_connections_until_healed() {
    let (closed_tx, closed) = mpsc::channel();
    let (target, _echo) = echo_server(closed_tx);
    let proxy = Proxy::start(target);
    assert!(!proxy.is_cut());

    let mut live = connect(proxy.addr());
    echo_once(&mut live, b"hello through the proxy");

    proxy.cut();
    assert!(proxy.is_cut());
    assert!(is_closed(&mut live), "the live connection survived the cut");
    closed
        .recv_timeout(IO_TIMEOUT)
        .expect("the target side of the cut connection was not closed");

    let mut new = connect(proxy.addr());
    let _ = new.write_all(b"anyone?");
    assert!(
        is_closed(&mut new),
        "a new connection was proxied while cut"
    );

    proxy.heal();
    assert!(!proxy.is_cut());
    let mut again = connect(proxy.addr());
    echo_once(&mut again, b"healed");
    echo_once(&mut again, b"and still");
}
