//! Serve one file (or a memory disk) over iSCSI, for trying initiators by hand:
//!
//! ```text
//! cargo run --release -p vsan-core --example iscsi_serve -- 127.0.0.1:3260 /tmp/disk.img 64M
//! iscsi-test-cu -d iscsi://127.0.0.1:3260/iqn.2026-12.io.vsan:example/0
//! ```
//!
//! Arguments: the portal address, a file path (created at the size given if missing) or
//! `mem`, and a size (`64M`, `1G`, bytes). `RUST_LOG` sets the log level.

use std::sync::Arc;

use vsan_core::export::iscsi::{Server, Target};
use vsan_core::scsi::{LogicalUnit, LuConfig, LuIdentity, TargetPort};
use vsan_core::{BlockDevice, FileOptions, Geometry, MemDevice};

const IQN: &str = "iqn.2026-12.io.vsan:example";

fn parse_size(s: &str) -> u64 {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().expect("a size such as 64M") * mul
}

#[tokio::main]
async fn main() -> vsan_core::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().collect();
    let portal = args.get(1).map_or("127.0.0.1:3260", |s| s.as_str());
    let path = args.get(2).map_or("mem", |s| s.as_str());
    let size = parse_size(args.get(3).map_or("64M", |s| s.as_str()));
    let device: Arc<dyn BlockDevice> = if path == "mem" {
        Arc::new(MemDevice::new(Geometry::new(size, 512)?))
    } else {
        Arc::new(FileOptions::new().create(size).open(path)?)
    };
    let lu = LogicalUnit::new(
        device,
        LuConfig {
            identity: LuIdentity::from_disk_id("example"),
            port: TargetPort {
                name: format!("{IQN},t,0x0001"),
                relative_id: 1,
                group: 1,
            },
            read_only: false,
            state_file: None,
        },
    )?;
    let server = Server::new(vec![Target::new(IQN, lu)])?;
    let listener = tokio::net::TcpListener::bind(portal).await?;
    println!("ready iscsi={} target={IQN}", listener.local_addr()?);
    server.serve_tcp(listener).await
}
