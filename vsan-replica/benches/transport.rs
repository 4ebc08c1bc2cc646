//! Micro figures for the wire codec and the TCP transport, each beside its baseline:
//! a 4 KiB write's encode/decode; a QD1 4 KiB write round trip (write, ack) over a TCP
//! link vs the same bytes over a bare tokio socket; and 256 pipelined 4 KiB writes.
//!
//! `cargo bench -p vsan-replica --bench transport`

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use vsan_replica::protocol::{Message, Status, WritePayload};
use vsan_replica::transport::{Link, TcpTransport, Transport};
use vsan_replica::wire;

fn write(id: u64) -> Message {
    Message::Write {
        id,
        offset: id * 4096,
        payload: WritePayload::Data(Bytes::from(vec![0xa5; 4096])),
        fua: false,
    }
}

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("wire");
    g.throughput(Throughput::Bytes(4096));
    let msg = write(1);
    g.bench_function("encode_4k_write", |b| {
        b.iter(|| wire::encode(&msg).unwrap())
    });
    let mut frame = BytesMut::new();
    wire::encode_into(&msg, &mut frame).unwrap();
    g.bench_function("decode_4k_write", |b| {
        b.iter_batched_ref(
            || frame.clone(),
            |buf| wire::decode(buf).unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A link whose peer acknowledges every write.
async fn link_to_acker() -> Link {
    let t = TcpTransport::new();
    let listener = t.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let (link, peer) = tokio::join!(t.connect(&addr), listener.accept());
    let mut peer = peer.unwrap();
    tokio::spawn(async move {
        while let Ok(msg) = peer.recv().await {
            if let Message::Write { id, .. } = msg {
                let ack = Message::WriteAck {
                    id,
                    status: Status::Ok,
                };
                if peer.send(ack).await.is_err() {
                    return;
                }
            }
        }
    });
    link.unwrap()
}

/// A bare socket whose peer answers every 4116-byte request with 16 bytes.
async fn raw_to_acker() -> TcpStream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let (mut server, _) = server.unwrap();
    server.set_nodelay(true).unwrap();
    tokio::spawn(async move {
        let mut req = vec![0u8; 4116];
        while server.read_exact(&mut req).await.is_ok() {
            if server.write_all(&[0u8; 16]).await.is_err() {
                return;
            }
        }
    });
    let client = client.unwrap();
    client.set_nodelay(true).unwrap();
    client
}

fn tcp(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("tcp_loopback");
    g.measurement_time(Duration::from_secs(5));

    let mut link = rt.block_on(link_to_acker());
    let mut id = 0;
    g.bench_function("qd1_4k_write_ack_link", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    id += 1;
                    link.send(write(id)).await.unwrap();
                    link.recv().await.unwrap();
                }
                start.elapsed()
            })
        })
    });

    let mut raw = rt.block_on(raw_to_acker());
    let req = vec![0x5au8; 4116];
    g.bench_function("qd1_4k_write_ack_bare_socket", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    raw.write_all(&req).await.unwrap();
                    let mut ack = [0u8; 16];
                    raw.read_exact(&mut ack).await.unwrap();
                }
                start.elapsed()
            })
        })
    });

    const DEPTH: u64 = 256;
    g.throughput(Throughput::Bytes(DEPTH * 4096));
    g.bench_function("pipelined_256_4k_writes_link", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    for i in 0..DEPTH {
                        link.send(write(i)).await.unwrap();
                    }
                    for _ in 0..DEPTH {
                        link.recv().await.unwrap();
                    }
                }
                start.elapsed()
            })
        })
    });
    g.finish();
}

criterion_group!(benches, codec, tcp);
criterion_main!(benches);
