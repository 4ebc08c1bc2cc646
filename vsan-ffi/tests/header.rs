//! `include/vsan.h` is what the pinned cbindgen makes of this crate today: a stale
//! committed header fails here. `VSAN_BLESS=1 cargo test -p vsan-ffi header` rewrites it.

use std::path::Path;

#[test]
fn header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = crate_dir.join("include/vsan.h");
    if std::env::var("VSAN_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/vsan.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/vsan.h is stale: regenerate it with `VSAN_BLESS=1 cargo test -p vsan-ffi \
         header` and commit it\n--- generated ---\n{}",
        String::from_utf8_lossy(&generated)
    );
}
