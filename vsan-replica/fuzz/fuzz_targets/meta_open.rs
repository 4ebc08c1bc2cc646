//! A whole metadata area opened with `meta::open`: see `vsan_replica_fuzz::meta::check_open`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_replica_fuzz::meta::check_open(data);
});
