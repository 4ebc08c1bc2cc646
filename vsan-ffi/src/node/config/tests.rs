//! The config parser's unit tests: what parses, and errors that name the key.

use super::*;

const GOOD: &str = r#"
[node]
id = 1
data_dir = "/tmp/n1"

[[disk]]
name = "vol0"
size = "1GiB"
nbd = "127.0.0.1:10809"
"#;

#[test]
fn parses_the_design_example_subset() {
    let c = Config::parse(GOOD).unwrap();
    assert_eq!(c.disk[0].size, Size(1 << 30));
    assert_eq!(c.disk[0].backing, Backing::File);
    assert_eq!(
        c.disk[0].image_path(Path::new("/d")),
        PathBuf::from("/d/vol0.img")
    );
}

#[test]
fn cache_section_defaults_and_keys() {
    let c = Config::parse(&format!("{GOOD}\n[disk.cache]\npath = \"/f/c\"\n")).unwrap();
    let d = &c.disk[0];
    assert_eq!(d.block_size(), 4096, "a cached disk has the cache's blocks");
    let cache = d.cache.as_ref().unwrap();
    assert_eq!(cache.size, None);
    let s = cache.settings().unwrap();
    let def = CacheConfig::default();
    assert_eq!(s.mode, Some(CacheMode::WriteBack));
    assert_eq!(
        (s.sequential_cutoff, s.high_watermark, s.low_watermark),
        (def.sequential_cutoff, def.high_watermark, def.low_watermark)
    );
    let c = Config::parse(&format!(
        "{GOOD}\n[disk.cache]\npath = \"/f/c\"\nsize = \"256MiB\"\nmode = \"pass-through\"\n\
             sequential_cutoff = \"0\"\nhigh_watermark = 90\nlow_watermark = 10\n"
    ))
    .unwrap();
    let cache = c.disk[0].cache.as_ref().unwrap();
    assert_eq!(cache.size, Some(Size(256 << 20)));
    let s = cache.settings().unwrap();
    assert_eq!(s.mode, Some(CacheMode::PassThrough));
    assert_eq!(
        (s.sequential_cutoff, s.high_watermark, s.low_watermark),
        (0, 90, 10)
    );
    assert_eq!(Config::parse(GOOD).unwrap().disk[0].block_size(), 512);
    let e = Config::parse(&format!(
        "{GOOD}\n[disk.cache]\npath = \"/f/c\"\nsequential_cutoff = 100\n"
    ))
    .unwrap_err();
    assert_eq!(e.key, "disk[0].cache.sequential_cutoff", "{e}");
}

#[test]
fn peer_transport_keys() {
    let with_peer = |lines: &str| {
        Config::parse(&format!(
            "[node]\nid = 1\ndata_dir = \"/tmp/n1\"\n\n[[peer]]\nid = 2\n{lines}\n"
        ))
    };
    let c =
        with_peer("address = \"127.0.0.1:7002\"\ntransport = \"tcp\"\nlanes = 4\nsecret = \"s\"")
            .unwrap();
    assert_eq!(c.peer[0].lanes, Some(4));
    with_peer("address = \"/run/r.sock\"\ntransport = \"loopback\"\nbusy_poll_us = 20").unwrap();
    with_peer("address = \"127.0.0.1:7002\"\ntransport = \"quic\"\npeer_fingerprint = \"x\"")
        .unwrap();
    for (lines, key, says) in [
        (
            "address = \"a:1\"\nlanes = 0",
            "peer[0].lanes",
            "must be 1 to 64",
        ),
        (
            "address = \"a:1\"\nlanes = 65",
            "peer[0].lanes",
            "must be 1 to 64",
        ),
        (
            "address = \"a:1\"\ntransport = \"quic\"\nsecret = \"s\"",
            "peer[0].secret",
            "not used by transport \"quic\"",
        ),
        (
            "address = \"a:1\"\nsecret = \"\"",
            "peer[0].secret",
            "empty",
        ),
        (
            "address = \"a:1\"\nsecret = \"s\"\nsecret_file = \"/f\"",
            "peer[0].secret",
            "not both",
        ),
        (
            "address = \"a:1\"\ntransport = \"quic\"\ncert = \"/c\"",
            "peer[0].cert",
            "both cert and key",
        ),
        (
            "address = \"a:1\"\nbusy_poll_us = 5",
            "peer[0].busy_poll_us",
            "only by loopback",
        ),
        (
            "address = \"127.0.0.1:1\"\ntransport = \"loopback\"",
            "peer[0].address",
            "absolute path of a Unix socket",
        ),
        (
            "address = \"a:1\"\ntransport = \"carrier-pigeon\"",
            "peer[0].transport",
            "not one of",
        ),
    ] {
        let e = with_peer(lines).unwrap_err();
        assert_eq!(e.key, key, "{lines}: {e}");
        assert!(e.message.contains(says), "{lines}: {e}");
    }
}

