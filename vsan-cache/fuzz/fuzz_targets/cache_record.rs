//! One log record, decoded and scanned: see `vsan_cache_fuzz::check_record`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_cache_fuzz::check_record(data);
});
