//! Arbitrary bytes as a replica superblock block: see `vsan_replica_fuzz::meta::check_superblock`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_replica_fuzz::meta::check_superblock(data);
});
