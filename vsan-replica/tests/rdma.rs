//! `RdmaTransport` where RDMA cannot be set up (no device on these machines, or built
//! without the `rdma` feature): links fall back to TCP, say so, and carry everything a
//! TCP link does, including authentication and a mirrored disk pair. Run both without
//! and with `--features rdma`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::timeout;
use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{Config, DiskId, LinkState, Message, WritePayload};
use vsan_replica::transport::rdma::{RdmaConfig, RdmaTransport};
use vsan_replica::transport::{Link, Listener, SharedSecret, TcpConfig, Transport};
use vsan_replica::{MirrorStatus, MirroredDisk, Replica};

const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {WAIT:?}"),
    }
}

/// Whether this machine has an RDMA device (these test machines have none).
fn has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// What the fall-back reason must say on this build and machine (`None`: RDMA may work
/// here, or fail for a reason of its own).
fn expected_reason() -> Option<&'static str> {
    if !cfg!(feature = "rdma") {
        Some("built without the rdma feature")
    } else if !has_rdma_device() {
        Some("no RDMA device")
    } else {
        None
    }
}

/// The link uses the transport status shows, and a TCP link comes with a reason.
fn check_fallback(who: &str, link_transport: &str, t: &RdmaTransport) {
    let Some(want) = expected_reason() else {
        assert!(
            link_transport == "rdma" || t.fallback_reason().is_some(),
            "{who}: {link_transport} with no reason"
        );
        return;
    };
    assert_eq!(link_transport, "tcp", "{who}");
    let why = t
        .fallback_reason()
        .unwrap_or_else(|| panic!("{who}: no reason"));
    assert!(why.contains(want), "{who}: {why}");
}

fn with_secret(secret: &[u8]) -> RdmaTransport {
    let mut tcp = TcpConfig::default();
    tcp.secret = Some(SharedSecret::new(secret).unwrap());
    let mut config = RdmaConfig::default();
    config.tcp = tcp;
    RdmaTransport::with_config(config)
}

async fn listen(t: &RdmaTransport) -> Box<dyn Listener> {
    within("listen", t.listen("127.0.0.1:0")).await.unwrap()
}

