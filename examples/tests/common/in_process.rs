//! Nodes started in the test process (the library's [`Node`], not `vsan-node`), with the
//! management service on, and a gRPC client for them.

use vsan::node::config::Config;
use vsan::node::{Node, StartOptions};
use vsan_replica::mgmt::v1::mgmt_client::MgmtClient;

/// Start a node in this process: id 1, data in `dir`, management on any free loopback
/// port, `extra_node` added to `[node]`, then `disks`.
pub async fn node(dir: &std::path::Path, extra_node: &str, disks: &str) -> Node {
    let text = format!(
        "[node]\nid = 1\ndata_dir = {:?}\nmgmt = \"127.0.0.1:0\"\n{extra_node}\n{disks}",
        dir.display().to_string()
    );
    let cfg = Config::parse(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    Node::start(&cfg, StartOptions::default())
        .await
        .unwrap_or_else(|e| panic!("start: {e}"))
}

/// A gRPC client of `n`'s management service.
pub async fn client(n: &Node) -> MgmtClient<tonic::transport::Channel> {
    MgmtClient::connect(format!("http://{}", n.mgmt_address().unwrap()))
        .await
        .unwrap()
}
