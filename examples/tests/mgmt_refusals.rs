//! What the management API refuses, end to end: `vsanctl` (the binary) against a real
//! `vsan-node` serving `vsan.mgmt.v1`:
//!
//! - bad input: an unknown disk, an empty name, a size that is not one, a wrong or
//!   missing token, garbage and HTTP/1 on the port, a malformed protobuf: each gets its
//!   gRPC code (or exit 2 before anything is sent) and the node keeps serving;
//! - a config with an empty or padded token is refused;
//! - TLS: `--tls-ca` with a CA that signed the node's certificate, and without.
//!
//! A missing qemu-io (or openssl, for TLS) skips a test with a `SKIP:` line, or fails it
//! when `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::vsanctl::{
    MGMT, assert_node_error, assert_usage_error, code, mgmt_addr, vsanctl, vsanctl_cmd, vsanctl_ok,
};
use common::{
    Node, Region, Sig, TOOL_TIMEOUT, TestDir, qemu_io_reads, qemu_io_writes, require_tool,
    run_command, toml_str,
};
use serde_json::Value;
use vsan::node::config::Config;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
const DISK: &str = "vol0";

/// A node with a token, a local disk and a cached one (nothing mirrored).
fn start_token_node(dir: &TestDir, token_lines: &str) -> (Node, String) {
    let config = format!(
        "[node]\nid = 1\ndata_dir = {}\n{MGMT}{token_lines}\n\
         [[disk]]\nname = \"vol0\"\nsize = \"4MiB\"\nnbd = \"127.0.0.1:0\"\n\n\
         [[disk]]\nname = \"fast\"\nsize = \"4MiB\"\nnbd = \"127.0.0.1:0\"\n\
         [disk.cache]\npath = {}\nsize = \"1MiB\"\n",
        toml_str(dir.data_dir()),
        toml_str(dir.join("fast.cache")),
    );
    let node = Node::start(dir, &config, &[DISK, "fast"]);
    let m = mgmt_addr(&node);
    (node, m)
}

/// Raw gRPC: a request body sent as given, the answer's bytes returned as they come.
mod raw {
    use bytes::{Buf, BufMut, Bytes};
    use tonic::Status;
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    #[derive(Debug, Clone, Copy, Default)]
    pub struct RawCodec;

    impl Codec for RawCodec {
        type Encode = Bytes;
        type Decode = Bytes;
        type Encoder = RawCodec;
        type Decoder = RawCodec;
        fn encoder(&mut self) -> RawCodec {
            RawCodec
        }
        fn decoder(&mut self) -> RawCodec {
            RawCodec
        }
    }

    impl Encoder for RawCodec {
        type Item = Bytes;
        type Error = Status;
        fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
            dst.put(item);
            Ok(())
        }
    }

    impl Decoder for RawCodec {
        type Item = Bytes;
        type Error = Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
            Ok(Some(src.copy_to_bytes(src.remaining())))
        }
    }
}

/// Send `body` (not necessarily a valid message) to `method` of the node's service.
async fn raw_call(
    addr: &str,
    token: &str,
    method: &'static str,
    body: Vec<u8>,
) -> Result<bytes::Bytes, tonic::Status> {
    use tonic::codegen::http::uri::PathAndQuery;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("an address")
        .connect()
        .await
        .expect("connect to the management service");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("the channel is ready");
    let mut req = tonic::Request::new(bytes::Bytes::from(body));
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("an ASCII token"),
    );
    grpc.unary(req, PathAndQuery::from_static(method), raw::RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// Write `bytes` on a fresh connection to `addr` and read until the node closes it;
/// what it answered. Panics if it neither answers nor closes within 10 s.
fn send_raw(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connect to the management port");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    // The node may close before it has read everything: a reset is an answer too.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the node neither answered nor closed the connection: {e}"),
    }
    got
}