#[test]
fn errors_name_the_key() {
    let e = Config::parse(&GOOD.replace("nbd =", "sizee = 1\nnbd =")).unwrap_err();
    assert_eq!(e.key, "disk[0].sizee", "{e}");
    assert!(e.message.contains("unknown field `sizee`"), "{e}");
    let e = Config::parse(&GOOD.replace("\"1GiB\"", "\"12 parsecs\"")).unwrap_err();
    assert_eq!(e.key, "disk[0].size", "{e}");
    assert!(e.message.contains("\"12 parsecs\" is not a size"), "{e}");
    let e = Config::parse(&GOOD.replace("\"1GiB\"", "1000")).unwrap_err();
    assert_eq!(e.key, "disk[0].size", "{e}");
    assert!(e.message.contains("multiple of the block size"), "{e}");
    let e = Config::parse(&GOOD.replace("127.0.0.1:10809", "nowhere")).unwrap_err();
    assert_eq!(e.key, "disk[0].nbd", "{e}");
}

#[test]
fn vhost_user_keys_and_their_refusals() {
    let c = Config::parse(&format!(
        "{GOOD}vhost_user = \"/run/vsan/vol0.vhost\"\nvhost_user_queues = 4\n\
         vhost_user_busy_poll_us = 50\n"
    ))
    .unwrap();
    let d = &c.disk[0];
    assert_eq!(
        d.vhost_user.as_deref(),
        Some(Path::new("/run/vsan/vol0.vhost"))
    );
    assert_eq!(
        (d.vhost_user_queues, d.vhost_user_busy_poll_us),
        (Some(4), Some(50))
    );
    let refused = |extra: &str| Config::parse(&format!("{GOOD}{extra}")).unwrap_err();
    let e = refused("vhost_user_queues = 2\n");
    assert_eq!(e.key, "disk[0].vhost_user_queues", "{e}");
    assert!(e.message.contains("only with `vhost_user`"), "{e}");
    let e = refused("vhost_user = \"/s\"\nvhost_user_queues = 0\n");
    assert_eq!(e.key, "disk[0].vhost_user_queues", "{e}");
    let e = refused("vhost_user = \"/s\"\nvhost_user_queues = 65\n");
    assert!(e.message.contains("not 1 to 64"), "{e}");
    let e = refused("vhost_user = \"/s\"\nvhost_user_busy_poll_us = 2000000\n");
    assert_eq!(e.key, "disk[0].vhost_user_busy_poll_us", "{e}");
    let e = refused("vhost_user = \"\"\n");
    assert_eq!(e.key, "disk[0].vhost_user", "{e}");
    let e = refused(
        "vhost_user = \"/s\"\n\n[[disk]]\nname = \"vol1\"\nsize = \"1GiB\"\nvhost_user = \"/s\"\n",
    );
    assert_eq!(e.key, "disk[1].vhost_user", "{e}");
    assert!(e.message.contains("is also disk[0].vhost_user"), "{e}");
    let e = refused(
        "\n[[disk]]\nname = \"vol1\"\nsize = \"1GiB\"\nnbd = \"unix:/s\"\nvhost_user = \"/s\"\n",
    );
    assert!(e.message.contains("is also disk[1].nbd"), "{e}");
}

#[test]
fn worker_threads_are_one_per_disk_at_most_one_per_core_unless_set() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let one = Config::parse(GOOD).unwrap();
    assert_eq!(one.worker_threads(), 1, "one disk, one worker");
    let many_disks: String = (0..cores + 3)
        .map(|i| format!("\n[[disk]]\nname = \"d{i}\"\nsize = \"1MiB\"\n"))
        .collect();
    let many = Config::parse(&format!("{GOOD}{many_disks}")).unwrap();
    assert_eq!(many.worker_threads(), cores, "never more than the cores");
    let set = Config::parse(&GOOD.replace("id = 1", "id = 1\nthreads = 6")).unwrap();
    assert_eq!(set.worker_threads(), 6, "node.threads wins");
    let none = Config::parse(&GOOD[..GOOD.find("[[disk]]").unwrap()]).unwrap();
    assert_eq!(none.worker_threads(), 1, "a node without disks still runs");
}