async fn pair(client: &RdmaTransport, server: &RdmaTransport) -> (Link, Link) {
    let listener = listen(server).await;
    let addr = listener.local_addr();
    let (c, s) = within("connect and accept", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    (c.unwrap(), s.unwrap())
}

fn write_msg(id: u64, rng: &mut SmallRng) -> Message {
    let mut data = vec![0u8; 4096];
    rng.fill(&mut data[..]);
    Message::Write {
        id,
        offset: id * 4096,
        payload: WritePayload::Data(Bytes::from(data)),
        fua: false,
    }
}

#[tokio::test]
async fn without_rdma_links_fall_back_to_tcp_and_say_why() {
    let client = RdmaTransport::new();
    let server = RdmaTransport::new();
    assert_eq!(client.name(), "rdma");
    assert_eq!(client.fallback_reason(), None);
    let (mut c, mut s) = pair(&client, &server).await;

    // The links are TCP links, and say so for status.
    check_fallback("client", c.transport(), &client);
    check_fallback("server", s.transport(), &server);
    if expected_reason().is_some() {
        assert!(c.peer().starts_with("tcp:"), "{}", c.peer());
    }

    // Messages round trip both ways, in order.
    let mut rng = SmallRng::seed_from_u64(1);
    let to_server: Vec<Message> = (0..200).map(|i| write_msg(i, &mut rng)).collect();
    for m in &to_server {
        c.send(m.clone()).await.unwrap();
    }
    for want in &to_server {
        assert_eq!(&within("server recv", s.recv()).await.unwrap(), want);
    }
    s.send(Message::Pong { id: 9 }).await.unwrap();
    assert_eq!(
        within("client recv", c.recv()).await.unwrap(),
        Message::Pong { id: 9 }
    );

    // Close ends the link for the peer after the last message.
    c.send(Message::Ping { id: 10 }).await.unwrap();
    within("close", c.close()).await.unwrap();
    assert_eq!(
        within("last", s.recv()).await.unwrap(),
        Message::Ping { id: 10 }
    );
    assert_eq!(
        within("end", s.recv()).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
}

#[tokio::test]
async fn the_tcp_secret_authenticates_fallback_links() {
    let (client, server) = (with_secret(b"shared"), with_secret(b"shared"));
    let (c, mut s) = pair(&client, &server).await;
    check_fallback("client", c.transport(), &client);
    c.send(Message::Ping { id: 1 }).await.unwrap();
    assert_eq!(
        within("ping", s.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );

    // A different secret is refused on both sides.
    let (client, server) = (with_secret(b"one"), with_secret(b"two"));
    let listener = listen(&server).await;
    let addr = listener.local_addr();
    let (c, s) = within("mismatch", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    for (who, r) in [("client", c), ("server", s)] {
        let err = r.expect_err(who);
        assert_eq!(err.kind(), ErrorKind::Protocol, "{who}: {err}");
    }
}

#[tokio::test]
async fn connecting_to_nothing_fails_with_the_tcp_error() {
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let t = RdmaTransport::new();
    let err = within("connect", t.connect(&free)).await.unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::Closed | ErrorKind::Io),
        "{err}"
    );
    assert!(t.fallback_reason().is_some());
}

#[tokio::test]
async fn invalid_settings_are_refused() {
    let mut config = RdmaConfig::default();
    config.credits = 1;
    let t = RdmaTransport::with_config(config);
    let err = t.connect("127.0.0.1:1").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = t.listen("127.0.0.1:0").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
}

// ----- a mirrored disk pair over RdmaTransport -----

const MIB: u64 = 1 << 20;
const BS: u32 = 512;
const NAME: &str = "vol0";

fn config(node: u32, size: u64) -> Config {
    let mut cfg = Config::new(node, 3 - node, DiskId([0x3c; 16]), NAME, size, BS);
    cfg.peer_timeout = Duration::from_secs(5);
    cfg.ping_interval = Duration::from_millis(100);
    cfg.connect_timeout = Duration::from_secs(2);
    cfg
}

async fn start(node: u32, local: Arc<MemDevice>) -> MirroredDisk {
    let cfg = config(node, local.geometry().size());
    let replica = Replica::with_memory_meta(&cfg, local).await.unwrap();
    MirroredDisk::start(cfg, replica, None).unwrap()
}

async fn wait_for(disk: &MirroredDisk, what: &str, pred: impl Fn(&MirrorStatus) -> bool) {
    let mut rx = disk.watch_status();
    let reached = timeout(WAIT, async {
        loop {
            if pred(&rx.borrow_and_update()) {
                return;
            }
            if rx.changed().await.is_err() {
                panic!("{what}: the mirror driver stopped");
            }
        }
    })
    .await;
    if reached.is_err() {
        panic!("{what}: not reached; status {:?}", disk.status());
    }
}

fn in_sync(s: &MirrorStatus) -> bool {
    s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0 && !s.inconsistent
}

async fn image(dev: &dyn BlockDevice) -> Vec<u8> {
    let size = dev.geometry().size() as usize;
    within("read image", dev.read(0, size))
        .await
        .unwrap()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mirrored_pair_over_rdma_transport_mirrors_writes_over_tcp() {
    let geometry = Geometry::new(4 * MIB, BS).unwrap();
    let (m1, m2) = (
        Arc::new(MemDevice::new(geometry)),
        Arc::new(MemDevice::new(geometry)),
    );
    let d2 = start(2, Arc::clone(&m2)).await;
    let server = RdmaTransport::new();
    let listener = listen(&server).await;
    let addr = listener.local_addr();
    let disks = HashMap::from([(NAME.to_string(), d2.clone())]);
    let accept = tokio::spawn(accept_loop(listener, disks));

    let d1 = start(1, Arc::clone(&m1)).await;
    let client = RdmaTransport::new();
    let dial = tokio::spawn(dial_loop(
        Arc::new(client.clone()),
        addr.clone(),
        d1.clone(),
    ));
    wait_for(&d1, "node 1 in sync", in_sync).await;
    wait_for(&d2, "node 2 in sync", in_sync).await;

    // Status shows the transport in use, and the transport says why.
    let s1 = d1.status();
    let in_use = s1.link_transport.as_deref().unwrap_or("none");
    check_fallback("node 1", in_use, &client);
    assert_eq!(
        d2.status().link_transport,
        s1.link_transport,
        "both ends agree"
    );

    // Writes from both nodes, large and small, some FUA; then a flush on each.
    let mut rng = SmallRng::seed_from_u64(7);
    for i in 0..64u64 {
        let len = [512usize, 4096, 65536, 200 * 1024][(i % 4) as usize];
        let offset = rng.random_range(0..(4 * MIB - len as u64) / 512) * 512;
        let mut data = vec![0u8; len];
        rng.fill(&mut data[..]);
        let (disk, flags) = if i % 2 == 0 {
            (&d1, IoFlags::empty())
        } else {
            (&d2, IoFlags::FUA)
        };
        within(
            "write",
            disk.write(offset, Bytes::from(data.clone()), flags),
        )
        .await
        .unwrap();
        let other = if i % 2 == 0 { &d2 } else { &d1 };
        let back = within("read back", other.read(offset, len)).await.unwrap();
        assert_eq!(
            &back[..],
            &data[..],
            "write {i} read back on the other node"
        );
    }
    within("flush 1", d1.flush()).await.unwrap();
    within("flush 2", d2.flush()).await.unwrap();

    let (i1, i2) = (image(&*m1).await, image(&*m2).await);
    assert!(i1 == i2, "the replicas differ");
    assert!(i1.iter().any(|&b| b != 0), "nothing was written");

    dial.abort();
    accept.abort();
}