#[test]
fn bad_input_gets_its_grpc_code_and_the_node_keeps_serving() {
    const TOKEN: &str = "s3cret-token";
    let dir = TestDir::new("mgmt-bad");
    let (node, m) = start_token_node(&dir, &format!("mgmt_token = \"{TOKEN}\"\n"));
    let with_token = |args: &[&str]| {
        let mut a = vec!["--token", TOKEN];
        a.extend_from_slice(args);
        vsanctl(&m, &a)
    };

    // Tokens: missing, wrong, right (as an option, a file, the environment).
    let out = vsanctl(&m, &["status"]);
    assert_node_error(&out, "UNAUTHENTICATED", "requires a bearer token");
    let out = vsanctl(&m, &["--token", "s3cret-tokem", "status"]);
    assert_node_error(&out, "UNAUTHENTICATED", "wrong bearer token");
    with_token(&["status"]).assert_success();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token file");
    let tf = token_file.to_str().expect("a UTF-8 path");
    vsanctl_ok(&m, &["--token-file", tf, "list"]);
    let env = [("VSAN_MGMT", m.as_str()), ("VSAN_MGMT_TOKEN", TOKEN)];
    let out = run_command(vsanctl_cmd(None, &["list"], &env), TOOL_TIMEOUT);
    out.assert_success();
    assert_eq!(out.stdout, "vol0\nfast\n", "{out}");

    // Unknown disk, empty name: the node's code and message, exit 1.
    let line = assert_node_error(&with_token(&["status", "nope"]), "NOT_FOUND", "");
    assert_eq!(line, "vsanctl: NOT_FOUND: node 1 has no disk \"nope\"");
    assert_node_error(
        &with_token(&["status", ""]),
        "INVALID_ARGUMENT",
        "a disk name is required",
    );
    assert_node_error(&with_token(&["delete", "nope"]), "NOT_FOUND", "\"nope\"");
    assert_node_error(
        &with_token(&["create", DISK, "--size", "1MiB"]),
        "ALREADY_EXISTS",
        "\"vol0\"",
    );
    // Actions that need a mirror or a cache, on a disk without.
    for args in [
        &["discard-my-data", DISK][..],
        &["verify", DISK],
        &["cancel-verify", DISK],
        &["set-rate", DISK, "40MiB"],
        &["detach", DISK],
        &["attach", DISK],
    ] {
        assert_node_error(&with_token(args), "FAILED_PRECONDITION", "is not mirrored");
    }
    assert_node_error(
        &with_token(&["cache-mode", DISK, "write-through"]),
        "FAILED_PRECONDITION",
        "has no cache",
    );
    // The cached disk switches modes.
    let out = with_token(&["--json", "cache-mode", "fast", "write-through"]);
    out.assert_success();
    let said: Value = serde_json::from_str(&out.stdout).expect("a JSON answer");
    assert!(
        said["message"].as_str().is_some_and(|m| m.contains("fast")),
        "{out}"
    );
    // Nothing to watch on a disk without a mirror.
    let out = with_token(&["watch", DISK]);
    assert_eq!(code(&out), 1, "{out}");
    assert!(out.stderr.contains("vol0 is not mirrored"), "{out}");
    let s: Value = serde_json::from_str(&with_token(&["status", "fast", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(s["cache"]["mode"], "write-through", "{s:#}");
    assert_eq!(s["cache"]["state"], "running", "{s:#}");
    assert_eq!(s["link"], "local", "{s:#}");
    assert_eq!(s["mirrored"], false, "{s:#}");

    // A disk made and removed at run time; bad names and sizes refused.
    let out = with_token(&[
        "create",
        "x",
        "--size",
        "1MiB",
        "--backing",
        "mem",
        "--nbd",
        "127.0.0.1:0",
    ]);
    out.assert_success();
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("x ") && l.contains("local")),
        "{out}"
    );
    let s: Value = serde_json::from_str(&with_token(&["status", "x", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(s["size"], MIB, "{s:#}");
    assert_eq!(s["link"], "local", "{s:#}");
    let nbd = s["nbd"]
        .as_str()
        .unwrap_or_else(|| panic!("x is not exported: {s:#}"))
        .to_string();
    assert_eq!(with_token(&["list"]).stdout, "vol0\nfast\nx\n");
    if require_tool("qemu-io") {
        let r = Region::new(0x42, 0, 64 * KIB);
        qemu_io_writes(&format!("nbd://{nbd}/x"), &[r]);
        qemu_io_reads(&format!("nbd://{nbd}/x"), &[r]);
    }
    let out = with_token(&["delete", "x"]);
    out.assert_success();
    assert!(out.stdout.contains("deleted"), "{out}");
    assert_node_error(&with_token(&["status", "x"]), "NOT_FOUND", "\"x\"");
    assert_node_error(
        &with_token(&["create", "y", "--size", "1000"]),
        "INVALID_ARGUMENT",
        "not a positive multiple of the block size",
    );
    assert_node_error(
        &with_token(&["create", "bad name", "--size", "1MiB"]),
        "INVALID_ARGUMENT",
        "is not a disk name",
    );
    assert_node_error(
        &with_token(&["create", "y", "--size", "1MiB", "--nbd", "nowhere"]),
        "INVALID_ARGUMENT",
        "nbd",
    );

    // Bad usage: exit 2, nothing sent.
    assert_usage_error(&with_token(&["create", "x", "--size", "banana"]), "banana");
    assert_usage_error(&with_token(&["create", "x", "--size", "0"]), "--size");
    assert_usage_error(&with_token(&["set-rate", DISK, "fast"]), "dynamic");
    assert_usage_error(
        &with_token(&["cache-mode", DISK, "sometimes"]),
        "write-back",
    );
    assert_usage_error(&with_token(&["frobnicate"]), "frobnicate");
    assert_usage_error(&vsanctl(&m, &[]), "Usage");
    assert_usage_error(
        &vsanctl(&m, &["--token-file", "/nonexistent/token", "list"]),
        "/nonexistent/token",
    );
    assert_usage_error(
        &vsanctl(&m, &["--token", TOKEN, "--tls-domain", "x", "list"]),
        "--tls-ca",
    );
    // A node nobody serves: exit 1, said plainly.
    let out = vsanctl("127.0.0.1:1", &["status"]);
    assert_eq!(code(&out), 1, "{out}");
    assert!(
        out.stderr
            .contains("cannot reach the node at http://127.0.0.1:1"),
        "{out}"
    );

    // Not gRPC at all: garbage, HTTP/1. The node closes the connection.
    let garbage: Vec<u8> = (0..65536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    send_raw(&m, &garbage);
    let answer = send_raw(
        &m,
        b"GET /vsan.mgmt.v1.Mgmt/ListDisks HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    eprintln!("HTTP/1 answer: {:?}", String::from_utf8_lossy(&answer));
    // gRPC with a malformed message, an unknown method, a message over the limit, and
    // (typed) a CreateDisk of size 0.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let get = "/vsan.mgmt.v1.Mgmt/GetDiskStatus";
        let e = raw_call(&m, TOKEN, get, vec![0xff, 0xff, 0xff, 0xff])
            .await
            .expect_err("a malformed message was accepted");
        eprintln!("malformed message: {e:?}");
        assert!(
            e.code() == tonic::Code::InvalidArgument && e.message().contains("malformed"),
            "{e:?}"
        );
        let e = raw_call(&m, TOKEN, "/vsan.mgmt.v1.Mgmt/Frobnicate", vec![])
            .await
            .expect_err("an unknown method answered");
        assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
        // Field 1 (name) as a 5 MiB string.
        let mut big = vec![0x0a, 0x80, 0x80, 0xc0, 0x02];
        big.resize(big.len() + 5 * MIB as usize, b'a');
        let e = raw_call(&m, TOKEN, get, big)
            .await
            .expect_err("a 5 MiB message was accepted");
        eprintln!("5 MiB message: {e:?}");
        assert!(
            matches!(
                e.code(),
                tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
            ),
            "{e:?}"
        );
        // The token is checked before the message is read.
        let e = raw_call(&m, "wrong", get, vec![0x0a, 0x04, b'v', b'o', b'l', b'0'])
            .await
            .expect_err("a wrong token was let in");
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        let ok = raw_call(&m, TOKEN, get, vec![0x0a, 0x04, b'v', b'o', b'l', b'0'])
            .await
            .expect("a well-formed raw request");
        assert!(!ok.is_empty());

        use vsan_replica::mgmt::AddToken;
        use vsan_replica::mgmt::v1;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{m}"))
            .expect("an address")
            .connect()
            .await
            .expect("connect");
        let mut client = v1::mgmt_client::MgmtClient::with_interceptor(
            channel,
            AddToken::new(Some(TOKEN)).expect("an ASCII token"),
        );
        let e = client
            .create_disk(v1::CreateDiskRequest {
                name: "x".into(),
                size: 0,
                ..Default::default()
            })
            .await
            .expect_err("a disk of size 0 was created");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("size 0"), "{e:?}");
        let e = client
            .set_cache_mode(v1::SetCacheModeRequest {
                name: "fast".into(),
                mode: 77,
            })
            .await
            .expect_err("cache mode 77 was taken");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("not a cache mode"), "{e:?}");
        let e = client
            .watch_disk_status(v1::WatchRequest {
                name: "nope".into(),
                interval_ms: 0,
            })
            .await
            .expect_err("a watch of no disk");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    });

    // After all of it the node still answers, over the API and over NBD.
    let s: Value = serde_json::from_str(&with_token(&["status", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(s["disks"].as_array().map(Vec::len), Some(2), "{s:#}");
    if require_tool("qemu-io") {
        let r = Region::new(0x77, MIB, 64 * KIB);
        qemu_io_writes(&node.uri_named(DISK), &[r]);
        qemu_io_reads(&node.uri_named(DISK), &[r]);
    }
    let log = node.log();
    assert!(!log.contains("panicked"), "the node panicked:\n{log}");
    node.stop_clean(Sig::TERM);
}

/// `openssl args...`, required to succeed.
fn openssl(dir: &TestDir, args: &[&str]) {
    let mut cmd = Command::new("openssl");
    cmd.args(args).current_dir(dir.path());
    run_command(cmd, TOOL_TIMEOUT).assert_success();
}

#[test]
fn tls_with_the_nodes_ca_and_a_token() {
    if !require_tool("openssl") {
        return;
    }
    let dir = TestDir::new("mgmt-tls");
    // A CA, and a certificate for 127.0.0.1 it signs; another CA that signed nothing.
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for ca in ["ca", "other"] {
        let (key, pem, subj) = (
            format!("{ca}.key"),
            format!("{ca}.pem"),
            format!("/CN=vsan test {ca}"),
        );
        let mut a = vec!["req", "-x509"];
        a.extend(ec);
        a.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subj]);
        openssl(&dir, &a);
    }
    let mut a = vec!["req"];
    a.extend(ec);
    a.extend([
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    openssl(&dir, &a);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName = IP:127.0.0.1, DNS:localhost\nbasicConstraints = CA:FALSE\n",
    )
    .expect("write ext.cnf");
    openssl(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "node.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "node.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
    let lines = format!(
        "mgmt_token = \"tls-token\"\nmgmt_cert = {}\nmgmt_key = {}\n",
        toml_str(dir.join("node.pem")),
        toml_str(dir.join("node.key"))
    );
    let (node, m) = start_token_node(&dir, &lines);
    let ca = dir.join("ca.pem");
    let ca = ca.to_str().expect("a UTF-8 path");
    let other = dir.join("other.pem");
    let other = other.to_str().expect("a UTF-8 path");

    let out = vsanctl_ok(&m, &["--tls-ca", ca, "--token", "tls-token", "list"]);
    assert_eq!(out.stdout, "vol0\nfast\n", "{out}");
    let https = format!("https://{m}");
    vsanctl_ok(&https, &["--tls-ca", ca, "--token", "tls-token", "status"]);
    let localhost = m.replace("127.0.0.1", "localhost");
    vsanctl_ok(
        &localhost,
        &["--tls-ca", ca, "--token", "tls-token", "list"],
    );
    // The token is still required under TLS.
    let out = vsanctl(&m, &["--tls-ca", ca, "status"]);
    assert_node_error(&out, "UNAUTHENTICATED", "bearer token");
    // A CA that did not sign the node's certificate, or no TLS at all: refused, exit 1.
    let out = vsanctl(&m, &["--tls-ca", other, "--token", "tls-token", "status"]);
    assert_eq!(code(&out), 1, "{out}");
    eprintln!("wrong CA: {}", out.stderr.trim());
    let out = vsanctl(&m, &["--token", "tls-token", "status"]);
    assert_eq!(code(&out), 1, "{out}");
    assert!(out.stderr.contains("--tls-ca"), "no hint at TLS:\n{out}");
    eprintln!("no TLS: {}", out.stderr.trim());
    // https without a CA to check it with is a usage error.
    assert_usage_error(&vsanctl(&https, &["status"]), "--tls-ca");
    vsanctl_ok(
        &m,
        &["--tls-ca", ca, "--token", "tls-token", "status", DISK],
    );
    node.stop_clean(Sig::TERM);
}

/// An empty `mgmt_token` was accepted (and then any `Bearer ` passed).
#[test]
fn an_empty_or_padded_token_is_refused_by_the_config() {
    for token in ["\"\"", "\"  \"", "\" x\""] {
        let text = format!(
            "[node]\nid = 1\ndata_dir = \"/tmp/x\"\nmgmt = \"127.0.0.1:0\"\nmgmt_token = {token}\n"
        );
        let e = Config::parse(&text).expect_err(token);
        assert!(e.to_string().contains("mgmt_token"), "{e}");
    }
}
