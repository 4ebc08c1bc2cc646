//! Committed fuzz corpora, for the tests that replay them (feature `test-utils`): every
//! crate's `tests/*_corpus.rs` reads its `fuzz/corpus/<target>/` files through here.

use std::path::{Path, PathBuf};

/// Every file in `dir`, sorted by name, with its bytes. Panics, naming the path, if the
/// directory or a file cannot be read.
pub fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// Runs `check` on `bytes`; if it panics, panics again naming `path` (the corpus file)
/// and the check's message.
pub fn replay<T>(path: &Path, bytes: &[u8], check: impl FnOnce(&[u8]) -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(bytes))) {
        Ok(v) => v,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| e.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            panic!("{} fails its check: {msg}", path.display());
        }
    }
}

/// `bytes` with one byte changed at each of `n` places spread over it: the first 16 at
/// multiples of `stride` (land them in the inputs' header fields), the rest scattered.
/// Deterministic, so a failure names a reproducible input.
pub fn mutations(bytes: &[u8], n: usize, stride: usize) -> impl Iterator<Item = Vec<u8>> + '_ {
    (0..n.min(bytes.len())).map(move |i| {
        let mut m = bytes.to_vec();
        let at = if i < 16 {
            i * stride % bytes.len()
        } else {
            (i * 7919 + 13) % bytes.len()
        };
        m[at] ^= [0x01, 0x80, 0xff][i % 3];
        m
    })
}
