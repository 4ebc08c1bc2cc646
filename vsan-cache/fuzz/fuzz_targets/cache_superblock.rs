//! Two superblock copies, decoded and picked: see `vsan_cache_fuzz::check_superblock`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_cache_fuzz::check_superblock(data);
});
