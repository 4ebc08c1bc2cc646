//! A layout and an activity log record: see `vsan_replica_fuzz::meta::check_al`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_replica_fuzz::meta::check_al(data);
});
